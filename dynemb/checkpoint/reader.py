"""Loading checkpoints: check everything first (the manifest's checksum and schema, the
manifest against the model, every file's size, sha256, metadata and shapes, key ownership,
capacity and bucket fit, dense state), on every rank, and only then change the model. With
``reshard=True`` every rank streams every shard file in bounded row windows and keeps the keys
that :func:`dynemb.distributed.route` gives it; rows that do not fit their bucket are dropped
lowest score first (``on_full``) or refused."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynemb.checkpoint import steps
from dynemb.checkpoint.files import TensorFile, inside
from dynemb.checkpoint.fit import lowest_scored, resolve_on_full
from dynemb.checkpoint.integrity import check_files
from dynemb.checkpoint.manifest import DELTA, read_manifest, to_json
from dynemb.checkpoint.model import (
    ModelView, TableSlot, check_dense_state, optimizer_type, view_model,
)
from dynemb.nn.modules import dense_only
from dynemb.nn.staging import check_idle
from dynemb.checkpoint.paths import load_lock
from dynemb.checkpoint.schema import FileSpec, file_specs
from dynemb.config import OnFull, Routing, TableConfig
from dynemb.distributed.routing import route
from dynemb.errors import CapacityError, CheckpointError
from dynemb.table.stats import ExportBatch
from dynemb.table.table import DynamicTable

logger = logging.getLogger(__name__)

READ_ROWS = 1 << 17
"""Rows per window when streaming a shard file: bounds the memory of a load."""
ROW_TENSORS = ("keys", "embeddings", "optimizer_state", "scores")


@dataclass
class TablePlan:
    """What one rank reads into one table."""

    slot: TableSlot
    parts: list[FileSpec]
    """Every rows file this rank reads."""
    admission: list[FileSpec]
    evicted: list[FileSpec]
    reroute: bool
    """Keep only the keys routed to this rank (reshard); else every key must be this rank's."""
    table_step: int
    optimizer_step: int
    rows_here: int = 0
    target: tuple = field(default=())
    """(world size, routing mode, id_range) of the model."""
    drop: torch.Tensor | None = None
    """Sorted keys that do not fit their bucket and are not loaded (on_full WARN/COUNT)."""

    def owned(self, keys: torch.Tensor, rank: int) -> torch.Tensor:
        """(K,) bool: which keys this rank owns under the model's routing."""
        w, mode, id_range = self.target
        return route(keys, w, mode, id_range=id_range) == rank

    def files(self) -> list[FileSpec]:
        return self.parts + self.admission + self.evicted


@dataclass
class LoadPlan:
    """What one rank reads, checked (``dense`` is filled by the validation)."""

    root: Path
    manifest: dict
    tables: list[TablePlan]
    dense_file: FileSpec
    on_full: OnFull
    dense: dict | None = None
    steps_before: list[int] = field(default_factory=list)
    """Each table's step before the load (for the eviction log)."""


def _describe_routing(world_size: int, entry_or_config: dict | TableConfig) -> str:
    if isinstance(entry_or_config, dict):
        mode, id_range = entry_or_config["routing"], entry_or_config["id_range"]
    else:
        mode, id_range = entry_or_config.routing.value, entry_or_config.id_range
    rng = f", id_range {id_range}" if mode == Routing.CONTINUOUS.value else ""
    return f"{world_size} rank(s) with routing {mode}{rng}"


def _check_table(root: Path, key: str, entry: dict, slot: TableSlot) -> None:
    """Dims, optimizer type and score policy must match; hyper-parameters may change."""
    c = slot.config
    where = f"checkpoint {root}: table {key!r}"
    if entry["dim"] != c.dim:
        raise CheckpointError(f"{where}: dim is {entry['dim']} in the checkpoint, expected "
                              f"{c.dim} (the model's); load into a model with the same dims.")
    found, expected = entry["optimizer"]["type"], type(c.optimizer).__name__
    if found != expected:
        raise CheckpointError(f"{where}: optimizer is {found} in the checkpoint, expected "
                              f"{expected} (the model's); the optimizer state would not fit. "
                              "Configure the table with the optimizer it was saved with.")
    if entry["state_width"] != slot.table.optimizer.state_width:
        raise CheckpointError(f"{where}: optimizer state width {entry['state_width']} in the "
                              f"checkpoint, expected {slot.table.optimizer.state_width}.")
    if entry["score"] != c.score.value:
        raise CheckpointError(f"{where}: score policy {entry['score']} in the checkpoint, "
                              f"expected {c.score.value} (the model's); scores of one policy "
                              "mean nothing to another.")
    if entry["optimizer"] != to_json(c.optimizer):
        logger.info("%s: optimizer hyper-parameters changed from %s to %s", where,
                    entry["optimizer"], to_json(c.optimizer))
    if entry["admission"] != (slot.table.admission is not None):
        logger.warning("%s: admission counters %s in the checkpoint, but the table %s admission; "
                       "they are %s", where, "present" if entry["admission"] else "absent",
                       "has" if slot.table.admission is not None else "has no",
                       "dropped" if entry["admission"] else "left empty")


def _table_plan(root: Path, manifest: dict, specs: list[FileSpec], key: str, slot: TableSlot,
                view: ModelView, reshard: bool) -> TablePlan:
    entry = manifest["tables"][key]
    _check_table(root, key, entry, slot)
    w_old, w_new, rank = manifest["world_size"], view.world.size, view.world.rank
    c = slot.config
    same = (w_old == w_new and entry["routing"] == c.routing.value
            and (c.routing != Routing.CONTINUOUS or entry["id_range"] == c.id_range))
    if not same and not reshard:
        raise CheckpointError(
            f"checkpoint {root}: table {key!r} was saved over "
            f"{_describe_routing(w_old, entry)}; this model runs over "
            f"{_describe_routing(w_new, c)}. Its keys would land on the wrong ranks: pass "
            "reshard=True to re-route every key to its owner (every rank reads every shard file).")
    sources = set(range(w_old)) if not same else {rank}
    mine = [s for s in specs if s.table == key and s.rank in sources]
    ranks = [entry["ranks"][r] for r in sorted(sources)]
    return TablePlan(
        slot=slot, parts=[s for s in mine if s.content == "rows"],
        admission=[s for s in mine if s.content == "admission"],
        evicted=[s for s in mine if s.content == "evicted"],
        reroute=not same, table_step=max(r["table_step"] for r in ranks),
        optimizer_step=max(r["optimizer_step"] for r in ranks),
        target=(w_new, c.routing, c.id_range))


def _plan(path: str | os.PathLike, view: ModelView, reshard: bool, on_full: OnFull) -> LoadPlan:
    root = Path(path).absolute()
    manifest = read_manifest(root)
    specs = file_specs(manifest, f"checkpoint {root}")
    found, expected = sorted(manifest["tables"]), sorted(t.key for t in view.tables)
    if found != expected:
        raise CheckpointError(f"checkpoint {root}: holds tables {found}, expected the model's "
                              f"{expected}; load into the model that was saved (table names "
                              "include the module path, e.g. 'sparse/user').")
    models = view.by_key()
    tables = [_table_plan(root, manifest, specs, k, models[k], view, reshard) for k in expected]
    rank, w_old = view.world.rank, manifest["world_size"]
    if w_old == view.world.size:
        source = rank
    elif manifest["dense"]["replicated"]:
        source = 0
    else:
        raise CheckpointError(f"checkpoint {root}: its dense state differs between its {w_old} "
                              f"ranks, so it cannot be given to {view.world.size} ranks; load it "
                              f"over {w_old} ranks (data-parallel dense parameters are identical "
                              "on every rank and reshard freely).")
    dense = next(s for s in specs if s.content == "dense" and s.rank == source)
    return LoadPlan(root=root, manifest=manifest, tables=tables, dense_file=dense,
                    on_full=on_full)


# ---------------------------------------------------------------- validation (no mutation)


def _windows(root: Path, parts: list[FileSpec], names: tuple[str, ...]
             ) -> Iterator[list[torch.Tensor]]:
    """Tensors ``names`` of every rows file, ``READ_ROWS`` rows at a time."""
    for part in parts:
        f = TensorFile(inside(root, part.rel))
        for lo in range(0, part.rows, READ_ROWS):
            yield [f.read(name, lo, lo + READ_ROWS) for name in names]


def _nonfinite_rows(emb: torch.Tensor, state: torch.Tensor, mine: torch.Tensor) -> int:
    """Rows of ``mine`` whose embedding or state holds NaN or inf (a finite sum of everything
    proves there are none, at a fraction of the cost of ``isfinite``)."""
    if bool(torch.isfinite(emb.sum() + state.sum())):
        return 0
    bad = (~torch.isfinite(emb)).any(1) | (~torch.isfinite(state)).any(1)
    return int(bad[mine].sum())


def _bucket_counts(plan: LoadPlan, t: TablePlan, rank: int, full: bool) -> torch.Tensor | None:
    """Checks key ownership and that every row is finite as float32 (``load_rows`` refuses
    others), and counts the rows this rank keeps (``t.rows_here``); for a full load, the rows
    per home bucket of the table."""
    table = t.slot.table
    per_bucket = torch.zeros(table.index.num_buckets, dtype=torch.int64) if full else None
    t.rows_here = 0
    for keys, emb, state in _windows(plan.root, t.parts, ROW_TENSORS[:3]):
        mine = t.owned(keys, rank)
        if not t.reroute and not bool(mine.all()):
            raise CheckpointError(
                f"checkpoint {plan.root}: a file of table {t.slot.key!r} holds "
                f"{int((~mine).sum())} keys that rank {rank} does not own under the recorded "
                "routing (keys inserted into a shard by hand?); pass reshard=True to send every "
                "key to its owner.")
        bad = _nonfinite_rows(emb, state, mine)
        if bad:
            raise CheckpointError(
                f"checkpoint {plan.root}: table {t.slot.key!r} holds rows whose embedding or "
                f"optimizer state is NaN or infinite ({bad} in one window of rank {rank}'s "
                "rows); a table accepts finite rows only: load an older checkpoint.")
        t.rows_here += int(mine.sum())
        if full:
            buckets = table.home_buckets(keys[mine]).cpu()
            per_bucket += torch.bincount(buckets, minlength=table.index.num_buckets)
    return per_bucket


def _raise_unfit(plan: LoadPlan, t: TablePlan, rank: int, per_bucket: torch.Tensor) -> None:
    table = t.slot.table
    where = (f"checkpoint {plan.root}: table {t.slot.key!r}: {t.rows_here} rows belong on "
             f"rank {rank}")
    fix = ("raise the table's capacity, or pass on_full='warn' to keep each full bucket's "
           "highest-scored rows and drop the rest")
    if t.rows_here > table.capacity():
        raise CheckpointError(f"{where}, but its shard has {table.capacity()} slots; {fix}.")
    over = int((per_bucket - table.index.width).clamp(min=0).sum())
    raise CheckpointError(
        f"{where} and {over} of them find their hash bucket full (buckets of "
        f"{table.index.width} slots; this table has {table.index.num_buckets} buckets, so "
        f"keys hash differently than where they were saved); {fix}.")


def _choose_dropped(plan: LoadPlan, t: TablePlan, rank: int, per_bucket: torch.Tensor) -> None:
    """The rows of over-full buckets are read again (keys and scores only); each such bucket
    keeps its ``width`` highest-scored rows (``fit.lowest_scored``)."""
    table = t.slot.table
    over = per_bucket > table.index.width
    cand = [[], [], []]
    for keys, scores in _windows(plan.root, t.parts, ("keys", "scores")):
        mine = t.owned(keys, rank)
        keys, scores = keys[mine], scores[mine]
        buckets = table.home_buckets(keys).cpu()
        sel = over[buckets]
        for out, col in zip(cand, (keys, scores, buckets)):
            out.append(col[sel])
    keys, scores, buckets = (torch.cat(c) for c in cand)
    t.drop = lowest_scored(keys, scores, buckets, table.index.width)
    t.rows_here -= t.drop.numel()


def _check_fit(plan: LoadPlan, t: TablePlan, rank: int) -> None:
    """Key ownership; a full load fills a cleared table: rows must fit every bucket (or, with
    on_full WARN/COUNT, the rows that do not are chosen now)."""
    full = plan.manifest["kind"] != DELTA
    per_bucket = _bucket_counts(plan, t, rank, full)
    if not full or int(per_bucket.max()) <= t.slot.table.index.width:
        return
    if plan.on_full == OnFull.RAISE:
        _raise_unfit(plan, t, rank, per_bucket)
    _choose_dropped(plan, t, rank, per_bucket)


def _check_dense_file(plan: LoadPlan, dense: object) -> dict:
    where = f"checkpoint {plan.root}: {plan.dense_file.rel}"
    if not isinstance(dense, dict) or set(dense) != {"model", "optimizer"} \
            or not isinstance(dense["model"], dict):
        raise CheckpointError(f"{where}: expected a dict of 'model' (a state dict) and "
                              f"'optimizer', found {type(dense).__name__}.")
    opt = dense["optimizer"]
    if (opt is None) != (plan.manifest["dense"]["optimizer"] is None) or opt is not None and (
            not isinstance(opt, dict) or not isinstance(opt.get("param_groups"), list)
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                       for g in opt["param_groups"])):
        raise CheckpointError(f"{where}: its optimizer state does not match the manifest's "
                              f"dense optimizer {plan.manifest['dense']['optimizer']!r}.")
    return dense


def _check_dense(plan: LoadPlan, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> None:
    raw = inside(plan.root, plan.dense_file.rel).read_bytes()
    where = f"checkpoint {plan.root}"
    try:
        dense = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (any unpickling failure: a damaged file)
        raise CheckpointError(f"{where}: {plan.dense_file.rel} cannot be read ({e}).") from None
    dense = _check_dense_file(plan, dense)
    dense["model"] = check_dense_state(model, dense["model"], where)
    saved_type, found_type = plan.manifest["dense"]["optimizer"], optimizer_type(optimizer)
    if optimizer is not None:
        if saved_type is None:
            raise CheckpointError(f"{where}: has no dense optimizer state, but dense_optimizer= "
                                  f"{found_type} was given; pass dense_optimizer=None.")
        if saved_type != found_type:
            raise CheckpointError(f"{where}: dense optimizer is {saved_type} in the checkpoint, "
                                  f"expected {found_type} (the one given).")
        sizes = [len(g["params"]) for g in dense["optimizer"]["param_groups"]]
        own = [len(g["params"]) for g in optimizer.param_groups]
        if sizes != own:
            raise CheckpointError(f"{where}: the dense optimizer has parameter groups of sizes "
                                  f"{sizes} in the checkpoint, expected {own}.")
    plan.dense = dense


def _check_delta_base(plan: LoadPlan) -> None:
    since = plan.manifest["since_step"]
    for t in plan.tables:
        marks = steps.steps_of(t.slot.table).marks
        if marks.get(since) != t.slot.table.step:
            raise CheckpointError(
                f"checkpoint {plan.root}: a delta since step {since}, but table "
                f"{t.slot.key!r} is not at step {since} (this process last loaded or saved "
                f"steps {sorted(marks)}, and the table may have changed since); load the "
                f"checkpoint of step {since} (or the delta before this one) first.")


# ---------------------------------------------------------------- mutation


def _clear_rows(table: DynamicTable) -> None:
    """Erases every row of a table."""
    if table.size():
        keys = [table.export_batch(s, 1 << 16).keys for s in range(0, table.capacity(), 1 << 16)]
        table.erase(torch.cat(keys))


def _load_rows(plan: LoadPlan, t: TablePlan, rank: int) -> ExportBatch | None:
    """Streams the rows this rank keeps into the table; returns the dropped ones (or None)."""
    table = t.slot.table
    dropped: list[list[torch.Tensor]] = []
    for cols in _windows(plan.root, t.parts, ROW_TENSORS):
        if t.reroute:
            mine = t.owned(cols[0], rank)
            cols = [c[mine] for c in cols]
        if t.drop is not None and t.drop.numel():
            out = torch.isin(cols[0], t.drop)
            if bool(out.any()):
                dropped.append([c[out] for c in cols])
                cols = [c[~out] for c in cols]
        if cols[0].numel():
            table.load_rows(*(c.to(table.device) for c in cols))
    if t.drop is None:
        return None
    cols = [torch.cat(c) for c in zip(*dropped)] if dropped else [
        torch.empty((0, *w), dtype=dt) for w, dt in
        (((), torch.int64), ((table.dim,), torch.float32),
         ((table.optimizer.state_width,), torch.float32), ((), torch.int64))]
    return ExportBatch(*cols)


def _gather_small(plan: LoadPlan, t: TablePlan, files: list[FileSpec], names: tuple[str, ...],
                  rank: int) -> list[torch.Tensor]:
    """Concatenates small per-rank tensors (admission counters, evicted keys), keeping this
    rank's keys."""
    cols = [[TensorFile(inside(plan.root, s.rel)).read(n) for s in files] for n in names]
    cols = [torch.cat(c) if c else torch.empty(0, dtype=torch.int64) for c in cols]
    if t.reroute and cols[0].numel():
        mine = t.owned(cols[0], rank)
        cols = [c[mine] for c in cols]
    return cols


def _apply_table(plan: LoadPlan, t: TablePlan, rank: int) -> ExportBatch | None:
    """Puts the checkpoint's state into one table: a full checkpoint replaces every row, a
    delta erases its evicted keys and overwrites its rows; admission counters are replaced.
    Returns the rows dropped for want of room (on_full WARN/COUNT), or None."""
    table, delta = t.slot.table, plan.manifest["kind"] == DELTA
    if not delta:
        _clear_rows(table)
    else:
        (evicted,) = _gather_small(plan, t, t.evicted, ("keys",), rank)
        if evicted.numel():
            table.erase(evicted.to(table.device))
    # after the erases (each a table step), before load_rows (rows count as written now)
    table.step = t.table_step
    table.optimizer.step = t.optimizer_step
    dropped = _load_rows(plan, t, rank)
    if table.admission is not None:
        table.admission.clear()
        keys, counts = _gather_small(plan, t, t.admission, ("keys", "counts"), rank)
        if keys.numel():
            lost = table.admission.load(keys.to(table.device), counts.to(table.device),
                                        partial=True)
            if lost:  # (counter_capacity is per rank: fewer ranks may hold fewer counters)
                logger.warning("table %r: admission counters restored in part: kept %d of %d; "
                               "the rest found their buckets of the counter table (%d slots) "
                               "full and were dropped, the lowest counts first. Raise "
                               "Admission.counter_capacity to keep them.", t.slot.key,
                               keys.numel() - lost, keys.numel(),
                               table.admission.index.num_slots)
    return dropped


# ---------------------------------------------------------------- load


def _validate(path: str | os.PathLike, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer | None, reshard: bool, on_full: OnFull,
              view: ModelView) -> LoadPlan:
    """Everything that can fail before the model changes."""
    plan = _plan(path, view, reshard, on_full)
    files = [plan.dense_file] + [s for t in plan.tables for s in t.files()]
    check_files(plan.root, plan.manifest, files)
    for t in plan.tables:
        _check_fit(plan, t, view.world.rank)
    _check_dense(plan, model, optimizer)
    if plan.manifest["kind"] == DELTA:
        _check_delta_base(plan)
    return plan


def _report(plan: LoadPlan, t: TablePlan, rows: ExportBatch, rank: int) -> None:
    n = rows.keys.numel()
    level = logging.WARNING if plan.on_full == OnFull.WARN else logging.INFO
    logger.log(level, "checkpoint %s: table %r: %d of its rows for rank %d did not fit their hash "
               "buckets (buckets of %d slots): kept each full bucket's highest-scored rows and "
               "dropped %d (on_full=%s; pass dropped={} to load to get them, or raise the "
               "table's capacity)", plan.root, t.slot.key, n + t.rows_here, rank,
               t.slot.table.index.width, n, plan.on_full.value)


def _apply(plan: LoadPlan, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
           rank: int, dropped: dict[str, ExportBatch] | None) -> None:
    for t in plan.tables:
        try:
            rows = _apply_table(plan, t, rank)
        except CapacityError as e:
            raise CheckpointError(
                f"checkpoint {plan.root}: table {t.slot.key!r}: its {t.rows_here} rows for rank "
                f"{rank} do not fit the shard's hash buckets ({e}); the table is partly loaded: "
                "raise its capacity (or bucket_capacity) and load again.") from None
        if rows is not None:
            _report(plan, t, rows, rank)
            if dropped is not None:
                dropped[t.slot.key] = rows
    with dense_only():
        model.load_state_dict(plan.dense["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(plan.dense["optimizer"])


def load(path: str | os.PathLike, *, model: torch.nn.Module,
         dense_optimizer: torch.optim.Optimizer | None = None, reshard: bool = False,
         on_full: OnFull | str | None = None,
         dropped: dict[str, ExportBatch] | None = None) -> int:
    """Loads a checkpoint (full, or a delta on top of the checkpoint it was taken since) into
    ``model``'s tables, dense parameters and ``dense_optimizer``.

    Collective when the model holds sharded collections: every rank calls it. It holds the
    path's lock shared (a save to the path waits until it is done). Every check runs first on
    every rank: the manifest (checksum, schema), the manifest against the model (table
    names, dims, optimizer type, score policy, routing and world size), each file's size,
    sha256, metadata and shapes, that each key is on its owner, and the fit; the model changes
    only if every rank passed.

    Args:
        path: a checkpoint directory written by ``save`` or ``export_incremental``.
        model: a module holding the same tables (plain or sharded, any world size with reshard).
        dense_optimizer: receives the saved dense optimizer state (None: not loaded).
        reshard: allow another world size or routing mode: every rank streams every shard file
            in windows of ``READ_ROWS`` rows and keeps the keys ``route`` gives it.
        on_full: what a full load does when more rows belong to a hash bucket (or a shard)
            than it holds: ``OnFull.RAISE`` refuses before anything changes; ``OnFull.WARN``
            keeps each such bucket's highest-scored rows, drops the rest and logs a warning per
            table with the count; ``OnFull.COUNT`` the same, logged at INFO. None (default):
            WARN with ``reshard=True``, else RAISE.
        dropped: a dict to receive, per table name, the rows this rank dropped (an
            ``ExportBatch``: keys, embeddings, optimizer_state, scores), for each table that
            dropped rows (with on_full WARN/COUNT); tables that dropped none get no entry.

    Returns:
        The training step the checkpoint was saved at.

    Raises:
        CheckpointError: on every rank, naming what was expected and what was found.
    """
    check_idle(model, "dynemb.checkpoint.load")
    view = view_model(model)
    plan, error, lock = None, None, None
    try:
        try:
            mode = resolve_on_full(on_full, bool(reshard))
            lock = load_lock(Path(path))  # no save replaces the files while they are read
            plan = _validate(path, model, dense_optimizer, bool(reshard), mode, view)
            plan.steps_before = [t.slot.table.step for t in plan.tables]
        except Exception as e:  # noqa: BLE001  (raised on every rank, before any change)
            error = e
        view.world.raise_together(error, f"checkpoint load of {path} (validation)")
        try:
            _apply(plan, model, dense_optimizer, view.world.rank, dropped)
        except Exception as e:  # noqa: BLE001
            error = e
        view.world.raise_together(error, f"checkpoint load of {path}")
    finally:
        if lock is not None:
            lock.__exit__()
    step = plan.manifest["step"]
    for t, before in zip(plan.tables, plan.steps_before):
        steps.after_load(t.slot.table, step, before)
    logger.info("loaded %s checkpoint %s (step %d) on rank %d of %d", plan.manifest["kind"],
                plan.root, step, view.world.rank, view.world.size)
    return step
