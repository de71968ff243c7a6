"""Training pipelines: the stages of coming batches overlap the current batch's work, without
tracing or rewriting the model (see docs/pipelines.md for the timelines).

::

    pipe = dynemb.train.pipeline("fused_sparse_dist", model=model, optimizer=dense_opt,
                                 loss_fn=loss_fn)
    it = iter(loader)
    while True:
        try:
            step = pipe.progress(it)      # trains the oldest batch in flight
        except StopIteration:
            break

The model stays an ordinary module whose forward calls its collections. The pipeline attaches
itself to every dynemb collection of the model (sharded or not) and starts a coming batch's
stages through explicit calls on them; the collection call inside forward consumes the staged
result of exactly that batch and raises :class:`~dynemb.errors.InputError` for any other one.

Kinds (``lead``: batches pulled beyond the one being trained):

- ``base`` (lead 0): the eager loop, stage after stage.
- ``sparse_dist`` (lead 1): batch i+1's input distribution (ids routed, the id all-to-all in
  flight) starts before batch i's forward.
- ``fused_sparse_dist`` (lead 1): as sparse_dist, and batch i+1's lookup (owner lookups,
  pooling, the output all-to-all started) runs right after batch i's backward, before the dense
  optimizer step.
- ``semi_sync`` (lead 2): from batch ``start_batch`` on, batch i+1's lookup runs before batch
  i's forward: it sees the rows after batch i-1's sparse update and before batch i's (one step
  stale); its rows are held until its own backward. ``stash_gradients``: the dense optimizer
  step after batch i's backward applies batch i-1's dense gradients.
- ``prefetch`` (lead 1): batch i's lookup runs first, then batch i+1's rows are brought into
  the caches of CACHING tables (:meth:`DynamicTable.prefetch`) before batch i's forward and
  backward; batch i's rows are held until its backward, so the prefetch never evicts them.

base, sparse_dist, fused_sparse_dist and prefetch compute exactly what the eager loop
(forward, backward, dense step) computes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dynemb.config import StorageMode
from dynemb.distributed import comm
from dynemb.errors import ConfigError, DynembError, InputError
from dynemb.nn.staging import StageQueue, Stageable, Staged, release
from dynemb.train.config import PIPELINE_KINDS as KINDS
from dynemb.train.streams import Streams

logger = logging.getLogger(__name__)

_NONE, _HAVE, _FAILED = 0, 1, 2
"""What a rank's iterator gave (the per-batch agreement)."""
LEAD = {"base": 0, "sparse_dist": 1, "fused_sparse_dist": 1, "semi_sync": 2, "prefetch": 1}
"""Batches each kind pulls beyond the one it trains."""
SPLIT = ("data", "input_dist", "lookup", "prefetch", "output_dist", "dense", "backward",
         "optimizer")
"""The step time split (seconds): waiting for the next batch, the collections' stages,
the model's forward and backward outside them (``dense``), the collections' backward (gradient
exchange and fused optimizers), the dense optimizer step."""


@dataclass
class Step:
    """One trained (or evaluated) batch."""

    index: int
    """The batch's number among those this pipeline pulled (0, 1, ...)."""
    batch: Any
    output: Any
    loss: torch.Tensor
    """The loss, detached."""
    training: bool
    seconds: dict[str, float] = field(default_factory=dict)
    """This ``progress`` call's time split (see ``SPLIT``) and its ``total``."""


@dataclass
class _InFlight:
    index: int
    batch: Any
    sparse: Any
    training: bool
    staged: list[Staged]
    looked_up: bool = False


def pipeline(kind: str, *, model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
             optimizer: torch.optim.Optimizer | None = None,
             forward: Callable[[torch.nn.Module, Any], Any] | None = None,
             after_backward: Callable[[], None] | None = None, start_batch: int = 0,
             stash_gradients: bool = False, group=None) -> TrainPipeline:
    """Builds a training pipeline of ``kind`` (see :data:`KINDS` and the module docstring).

    Args:
        model: an ``nn.Module`` holding dynemb collections (sharded or not); never rewritten.
        loss_fn: ``loss_fn(output, batch)`` -> the scalar loss that backward runs on.
        optimizer: the dense optimizer (None: no dense step).
        forward: ``forward(model, batch)`` -> output (default ``model(batch)``).
        after_backward: called after each backward, before the dense step (e.g. a manual
            gradient all-reduce).
        start_batch: semi_sync only: batches before it run synchronously.
        stash_gradients: semi_sync only: the dense step applies the previous batch's gradients.
        group: the process group whose ranks agree each step whether every rank still has a
            batch (default: the sharded collections' group; none in one process).
    """
    return TrainPipeline(kind, model=model, loss_fn=loss_fn, optimizer=optimizer,
                         forward=forward, after_backward=after_backward, start_batch=start_batch,
                         stash_gradients=stash_gradients, group=group)


class TrainPipeline:
    """See :func:`pipeline`. ``progress(it)`` trains the oldest batch in flight and returns its
    :class:`Step`; ``StopIteration`` once ``it`` is exhausted and every batch is done."""

    def __init__(self, kind: str, *, model, loss_fn, optimizer, forward, after_backward,
                 start_batch: int, stash_gradients: bool, group) -> None:
        if kind not in KINDS:
            raise ConfigError(f"dynemb.train.pipeline: expected a kind in {list(KINDS)}, found "
                              f"{kind!r}.")
        if kind != "semi_sync" and (start_batch or stash_gradients):
            raise ConfigError(f"pipeline {kind!r}: start_batch and stash_gradients belong to "
                              "the semi_sync pipeline; leave them at their defaults.")
        if not isinstance(start_batch, int) or isinstance(start_batch, bool) or start_batch < 0:
            raise ConfigError(f"pipeline {kind!r}: start_batch: expected an int >= 0, found "
                              f"{start_batch!r}.")
        if not isinstance(stash_gradients, bool):
            raise ConfigError(f"pipeline {kind!r}: stash_gradients: expected True or False, "
                              f"found {stash_gradients!r}.")
        self.kind, self.model, self.loss_fn, self.optimizer = kind, model, loss_fn, optimizer
        self._forward = forward or (lambda m, b: m(b))
        self._after_backward = after_backward
        self.start_batch, self.stash_gradients = start_batch, stash_gradients
        self.collections = _collections(model, kind)
        if kind == "fused_sparse_dist":
            _check_fused(self.collections, optimizer)
        if kind == "prefetch":
            _check_prefetch(self.collections)
        self._group, self._agree = _agreement_group(self.collections, group)
        self._device = torch.device("cpu")
        if self._agree and dist.get_backend(self._group) == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.name = f"{kind!r} (rank {dist.get_rank(self._group) if self._agree else 0})"
        # lead 0 (base): no other batch's stage runs between a lookup and its backward, so
        # nothing could evict its rows; holding them would only cost time
        self._queues = [StageQueue(self.name, hold_rows=LEAD[kind] > 0)
                        for _ in self.collections]
        self.streams = Streams(self.collections[0].device)
        attached = []
        try:
            for c, q in zip(self.collections, self._queues):
                c.attach(q)
                attached.append(c)
        except Exception:
            for c in attached:
                c.detach()
            raise
        self._inflight: deque[_InFlight] = deque()
        self._it: Iterator | None = None
        self._exhausted = False
        self._pulled = 0
        self._training = model.training
        self._applied = model.training
        self._stash: list[torch.Tensor | None] | None = None
        self._failed: BaseException | None = None
        self._closed = False
        self.dropped = 0
        """Batches this rank pulled but did not train because another rank had run out."""

    # ------------------------------------------------------------------ public

    @property
    def lead(self) -> int:
        """Batches pulled beyond the one being trained."""
        return LEAD[self.kind]

    @property
    def in_flight(self) -> int:
        """Batches pulled and not yet trained."""
        return len(self._inflight)

    def is_semi_sync(self) -> bool:
        """Whether the next batch to train runs semi-synchronously (semi_sync, from
        ``start_batch`` on)."""
        nxt = self._inflight[0].index if self._inflight else self._pulled
        return self.kind == "semi_sync" and nxt >= self.start_batch

    def train(self, mode: bool = True) -> TrainPipeline:
        """Batches pulled from now on train (batches already in flight keep their mode)."""
        self._training = bool(mode)
        return self

    def eval(self) -> TrainPipeline:
        """Batches pulled from now on are evaluated: forward and loss, no update."""
        return self.train(False)

    def progress(self, it: Iterator) -> Step:
        """Trains (or evaluates) the oldest batch in flight, pulling from ``it`` what this kind
        runs ahead; raises ``StopIteration`` once ``it`` is exhausted and nothing is in flight
        (again on every later call with it; a new iterator continues)."""
        self._check_usable()
        if it is not self._it:
            self._it, self._exhausted = it, False
        if self.model.training != self._applied:  # the user switched the model's mode
            self._training = self.model.training
        t0 = time.perf_counter()
        try:
            data = self._fill(self.lead + 1)
            step = self._run() if self._inflight else None
            self._set_mode(self._training)  # back to the mode asked for: a switch shows against it
        except BaseException as e:
            self._fail(e)
            if isinstance(e, StopIteration):  # not the iterator's end: the step's own code
                raise self._stopped_inside() from e
            raise
        if step is None:
            raise StopIteration
        step.seconds["data"] = data
        step.seconds["total"] = time.perf_counter() - t0
        return step

    def drain(self) -> list[Step]:
        """Trains every batch in flight without pulling more; returns their steps (then a
        checkpoint can be saved, and ``progress`` pulls again)."""
        self._check_usable()
        steps = []
        try:
            while self._inflight:
                steps.append(self._run())
            self._set_mode(self._training)
        except BaseException as e:
            self._fail(e)
            if isinstance(e, StopIteration):
                raise self._stopped_inside() from e
            raise
        return steps

    def close(self) -> None:
        """Detaches the pipeline from the collections, releasing the rows held for batches in
        flight (their batches are dropped untrained)."""
        if self._closed:
            return
        for b in self._inflight:
            for s in b.staged:
                release(s)
        self._inflight.clear()
        for c in self.collections:
            c.detach()
        self._closed = True

    def __enter__(self) -> TrainPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the schedule

    def _run(self) -> Step:
        """Trains the oldest batch in flight, with the stages of the next ones this kind
        overlaps with it."""
        cur = self._inflight[0]
        nxt = self._inflight[1] if len(self._inflight) > 1 else None
        if self.kind == "semi_sync" and nxt is not None and nxt.index >= self.start_batch:
            with self.streams.ahead():
                self._lookup(nxt)  # before batch i's update: one step stale
        if self.kind == "prefetch":
            self._lookup(cur)  # its rows held, so the prefetch cannot evict them
            if nxt is not None:
                with self.streams.ahead():
                    self._prefetch(nxt)
        self.streams.consume(cur.staged)
        self._set_mode(cur.training)
        seconds = dict.fromkeys(SPLIT, 0.0)
        self._collect(seconds)  # the stages run so far (input, lookups, prefetch)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(cur.training):
            output = self._forward(self.model, cur.batch)
            self._check_consumed(cur)
            loss = self.loss_fn(output, cur.batch)
            if cur.training:
                if self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if self._after_backward is not None:
                    self._after_backward()
        for s in cur.staged:  # the batch is done: an output its loss did not use still held
            release(s)
        seconds["dense"] = time.perf_counter() - t0 - self._collect(seconds)
        self._inflight.popleft()
        if self.kind == "fused_sparse_dist" and nxt is not None:
            with self.streams.ahead():  # after batch i's sparse update, beside its dense step
                self._lookup(nxt)
        if cur.training and self.optimizer is not None:
            t1 = time.perf_counter()
            self._dense_step(cur)
            seconds["optimizer"] = time.perf_counter() - t1
        self._collect(seconds)
        return Step(index=cur.index, batch=cur.batch, output=output, loss=loss.detach(),
                    training=cur.training, seconds=seconds)

    def _collect(self, seconds: dict[str, float]) -> float:
        """Adds the collections' stage timers into ``seconds``; returns their sum."""
        total = 0.0
        for q in self._queues:
            for stage, s in q.read_timers().items():
                seconds[stage] += s
                total += s
        return total

    def _dense_step(self, cur: _InFlight) -> None:
        if self.stash_gradients and cur.index >= self.start_batch:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            stash = self._stash if self._stash is not None else [None] * len(params)
            self._stash = [p.grad for p in params]
            for p, g in zip(params, stash):
                p.grad = g
        self.optimizer.step()

    def _fill(self, depth: int) -> float:
        """Pulls batches until ``depth`` are in flight (or the iterator ends on some rank),
        staging each one's input; returns the seconds spent waiting for data."""
        waited = 0.0
        while len(self._inflight) < depth and not self._exhausted:
            t0 = time.perf_counter()
            batch, error = None, None
            try:
                batch, have = next(self._it), _HAVE
            except StopIteration:
                have = _NONE
            except Exception as e:  # noqa: BLE001  (raised on every rank by _all_have)
                have, error = _FAILED, e
            waited += time.perf_counter() - t0
            if not self._all_have(have, error):
                self._exhausted = True
                self.dropped += int(have == _HAVE)
                break
            with self.streams.ahead():
                self._stage(batch)
        return waited

    def _all_have(self, have: int, error: Exception | None) -> bool:
        """Whether every rank pulled a batch (one small all-reduce per batch when sharded);
        when some did not, the ranks that did say so and drop theirs. A rank whose iterator
        raised makes every rank raise (its own error there)."""
        got = [have]
        if self._agree:
            world, rank = dist.get_world_size(self._group), dist.get_rank(self._group)
            flags = torch.zeros(world, dtype=torch.int64, device=self._device)
            flags[rank] = have
            dist.all_reduce(flags, group=self._group)
            got = flags.tolist()
        if error is not None:
            raise error
        failed = [r for r, g in enumerate(got) if g == _FAILED]
        if failed:
            raise DynembError(f"pipeline {self.name}: the batch iterator of "
                              f"{comm.ranks_text(failed)} raised (the error raised there says "
                              "why); every rank stops so none waits forever.")
        if all(g == _HAVE for g in got):
            return True
        if any(g == _HAVE for g in got):
            logger.warning("pipeline %s: rank(s) %s ran out of batches at batch %d; every rank "
                           "stops there (rank(s) %s drop the batch they pulled)", self.name,
                           [r for r, g in enumerate(got) if g != _HAVE], self._pulled,
                           [r for r, g in enumerate(got) if g == _HAVE])
        return False

    def _stage(self, batch: Any) -> None:
        sparse = getattr(batch, "sparse", batch)
        b = _InFlight(index=self._pulled, batch=batch, sparse=sparse, training=self._training,
                      staged=[])
        self._pulled += 1
        self._inflight.append(b)
        with self._mode(b):
            for c in self.collections:
                b.staged.append(c.stage_input(sparse))

    def _lookup(self, b: _InFlight) -> None:
        if b.looked_up:
            return
        with self._mode(b):
            for c, s in zip(self.collections, b.staged):
                c.stage_lookup(s)
        b.looked_up = True

    def _prefetch(self, b: _InFlight) -> None:
        with self._mode(b):
            for c, s in zip(self.collections, b.staged):
                c.stage_prefetch(s)

    @contextlib.contextmanager
    def _mode(self, b: _InFlight):
        """The collections in ``b``'s mode while its stages run (the model's mode restored)."""
        before = [c.training for c in self.collections]
        for c in self.collections:
            c.train(b.training)
        try:
            with torch.set_grad_enabled(b.training):
                yield
        finally:
            for c, m in zip(self.collections, before):
                c.train(m)

    def _set_mode(self, training: bool) -> None:
        """Puts the model in ``training`` mode: a batch's own while it runs, then the mode
        batches are pulled in (what ``progress`` compares ``model.training`` with to see a
        switch the user made between calls)."""
        self.model.train(training)
        self._applied = training

    def _check_consumed(self, b: _InFlight) -> None:
        """Every collection consumed ``b`` in the model's forward (never silently unpipelined)."""
        for c, s in zip(self.collections, b.staged):
            if c._stages.queue and c._stages.queue[0] is s:
                raise InputError(f"pipeline {self.name}: the model's forward did not call "
                                 f"{_describe(self.model, c)} with batch {b.index}; every "
                                 "collection must be called once per batch with the batch's "
                                 "sparse part (or, for a model that skips one, use it without "
                                 "a pipeline).")

    def _fail(self, error: BaseException) -> None:
        self._failed = error
        for b in self._inflight:
            for s in b.staged:
                release(s)

    def _stopped_inside(self) -> DynembError:
        return DynembError(f"pipeline {self.name}: StopIteration was raised inside a step (the "
                           "model's forward, loss_fn, backward, after_backward or the optimizer), "
                           "not by the iterator; passed on, it would end the training loop as if "
                           "the data had run out. Find what raised it (the chained error) and "
                           "raise another exception there.")

    def _check_usable(self) -> None:
        if self._closed:
            raise DynembError(f"pipeline {self.name}: closed; build a new pipeline.")
        if self._failed is not None:
            raise DynembError(f"pipeline {self.name}: an earlier step failed "
                              f"({type(self._failed).__name__}: {self._failed}); its batches in "
                              "flight were dropped. close() it and build a new pipeline.")


# ---------------------------------------------------------------------- construction checks


def _collections(model: torch.nn.Module, kind: str) -> list[Stageable]:
    """The model's outermost dynemb collections (a sharded collection's local shards are part
    of it); ConfigError when there is none."""
    found: list[Stageable] = []
    inside: set[int] = set()
    for m in model.modules():
        if isinstance(m, Stageable) and id(m) not in inside:
            found.append(m)
            inside.update(id(s) for s in m.modules())
    if not found:
        raise ConfigError(f"pipeline {kind!r}: the model holds no dynemb collection (an "
                          "EmbeddingBagCollection, EmbeddingCollection or a sharded one); "
                          "there is nothing to pipeline. Train it with an ordinary loop.")
    return found


def _describe(model: torch.nn.Module, c: torch.nn.Module) -> str:
    names = [n for n, m in model.named_modules() if m is c]
    return f"{type(c).__name__} {names[0] or '(the model)'!r}" if names else type(c).__name__


def _check_fused(collections: list[Stageable], optimizer) -> None:
    """fused_sparse_dist looks batch i+1 up before the dense step: nothing the lookup reads
    may be trained by the dense optimizer."""
    if optimizer is None:
        return
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for c in collections:
        for name, p in c.named_parameters():
            if id(p) in trained:
                raise ConfigError(
                    f"pipeline 'fused_sparse_dist': parameter {name!r} of {type(c).__name__} is "
                    "trained by the dense optimizer, and the lookup of the next batch (which "
                    "reads it) runs before the dense step; take it out of the optimizer or use "
                    "'sparse_dist'.")


def _check_prefetch(collections: list[Stageable]) -> None:
    cached = [c.name for col in collections for c in col.configs
              if c.storage.mode == StorageMode.CACHING]
    if not cached:
        raise ConfigError("pipeline 'prefetch': no table is CACHING, so there is nothing to "
                          "prefetch; use 'sparse_dist' (or store a table with "
                          "StorageConfig(mode='caching')).")


def _agreement_group(collections: list[Stageable], group) -> tuple[Any, bool]:
    """(the group whose ranks agree each step, whether there is one)."""
    sharded = [c for c in collections if hasattr(c, "world_size")]
    if group is None and sharded:
        group = sharded[0].group
    elif group is None:
        return None, False
    if not dist.is_available() or not dist.is_initialized():
        return None, False
    return group, dist.get_world_size(group) > 1
