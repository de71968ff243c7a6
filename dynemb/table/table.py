"""DynamicTable: one rank's dynamic embedding table (hash index + rows + admission + init)."""

from __future__ import annotations

import logging
import zlib
from collections import Counter
from dataclasses import dataclass

import torch

from dynemb.batch import check_keys
from dynemb.config import Initializer, OnFull, ScorePolicy, TableConfig
from dynemb.errors import CapacityError, InputError
from dynemb.kernels.backend import backend_for
from dynemb.kernels.hashing import GOLDEN, to_signed
from dynemb.kernels.index_numba import (
    C_EVICTED, C_INSERTED, P_CUSTOM, P_LFU, P_LRU, P_NO_EVICTION, P_STEP,
)
from dynemb.optim.rules import RowOptimizer
from dynemb.table.admission import AdmissionFilter
from dynemb.table.index import HashIndex
from dynemb.table.memory import MemoryUsage
from dynemb.table.stats import (
    Evicted, ExportBatch, FindResult, InsertResult, TableStats,
)

logger = logging.getLogger(__name__)

POLICY_CODES = {ScorePolicy.LRU: P_LRU, ScorePolicy.LFU: P_LFU, ScorePolicy.STEP: P_STEP,
                ScorePolicy.CUSTOM: P_CUSTOM, ScorePolicy.NO_EVICTION: P_NO_EVICTION}


def canonical_device(device: torch.device | str | None) -> torch.device:
    """``device`` as tensors report it ("cuda" becomes "cuda:0"), default CPU."""
    return torch.empty(0, device=device or "cpu").device


@dataclass
class Lookup:
    """One resolved lookup: N key occurrences mapped onto U unique entries.

    ``unique_slots[u]`` is the row of entry u, or -1 (no row: eval mode, not admitted, failed);
    every occurrence without a row is its own entry. ``epoch`` is the table's eviction epoch
    after the lookup: if it changed by backward, slots are resolved again by key.
    """

    unique_keys: torch.Tensor
    unique_slots: torch.Tensor
    inverse: torch.Tensor
    inserted: torch.Tensor | None
    evicted: Evicted
    epoch: int


def _mix(init: Initializer, name: str) -> int:
    return to_signed((init.seed * GOLDEN) ^ zlib.crc32(name.encode()))


class DynamicTable:
    """Rows keyed by raw int64 ids, created on first sight, evicted by score when full.

    Args:
        config: the table's configuration.
        device: where rows and index live (default CPU).
        backend: "numba" (compiled CPU kernels, the CPU default) or "torch" (vectorised reference,
            any device).
    """

    def __init__(self, config: TableConfig, *, device: torch.device | str | None = None,
                 backend: str | None = None) -> None:
        self.config = config
        self.name = config.name
        self.dim = config.dim
        self.device = canonical_device(device)
        self.backend = backend_for(self.device, backend)
        self.index = HashIndex(config.capacity, config.bucket_capacity, self.device, self.backend)
        self.optimizer = RowOptimizer(config.optimizer, config.dim)
        self.rows = torch.zeros(self.index.num_slots, config.dim + self.optimizer.state_width,
                                dtype=torch.float32, device=self.device)
        self.admission = (None if config.admission is None
                          else AdmissionFilter(config.admission, self.device, self.backend))
        self.step = 0
        self._policy = POLICY_CODES[config.score]
        self._init_mix = _mix(config.initializer, config.name)
        self._eval_mix = _mix(config.eval_initializer, config.name)
        self._no_scores = torch.empty(0, dtype=torch.int64, device=self.device)
        self._epoch = 0
        self._counters: Counter[str] = Counter()
        # ScorePolicy.CUSTOM: the score training lookups give the keys they touch or insert
        # (set it each step, e.g. to a timestamp); None gives new keys the table step.
        self.lookup_score: int | None = None

    # ------------------------------------------------------------------ public verbs

    def find(self, keys: torch.Tensor, out: torch.Tensor | None = None) -> FindResult:
        """Rows of ``keys`` (N,) int64 without inserting or touching scores.

        ``out``: an optional (N, dim) float32 tensor to write the values into (reusing one
        saves allocating, and on some hosts page-faulting, a fresh tensor per call).
        """
        keys = self._keys(keys, "find")
        if out is not None:
            self._check_shape("out", out, (keys.numel(), self.dim))
            if out.dtype != torch.float32 or not out.is_contiguous() or out.device != self.device:
                raise InputError(f"table {self.name!r}: find(out=) must be a contiguous float32 "
                                 f"tensor on {self.device}, found {out.dtype} on {out.device}.")
        slots = self.backend.find(self.index, keys, self._no_scores, self._policy, self.step,
                                  False, False)
        return FindResult(values=self._values(keys, slots, out), found=slots >= 0)

    def find_or_insert(self, keys: torch.Tensor, scores: torch.Tensor | None = None) -> InsertResult:
        """Rows of ``keys``, creating (initialising) missing ones; evicts when a bucket is full.

        Admission does not apply here (it filters training lookups). ``scores`` (N,) int64 only
        with ScorePolicy.CUSTOM.
        """
        keys = self._keys(keys, "find_or_insert")
        lk = self._resolve(keys, touch=True, insert=True, admit=False,
                           custom=self._scores(scores, keys, "find_or_insert"))
        values = self._values(keys, lk.unique_slots[lk.inverse])
        return InsertResult(values=values, inserted=lk.inserted, evicted=lk.evicted)

    def insert_or_assign(self, keys: torch.Tensor, values: torch.Tensor,
                         scores: torch.Tensor | None = None,
                         optimizer_state: torch.Tensor | None = None) -> Evicted:
        """Sets the embeddings (and optionally optimizer state) of distinct ``keys`` (N,),
        inserting missing ones. Existing rows keep their optimizer state unless given."""
        keys = self._keys(keys, "insert_or_assign")
        if keys.numel() != torch.unique(keys).numel():
            raise InputError(f"table {self.name!r}: insert_or_assign expects distinct keys.")
        self._check_shape("values", values, (keys.numel(), self.dim))
        if optimizer_state is not None:
            self._check_shape("optimizer_state", optimizer_state,
                              (keys.numel(), self.optimizer.state_width))
        lk = self._resolve(keys, touch=True, insert=True, admit=False,
                           custom=self._scores(scores, keys, "insert_or_assign"))
        slots = lk.unique_slots[lk.inverse]
        ok = slots >= 0
        self.rows[slots[ok], :self.dim] = values.detach()[ok].to(self.rows)
        if optimizer_state is not None:
            self.rows[slots[ok], self.dim:] = optimizer_state.detach()[ok].to(self.rows)
        self._mark_written(slots[ok])
        return lk.evicted

    def erase(self, keys: torch.Tensor) -> int:
        """Removes ``keys`` that are present; returns how many were."""
        keys = torch.unique(self._keys(keys, "erase"))
        n = int((self.backend.erase(self.index, keys) >= 0).sum())
        if n:
            self._epoch += 1
            self._counters["erased"] += n
        return n

    def export_batch(self, start: int, count: int) -> ExportBatch:
        """The rows in slots [start, start + count) (iterate start = 0, count, 2·count, ... up to
        ``capacity()`` to export the whole table)."""
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (start, count)):
            raise InputError(f"table {self.name!r}: export_batch needs ints start, count >= 0, "
                             f"found {start!r}, {count!r}.")
        slots = self.index.occupied(min(start, self.capacity()), min(start + count, self.capacity()))
        rows = self.rows[slots]
        return ExportBatch(keys=self.index.keys[slots], embeddings=rows[:, :self.dim],
                           optimizer_state=rows[:, self.dim:], scores=self.index.scores[slots])

    def size(self) -> int:
        return self.index.size()

    def capacity(self) -> int:
        return self.index.num_slots

    def memory_usage(self) -> MemoryUsage:
        row_bytes = self.rows.element_size() * self.rows.shape[0]
        return MemoryUsage(
            values_bytes=row_bytes * self.dim,
            optimizer_state_bytes=row_bytes * self.optimizer.state_width,
            index_bytes=self.index.nbytes(),
            admission_bytes=0 if self.admission is None else self.admission.index.nbytes())

    def stats(self) -> TableStats:
        c = self._counters
        return TableStats(
            size=self.size(), capacity=self.capacity(), step=self.step,
            optimizer_step=self.optimizer.step, lookups=c["lookups"], hits=c["hits"],
            inserted=self.index.count(C_INSERTED), evicted=self.index.count(C_EVICTED),
            failed_inserts=c["failed_inserts"], admission_rejected=c["admission_rejected"],
            counter_evictions=0 if self.admission is None else self.admission.counter_evictions,
            erased=c["erased"], stale_updates=c["stale_updates"])

    # ------------------------------------------------------------------ module path

    def lookup(self, keys: torch.Tensor, *, train: bool, keep_evicted: bool = False) -> Lookup:
        """Resolves (N,) keys for a module: in training rows are created (through admission) and
        scores touched; in eval nothing changes. Evictions are always counted and their keys and
        scores returned; their rows are copied out only with ``keep_evicted`` (a copy the
        single-tier training path does not need)."""
        keys = self._keys(keys, "lookup")
        custom = None
        if train and self.config.score == ScorePolicy.CUSTOM and self.lookup_score is not None:
            custom = torch.full_like(keys, int(self.lookup_score))
        return self._resolve(keys, touch=train, insert=train, admit=True, custom=custom,
                             keep_evicted=keep_evicted)

    def embeddings(self, lk: Lookup) -> torch.Tensor:
        """(U, dim) float32: the row of each unique entry, or its eval-initializer row."""
        return self._values(lk.unique_keys, lk.unique_slots)

    def sources(self, lk: Lookup) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each entry's embedding is, for the pooling kernels: ``src`` (U,) int64 is the
        slot, or ``-1 - m`` for row m of ``extra`` (M, dim), the eval-initializer rows of entries
        without a row. Slots are resolved again if rows were evicted since the lookup."""
        slots = self.current_slots(lk)
        missing = torch.nonzero(slots < 0).flatten()
        extra = torch.empty(missing.numel(), self.dim, dtype=torch.float32, device=self.device)
        src = slots
        if missing.numel():
            order = torch.arange(missing.numel(), device=self.device)
            self.backend.init_rows(extra, order, lk.unique_keys[missing], self.dim, 0.0,
                                   self.config.eval_initializer, self._eval_mix)
            src = slots.clone()
            src[missing] = -1 - order
        return src, extra

    def current_slots(self, lk: Lookup) -> torch.Tensor:
        """The lookup's slots, resolved again by key if rows were evicted or erased since (a key
        that lost its row gets -1 and is counted in ``stats().stale_updates``)."""
        if lk.epoch == self._epoch:
            return lk.unique_slots
        now = self.backend.find(self.index, lk.unique_keys, self._no_scores, self._policy,
                                self.step, False, False)
        now = torch.where(lk.unique_slots >= 0, now, -1)
        self._counters["stale_updates"] += int(((lk.unique_slots >= 0) & (now < 0)).sum())
        lk.unique_slots, lk.epoch = now, self._epoch
        return now

    def apply_gradients(self, lk: Lookup, grads: torch.Tensor, *, clip: bool = True) -> None:
        """Applies the fused optimizer: ``grads`` (U, dim) are the summed gradients per entry.

        ``clip=False`` skips ``max_grad_norm`` clipping (a sharded table is clipped by the norm
        over all shards before this call)."""
        slots = self.current_slots(lk)
        self.optimizer.apply(self.backend, self.rows, slots, grads.to(torch.float32).contiguous(),
                             clip=clip)
        self._mark_written(slots[slots >= 0])

    # ------------------------------------------------------------------ internals

    def _resolve(self, keys: torch.Tensor, *, touch: bool, insert: bool, admit: bool,
                 custom: torch.Tensor | None, keep_evicted: bool = True) -> Lookup:
        be, ix = self.backend, self.index
        custom = self._no_scores if custom is None else custom
        if touch:
            self.step += 1
        slots = be.find(ix, keys, custom, self._policy, self.step, touch, True)
        if touch:
            self._counters["lookups"] += keys.numel()
            self._counters["hits"] += int((slots >= 0).sum())
        inserted, evicted, failed = None, self._evicted_none(), 0
        if insert:
            inserted = torch.zeros(keys.numel(), dtype=torch.bool, device=self.device)
            miss = torch.nonzero(slots < 0).flatten()
            if admit and self.admission is not None and miss.numel():
                ok = self.admission.admit(keys[miss])
                self._counters["admission_rejected"] += int((~ok).sum())
                miss = miss[ok]
            if miss.numel():
                mkeys = keys[miss]
                new_slots, fresh, ev = be.insert(ix, mkeys, custom[miss] if custom.numel() else custom,
                                                 self._policy, self.step)
                evicted = self._take_evicted(*ev, with_rows=keep_evicted)
                be.init_rows(self.rows, new_slots[fresh], mkeys[fresh], self.dim,
                             self.optimizer.initial_state, self.config.initializer, self._init_mix)
                slots[miss] = new_slots
                inserted[miss] = fresh
                failed = int((new_slots < 0).sum())
        inverse, unique_slots, unique_pos = be.finish(ix, slots)
        if failed:
            self._on_full(failed)
        return Lookup(unique_keys=keys[unique_pos], unique_slots=unique_slots, inverse=inverse,
                      inserted=inserted, evicted=evicted, epoch=self._epoch)

    def _values(self, keys: torch.Tensor, slots: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(keys.numel(), self.dim, dtype=torch.float32, device=self.device)
        self.backend.gather(self.rows, slots, self.dim, out)
        missing = torch.nonzero(slots < 0).flatten()
        if missing.numel():
            self.backend.init_rows(out, missing, keys[missing], self.dim, 0.0,
                                   self.config.eval_initializer, self._eval_mix)
        return out

    def _take_evicted(self, keys, slots, scores, *, with_rows: bool) -> Evicted:
        if keys.numel() == 0:
            return self._evicted_none()
        self._epoch += 1
        if not with_rows:
            return Evicted(keys=keys, embeddings=None, optimizer_state=None, scores=scores)
        rows = torch.empty(slots.numel(), self.rows.shape[1], dtype=self.rows.dtype,
                           device=self.device)
        self.backend.gather(self.rows, slots, self.rows.shape[1], rows)
        return Evicted(keys=keys, embeddings=rows[:, :self.dim],
                       optimizer_state=rows[:, self.dim:], scores=scores)

    def _evicted_none(self) -> Evicted:
        empty = self._no_scores
        rows = self.rows[:0]
        return Evicted(keys=empty, embeddings=rows[:, :self.dim],
                       optimizer_state=rows[:, self.dim:], scores=empty)

    def _mark_written(self, slots: torch.Tensor) -> None:
        if self.config.score == ScorePolicy.STEP:
            self.index.scores[slots] = self.step

    def _on_full(self, failed: int) -> None:
        self._counters["failed_inserts"] += failed
        if self.config.on_full == OnFull.COUNT:
            return
        if self.config.score == ScorePolicy.NO_EVICTION:
            why = "its bucket is full and score=NO_EVICTION forbids eviction"
        elif self.config.score == ScorePolicy.CUSTOM:
            why = "its bucket is full of rows used by this call or with higher custom scores"
        else:
            why = "its bucket is full of rows used by this same call (the table is too small for the batch)"
        msg = (f"table {self.name!r}: {failed} key occurrence(s) could not get a row: {why} "
               f"(size {self.size()} of capacity {self.capacity()}). Raise capacity, choose an "
               "evicting ScorePolicy, or set on_full=WARN/COUNT to give such keys the eval "
               "initializer and count them in stats().failed_inserts.")
        if self.config.on_full == OnFull.RAISE:
            raise CapacityError(msg)
        logger.warning(msg)

    def _keys(self, keys: torch.Tensor, verb: str) -> torch.Tensor:
        check_keys(keys, f"table {self.name!r}: {verb}")
        return keys.to(self.device)

    def _scores(self, scores, keys, verb) -> torch.Tensor | None:
        if scores is None:
            return None
        if self.config.score != ScorePolicy.CUSTOM:
            raise InputError(f"table {self.name!r}: {verb} got scores but the table's score "
                             f"policy is {self.config.score.name}; scores need ScorePolicy.CUSTOM.")
        self._check_shape("scores", scores, (keys.numel(),))
        if scores.dtype.is_floating_point or scores.dtype == torch.bool:
            raise InputError(f"table {self.name!r}: {verb} expects integer scores, found "
                             f"{scores.dtype}.")
        scores = scores.to(device=self.device, dtype=torch.int64)
        uk, inv = torch.unique(keys, return_inverse=True)
        if uk.numel() < keys.numel():  # one score per key: duplicates must agree
            low = torch.full_like(uk, torch.iinfo(torch.int64).max).scatter_reduce(0, inv, scores, "amin")
            if not bool((low[inv] == scores).all()):
                raise InputError(f"table {self.name!r}: {verb} got one key twice with different "
                                 "scores; give each key one score.")
        return scores

    def _check_shape(self, what: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise InputError(f"table {self.name!r}: {what} must have shape {shape}, found "
                             f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}.")
