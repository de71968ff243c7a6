"""``dynemb plan --plot``: a plan as one PNG.

Per table, its predicted hbm hit rate over the cache_load_factor x for CACHING and HYBRID (the
curves the planner chose from) with the chosen point marked; below them, the plan's bytes per
tier (stacked by table) against each budget.

matplotlib is imported only when a plot is drawn (importing dynemb never imports it), and draws
with its Agg canvas on a figure of its own: pyplot's global state and backend are left alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from dynemb.config import StorageMode, TableConfig
from dynemb.errors import ConfigError, PlanningError
from dynemb.planner.cost import predict_counts
from dynemb.planner.plan import Plan
from dynemb.planner.profile import AccessProfile
from dynemb.planner.topology import Topology
from dynemb.table.memory import shard_capacity, storage_layout
from dynemb.units import human_bytes

CURVE_XS = tuple(round(0.1 + 0.025 * i, 3) for i in range(37))
"""x values the curves are drawn at: 0.1, 0.125, ..., 1.0."""
MAX_TABLES = 24
"""Tables drawn at most (the ones with the largest predicted time when there are more)."""
_COLORS = {StorageMode.CACHING: "tab:blue", StorageMode.HYBRID: "tab:orange"}
_BAR_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink",
               "tab:gray", "tab:olive", "tab:cyan")
"""Table colours of the bars (red is the budget's and the chosen point's)."""


def hit_rate_curve(config: TableConfig, profile: AccessProfile, topology: Topology,
                   mode: StorageMode, xs: Sequence[float] = CURVE_XS) -> list[tuple[float, float]]:
    """(x, predicted hbm hit rate) of ``config``'s shard stored in ``mode`` at each x of ``xs``
    (x = 1.0 is HBM_ONLY): the prediction the planner makes, from the same layout and profile.
    An x the table cannot be built with (HYBRID over a single bucket) is left out."""
    w = topology.world_size
    rows = shard_capacity(config.capacity, w)
    out = []
    for x in xs:
        try:
            layout = storage_layout(rows, config.bucket_capacity, mode, x)
        except ConfigError:
            continue
        out.append((float(x), predict_counts(profile, layout, w).hbm_hit_rate))
    return out


def _shown(plan: Plan, tables: Sequence[TableConfig], limit: int) -> list[TableConfig]:
    if len(tables) <= limit:
        return list(tables)
    slowest = sorted(tables, key=lambda c: -plan.tables[c.name].predicted_ms)[:limit]
    keep = {c.name for c in slowest}
    return [c for c in tables if c.name in keep]


def _draw_table(ax, config: TableConfig, profile: AccessProfile, plan: Plan) -> None:
    choice = plan.tables[config.name]
    for mode in (StorageMode.CACHING, StorageMode.HYBRID):
        curve = hit_rate_curve(config, profile, plan.topology, mode)
        if curve:
            ax.plot(*zip(*curve), color=_COLORS[mode], lw=1.4, label=mode.value)
    ax.plot([choice.cache_load_factor], [choice.predicted_hit_rate], marker="*", ms=13,
            color="tab:red", zorder=5, ls="none", label="chosen")
    ax.set_title(f"{config.name}: {choice.mode.value}"
                 + (f" x={choice.cache_load_factor:g}" if choice.mode != StorageMode.HBM_ONLY
                    else "") + (" (pinned)" if choice.pinned else ""), fontsize=9)
    ax.text(0.97, 0.04, f"hit {choice.predicted_hit_rate:.3f}\n{choice.predicted_ms:.3g} ms",
            transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
    ax.set_xlim(0.08, 1.02)
    ax.set_ylim(-0.02, 1.04)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=7)


def _draw_tier(ax, title: str, parts: Sequence[tuple[str, int]], budget: int) -> None:
    total = sum(v for _, v in parts)
    scale_unit = next(((u, s) for u, s in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20),
                                           ("KiB", 1 << 10)) if max(total, budget) >= s),
                      ("B", 1))
    unit, size = scale_unit
    left = 0.0
    for i, (name, value) in enumerate(parts):
        ax.barh(0, value / size, left=left, height=0.5, label=name, edgecolor="white", lw=0.5,
                color=_BAR_COLORS[i % len(_BAR_COLORS)])
        left += value / size
    ax.axvline(budget / size, color="tab:red", ls="--", lw=1.5, label="budget")
    share = f" ({100.0 * total / budget:.0f} %)" if budget > 0 else ""
    ax.set_title(f"{title}: {human_bytes(total)} of {human_bytes(budget)}{share}", fontsize=9)
    ax.set_xlim(0, max(total, budget, 1) / size * 1.08)
    ax.set_xlabel(unit, fontsize=8)
    ax.set_yticks([])
    ax.tick_params(labelsize=7)


def plot_plan(plan: Plan, tables: Sequence[TableConfig], profiles: Mapping[str, AccessProfile],
              path: str | os.PathLike, *, max_tables: int = MAX_TABLES, dpi: int = 80) -> None:
    """Draws ``plan`` of ``tables`` (each with its profile in ``profiles``) into a PNG at
    ``path``.

    Raises:
        PlanningError: a table is missing from the plan or from ``profiles``.
        ConfigError: matplotlib is not installed, or the file cannot be written.
    """
    missing = [c.name for c in tables if c.name not in plan.tables or c.name not in profiles]
    if missing:
        raise PlanningError(f"plot_plan: table(s) {missing} are not in the plan or have no "
                            "profile; plot the tables that were planned, with their profiles.")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("--plot: expected matplotlib to be installed (it is pinned in "
                          "requirements.txt; `make install` installs it), found it missing.") \
            from None
    shown = _shown(plan, tables, max_tables)
    ncols = min(4, max(2, len(shown)))
    nrows = max(1, math.ceil(len(shown) / ncols))
    fig = Figure(figsize=(3.1 * ncols, 2.5 * nrows + 2.0), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(nrows + 1, ncols, height_ratios=[2.5] * nrows + [1.6])
    for i, config in enumerate(shown):
        ax = fig.add_subplot(grid[i // ncols, i % ncols])
        _draw_table(ax, config, profiles[config.name], plan)
        if i % ncols == 0:
            ax.set_ylabel("hbm hit rate", fontsize=8)
        if i == 0:
            ax.legend(fontsize=7, loc="center right")
        if i // ncols == nrows - 1 or i + ncols >= len(shown):
            ax.set_xlabel("cache_load_factor x", fontsize=8)
    bars = grid[nrows, :].subgridspec(1, 2)
    topo = plan.topology
    hbm = [(c.name, plan.tables[c.name].hbm_bytes) for c in tables]
    ddr = [(c.name, plan.tables[c.name].ddr_bytes * topo.ranks_per_host) for c in tables]
    _draw_tier(fig.add_subplot(bars[0, 0]), "hbm per rank", hbm, topo.hbm_budget)
    ax = fig.add_subplot(bars[0, 1])
    _draw_tier(ax, "ddr per host", ddr, topo.ddr_budget_per_host)
    if len(tables) <= 10:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    note = "" if len(shown) == len(tables) else \
        f" (curves of the {len(shown)} slowest of {len(tables)} tables)"
    fig.suptitle(f"dynemb plan: {plan.predicted_ms:.3f} ms per step predicted, "
                 f"{topo.world_size} rank(s), {topo.device}{note}", fontsize=10)
    try:
        fig.savefig(os.fspath(path), dpi=dpi, format="png")
    except OSError as e:
        raise ConfigError(f"--plot {os.fspath(path)!r}: cannot write it ({e.strerror or e}).") \
            from None
