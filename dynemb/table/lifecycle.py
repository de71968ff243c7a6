"""The life cycle of a table's rows: admission, initialisation, eviction and the ``on_full``
decision, one implementation for every storage mode.

A resolver (``dynemb.table.resolver``, ``dynemb.table.caching``) finds and inserts the keys of
a call; it asks the :class:`RowLifecycle` which new keys admission lets in (:meth:`admitted`,
which only judges), initialises the rows it created (:meth:`init_rows`), records the rows its
index evicted (:meth:`take_evicted`), tells admission what happened once the call succeeded
(:meth:`record_admission`), and leaves occurrences that got no row to :meth:`on_full`, which
with ``on_full`` RAISE first undoes the call's step and counters (:meth:`refuse`).
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Iterator
from typing import NoReturn

import torch

from dynemb.config import Initializer, InitKind, OnFull, ScorePolicy, TableConfig
from dynemb.errors import CapacityError
from dynemb.kernels.hashing import GOLDEN, to_signed
from dynemb.optim.rules import RowOptimizer
from dynemb.table.admission import AdmissionFilter
from dynemb.table.index import HashIndex
from dynemb.table.pinned import upload
from dynemb.table.state import Saved, TableState
from dynemb.table.stats import Evicted
from dynemb.table.storage import RowStore

logger = logging.getLogger("dynemb.table.table")


def _mix(init: Initializer, name: str) -> int:
    """The per-table seed of an initializer: rows differ between tables of one seed."""
    return to_signed((init.seed * GOLDEN) ^ zlib.crc32(name.encode()))


_NO_DRAW = Initializer(kind=InitKind.CONSTANT, value=0.0)


class RowLifecycle:
    """Admits, initialises and evicts the rows of one table, and decides ``on_full``.

    Args:
        config: the table's configuration (name, dim, initializers, on_full, score policy).
        state: the table's shared state (step, epoch, counters, eviction log).
        store: the table's row store.
        admission: the table's admission filter, or None.
        optimizer: the table's row optimizer (the initial optimizer state of new rows).
        device: the table's device.
    """

    def __init__(self, config: TableConfig, state: TableState, store: RowStore,
                 admission: AdmissionFilter | None, optimizer: RowOptimizer,
                 device: torch.device) -> None:
        self.config, self.state, self.store = config, state, store
        self.admission = admission
        self.optimizer = optimizer
        self._assigning = False
        self.device = device
        self.init_mix = _mix(config.initializer, config.name)
        self.eval_mix = _mix(config.eval_initializer, config.name)

    # ------------------------------------------------------------------ admission

    def admitted(self, keys: torch.Tensor, miss: torch.Tensor, admit: bool) -> torch.Tensor:
        """The positions of ``miss`` (occurrences of keys without a row) that admission lets in
        (all of them when ``admit`` is False or the table has no admission). Changes no counter
        of the admission filter: :meth:`record_admission` does, once the call has succeeded."""
        if admit and self.admission is not None and miss.numel():
            ok = self.admission.judge(keys[miss].to(self.device)).to(miss.device)
            self.state.counters["admission_rejected"] += int((~ok).sum())
            miss = miss[ok]
        return miss

    def record_admission(self, keys: torch.Tensor, miss: torch.Tensor, slots: torch.Tensor,
                         admit: bool) -> None:
        """After a call: the admission filter forgets the keys among ``keys[miss]`` that got a row
        (``slots`` >= 0) and counts the occurrences of those that did not."""
        if admit and self.admission is not None and miss.numel():
            self.admission.record(keys[miss].to(self.device), (slots[miss] >= 0).to(self.device))

    # ------------------------------------------------------------------ rows

    def init_rows(self, ix: HashIndex, slots: torch.Tensor, keys: torch.Tensor,
                  offset: int) -> None:
        """Initial rows for new ``keys`` at ``slots`` of ``ix`` (the index of every row of the
        table, whose slot 0 is global row ``offset``; distinct, as ``put_where`` needs),
        written at the current step."""
        if not (self._assigning and self.optimizer.state_width == 0):  # (else nothing to write)
            rids = upload(slots, self.device)
            init = _NO_DRAW if self._assigning else self.config.initializer
            self.store.init(rids + offset if offset else rids, keys, self.optimizer.initial_state,
                            init, self.init_mix)
        self.store.backend.put_where(ix.written, slots, self.state.step)

    @contextlib.contextmanager
    def assigning(self) -> Iterator[None]:
        """While open, new rows get their optimizer state but no drawn embedding: the caller
        writes every new row's embedding itself (``insert_or_assign``), so drawing one (most of
        a new row's cost) would be thrown away; with no state (SGD) nothing is written at all
        (65,536 new rows of 64: 2.7 ms of zeros the caller overwrote)."""
        self._assigning = True
        try:
            yield
        finally:
            self._assigning = False

    def values(self, keys: torch.Tensor, rids: torch.Tensor, out: torch.Tensor | None = None, *,
               rowless: int | None = None) -> torch.Tensor:
        """(N, dim) float32: the embedding of each global row id ``rids`` (N,), or for -1 the
        eval-initializer row of its key ``keys`` (N,); written into ``out`` when given.
        ``rowless``: how many ``rids`` are -1, when known: then nothing is read back from the
        device (with some, every row is eval-initialised and the rows that exist gathered over
        them)."""
        dim = self.config.dim
        if out is None:
            out = torch.empty(keys.numel(), dim, dtype=torch.float32, device=self.device)
        if rowless is not None:
            if rowless:
                self.eval_rows(keys, out)
            self.store.gather(rids, dim, out)
            return out
        self.store.gather(rids, dim, out)
        self.eval_at(keys, torch.nonzero(rids < 0).flatten(), out)
        return out

    def eval_at(self, keys: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        """``out[p]`` = the eval-initializer row of ``keys[p]`` for each of ``positions``."""
        if positions.numel():
            self.store.backend.init_rows(out, positions, keys[positions], self.config.dim, 0.0,
                                         self.config.eval_initializer, self.eval_mix)

    def eval_rows(self, keys: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (N, dim) = the eval-initializer rows of ``keys`` (N,) (keys without a row)."""
        rows = torch.arange(keys.numel(), device=out.device)
        self.store.backend.init_rows(out, rows, keys, self.config.dim, 0.0,
                                     self.config.eval_initializer, self.eval_mix)

    def take_evicted(self, keys: torch.Tensor, slots: torch.Tensor, scores: torch.Tensor, *,
                     with_rows: bool, offset: int) -> Evicted:
        """Records rows the table's index evicted (before their slots are reused): logged, the
        epoch advances. ``slots`` are slots of that index, whose slot 0 is global row
        ``offset``; their rows are copied out only ``with_rows``."""
        if keys.numel() == 0:
            return self.evicted_none()
        self.state.evicted(keys)
        dim = self.config.dim
        keys, scores = upload(keys, self.device), upload(scores, self.device)
        if not with_rows:
            return Evicted(keys=keys, embeddings=None, optimizer_state=None, scores=scores)
        rows = self.store.read(upload(slots, self.device) + offset)
        return Evicted(keys=keys, embeddings=rows[:, :dim], optimizer_state=rows[:, dim:],
                       scores=scores)

    def evicted_none(self) -> Evicted:
        """No rows evicted."""
        empty, rows, dim = self.state.no_scores, self.store.hbm[:0], self.config.dim
        return Evicted(keys=empty, embeddings=rows[:, :dim], optimizer_state=rows[:, dim:],
                       scores=empty)

    # ------------------------------------------------------------------ on_full

    def refuse(self, failed: int, saved: Saved, *, held: int, size: int,
               capacity: int) -> NoReturn:
        """Raises for an atomic call (``on_full`` RAISE) whose insert kernel could not place
        ``failed`` occurrences and changed nothing: the caller has undone its touches and pins;
        this restores the step and counters ``saved`` before the call, then counts the failure.
        ``held``, ``size``, ``capacity``: as for :meth:`on_full`."""
        self.state.restore(saved)
        self.on_full(failed, held=held, size=size, capacity=capacity)
        raise AssertionError("unreachable: on_full RAISE raises")  # pragma: no cover

    def on_full(self, failed: int, *, held: int, size: int, capacity: int) -> None:
        """Counts ``failed`` occurrences that got no row; raises (RAISE: the call was atomic and
        changed nothing), warns (WARN) or stays silent (COUNT). ``held``: rows held by lookups
        in flight; ``size``, ``capacity``: of the table, for the message."""
        self.state.counters["failed_inserts"] += failed
        cfg = self.config
        if cfg.on_full == OnFull.COUNT:
            return
        if cfg.score == ScorePolicy.NO_EVICTION:
            why = "its bucket is full and score=NO_EVICTION forbids eviction"
        elif cfg.score == ScorePolicy.CUSTOM:
            why = "its bucket is full of rows used by this call or with higher custom scores"
        else:
            why = "its bucket is full of rows used by this same call (the table is too small for the batch)"
        if held and cfg.score != ScorePolicy.NO_EVICTION:
            why += (f", or held by lookups in flight ({held} rows are held from lookup(hold=True) "
                    "until apply_gradients or release: fewer batches in flight need fewer rows)")
        msg = (f"table {cfg.name!r}: {failed} key occurrence(s) could not get a row: {why} "
               f"(size {size} of capacity {capacity}). Raise capacity, choose an "
               "evicting ScorePolicy, or set on_full=WARN/COUNT to give such keys the eval "
               "initializer and count them in stats().failed_inserts.")
        if cfg.on_full == OnFull.RAISE:
            raise CapacityError(msg + " The call changed nothing in the table.")
        logger.warning(msg)
