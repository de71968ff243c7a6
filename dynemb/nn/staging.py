"""Staged calls of a collection: how a training pipeline (:mod:`dynemb.train.pipelines`) runs a
coming batch's stages ahead of the model's forward without tracing or rewriting it.

A pipeline attaches a :class:`StageQueue` to each collection of the model. It then starts each
batch's stages through explicit calls (``stage_input``, ``stage_lookup``, ``stage_prefetch``);
when the model's forward calls the collection, the collection consumes the staged result of
exactly that batch (the same object the pipeline staged; the oldest one in flight), running the
stages not run yet. A call with any other batch raises :class:`InputError` naming the
collection: a collection with a pipeline attached never looks a batch up on its own.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from dynemb.errors import CheckpointError, InputError

STAGES = ("input_dist", "lookup", "output_dist", "prefetch", "backward")
"""Stage timers a collection reports (seconds since the pipeline last read them)."""


@dataclass
class Staged:
    """One batch staged on one collection."""

    batch: Any
    """The object the pipeline staged (the model's forward must pass this very object)."""
    training: bool
    grad: bool
    """Train mode and grad mode when the batch was staged (they decide lookup and backward)."""
    state: Any = None
    """The collection's own record of the batch (its checked batch, its input distribution)."""
    out: Any = None
    """What the lookup stage computed for forward (values, the autograd context); None until
    it ran."""
    holds: list = field(default_factory=list)
    """(table, Lookup) pairs holding rows until the batch's backward (released on discard)."""

    @property
    def looked_up(self) -> bool:
        return self.out is not None

    @property
    def updates(self) -> bool:
        """Whether the batch's backward applies gradients (train mode with grad enabled)."""
        return self.training and self.grad


class StageQueue:
    """The batches a pipeline staged on one collection, oldest first, and the stage timers."""

    def __init__(self, owner: str, *, hold_rows: bool = True) -> None:
        self.owner = owner
        self.hold_rows = hold_rows
        """Whether a staged lookup holds its rows until its backward: needed where another
        batch's stages can run in between (a pipeline that pulls ahead), not otherwise."""
        self.queue: deque[Staged] = deque()
        self.seconds = dict.fromkeys(STAGES, 0.0)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - t0

    def read_timers(self) -> dict[str, float]:
        """The stage seconds since the last call (and restarts them)."""
        out, self.seconds = self.seconds, dict.fromkeys(STAGES, 0.0)
        return out


def release(staged: Staged) -> None:
    """Drops the row holds a staged batch still has (its backward never ran, or failed)."""
    for table, lk in staged.holds:
        table.release(lk)
    staged.holds.clear()


class Stageable(torch.nn.Module):
    """What a collection needs to be driven by a pipeline (mixed into the collections)."""

    _stages: StageQueue | None = None

    def _holds(self, staged: Staged) -> bool:
        """Whether ``staged``'s lookup holds its rows (see :attr:`StageQueue.hold_rows`)."""
        return staged.updates and self._stages is not None and self._stages.hold_rows

    def attach(self, queue: StageQueue) -> None:
        """Lets a pipeline drive this collection (one pipeline at a time)."""
        if self._stages is not None:
            raise InputError(f"{type(self).__name__}: already driven by the pipeline "
                             f"{self._stages.owner}; close that pipeline first.")
        self._stages = queue

    def detach(self) -> None:
        """Releases what the attached pipeline still has staged here, and detaches it."""
        if self._stages is not None:
            for staged in self._stages.queue:
                release(staged)
            self._stages = None

    @property
    def in_flight(self) -> int:
        """Batches staged here and not yet consumed by forward."""
        return 0 if self._stages is None else len(self._stages.queue)

    def _timed(self, stage: str) -> contextlib.AbstractContextManager:
        """Times a stage into the attached pipeline's timers (nothing without one)."""
        return contextlib.nullcontext() if self._stages is None else self._stages.timed(stage)

    def _stage(self, batch: Any, state_of) -> Staged:
        """Queues ``batch`` (the mode taken now); ``state_of(batch)`` runs the input stage."""
        staged = Staged(batch=batch, training=self.training, grad=torch.is_grad_enabled())
        with self._stages.timed("input_dist"):
            staged.state = state_of(batch)
        self._stages.queue.append(staged)
        return staged

    def _take(self, batch: Any) -> Staged:
        """The staged record of ``batch`` (the oldest in flight), its lookup run if it was not;
        InputError for any other batch or a changed mode."""
        q, name = self._stages, type(self).__name__
        if not q.queue or q.queue[0].batch is not batch:
            what = ("no batch is staged" if not q.queue else
                    f"the oldest staged batch is another object ({len(q.queue)} in flight)")
            raise InputError(
                f"{name}: called with a batch the pipeline {q.owner} did not stage ({what}). "
                "While a pipeline drives this collection, the model's forward must pass it the "
                "very object the pipeline staged (batch.sparse, or the batch itself), once per "
                "batch; build the model's input without copying or converting the sparse part, "
                "or call pipeline.close() to use the collection on its own.")
        staged = q.queue[0]
        if (self.training, torch.is_grad_enabled()) != (staged.training, staged.grad):
            raise InputError(
                f"{name}: the batch was staged in {_mode(staged.training, staged.grad)} but "
                f"forward runs in {_mode(self.training, torch.is_grad_enabled())}; switch modes "
                f"through the pipeline {q.owner} (pipe.train() / pipe.eval()), not the model.")
        q.queue.popleft()
        if not staged.looked_up:
            self.stage_lookup(staged)
        return staged

    def stage_input(self, batch: Any) -> Staged:  # pragma: no cover (each collection's own)
        raise NotImplementedError

    def stage_lookup(self, staged: Staged) -> None:  # pragma: no cover
        raise NotImplementedError

    def stage_prefetch(self, staged: Staged) -> int:  # pragma: no cover
        raise NotImplementedError


def check_idle(model: torch.nn.Module, what: str) -> None:
    """CheckpointError unless no pipeline holds batches in flight on ``model``'s collections
    (their rows would be saved or replaced under them). Anything but a module passes (the
    checkpoint's own checks refuse it)."""
    if not isinstance(model, torch.nn.Module):
        return
    for name, m in model.named_modules():
        if isinstance(m, Stageable) and m.in_flight:
            raise CheckpointError(
                f"{what}: the pipeline {m._stages.owner} holds {m.in_flight} batch(es) in flight "
                f"on {type(m).__name__} {name or '(the model)'!r}; call the pipeline's drain() "
                "first (it trains them), then save, then go on with progress(); after a step "
                "failed, close() the pipeline instead (its batches in flight are dropped).")


def _mode(training: bool, grad: bool) -> str:
    return ("train" if training else "eval") + (" mode with grad" if grad else " mode without grad")
