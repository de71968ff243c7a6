"""Where ``dynemb train`` saves and finds its checkpoints: ``<out>/checkpoints/step-NNNNNNNN``,
written and read by :mod:`dynemb.checkpoint` (every rank calls both: they are collective when
the tables are sharded)."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch

from dynemb import checkpoint
from dynemb.errors import ConfigError

logger = logging.getLogger(__name__)

_NAME = re.compile(r"step-(\d{8,})")


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


def clear(out: Path) -> None:
    """Deletes the checkpoints of an earlier run in ``out`` (a fresh run starts there)."""
    old = list_checkpoints(out)
    if old:
        logger.warning("a fresh run in %s: deleting the %d checkpoint(s) of the earlier run "
                       "(use --resume to continue it instead)", out, len(old))
    for _, path in old:
        shutil.rmtree(path, ignore_errors=True)


def restore(out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Loads the newest checkpoint of run directory ``out``; returns its step.

    Raises:
        ConfigError: there is no checkpoint to resume from.
    """
    found = list_checkpoints(out)
    if not found:
        raise ConfigError(f"--resume: expected a checkpoint in {out / 'checkpoints'}, found "
                          "none; run without --resume to start afresh, or pass the --out of "
                          "the run to continue.")
    _, path = found[-1]
    step = checkpoint.load(path, model=model, dense_optimizer=optimizer)
    logger.info("resumed from %s (step %d)", path, step)
    return step


def previous_history(out: Path) -> list[dict]:
    """The ``history`` of the run's metrics.json, if there is one."""
    try:
        data = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    history = data.get("history") if isinstance(data, dict) else None
    return [h for h in history if isinstance(h, dict) and "step" in h] if history else []
