"""``planner.plan``: choose each table's storage mode and cache_load_factor within the budgets."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dynemb.checkpoint.files import write_text_atomic
from dynemb.config import Storage, StorageMode, TableConfig
from dynemb.errors import ConfigError, PlanningError
from dynemb.optim.rules import state_width
from dynemb.planner.cost import CostModel, predict_counts, read_json
from dynemb.planner.defaults import default_cost_model
from dynemb.planner.profile import AccessProfile
from dynemb.planner.solver import Option, solve
from dynemb.planner.topology import Topology
from dynemb.table.memory import shard_capacity, storage_layout, table_memory

logger = logging.getLogger(__name__)

FACTORS = tuple(round(0.1 * i, 1) for i in range(1, 10))
"""cache_load_factor values tried for HYBRID and CACHING (x = 1.0 is HBM_ONLY)."""
PLAN_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TableChoice:
    """What the plan gives one table (bytes are one rank's shard)."""

    mode: StorageMode
    cache_load_factor: float
    predicted_hit_rate: float
    """Share of lookups served from hbm."""
    predicted_ms: float
    """Predicted time per step of the table's shard on one rank."""
    hbm_bytes: int
    ddr_bytes: int
    pinned: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mode, StorageMode) or self.mode == StorageMode.AUTO:
            raise PlanningError(f"TableChoice.mode: expected HBM_ONLY, HYBRID or CACHING, found "
                                f"{self.mode!r}.")
        checks = (("cache_load_factor", 0.1, 1.0), ("predicted_hit_rate", 0.0, 1.0),
                  ("predicted_ms", 0.0, math.inf), ("hbm_bytes", 0, math.inf),
                  ("ddr_bytes", 0, math.inf))
        for name, low, high in checks:
            v = getattr(self, name)
            number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not (number and low <= v <= high) or (name.endswith("bytes") and
                                                      not isinstance(v, int)):
                raise PlanningError(f"TableChoice.{name}: expected a number in [{low}, {high}]"
                                    f"{' (an int)' if name.endswith('bytes') else ''}, found "
                                    f"{v!r}.")
        if self.mode == StorageMode.HBM_ONLY and self.cache_load_factor != 1.0:
            raise PlanningError(f"TableChoice: mode hbm_only has cache_load_factor 1.0, found "
                                f"{self.cache_load_factor!r}.")
        if not isinstance(self.pinned, bool):
            raise PlanningError(f"TableChoice.pinned: expected true or false, found "
                                f"{self.pinned!r}.")

    def storage(self, ddr_path: str | None = None) -> Storage:
        if self.mode == StorageMode.HBM_ONLY:
            return Storage()
        return Storage(mode=self.mode, cache_load_factor=self.cache_load_factor,
                       ddr_path=ddr_path)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "mode": self.mode.value}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The chosen placement of every table and its predicted totals."""

    tables: dict[str, TableChoice]
    topology: Topology
    cost_source: str
    optimal: bool = True

    @property
    def hbm_bytes_per_rank(self) -> int:
        return sum(t.hbm_bytes for t in self.tables.values())

    @property
    def ddr_bytes_per_host(self) -> int:
        return self.topology.ranks_per_host * sum(t.ddr_bytes for t in self.tables.values())

    @property
    def predicted_ms(self) -> float:
        return math.fsum(t.predicted_ms for t in self.tables.values())

    def apply(self, tables: Sequence[TableConfig]) -> list[TableConfig]:
        """``tables`` with the chosen storage (a pinned table keeps its own; a ``ddr_path`` of the
        config is kept where the chosen mode has a ddr tier)."""
        out = []
        for c in tables:
            if c.name not in self.tables:
                raise PlanningError(f"Plan.apply: table {c.name!r} is not in the plan (planned: "
                                    f"{sorted(self.tables)}).")
            choice = self.tables[c.name]
            if choice.pinned or c.storage.planned:
                out.append(c)
                continue
            out.append(dataclasses.replace(c, storage=choice.storage(c.storage.ddr_path)))
        return out

    def as_dict(self) -> dict:
        return {"version": PLAN_VERSION, "topology": self.topology.as_dict(),
                "cost_source": self.cost_source, "optimal": self.optimal,
                "hbm_bytes_per_rank": self.hbm_bytes_per_rank,
                "hbm_budget_per_rank": self.topology.hbm_budget,
                "ddr_bytes_per_host": self.ddr_bytes_per_host,
                "ddr_budget_per_host": self.topology.ddr_budget_per_host,
                "predicted_ms": self.predicted_ms,
                "tables": {k: v.as_dict() for k, v in self.tables.items()}}

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, json.dumps(self.as_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        data = read_json(path, "plan")
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            raise PlanningError(f"plan {str(path)!r}: expected a dynemb plan of version "
                                f"{PLAN_VERSION}; make it again with `dynemb plan`.")
        try:
            tables = {}
            for name, t in data["tables"].items():
                t = dict(t)
                t["mode"] = StorageMode(t["mode"])
                try:
                    tables[name] = TableChoice(**t)
                except PlanningError as e:
                    raise PlanningError(f"plan {str(path)!r}: table {name!r}: {e}") from None
            if not isinstance(data["optimal"], bool):
                raise ValueError(f"optimal: expected true or false, found {data['optimal']!r}")
            return cls(tables=tables, topology=Topology.from_dict(data["topology"]),
                       cost_source=str(data["cost_source"]), optimal=data["optimal"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanningError(f"plan {str(path)!r}: malformed ({e}).") from None


def _row_bytes(config: TableConfig) -> int:
    return 4 * (config.dim + state_width(config.optimizer, config.dim))


def candidates(storage: Storage,
               factors: Sequence[float] = FACTORS) -> list[tuple[StorageMode, float]]:
    """The (mode, cache_load_factor) pairs the planner may choose for a table configured with
    ``storage``: just its own when it is planned (pinned); the mode's x values when only x is
    left open; HBM_ONLY or HYBRID/CACHING at the given x under AUTO with x; all of them under
    AUTO."""
    if storage.planned:
        return [(storage.effective_mode, storage.cache_load_factor)]
    x = storage.cache_load_factor
    if x is not None:  # AUTO with x < 1 pinned (x = 1.0 is planned: HBM_ONLY)
        return [(StorageMode.HYBRID, x), (StorageMode.CACHING, x)]
    modes = ((StorageMode.HYBRID, StorageMode.CACHING) if storage.mode == StorageMode.AUTO
             else (storage.mode,))
    out = [(StorageMode.HBM_ONLY, 1.0)]
    for mode in modes:
        out += [(mode, f) for f in factors if f < 1.0]
    return out


def table_options(config: TableConfig, profile: AccessProfile, topology: Topology,
                  cost: CostModel, *,
                  factors: Sequence[float] = FACTORS) -> list[tuple[Option, TableChoice]]:
    """Every placement the planner considers for one table (see :func:`candidates`): its bytes
    per rank (``table_memory`` of the shard the runtime builds, with the working set of the
    profile's lookups) and its predicted cost."""
    w = topology.world_size
    rows = shard_capacity(config.capacity, w)
    mmap = config.storage.ddr_path is not None
    pinned = config.storage.planned
    ids = math.ceil(profile.lookups_per_step / w)
    out, why = [], ""
    for mode, x in candidates(config.storage, factors):
        try:
            layout = storage_layout(rows, config.bucket_capacity, mode, x)
        except ConfigError as e:  # e.g. HYBRID needs two buckets
            why = str(e)
            continue
        mem = table_memory(config, mode=mode, cache_load_factor=x, world_size=w,
                           ids_per_step=ids)
        counts = predict_counts(profile, layout, w)
        ms = cost.step_ms(counts, _row_bytes(config), mmap)
        choice = TableChoice(mode=layout.mode, cache_load_factor=1.0 if layout.mode ==
                             StorageMode.HBM_ONLY else x, predicted_hit_rate=counts.hbm_hit_rate,
                             predicted_ms=ms, hbm_bytes=mem.hbm_bytes, ddr_bytes=mem.ddr_bytes,
                             pinned=pinned)
        out.append((Option(hbm_bytes=mem.hbm_bytes, ddr_bytes=mem.ddr_bytes, cost=ms), choice))
    if not out:
        raise PlanningError(f"table {config.name!r}: no storage option can be built for a shard "
                            f"of {rows} rows over {w} rank(s): {why}")
    return out


def plan(tables: Sequence[TableConfig], topology: Topology, *,
         profiles: Mapping[str, AccessProfile] | None = None,
         calibration: CostModel | str | Path | None = None,
         factors: Sequence[float] = FACTORS) -> Plan:
    """The cheapest placement of ``tables`` within ``topology``'s budgets.

    A table whose ``Storage`` is planned (mode and cache_load_factor given) is pinned: it is
    charged as it is. ``StorageMode.AUTO`` leaves the mode to the planner, a missing
    ``cache_load_factor`` leaves x (see :func:`candidates`).

    Args:
        tables: the table configs.
        topology: ranks and budgets.
        profiles: per table name, its access profile (default: :func:`default_profile`).
        calibration: a ``CostModel`` or the path of a calibration; None: the defaults of
            ``topology.device``.
        factors: the cache_load_factor values tried (default 0.1, 0.2, ..., 0.9).

    Raises:
        PlanningError: nothing fits (the message names the tier and what would fit), or bad
            input.
    """
    names = [c.name for c in tables]
    if len(set(names)) != len(names):
        raise PlanningError(f"plan: table names must be distinct, found {names}.")
    unknown = sorted(set(profiles or {}) - set(names))
    if unknown:
        raise PlanningError(f"plan: unknown table name(s) {unknown}; tables: {names}.")
    cost = _cost_model(calibration, topology)
    per_table = []
    for c in tables:
        prof = (profiles or {}).get(c.name) or default_profile(c)
        per_table.append(table_options(c, prof, topology, cost, factors=factors))
    solution = solve([[o for o, _ in opts] for opts in per_table],
                     hbm_budget=topology.hbm_budget, ddr_budget=topology.ddr_budget_per_rank,
                     names=names)
    chosen = {c.name: opts[i][1] for c, opts, i in zip(tables, per_table, solution.choices)}
    logger.info("planned %d table(s): %.3f ms per step predicted, hbm %d of %d bytes per rank, "
                "ddr %d of %d bytes per host (%s)", len(tables), solution.cost,
                solution.hbm_bytes, topology.hbm_budget,
                solution.ddr_bytes * topology.ranks_per_host, topology.ddr_budget_per_host,
                cost.source)
    return Plan(tables=chosen, topology=topology, cost_source=cost.source,
                optimal=solution.optimal)


def default_profile(config: TableConfig) -> AccessProfile:
    """A table without a profile: uniform ids over its capacity, as many lookups per step as
    1/64 of its rows (at least one). Give real profiles: the skew decides between HYBRID and
    CACHING."""
    return AccessProfile(lookups_per_step=max(1.0, config.capacity / 64), zipf_alpha=0.0,
                         num_ids=config.capacity)


def _cost_model(calibration: CostModel | str | Path | None, topology: Topology) -> CostModel:
    if calibration is None:
        return default_cost_model(topology.device)
    if isinstance(calibration, CostModel):
        return calibration
    return CostModel.load(calibration)
