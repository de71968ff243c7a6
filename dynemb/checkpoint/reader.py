"""Loading checkpoints: check everything first (manifest against the model, file sizes and
checksums, shard shapes, key ownership, capacity, dense state), on every rank, and only then
change the model. With ``reshard=True`` every rank streams every shard file in bounded row
windows and keeps the keys that :func:`dynemb.distributed.route` gives it."""

from __future__ import annotations

import io
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynemb.checkpoint import steps
from dynemb.errors import CheckpointError
from dynemb.checkpoint.files import TensorFile, verify
from dynemb.checkpoint.manifest import DELTA, read_manifest, to_json
from dynemb.checkpoint.model import (
    ModelView, TableSlot, check_dense_state, optimizer_type, view_model,
)
from dynemb.config import Routing, TableConfig
from dynemb.distributed.routing import route
from dynemb.errors import CapacityError
from dynemb.table.table import DynamicTable

logger = logging.getLogger(__name__)

READ_ROWS = 1 << 17
"""Rows per window when streaming a shard file: bounds the memory of a load."""
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads that check file checksums (hashlib and file reads release the GIL)."""
ROW_TENSORS = ("keys", "embeddings", "optimizer_state", "scores")


@dataclass
class TablePlan:
    """What one rank reads into one table."""

    slot: TableSlot
    parts: list[dict]
    """``{file, rows}`` of every shard file this rank reads."""
    admission: list[str]
    evicted: list[str]
    reroute: bool
    """Keep only the keys routed to this rank (reshard); else every key must be this rank's."""
    table_step: int
    optimizer_step: int
    rows_here: int = 0
    target: tuple = field(default=())
    """(world size, routing mode, id_range) of the model."""

    def owned(self, keys: torch.Tensor, rank: int) -> torch.Tensor:
        """(K,) bool: which keys this rank owns under the model's routing."""
        w, mode, id_range = self.target
        return route(keys, w, mode, id_range=id_range) == rank


@dataclass
class LoadPlan:
    """What one rank reads, checked (``dense`` is filled by the validation)."""

    root: Path
    manifest: dict
    tables: list[TablePlan]
    dense_file: str
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


def _table_plan(root: Path, manifest: dict, key: str, slot: TableSlot, view: ModelView,
                reshard: bool) -> TablePlan:
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
    ranks = entry["ranks"] if not same else [entry["ranks"][rank]]
    return TablePlan(
        slot=slot, parts=[p for r in ranks for p in r["parts"]],
        admission=[r["admission"]["file"] for r in ranks if r["admission"]],
        evicted=[r["evicted"]["file"] for r in ranks if r["evicted"]],
        reroute=not same, table_step=max(r["table_step"] for r in ranks),
        optimizer_step=max(r["optimizer_step"] for r in ranks),
        target=(w_new, c.routing, c.id_range))


def _plan(path: str | os.PathLike, view: ModelView, reshard: bool) -> LoadPlan:
    root = Path(path).absolute()
    manifest = read_manifest(root)
    found, expected = sorted(manifest["tables"]), sorted(t.key for t in view.tables)
    if found != expected:
        raise CheckpointError(f"checkpoint {root}: holds tables {found}, expected the model's "
                              f"{expected}; load into the model that was saved (table names "
                              "include the module path, e.g. 'sparse/user').")
    models = view.by_key()
    tables = [_table_plan(root, manifest, k, models[k], view, reshard) for k in expected]
    rank, w_old = view.world.rank, manifest["world_size"]
    if w_old == view.world.size:
        dense_file = manifest["dense"]["files"][rank]
    elif manifest["dense"]["replicated"]:
        dense_file = manifest["dense"]["files"][0]
    else:
        raise CheckpointError(f"checkpoint {root}: its dense state differs between its {w_old} "
                              f"ranks, so it cannot be given to {view.world.size} ranks; load it "
                              f"over {w_old} ranks (data-parallel dense parameters are identical "
                              "on every rank and reshard freely).")
    return LoadPlan(root=root, manifest=manifest, tables=tables, dense_file=dense_file)


# ---------------------------------------------------------------- validation (no mutation)


def _verify_files(plan: LoadPlan) -> None:
    """Size and sha256 of every file this rank reads (hashed on ``HASH_THREADS`` threads;
    the first failure in manifest order is raised)."""
    files = plan.manifest["files"]
    rels = [plan.dense_file] + [p["file"] for t in plan.tables for p in t.parts]
    rels += [f for t in plan.tables for f in t.admission + t.evicted]
    for rel in rels:
        if rel not in files:
            raise CheckpointError(f"checkpoint {plan.root}: the manifest names {rel} but has no "
                                  "size or checksum for it; the manifest is damaged.")
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        jobs = [pool.submit(verify, plan.root, rel, files[rel]) for rel in rels]
        for job in jobs:
            job.result()


def _check_fit(plan: LoadPlan, t: TablePlan, rank: int, per_bucket: torch.Tensor | None) -> None:
    """A full load fills a cleared table: rows must fit its capacity and every bucket."""
    table = t.slot.table
    where = (f"checkpoint {plan.root}: table {t.slot.key!r}: {t.rows_here} rows belong on "
             f"rank {rank}")
    if t.rows_here > table.capacity():
        raise CheckpointError(f"{where}, but its shard has {table.capacity()} slots; raise the "
                              "table's capacity.")
    if per_bucket is not None and int(per_bucket.max()) > table.index.width:
        over = int((per_bucket - table.index.width).clamp(min=0).sum())
        raise CheckpointError(
            f"{where} and {over} of them find their hash bucket full (buckets of "
            f"{table.index.width} slots; this table has {table.index.num_buckets} buckets, so "
            "keys hash differently than where they were saved); raise the table's capacity.")


def _check_parts(plan: LoadPlan, t: TablePlan, rank: int) -> None:
    """Shapes of every shard file, and which keys land here (capacity and bucket checks)."""
    table = t.slot.table
    widths = {"keys": (), "embeddings": (table.dim,),
              "optimizer_state": (table.optimizer.state_width,), "scores": ()}
    full = plan.manifest["kind"] != DELTA
    per_bucket = None
    t.rows_here = 0
    for part in t.parts:
        f = TensorFile(plan.root / part["file"])
        for name, tail in widths.items():
            shape = f.shape(name) if name in f.names() else None
            if shape != (part["rows"], *tail):
                raise CheckpointError(f"checkpoint {plan.root}: {part['file']}: tensor {name!r} "
                                      f"has shape {shape}, expected {(part['rows'], *tail)}.")
        for lo in range(0, part["rows"], READ_ROWS):
            keys = f.read("keys", lo, lo + READ_ROWS)
            mine = t.owned(keys, rank)
            if not t.reroute and not bool(mine.all()):
                raise CheckpointError(
                    f"checkpoint {plan.root}: {part['file']} holds {int((~mine).sum())} keys "
                    f"that rank {rank} does not own under the recorded routing (keys inserted "
                    "into a shard by hand?); pass reshard=True to send every key to its owner.")
            t.rows_here += int(mine.sum())
            if full:
                buckets = table.home_buckets(keys[mine]).cpu()
                counts = torch.bincount(buckets, minlength=table.index.num_buckets)
                per_bucket = counts if per_bucket is None else per_bucket + counts
    if full:
        _check_fit(plan, t, rank, per_bucket)


def _check_dense(plan: LoadPlan, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> None:
    raw = (plan.root / plan.dense_file).read_bytes()
    where = f"checkpoint {plan.root}"
    try:
        dense = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (any unpickling failure: a damaged file)
        raise CheckpointError(f"{where}: {plan.dense_file} cannot be read ({e}).") from None
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


def _clear_admission(table: DynamicTable) -> None:
    """Forgets every admission counter of a table."""
    table.admission.clear()


def _load_rows(plan: LoadPlan, t: TablePlan, rank: int) -> None:
    table = t.slot.table
    for part in t.parts:
        f = TensorFile(plan.root / part["file"])
        for lo in range(0, part["rows"], READ_ROWS):
            cols = [f.read(name, lo, lo + READ_ROWS) for name in ROW_TENSORS]
            if t.reroute:
                mine = t.owned(cols[0], rank)
                cols = [c[mine] for c in cols]
            if cols[0].numel():
                table.load_rows(*(c.to(table.device) for c in cols))


def _gather_small(plan: LoadPlan, t: TablePlan, files: list[str], names: tuple[str, ...],
                  rank: int) -> list[torch.Tensor]:
    """Concatenates small per-rank tensors (admission counters, evicted keys), keeping this
    rank's keys."""
    cols = [[TensorFile(plan.root / rel).read(n) for rel in files] for n in names]
    cols = [torch.cat(c) if c else torch.empty(0, dtype=torch.int64) for c in cols]
    if t.reroute and cols[0].numel():
        mine = t.owned(cols[0], rank)
        cols = [c[mine] for c in cols]
    return cols


def _apply_table(plan: LoadPlan, t: TablePlan, rank: int) -> None:
    """Puts the checkpoint's state into one table: a full checkpoint replaces every row, a
    delta erases its evicted keys and overwrites its rows; admission counters are replaced."""
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
    _load_rows(plan, t, rank)
    if table.admission is not None:
        _clear_admission(table)
        keys, counts = _gather_small(plan, t, t.admission, ("keys", "counts"), rank)
        if keys.numel():
            try:
                table.admission.load(keys.to(table.device), counts.to(table.device))
            except CapacityError as e:
                logger.warning("table %r: admission counters restored in part: %s",
                               t.slot.key, e)


# ---------------------------------------------------------------- load


def _validate(path: str | os.PathLike, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer | None, reshard: bool, view: ModelView) -> LoadPlan:
    """Everything that can fail before the model changes."""
    plan = _plan(path, view, reshard)
    _verify_files(plan)
    for t in plan.tables:
        _check_parts(plan, t, view.world.rank)
    _check_dense(plan, model, optimizer)
    if plan.manifest["kind"] == DELTA:
        _check_delta_base(plan)
    return plan


def _apply(plan: LoadPlan, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
           rank: int) -> None:
    for t in plan.tables:
        try:
            _apply_table(plan, t, rank)
        except CapacityError as e:
            raise CheckpointError(
                f"checkpoint {plan.root}: table {t.slot.key!r}: its {t.rows_here} rows for rank "
                f"{rank} do not fit the shard's hash buckets ({e}); the table is partly loaded: "
                "raise its capacity (or bucket_capacity) and load again.") from None
    model.load_state_dict(plan.dense["model"], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(plan.dense["optimizer"])


def load(path: str | os.PathLike, *, model: torch.nn.Module,
         dense_optimizer: torch.optim.Optimizer | None = None, reshard: bool = False) -> int:
    """Loads a checkpoint (full, or a delta on top of the checkpoint it was taken since) into
    ``model``'s tables, dense parameters and ``dense_optimizer``.

    Collective when the model holds sharded collections: every rank calls it. Every check runs
    first on every rank: the manifest against the model (table names, dims, optimizer type,
    score policy, routing and world size), each file's size and sha256, the shard shapes, that
    each key is on its owner, and the capacity; the model changes only if every rank passed.

    Args:
        path: a checkpoint directory written by ``save`` or ``export_incremental``.
        model: a module holding the same tables (plain or sharded, any world size with reshard).
        dense_optimizer: receives the saved dense optimizer state (None: not loaded).
        reshard: allow another world size or routing mode: every rank streams every shard file
            in windows of ``READ_ROWS`` rows and keeps the keys ``route`` gives it.

    Returns:
        The training step the checkpoint was saved at.

    Raises:
        CheckpointError: on every rank, naming what was expected and what was found.
    """
    view = view_model(model)
    plan, error = None, None
    try:
        plan = _validate(path, model, dense_optimizer, bool(reshard), view)
        plan.steps_before = [t.slot.table.step for t in plan.tables]
    except Exception as e:  # noqa: BLE001  (raised on every rank, before any change)
        error = e
    view.world.raise_together(error, f"checkpoint load of {path} (validation)")
    error = None
    try:
        _apply(plan, model, dense_optimizer, view.world.rank)
    except Exception as e:  # noqa: BLE001
        error = e
    view.world.raise_together(error, f"checkpoint load of {path}")
    step = plan.manifest["step"]
    for t, before in zip(plan.tables, plan.steps_before):
        steps.after_load(t.slot.table, step, before)
    logger.info("loaded %s checkpoint %s (step %d) on rank %d of %d", plan.manifest["kind"],
                plan.root, step, view.world.rank, view.world.size)
    return step
