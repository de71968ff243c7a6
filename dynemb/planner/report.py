"""A plan and a cost model as text, for ``dynemb plan`` and ``dynemb calibrate``.

Bytes are shown in binary units (``human_bytes``); ``plan.json`` keeps the exact numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynemb.planner.cost import EVENTS, CostModel
from dynemb.planner.plan import Plan
from dynemb.units import human_bytes

def _share(used: int, budget: int) -> str:
    if budget <= 0:
        return "no budget" if used == 0 else "over a budget of 0"
    return f"{100.0 * used / budget:.1f} %"


def format_plan(plan: Plan, notes: Mapping[str, str] | None = None) -> str:
    """The plan as a table: per table its mode, x, predicted hbm hit rate, hbm bytes per rank,
    ddr bytes per host, predicted ms per step (and ``notes[name]``, e.g. where its profile came
    from), then the totals against each budget and where the cost constants came from."""
    topo = plan.topology
    notes = notes or {}
    head = ("table", "mode", "x", "hbm hit", "hbm/rank", "ddr/host", "ms/step", "")
    rows = []
    for name, c in plan.tables.items():
        extra = ", ".join(s for s in ("pinned" if c.pinned else "", notes.get(name, "")) if s)
        rows.append((name, c.mode.value, f"{c.cache_load_factor:.2f}",
                     f"{c.predicted_hit_rate:.3f}", human_bytes(c.hbm_bytes),
                     human_bytes(c.ddr_bytes * topo.ranks_per_host), f"{c.predicted_ms:.4f}",
                     extra))
    rows.append(("total", "", "", "", human_bytes(plan.hbm_bytes_per_rank),
                 human_bytes(plan.ddr_bytes_per_host), f"{plan.predicted_ms:.4f}", ""))
    rows.append(("budget", "", "", "", human_bytes(topo.hbm_budget),
                 human_bytes(topo.ddr_budget_per_host), "", ""))
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    right = {2, 3, 4, 5, 6}

    def line(r: tuple[str, ...]) -> str:
        cells = [v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in
                 enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()

    out = [line(head), *(line(r) for r in rows[:-2]), "-" * len(line(head)),
           *(line(r) for r in rows[-2:])]
    out += [
        "",
        f"topology: {topo.world_size} rank(s), {topo.ranks_per_host} per host "
        f"({topo.hosts} host(s)), device {topo.device}; hbm {human_bytes(topo.hbm_bytes_per_rank)}"
        f" per rank less {topo.hbm_reserve_fraction:.0%} reserve, ddr "
        f"{human_bytes(topo.ddr_bytes_per_host)} per host less {topo.ddr_reserve_fraction:.0%} "
        "reserve",
        f"hbm per rank: {human_bytes(plan.hbm_bytes_per_rank)} of {human_bytes(topo.hbm_budget)}"
        f" ({_share(plan.hbm_bytes_per_rank, topo.hbm_budget)})",
        f"ddr per host: {human_bytes(plan.ddr_bytes_per_host)} of "
        f"{human_bytes(topo.ddr_budget_per_host)} "
        f"({_share(plan.ddr_bytes_per_host, topo.ddr_budget_per_host)})",
        f"predicted step time of the tables: {plan.predicted_ms:.4f} ms per rank",
        f"cost constants: {plan.cost_source}",
    ]
    if not plan.optimal:
        out.append("solver: stopped at its node limit; the plan is feasible but not proven "
                   "optimal")
    return "\n".join(out)


def format_cost_model(model: CostModel) -> str:
    """The constants, one event a line: ns per event = fixed + per byte x row bytes."""
    width = max(len(e) for e in EVENTS)
    out = [f"{'event'.ljust(width)}  {'fixed ns':>12}  {'ns per byte':>12}"]
    for event, fixed, per_byte in zip(EVENTS, model.fixed_ns, model.per_byte_ns):
        out.append(f"{event.ljust(width)}  {fixed:12.3f}  {per_byte:12.4f}")
    out.append(f"device: {model.device}; {model.source}")
    return "\n".join(out)
