"""The run directory of ``dynemb train``: who may start in it, and its checkpoints,
``<out>/checkpoints/step-NNNNNNNN``, written and read by :mod:`dynemb.checkpoint` (every rank
calls ``save`` and ``load``: they are collective when the tables are sharded).

Rules (checked on rank 0 before anything is written, see :func:`check_fresh` and
:func:`find_resume`):

- a fresh run refuses a directory that holds an earlier run (``config.yaml``, ``metrics.json``
  or anything in ``checkpoints/``) unless ``overwrite``, which deletes that run's checkpoints
  and ``metrics.json`` first;
- a resumed run starts from the newest checkpoint, whose name must agree with the step its
  manifest holds; ``steps`` below that step is refused (a run cannot train backwards), and
  ``steps`` equal to it leaves nothing to do (nothing is written);
- a checkpoint saved over another number of ranks is loaded with ``reshard=True`` (every key
  re-routed to its owner), and the log says so.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dynemb import checkpoint
from dynemb.checkpoint.manifest import read_manifest
from dynemb.data.base import is_int
from dynemb.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

_NAME = re.compile(r"step-(\d{8,})")
RUN_FILES = ("config.yaml", "metrics.json")
"""Files a run writes at the top of its directory."""


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resumed run starts from.

    Attributes:
        step: the training step it holds (its name and its manifest agree).
        path: its directory.
        world_size: the number of ranks it was saved over.
    """

    step: int
    path: Path
    world_size: int


def checkpoint_path(out: Path, step: int) -> Path:
    """The checkpoint directory of ``step`` in run directory ``out``."""
    return out / "checkpoints" / f"step-{step:08d}"


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the checkpoints in ``out/checkpoints``, oldest first."""
    folder = out / "checkpoints"
    found = []
    if folder.is_dir():
        for child in folder.iterdir():
            match = _NAME.fullmatch(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
    return sorted(found)


def save(out: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         keep: int, prune: bool) -> Path:
    """Saves the model's tables and dense state and the dense optimizer at ``step``; then, if
    ``prune`` (rank 0), deletes all but the newest ``keep`` checkpoints (0: keeps all)."""
    path = checkpoint_path(out, step)
    checkpoint.save(path, model=model, dense_optimizer=optimizer, step=step)
    if prune and keep:
        for _, old in list_checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def earlier_run(out: Path) -> list[str]:
    """What ``out`` holds of an earlier run: its run files and ``checkpoints/`` entries
    (empty when ``out`` is new or holds none of them)."""
    held = [name for name in RUN_FILES if (out / name).exists()]
    folder = out / "checkpoints"
    if folder.is_dir():
        entries = sum(1 for _ in folder.iterdir())
        if entries:
            held.append(f"checkpoints/ with {entries} entr{'y' if entries == 1 else 'ies'}")
    return held


def check_fresh(out: Path, overwrite: bool) -> None:
    """Makes ``out`` ready for a fresh run: refuses one that holds an earlier run unless
    ``overwrite``, which deletes that run's checkpoints and ``metrics.json`` (rank 0).

    Raises:
        ConfigError: ``out`` is a file, or holds an earlier run and ``overwrite`` is false, or
            the earlier run's files cannot be deleted.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: expected a run directory, found a file; choose "
                          "another --out.")
    held = earlier_run(out)
    if not held:
        return
    if not overwrite:
        raise ConfigError(f"--out {out} holds an earlier run ({', '.join(held)}); expected a "
                          "new or empty run directory. Pass --resume to continue that run, or "
                          "--overwrite to start afresh there (deleting its checkpoints and "
                          "metrics.json), or choose another --out.")
    old = list_checkpoints(out)
    logger.warning("--overwrite: a fresh run in %s, deleting the %d checkpoint(s) and the "
                   "metrics of the earlier run", out, len(old))
    try:
        for _, path in old:
            shutil.rmtree(path)
        (out / "metrics.json").unlink(missing_ok=True)
    except OSError as error:
        raise ConfigError(f"--overwrite: cannot delete the earlier run's {error.filename} "
                          f"({error.strerror}); delete it by hand or choose another "
                          "--out.") from None


def find_resume(out: Path, steps: int) -> ResumePoint:
    """The newest checkpoint of run directory ``out``, checked for resuming up to ``steps``
    (rank 0; nothing is written).

    Raises:
        ConfigError: there is no checkpoint, or it is past ``steps``.
        CheckpointError: its manifest is damaged or holds another step than its name says.
    """
    found = list_checkpoints(out)
    if not found:
        raise ConfigError(f"--resume: expected a checkpoint in {out / 'checkpoints'}, found "
                          "none; run without --resume to start afresh, or pass the --out of "
                          "the run to continue.")
    step, path = found[-1]
    manifest = read_manifest(path)
    saved, world = manifest.get("step"), manifest.get("world_size")
    if not (is_int(saved) and is_int(world) and world >= 1):
        raise CheckpointError(f"checkpoint {path}: expected an int step and world_size in its "
                              f"manifest, found {saved!r} and {world!r}.")
    if saved != step:
        raise CheckpointError(f"checkpoint {path}: its name says step {step}, its manifest "
                              f"holds step {saved}; expected them to agree. Delete it (or "
                              f"rename it step-{saved:08d}) and resume again.")
    if steps < step:
        raise ConfigError(f"--resume --steps {steps}: the newest checkpoint, {path}, is at step "
                          f"{step}, past the {steps} steps asked for; a run cannot train "
                          f"backwards. Pass --steps greater than {step} to continue it, or "
                          "start afresh with another --out (or --overwrite).")
    return ResumePoint(step=step, path=path, world_size=world)


def restore(point: ResumePoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            world_size: int) -> int:
    """Loads checkpoint ``point`` into the model and the dense optimizer (collective); a
    checkpoint saved over another number of ranks is resharded. Returns its step.

    Raises:
        CheckpointError: on every rank, when the checkpoint cannot be loaded.
    """
    reshard = point.world_size != world_size
    if reshard:
        logger.info("resuming %s, saved over %d rank(s), on %d rank(s): resharding its tables "
                    "(every rank reads every shard file and keeps the rows it owns)",
                    point.path, point.world_size, world_size)
    step = checkpoint.load(point.path, model=model, dense_optimizer=optimizer, reshard=reshard)
    if step != point.step:
        raise CheckpointError(f"checkpoint {point.path}: loaded step {step}, expected "
                              f"{point.step}: it changed while loading; resume again.")
    logger.info("resumed from %s (step %d)%s", point.path, step,
                f", resharded from {point.world_size} to {world_size} rank(s)" if reshard else "")
    return step


def previous_history(out: Path) -> list[dict]:
    """The ``history`` of the run's metrics.json, if there is one."""
    try:
        data = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    history = data.get("history") if isinstance(data, dict) else None
    if not isinstance(history, list):
        return []
    return [h for h in history if isinstance(h, dict) and is_int(h.get("step"))]
