"""Placing the tables of ``dynemb train``: each table's storage mode and cache_load_factor, from
the planner at start-up, from a saved plan (``--plan``), or, on ``--resume``, from the plan of
the run being resumed.

A table is left to the planner when ``embeddings.storage`` is ``auto`` (the default) or its
``cache_load_factor`` is null. At start-up rank 0 reads the machine's topology
(:func:`machine_topology`: world size and torchrun's LOCAL_WORLD_SIZE, the budgets of the config
or of this machine) and profiles each table on the first ``embeddings.profile_steps`` training
batches it would train on (scaled to the whole job by the world size), runs
:func:`dynemb.planner.plan` and shares the plan with every rank, so every rank builds the same
tables. The profiled batches are then trained on as usual (none is skipped or read twice).

The plan of a run is stored in its directory as ``plan.json`` (:data:`PLAN_FILE`); a resumed
run builds its tables from it, as the checkpoint's run did.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dynemb.config import Storage, StorageMode, TableConfig
from dynemb.data.base import Batch, DataSource
from dynemb.errors import ConfigError, PlanningError
from dynemb.planner import CostModel, Plan, TableChoice, Topology, plan
from dynemb.planner.sources import profiles_from_batches
from dynemb.train.config import TrainConfig
from dynemb.units import human_bytes

logger = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
"""The plan of a run, in its run directory."""


@dataclass(frozen=True)
class RunPlan:
    """How a run's tables were placed.

    Attributes:
        plan: the plan (None when every table's storage is given in the config).
        origin: ``planned`` (at start-up), ``file`` (``--plan``), ``resumed`` (the plan.json
            of the run being resumed) or ``pinned`` (no plan: every storage given).
        path: the plan file read (``file``, ``resumed``), else None.
        profile_steps: batches profiled (``planned``), else 0.
        seconds: time spent settling the plan on rank 0, all included.
        batch_seconds: of ``seconds``, the time spent building the profiled batches (which
            the run then trains on: time moved, not added).
    """

    plan: Plan | None
    origin: str
    path: str | None = None
    profile_steps: int = 0
    seconds: float = 0.0
    batch_seconds: float = 0.0


def needs_planning(tables: Sequence[TableConfig]) -> bool:
    """Whether some table's storage is left to the planner."""
    return any(not t.storage.planned for t in tables)


def existing_ancestor(path: str) -> str:
    """``path``, or its nearest existing ancestor (a ddr_path is created when first used): where
    to read the free disk a ddr_path will have."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p)


def machine_topology(config: TrainConfig, world_size: int) -> Topology:
    """The topology a run plans for: ``world_size`` ranks, torchrun's LOCAL_WORLD_SIZE ranks
    per host (all of them without it), the device of the config, and the budgets of
    ``config.embeddings`` where they are set, else this machine's
    (:meth:`dynemb.planner.Topology.from_machine`: on a CPU host hbm is each rank's share of
    the RAM available now and ddr the free disk under ``ddr_path``, or without it the RAM)."""
    emb = config.embeddings
    ddr_dir = None if emb.ddr_path is None else existing_ancestor(emb.ddr_path)
    local = os.environ.get("LOCAL_WORLD_SIZE", str(world_size))
    if not local.isdigit() or int(local) < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE: expected the ranks per host, an int >= 1 (torchrun "
                          f"sets it), found {local!r}; unset it or launch with torchrun.")
    topo = Topology.from_machine(world_size=world_size,
                                 ranks_per_host=min(int(local), world_size),
                                 device=config.device, ddr_path=ddr_dir,
                                 hbm_reserve_fraction=emb.hbm_reserve_fraction,
                                 ddr_reserve_fraction=emb.ddr_reserve_fraction)
    hbm = topo.hbm_bytes_per_rank if emb.hbm_bytes_per_rank is None else emb.hbm_bytes_per_rank
    ddr = topo.ddr_bytes_per_host if emb.ddr_bytes_per_host is None else emb.ddr_bytes_per_host
    return Topology(world_size=topo.world_size, ranks_per_host=topo.ranks_per_host,
                    hbm_bytes_per_rank=hbm, ddr_bytes_per_host=ddr, device=topo.device,
                    hbm_reserve_fraction=topo.hbm_reserve_fraction,
                    ddr_reserve_fraction=topo.ddr_reserve_fraction)


def first_batches(source: DataSource, config: TrainConfig, world_size: int,
                  start: int) -> list[Batch]:
    """Rank 0's training batches ``start``, ``start + 1``, ...: what it trains on first
    (batches are deterministic by index); ``embeddings.profile_steps`` of them, or as many as
    the steps left to train (at least one)."""
    count = max(1, min(config.embeddings.profile_steps, config.steps - start))
    stream = source.train_batches(config.batch_size // world_size, rank=0,
                                  world_size=world_size, start=start)
    try:
        return list(itertools.islice(stream, count))
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


def plan_tables(config: TrainConfig, tables: Sequence[TableConfig], source: DataSource, *,
                world_size: int, start: int = 0) -> tuple[Plan, list[Batch]]:
    """Plans ``tables`` for this machine (:func:`machine_topology`), each table profiled on
    rank 0's first training batches from ``start`` (:func:`first_batches`).

    Returns:
        The plan, and the batches profiled (for the training loop to train on).
    Raises:
        PlanningError: nothing fits the budgets (naming the tier and what would fit), or the
            calibration cannot be read.
    """
    batches = first_batches(source, config, world_size, start)
    return plan_on(config, tables, batches, world_size=world_size), batches


def plan_on(config: TrainConfig, tables: Sequence[TableConfig], batches: Sequence[Batch], *,
            world_size: int) -> Plan:
    """Plans ``tables`` for this machine, each profiled on ``batches`` (one of ``world_size``
    ranks' first training batches)."""
    emb = config.embeddings
    calibration = None
    if emb.calibration is not None:
        try:
            calibration = CostModel.load(emb.calibration)
        except PlanningError as error:
            raise PlanningError(f"embeddings.calibration: {error}") from None
    profiles = profiles_from_batches(batches, tables, steps=len(batches) or 1,
                                     world_size=world_size)
    topo = machine_topology(config, world_size)
    try:
        return plan(tables, topo, profiles=profiles, calibration=calibration)
    except PlanningError as error:
        raise PlanningError(f"{error} The budgets: {_budgets(config, topo)}.") from None


def _budgets(config: TrainConfig, topo: Topology) -> str:
    """Where the budgets of a plan made at start-up came from (for its errors)."""
    emb = config.embeddings
    hbm = "embeddings.hbm_bytes_per_rank" if emb.hbm_bytes_per_rank is not None else \
        "this GPU's memory" if topo.device == "cuda" else "this rank's share of the RAM available"
    ddr = "embeddings.ddr_bytes_per_host" if emb.ddr_bytes_per_host is not None else \
        "this host's RAM" if topo.device == "cuda" else \
        f"the free disk under ddr_path {emb.ddr_path}" if emb.ddr_path else \
        "the RAM available"
    return (f"hbm {human_bytes(topo.hbm_bytes_per_rank)} per rank ({hbm}) less "
            f"embeddings.hbm_reserve_fraction {topo.hbm_reserve_fraction}, ddr "
            f"{human_bytes(topo.ddr_bytes_per_host)} per host ({ddr}) less "
            f"embeddings.ddr_reserve_fraction {topo.ddr_reserve_fraction}, for "
            f"{topo.world_size} rank(s), {topo.ranks_per_host} per host; set "
            "embeddings.hbm_bytes_per_rank or embeddings.ddr_bytes_per_host to plan for other "
            "budgets")


def _allowed(choice: TableChoice, storage: Storage) -> bool:
    """Whether a table configured with ``storage`` may be built as ``choice`` says."""
    mode, x = choice.mode, choice.cache_load_factor
    if storage.planned:
        return mode == storage.effective_mode and x == storage.cache_load_factor
    if storage.cache_load_factor is not None:  # AUTO with x pinned
        return mode in (StorageMode.HYBRID, StorageMode.CACHING) and x == \
            storage.cache_load_factor
    return mode == StorageMode.HBM_ONLY or storage.mode in (StorageMode.AUTO, mode)


def check_plan(result: Plan, tables: Sequence[TableConfig], what: str) -> None:
    """Raises PlanningError unless ``result`` places exactly ``tables``, each in a way its
    config allows (a table whose mode or cache_load_factor is given keeps it)."""
    names = [t.name for t in tables]
    missing = [n for n in names if n not in result.tables]
    extra = sorted(set(result.tables) - set(names))
    if missing or extra:
        raise PlanningError(f"{what}: expected a plan of this run's tables {names}, found one "
                            f"of {sorted(result.tables)} (missing {missing}, not in this run "
                            f"{extra}); make the plan for these tables (dynemb plan), or run "
                            "without it to plan at start-up.")
    for t in tables:
        choice = result.tables[t.name]
        if not _allowed(choice, t.storage):
            raise PlanningError(
                f"{what}: table {t.name!r} is placed {choice.mode.value} with "
                f"cache_load_factor {choice.cache_load_factor}, but this run configures it "
                f"{t.storage.mode.value} with cache_load_factor {t.storage.cache_load_factor}; "
                "expected a plan made for this config (or set embeddings.storage: auto).")
        try:
            choice.storage(t.storage.ddr_path)
        except ConfigError as error:
            raise PlanningError(f"{what}: table {t.name!r}: {error}") from None


def apply_plan(result: Plan, tables: Sequence[TableConfig], what: str) -> list[TableConfig]:
    """``tables`` placed by ``result`` (checked by :func:`check_plan` first)."""
    check_plan(result, tables, what)
    placed = result.apply(tables)
    left = [t.name for t in placed if not t.storage.planned]
    if left:
        raise PlanningError(f"{what}: it marks table(s) {left} pinned, but this run leaves "
                            "them to the planner; expected a plan made for this config.")
    return placed


def load_plan(path: str | Path, tables: Sequence[TableConfig], what: str, fix: str) -> Plan:
    """The plan saved at ``path``, checked against ``tables`` (:func:`check_plan`); an error
    reading it names ``what`` and says ``fix``."""
    try:
        result = Plan.load(path)
    except PlanningError as error:
        raise PlanningError(f"{what}: {error} {fix}") from None
    check_plan(result, tables, what)
    return result


def _choices(result: Plan) -> dict[str, tuple[str, float]]:
    return {n: (c.mode.value, c.cache_load_factor) for n, c in result.tables.items()}


def store(result: Plan | None, out: Path) -> None:
    """Writes ``out/plan.json`` (atomically), or removes a stale one when there is no plan."""
    path = out / PLAN_FILE
    try:
        if result is None:
            path.unlink(missing_ok=True)
        else:
            result.save(path)  # atomic: a run killed meanwhile leaves the old file or the new
    except OSError as error:
        raise ConfigError(f"{path}: cannot write the run's plan ({error.strerror}); expected a "
                          "writable run directory with free space.") from None


def _note_world_size(result: Plan, world_size: int, path: str) -> None:
    made = result.topology.world_size
    if made != world_size:
        logger.warning("%s was made for %d rank(s), this run has %d: the tables are placed as "
                       "it says, but each rank's shards hold about %.2f times the rows it "
                       "planned for, so its bytes and times are not this run's (make a plan "
                       "for %d ranks with dynemb plan --world-size %d if they must fit)", path,
                       made, world_size, made / world_size, world_size, world_size)


def settle(config: TrainConfig, tables: Sequence[TableConfig], source: DataSource, *,
           world_size: int, out: Path, resume: bool,
           start: int) -> tuple[RunPlan, list[Batch]]:
    """Rank 0: the plan the run builds its tables from, stored as ``out/plan.json``.

    A resumed run whose directory holds a plan.json uses it (``--plan`` must then agree with
    it); else ``embeddings.plan`` (``--plan``); else, when a table is left to the planner, a
    plan made now from rank 0's first batches from ``start``; else none.

    Returns:
        The plan and how it was made, and the batches profiled (empty unless ``planned``).
    Raises:
        PlanningError: a plan file cannot be read or does not fit the tables, or nothing fits
            the budgets.
        ConfigError: ``--plan`` disagrees with the plan of the run being resumed, or plan.json
            cannot be written.
    """
    t0 = time.perf_counter()
    emb = config.embeddings
    given = None if emb.plan is None else load_plan(
        emb.plan, tables, f"--plan {emb.plan}", "Make it again with dynemb plan --out.")
    stored = out / PLAN_FILE
    if resume and stored.is_file():
        result = load_plan(stored, tables, f"the plan of the run in {out} ({stored})",
                           f"Delete {stored} to plan the tables again (the checkpoint's rows "
                           "load into any placement), or start afresh with --overwrite.")
        if given is not None and _choices(given) != _choices(result):
            raise ConfigError(f"--plan {emb.plan}: the run in {out} was built from the plan in "
                              f"{stored}, which places its tables otherwise; expected a resumed "
                              "run to build its tables as the checkpoint's run did. Drop "
                              "--plan, or start afresh with --overwrite.")
        _note_world_size(result, world_size, str(stored))
        return RunPlan(result, "resumed", str(stored), 0, time.perf_counter() - t0), []
    batches: list[Batch] = []
    built = 0.0
    if given is not None:
        _note_world_size(given, world_size, emb.plan)
        settled = RunPlan(given, "file", emb.plan)
    elif needs_planning(tables):
        if resume:
            logger.warning("resuming a run without %s: planning the tables again (they may be "
                           "placed otherwise than when the checkpoint was saved; its rows load "
                           "all the same)", stored)
        batches = first_batches(source, config, world_size, start)
        built = time.perf_counter() - t0
        settled = RunPlan(plan_on(config, tables, batches, world_size=world_size), "planned",
                          None, len(batches))
    else:
        settled = RunPlan(None, "pinned")
    store(settled.plan, out)
    return RunPlan(settled.plan, settled.origin, settled.path, settled.profile_steps,
                   time.perf_counter() - t0, built), batches


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def describe(settled: RunPlan) -> list[str]:
    """The plan as text lines: where it came from, one line per table (mode, x, predicted hbm
    hit rate, hbm bytes per rank, ddr bytes per rank, predicted ms per step), and the totals
    against the budgets."""
    result = settled.plan
    if result is None:
        return ["plan: none (every table's storage is given in the config)"]
    how = {"planned": f"planned at start-up in {settled.seconds:.2f} s, profiled on the first "
                      f"{settled.profile_steps} batch(es) (built in {settled.batch_seconds:.2f} "
                      "s, then trained on)",
           "file": f"from --plan {settled.path}",
           "resumed": f"the resumed run's plan, {settled.path}"}[settled.origin]
    topo = result.topology
    lines = [f"plan: {how}; {topo.world_size} rank(s), {topo.ranks_per_host} per host; cost "
             f"constants: {result.cost_source}"]
    for name, c in result.tables.items():
        lines.append(f"  {name:<12} {c.mode.value:<8} x={c.cache_load_factor:.2f}  "
                     f"hbm hit rate {c.predicted_hit_rate:.3f}  hbm {_mib(c.hbm_bytes)}  "
                     f"ddr {_mib(c.ddr_bytes)}  {c.predicted_ms:.4f} ms/step"
                     + ("  (pinned)" if c.pinned else ""))
    lines.append(f"  hbm {_mib(result.hbm_bytes_per_rank)} per rank of "
                 f"{_mib(topo.hbm_budget)}; ddr {_mib(result.ddr_bytes_per_host)} per host of "
                 f"{_mib(topo.ddr_budget_per_host)}; tables {result.predicted_ms:.4f} ms/step "
                 "predicted")
    return lines
