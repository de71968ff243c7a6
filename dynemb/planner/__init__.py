"""The planner: per table HBM_ONLY, HYBRID or CACHING and its cache_load_factor, chosen to
minimise the predicted step time within the hbm and ddr budgets of a topology.

::

    from dynemb import planner
    topo = planner.Topology(world_size=16, ranks_per_host=8, device="cuda",
                            hbm_bytes_per_rank=80 << 30, ddr_bytes_per_host=1 << 40)
    profiles = {"item": planner.AccessProfile(lookups_per_step=65536, zipf_alpha=1.05)}
    result = planner.plan(tables, topo, profiles=profiles)
    configs = result.apply(tables)

The parts are public and testable alone: :func:`solve` (the exact solver over
:class:`Option` lists), :class:`AccessProfile` (hit rates), :class:`CostModel` (the step cost,
fitted by :func:`calibrate`), :class:`Topology` (budgets).
"""

from dynemb.planner.calibrate import calibrate
from dynemb.planner.cost import Counts, CostModel, predict_counts
from dynemb.planner.defaults import default_cost_model
from dynemb.planner.plan import (
    FACTORS, Plan, TableChoice, candidates, default_profile, plan, table_options,
)
from dynemb.planner.profile import AccessProfile, MissCurve, Placement, fit_law
from dynemb.planner.solver import Option, Solution, solve
from dynemb.planner.topology import Topology

__all__ = [
    "FACTORS", "AccessProfile", "CostModel", "Counts", "MissCurve", "Option", "Placement", "Plan",
    "Solution", "TableChoice", "Topology", "calibrate", "candidates", "default_cost_model",
    "default_profile", "fit_law", "plan", "predict_counts", "solve", "table_options",
]
