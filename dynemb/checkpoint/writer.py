"""Writing checkpoints: rank 0 takes the path's save lock and checks what is there; every rank
writes its shard files into a temporary sibling directory; rank 0 adds the sealed manifest once
all have written, checks the new directory is complete, fsyncs, puts it in place atomically and
releases the lock. ``save`` writes every row; ``export_incremental`` the rows written and the
keys evicted since an earlier step."""

from __future__ import annotations

import io
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from dynemb.checkpoint import steps
from dynemb.errors import CheckpointError
from dynemb.checkpoint.files import (
    FileEntry, Hasher, fsync_dir, replace_dir, write_bytes, write_tensors,
)
from dynemb.checkpoint.integrity import file_metadata
from dynemb.checkpoint.manifest import (
    DELTA, FORMAT, FORMAT_VERSION, FULL, MANIFEST, table_dir, table_entry, write_json,
)
from dynemb.checkpoint.paths import (
    SaveLock, check_complete, check_replaceable, owned_name, remove_abandoned,
)
from dynemb.checkpoint.schema import INT64_MAX, FileSpec
from dynemb.checkpoint.model import ModelView, TableSlot, dense_state, optimizer_type, view_model
from dynemb.nn.staging import check_idle
from dynemb.table.stats import ExportBatch
from dynemb.table.table import DynamicTable

logger = logging.getLogger(__name__)

PART_BYTES = 64 << 20
"""Bytes of rows per shard file (a part): what one rank holds in memory while writing."""
EXPORT_SLOTS = 1 << 16
"""Slots per ``export_batch`` call."""


def _check_step(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT64_MAX:
        raise CheckpointError(f"checkpoint: expected {name} an int in [0, {INT64_MAX}] (the "
                              f"training step), found {value!r}.")
    return value


# ---------------------------------------------------------------- one rank's files


def _export(table: DynamicTable, since: int | None) -> Iterator[ExportBatch]:
    """The table's rows (written after table step ``since``, if given), a slot window at a time."""
    for start in range(0, table.capacity(), EXPORT_SLOTS):
        b = (table.export_batch(start, EXPORT_SLOTS) if since is None
             else table.export_batch(start, EXPORT_SLOTS, since_step=since))
        if b.keys.numel():
            yield b


def _parts(batches: Iterator[ExportBatch], part_rows: int) -> Iterator[list[torch.Tensor]]:
    """Regroups exported windows into parts of ``part_rows`` rows (the last one shorter).

    The parts are views of four buffers allocated once and refilled (a fresh 64 MiB tensor per
    part would be page-faulted in again every time): write each part before the next one.
    """
    bufs: list[torch.Tensor] | None = None
    n = 0
    for b in batches:
        cols = [b.keys, b.embeddings, b.optimizer_state, b.scores]
        if bufs is None:
            bufs = [torch.empty((part_rows, *c.shape[1:]), dtype=c.dtype) for c in cols]
        lo, rows = 0, cols[0].shape[0]
        while lo < rows:
            take = min(rows - lo, part_rows - n)
            for buf, c in zip(bufs, cols):
                buf[n:n + take].copy_(c[lo:lo + take])
            n, lo = n + take, lo + take
            if n == part_rows:
                yield bufs
                n = 0
    if n:
        yield [buf[:n] for buf in bufs]


def _kind(since: int | None) -> str:
    return FULL if since is None else DELTA


def _write_small(root: Path, rel_dir: str, content: str, tensors: dict[str, torch.Tensor],
                 slot: TableSlot, rank: int, since: int | None, files: Hasher) -> dict:
    """Writes an admission or evicted-keys file (``content``); returns its manifest entry."""
    rel = f"{rel_dir}/rank{rank:05d}.{content}.safetensors"
    keys = tensors["keys"].numel()
    meta = file_metadata(FileSpec(rel, content, rank, slot.key, rows=keys), _kind(since))
    files.add(root, rel, write_tensors(root / rel, tensors, meta))
    return {"file": rel, "keys": keys}


def _write_rows(root: Path, rel_dir: str, slot: TableSlot, rank: int, since: int | None,
                files: Hasher) -> tuple[list[dict], int]:
    """Writes the table's rows as parts; returns ([{file, rows}], total rows)."""
    t = slot.table
    row_bytes = 16 + 4 * (t.dim + t.optimizer.state_width)
    part_rows = max(1, PART_BYTES // row_bytes)
    parts, total = [], 0
    for p, (keys, emb, opt, scores) in enumerate(_parts(_export(t, since), part_rows)):
        rel = f"{rel_dir}/rank{rank:05d}.part{p:05d}.safetensors"
        meta = file_metadata(FileSpec(rel, "rows", rank, slot.key, p, keys.numel()),
                             _kind(since))
        size = write_tensors(root / rel, {"keys": keys, "embeddings": emb,
                                          "optimizer_state": opt, "scores": scores}, meta)
        files.add(root, rel, size)
        parts.append({"file": rel, "rows": keys.numel()})
        total += keys.numel()
    return parts, total


def _write_table(root: Path, index: int, slot: TableSlot, rank: int, since: int | None,
                 files: Hasher) -> dict:
    """Writes one table's shard on this rank; returns its per-rank manifest entry."""
    t = slot.table
    if t.interrupted:
        raise CheckpointError(
            f"table {slot.key!r}: a call that changes it was interrupted part way (e.g. by "
            "Ctrl-C), so its rows may be half written; expected a table whose calls all "
            "completed. Load the last checkpoint and train on from there instead of saving.")
    rel_dir = table_dir(index, slot.key)
    (root / rel_dir).mkdir(parents=True, exist_ok=True)
    t.flush()  # CACHING: write cached rows back before exporting
    if since is None:
        steps.start_tracking(t)
    parts, rows = _write_rows(root, rel_dir, slot, rank, since, files)
    entry = {"rows": rows, "table_step": t.step, "optimizer_step": t.optimizer.step,
             "since_table_step": since, "parts": parts, "admission": None, "evicted": None}
    if t.admission is not None:
        keys, counts = t.admission.export()
        entry["admission"] = _write_small(root, rel_dir, "admission",
                                          {"keys": keys, "counts": counts}, slot, rank, since,
                                          files)
    if since is not None:
        try:
            evicted = t.evicted_since(since)
        except Exception as e:  # noqa: BLE001  (InputError: the log does not reach back)
            raise CheckpointError(f"table {slot.key!r}: cannot list the keys evicted since table "
                                  f"step {since}: {e}") from None
        entry["evicted"] = _write_small(root, rel_dir, "evicted", {"keys": evicted}, slot, rank,
                                        since, files)
    return entry


def _write_dense(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 rank: int, files: Hasher) -> FileEntry:
    """Writes this rank's dense state dict and dense optimizer state (``torch.save``)."""
    (root / "dense").mkdir(exist_ok=True)
    buf = io.BytesIO()
    torch.save({"model": dense_state(model),
                "optimizer": None if optimizer is None else optimizer.state_dict()}, buf)
    rel = f"dense/rank{rank:05d}.pt"
    entry = write_bytes(root / rel, buf.getbuffer())
    files.known(rel, entry)
    return entry


def _write_rank(root: Path, model: torch.nn.Module, view: ModelView,
                optimizer: torch.optim.Optimizer | None,
                since: dict[str, int] | None) -> dict:
    """Everything this rank writes; returns its report for the manifest."""
    rank, files = view.world.rank, Hasher()
    try:
        tables = {slot.key: _write_table(root, i, slot, rank,
                                         None if since is None else since[slot.key], files)
                  for i, slot in enumerate(view.tables)}
        dense = _write_dense(root, model, optimizer, rank, files)
    finally:
        hashes = files.entries()
    return {"files": hashes, "tables": tables, "dense": dense.sha256}


# ---------------------------------------------------------------- manifest and commit


def _manifest(view: ModelView, reports: list[dict], kind: str, step: int,
              since_step: int | None, optimizer: torch.optim.Optimizer | None) -> dict:
    import dynemb  # noqa: PLC0415  (the package imports this module)

    tables = {}
    for slot in view.tables:
        entry = table_entry(slot.config, slot.table.optimizer.state_width)
        entry["ranks"] = [r["tables"][slot.key] for r in reports]
        tables[slot.key] = entry
    files: dict[str, dict] = {}
    for r in reports:
        files.update(r["files"])
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind, "step": step,
        "since_step": since_step, "library_version": dynemb.__version__,
        "torch_version": torch.__version__, "created_unix": time.time(),
        "world_size": view.world.size, "tables": tables,
        "dense": {"files": [f"dense/rank{r:05d}.pt" for r in range(len(reports))],
                  "optimizer": optimizer_type(optimizer),
                  "replicated": len({r["dense"] for r in reports}) == 1},
        "files": files,
    }


def _commit(tmp: Path, dest: Path, manifest: dict) -> None:
    """Rank 0, holding the lock: the sealed manifest, a check that the new directory is
    complete, fsync of every directory, the atomic replacement; then the previous checkpoint
    and abandoned replaced ones are removed."""
    write_bytes(tmp / MANIFEST, write_json(manifest))
    check_complete(tmp)
    for d, _, _ in os.walk(tmp, topdown=False):
        fsync_dir(Path(d))
    old = replace_dir(tmp, dest, owned_name(dest, "old"))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    remove_abandoned(dest, "old")


def _begin(dest: Path) -> tuple[SaveLock, Path]:
    """Rank 0: takes the save lock of ``dest``, refuses to replace what is not a checkpoint,
    removes temporary directories of saves that were killed, and makes its own."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = SaveLock(dest).__enter__()
    except OSError as e:
        raise CheckpointError(f"checkpoint: cannot take the save lock beside {dest} ({e}); "
                              "expected a writable directory.") from None
    try:
        check_replaceable(dest)
        remove_abandoned(dest, "tmp")
        tmp = owned_name(dest, "tmp")
        tmp.mkdir()
    except BaseException:
        lock.__exit__()
        raise
    return lock, tmp


def _write_all(view: ModelView, tmp: Path, dest: Path, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None, kind: str, step: int,
               since_step: int | None) -> None:
    """Every rank writes into ``tmp``; rank 0 commits; errors are raised on every rank."""
    world = view.world
    report, error = None, None
    try:
        optimizer_type(optimizer)
        since = None if since_step is None else {
            s.key: steps.table_step_at(s.table, s.key, since_step) for s in view.tables}
        tmp.mkdir(parents=True, exist_ok=True)
        report = _write_rank(tmp, model, view, optimizer, since)
    except Exception as e:  # noqa: BLE001  (raised on every rank below)
        error = e
    reports = world.all_gather(report)
    if world.rank == 0 and any(r is None for r in reports):
        shutil.rmtree(tmp, ignore_errors=True)
    world.raise_together(error, f"checkpoint {kind} save to {dest}")
    error = None
    if world.rank == 0:
        try:
            _commit(tmp, dest, _manifest(view, reports, kind, step, since_step, optimizer))
        except Exception as e:  # noqa: BLE001
            error = e
            shutil.rmtree(tmp, ignore_errors=True)
    world.raise_together(error, f"checkpoint {kind} commit of {dest}")


def _write(path: str | os.PathLike, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer | None, kind: str, step: int,
           since_step: int | None) -> ModelView:
    """The collective write of ``save`` and ``export_incremental``: rank 0 holds the path's save
    lock from before it looks at the path until the new checkpoint is in place."""
    check_idle(model, "dynemb.checkpoint." + ("save" if since_step is None else
                                              "export_incremental"))
    view = view_model(model)
    world, dest = view.world, Path(path).absolute()
    lock, tmp, error = None, None, None
    try:
        if world.rank == 0:
            try:
                optimizer_type(optimizer)
                lock, tmp = _begin(dest)
            except Exception as e:  # noqa: BLE001  (raised on every rank below)
                error = e
        world.raise_together(error, f"checkpoint {kind} save to {dest}")
        tmp = Path(world.all_gather(None if tmp is None else str(tmp))[0])
        _write_all(view, tmp, dest, model, optimizer, kind, step, since_step)
    finally:
        if lock is not None:
            lock.__exit__()
    return view


def save(path: str | os.PathLike, *, model: torch.nn.Module,
         dense_optimizer: torch.optim.Optimizer | None = None, step: int) -> None:
    """Saves every table row, its optimizer state, score and admission counters, plus the dense
    parameters and optimizer state, as a checkpoint directory at ``path``.

    Collective when the model holds sharded collections: every rank calls it with the same
    ``path`` (on a file system every rank sees). The directory is written next to ``path`` and
    put in place atomically once every rank has written and it is complete; the checkpoint that
    was at ``path`` stays valid until then. Saves to one path are serialised (a lock file beside
    it); a save replaces only an empty directory or a dynemb checkpoint (a valid manifest that
    names every file in it). CACHING tables are flushed first.

    Args:
        path: the checkpoint directory (replaced if it holds a checkpoint).
        model: a module holding dynemb collections (plain or sharded) and dense parameters.
        dense_optimizer: the optimizer of the dense parameters, or None.
        step: the training step (returned by ``load``, and a later ``since_step``).

    Raises:
        CheckpointError: on every rank, if any rank could not write, or ``path`` holds something
            else than a checkpoint, or two tables of the model have the same checkpoint name
            (nothing is replaced).
    """
    step = _check_step("step", step)
    view = _write(path, model, dense_optimizer, FULL, step, None)
    for slot in view.tables:
        steps.after_save(slot.table, step)
    logger.info("saved checkpoint %s at step %d (rank %d of %d)", path, step, view.world.rank,
                view.world.size)


def export_incremental(path: str | os.PathLike, *, model: torch.nn.Module, since_step: int,
                       step: int | None = None,
                       dense_optimizer: torch.optim.Optimizer | None = None) -> None:
    """Writes a delta checkpoint: the rows written (inserted, updated, assigned or loaded) since
    training step ``since_step``, the keys evicted or erased since then, the admission counters
    and the dense state, in the checkpoint format (``kind: "delta"``).

    ``load`` of the checkpoint of ``since_step`` and then of its deltas in order gives the same
    tables as a full checkpoint at the last delta's step. Collective, like :func:`save`.

    Args:
        path: the delta's directory.
        model: the model (as for ``save``).
        since_step: the training step of an earlier save, load or delta of this process.
        step: the training step now (recorded; the ``since_step`` of the next delta). Required.
        dense_optimizer: the dense optimizer, or None.

    Raises:
        CheckpointError: ``since_step`` is unknown to this process (or too old for the eviction
            log), ``step`` is missing, or a rank could not write.
    """
    since_step = _check_step("since_step", since_step)
    if step is None:
        raise CheckpointError("export_incremental: expected step=, the training step now (the "
                              "delta's step, returned by load and usable as the next since_step), "
                              "found None.")
    step = _check_step("step", step)
    if step < since_step:
        raise CheckpointError(f"export_incremental: step {step} is before since_step "
                              f"{since_step}; expected step >= since_step.")
    view = _write(path, model, dense_optimizer, DELTA, step, since_step)
    for slot in view.tables:
        steps.after_delta(slot.table, step, steps.table_step_at(slot.table, slot.key, since_step))
    logger.info("exported rows since step %d to %s at step %d", since_step, path, step)
