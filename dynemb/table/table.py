"""DynamicTable: one rank's dynamic embedding table (hash index + rows + admission + init)."""

from __future__ import annotations

import zlib
from collections import Counter

import torch

from dynemb.config import Initializer, ScorePolicy, StorageMode, TableConfig
from dynemb.errors import CapacityError, InputError
from dynemb.kernels.backend import backend_for
from dynemb.kernels.hashing import GOLDEN, home_bucket, index_hash, to_signed
from dynemb.kernels.index_numba import (
    C_EVICTED, C_INSERTED, P_CUSTOM, P_LFU, P_LRU, P_NO_EVICTION, P_STEP,
)
from dynemb.optim.rules import RowOptimizer
from dynemb.table.admission import AdmissionFilter
from dynemb.table.caching import Cache
from dynemb.table.checks import TableChecks
from dynemb.table.index import HashIndex
from dynemb.table.memory import MemoryUsage, TierMemory, storage_layout
from dynemb.table.stats import (
    EvictionLog, Evicted, ExportBatch, FindResult, InsertResult, Lookup, TableStats,
)
from dynemb.table.storage import DdrFiles, RowStore

POLICY_CODES = {ScorePolicy.LRU: P_LRU, ScorePolicy.LFU: P_LFU, ScorePolicy.STEP: P_STEP,
                ScorePolicy.CUSTOM: P_CUSTOM, ScorePolicy.NO_EVICTION: P_NO_EVICTION}


def canonical_device(device: torch.device | str | None) -> torch.device:
    """``device`` as tensors report it ("cuda" becomes "cuda:0"), default CPU."""
    return torch.empty(0, device=device or "cpu").device


def _mix(init: Initializer, name: str) -> int:
    return to_signed((init.seed * GOLDEN) ^ zlib.crc32(name.encode()))


class DynamicTable(TableChecks):
    """Rows keyed by raw int64 ids, created on first sight, evicted by score when full.

    Storage (``config.storage``): HBM_ONLY keeps every row on ``device``; HYBRID splits the rows
    by a hash of the key between ``device`` (hbm) and host memory (ddr); CACHING keeps every row
    in a ddr backing store under an hbm cache (write-back: see :meth:`flush`, :meth:`prefetch`).
    The mode changes where rows live, never what training computes.

    Args:
        config: the table's configuration.
        device: where hbm rows and the index live (default CPU).
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
        self.optimizer = RowOptimizer(config.optimizer, config.dim)
        self._policy = POLICY_CODES[config.score]
        st = config.storage
        self.layout = storage_layout(config.capacity, config.bucket_capacity, st.mode,
                                     st.cache_load_factor)
        self.mode = self.layout.mode
        lay = self.layout
        files = None if st.ddr_path is None else DdrFiles(st.ddr_path, config.name, reopen=st.reopen)
        self.files = files
        self.store = RowStore(lay.hbm_rows, lay.ddr_rows, config.dim,
                              config.dim + self.optimizer.state_width, self.device, self.backend,
                              files)
        self.cache: Cache | None = None
        if self.mode == StorageMode.CACHING:
            backing_device = torch.device("cpu")
            self.index = HashIndex(lay.num_buckets, lay.width, backing_device,
                                   self.store.ddr_backend, alloc=files and files.alloc)
            self.cache = Cache(self, files)
        else:
            self.index = HashIndex(lay.num_buckets, lay.width, self.device, self.backend,
                                   split=lay.split)
        self.admission = (None if config.admission is None
                          else AdmissionFilter(config.admission, self.device, self.backend))
        self.step = 0
        self._init_mix = _mix(config.initializer, config.name)
        self._eval_mix = _mix(config.eval_initializer, config.name)
        self._no_scores = torch.empty(0, dtype=torch.int64, device=self.device)
        self._epoch = 0
        self._counters: Counter[str] = Counter()
        self.log = EvictionLog(self._no_scores)
        # ScorePolicy.CUSTOM: the score training lookups give the keys they touch or insert
        # (set it each step, e.g. to a timestamp); None gives new keys the table step.
        self.lookup_score: int | None = None
        if self.cache is not None and st.reopen:
            self.cache.reopened(files.header())

    @property
    def rows(self) -> torch.Tensor:
        """The hbm rows (hbm_rows, dim + state width): pooling kernels read entries from here."""
        return self.store.hbm

    @property
    def row_offset(self) -> int:
        """Global row id of slot 0 of ``index`` (the backing store's rows follow the cache's)."""
        return self.layout.hbm_rows if self.cache is not None else 0

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
        rids = self.locate(keys)
        return FindResult(values=self._values(keys, rids, out), found=rids >= 0)

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
        self._check_rows(keys, values, optimizer_state, "insert_or_assign")
        lk = self._resolve(keys, touch=True, insert=True, admit=False,
                           custom=self._scores(scores, keys, "insert_or_assign"))
        rids = lk.unique_slots[lk.inverse]
        ok = rids >= 0
        self.store.write(rids[ok], values.detach()[ok].to(self.device))
        if optimizer_state is not None:
            self.store.write(rids[ok], optimizer_state.detach()[ok].to(self.device), self.dim)
        self._mark_written(rids[ok])
        return lk.evicted

    def load_rows(self, keys: torch.Tensor, embeddings: torch.Tensor,
                  optimizer_state: torch.Tensor, scores: torch.Tensor) -> None:
        """Inserts or overwrites the rows of distinct ``keys`` (N,) exactly: embeddings (N, dim),
        optimizer_state (N, state width), scores (N,) int64 (e.g. from a checkpoint). Counts no
        lookup and leaves ``step`` as it is; raises CapacityError if a key cannot get a row or
        placing it would evict another row."""
        keys = self._keys(keys, "load_rows")
        self._check_rows(keys, embeddings, optimizer_state, "load_rows")
        self._check_shape("scores", scores, (keys.numel(),))
        if self.cache is not None:
            self.cache.drop(keys)  # loaded rows go to the backing store, not through the cache
            self.cache.unflushed = True
        ix, be = self.index, self.index.backend
        bkeys = keys.to(ix.keys.device)
        none = self._no_scores.to(bkeys.device)
        slots = be.find(ix, bkeys, none, P_NO_EVICTION, self.step, False, True)
        miss = torch.nonzero(slots < 0).flatten()
        if miss.numel():  # never evicts: a key without a free slot fails
            new, fresh, _ = be.insert(ix, bkeys[miss], none, P_NO_EVICTION, self.step)
            slots[miss] = new
        be.unpin(ix, slots)
        if miss.numel() and bool((new < 0).any()):
            failed = int((new < 0).sum())
            be.erase(ix, bkeys[miss][fresh])  # roll back: the table is as it was
            raise CapacityError(
                f"table {self.name!r}: load_rows cannot place {failed} of {keys.numel()} rows "
                f"without evicting others (their buckets are full; capacity {self.capacity()}, "
                f"size {self.size()}); nothing was loaded. Load into a table with more capacity.")
        rids = slots.to(self.device) + self.row_offset
        self.store.write(rids, embeddings.detach().to(self.device, torch.float32))
        self.store.write(rids, optimizer_state.detach().to(self.device, torch.float32), self.dim)
        ix.scores[slots] = scores.to(ix.scores)
        ix.written[slots] = self.step

    def erase(self, keys: torch.Tensor) -> int:
        """Removes ``keys`` that are present; returns how many were."""
        keys = torch.unique(self._keys(keys, "erase"))
        if self.cache is not None:
            self.cache.drop(keys, write_back=False)
        gone = self.index.backend.erase(self.index, keys.to(self.index.keys.device))
        n = int((gone >= 0).sum())
        if n:
            self.step += 1  # a write: exports since the previous step see it
            self._epoch += 1
            self._counters["erased"] += n
            self.log.add(self.step, keys[(gone >= 0).to(keys.device)])
            if self.cache is not None:
                self.cache.unflushed = True
        return n

    def export_batch(self, start: int, count: int, *, since_step: int | None = None) -> ExportBatch:
        """The rows in slots [start, start + count) (iterate start = 0, count, 2·count, ... up to
        ``capacity()`` to export the whole table). ``since_step``: only rows written (inserted,
        updated, assigned, loaded) at a table step after it. A CACHING table flushes first."""
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (start, count)):
            raise InputError(f"table {self.name!r}: export_batch needs ints start, count >= 0, "
                             f"found {start!r}, {count!r}.")
        if since_step is not None and not isinstance(since_step, int):
            raise InputError(f"table {self.name!r}: since_step must be an int or None, "
                             f"found {since_step!r}.")
        if self.cache is not None:
            self.flush()
        ix = self.index
        slots = ix.occupied(min(start, self.capacity()), min(start + count, self.capacity()))
        if since_step is not None:
            slots = slots[ix.written[slots] > since_step]
        rows = self.store.read(slots.to(self.device) + self.row_offset)
        return ExportBatch(keys=ix.keys[slots].to(self.device), embeddings=rows[:, :self.dim],
                           optimizer_state=rows[:, self.dim:],
                           scores=ix.scores[slots].to(self.device))

    def flush(self) -> int:
        """CACHING: writes every dirty cached row (and every cached row's score) back to the
        backing store, and with ``ddr_path`` syncs its files to disk; returns the rows written.
        Other modes hold no copies: 0."""
        return 0 if self.cache is None else self.cache.flush()

    def prefetch(self, keys: torch.Tensor) -> int:
        """CACHING: brings the rows of ``keys`` that are in the backing store into the cache
        ahead of their lookup (new keys are created by the lookup itself); returns how many
        rows it fetched. Changes no row and no training result. Other modes: 0."""
        keys = self._keys(keys, "prefetch")
        return 0 if self.cache is None else self.cache.prefetch(keys)

    def size(self) -> int:
        return self.index.size()

    def home_buckets(self, keys: torch.Tensor) -> torch.Tensor:
        """The bucket (of ``index``, the table as a whole) each key (N,) lives in if present
        (e.g. to check that rows fit before loading them: a bucket holds ``index.width``)."""
        keys = self._keys(keys, "home_buckets")
        ix = self.index
        return home_bucket(keys, index_hash(keys), ix.num_buckets, ix.split)

    def capacity(self) -> int:
        return self.index.num_slots

    def memory_usage(self) -> MemoryUsage:
        """Bytes per tier of the live tensors (the same formula as ``dynemb.table_memory``)."""
        hbm_rows, ddr_rows = self.store.tier_bytes()
        width = self.dim + self.optimizer.state_width

        def split(nbytes: int) -> dict[str, int]:
            return {"values_bytes": nbytes * self.dim // width,
                    "optimizer_state_bytes": nbytes * self.optimizer.state_width // width}

        admission = 0 if self.admission is None else self.admission.index.nbytes()
        if self.cache is None:
            hbm_index, ddr_index = self.index.nbytes(), 0
        else:
            hbm_index, ddr_index = self.cache.nbytes(), self.index.nbytes()
        return MemoryUsage(
            hbm=TierMemory(**split(hbm_rows), index_bytes=hbm_index, admission_bytes=admission),
            ddr=TierMemory(**split(ddr_rows), index_bytes=ddr_index))

    def stats(self) -> TableStats:
        c = self._counters
        if self.cache is not None:
            hbm_rows, ddr_rows = self.cache.index.size(), self.size()
        elif self.mode == StorageMode.HBM_ONLY:
            hbm_rows, ddr_rows = self.size(), 0
        else:
            hbm_rows = int((self.index.digests[:self.layout.hbm_rows] >= 2).sum())
            ddr_rows = self.size() - hbm_rows
        return TableStats(
            size=self.size(), capacity=self.capacity(), step=self.step,
            optimizer_step=self.optimizer.step, lookups=c["lookups"],
            hits=c["hbm_hits"] + c["ddr_hits"], hbm_hits=c["hbm_hits"],
            hbm_misses=c["hbm_misses"], ddr_hits=c["ddr_hits"], ddr_misses=c["ddr_misses"],
            inserted=self.index.count(C_INSERTED), evicted=self.index.count(C_EVICTED),
            failed_inserts=c["failed_inserts"], admission_rejected=c["admission_rejected"],
            counter_evictions=0 if self.admission is None else self.admission.counter_evictions,
            erased=c["erased"], stale_updates=c["stale_updates"], hbm_rows=hbm_rows,
            ddr_rows=ddr_rows, cache_evictions=c["cache_evictions"],
            write_backs=c["write_backs"],
            backing_evictions=self.index.count(C_EVICTED) if self.cache is not None else 0,
            prefetched=c["prefetched"])

    # ------------------------------------------------------------------ eviction log

    def track_evictions(self, *, restart: bool = False) -> None:
        """Starts logging the keys evicted from the table or erased, with their table step (for
        incremental exports: :meth:`evicted_since`, ``export_batch(since_step=)``).
        Idempotent; ``restart`` empties the log and starts it at the current step."""
        self.log.start(self.step, restart=restart)

    def evicted_since(self, step: int) -> torch.Tensor:
        """Distinct keys (int64) evicted or erased at a table step after ``step``."""
        return self.log.since(step, f"table {self.name!r}")

    def trim_eviction_log(self, step: int) -> None:
        """Forgets log entries at or before ``step`` (after exporting them)."""
        self.log.trim(step)

    def close(self, *, delete_files: bool = False) -> None:
        """With ``ddr_path``: flushes (CACHING), or with ``delete_files`` removes the files this
        table created (e.g. a collection's tables that ``distributed.shard`` replaced)."""
        if self.files is None:
            return
        if delete_files and not self.files.reopen:
            self.files.delete()
        else:
            self.flush()

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
        return self._values(lk.unique_keys, self.current_slots(lk))

    def sources(self, lk: Lookup) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each entry's embedding is, for the pooling kernels: ``src`` (U,) int64 is the
        hbm row (of ``rows``), or ``-1 - m`` for row m of ``extra`` (M, dim): the entries in ddr
        and the eval-initializer rows of entries without a row. Rows are located again if rows
        were evicted since the lookup."""
        rids = self.current_slots(lk)
        away = rids < 0 if self.store.ddr is None else (rids < 0) | (rids >= self.layout.hbm_rows)
        away = torch.nonzero(away).flatten()
        extra = torch.empty(away.numel(), self.dim, dtype=torch.float32, device=self.device)
        src = rids
        if away.numel():
            self._values(lk.unique_keys[away], rids[away], extra)
            src = rids.clone()
            src[away] = -1 - torch.arange(away.numel(), device=self.device)
        return src, extra

    def current_slots(self, lk: Lookup) -> torch.Tensor:
        """The lookup's row ids, located again by key if rows were evicted, moved or erased
        since (a key that lost its row gets -1 and is counted in ``stats().stale_updates``)."""
        if lk.epoch == self._epoch:
            return lk.unique_slots
        now = torch.where(lk.unique_slots >= 0, self.locate(lk.unique_keys), -1)
        self._counters["stale_updates"] += int(((lk.unique_slots >= 0) & (now < 0)).sum())
        lk.unique_slots, lk.epoch = now, self._epoch
        return now

    def apply_gradients(self, lk: Lookup, grads: torch.Tensor, *, clip: bool = True) -> None:
        """Applies the fused optimizer: ``grads`` (U, dim) are the summed gradients per entry.

        ``clip=False`` skips ``max_grad_norm`` clipping (a sharded table is clipped by the norm
        over all shards before this call)."""
        rids = self.current_slots(lk)
        self.optimizer.apply(self.store.parts(rids), grads.to(torch.float32).contiguous(),
                             clip=clip)
        self._mark_written(rids[rids >= 0])

    def locate(self, keys: torch.Tensor) -> torch.Tensor:
        """Global row id of each key (N,) or -1, touching nothing."""
        if self.cache is not None:
            return self.cache.locate(keys)
        return self.index.find(keys)

    # ------------------------------------------------------------------ internals

    def _resolve(self, keys: torch.Tensor, *, touch: bool, insert: bool, admit: bool,
                 custom: torch.Tensor | None, keep_evicted: bool = True) -> Lookup:
        custom = self._no_scores if custom is None else custom
        if touch:
            self.step += 1
            self._counters["lookups"] += keys.numel()
        if self.cache is not None:
            return self.cache.resolve(keys, touch=touch, insert=insert, admit=admit,
                                      custom=custom, keep_evicted=keep_evicted)
        be, ix = self.backend, self.index
        slots = be.find(ix, keys, custom, self._policy, self.step, touch, True)
        if touch:
            self._count_tiers(keys, slots)
        inserted, evicted, failed = None, self._evicted_none(), 0
        if insert:
            inserted = torch.zeros(keys.numel(), dtype=torch.bool, device=self.device)
            miss = self._admitted(keys, torch.nonzero(slots < 0).flatten(), admit)
            if miss.numel():
                mkeys = keys[miss]
                new_slots, fresh, ev = be.insert(ix, mkeys, custom[miss] if custom.numel() else custom,
                                                 self._policy, self.step)
                evicted = self._take_evicted(*ev, with_rows=keep_evicted)
                self._init_rows(ix, new_slots[fresh], mkeys[fresh])
                slots[miss] = new_slots
                inserted[miss] = fresh
                failed = int((new_slots < 0).sum())
        inverse, unique_slots, unique_pos = be.finish(ix, slots)
        if failed:
            self._on_full(failed)
        return Lookup(unique_keys=keys[unique_pos], unique_slots=unique_slots, inverse=inverse,
                      inserted=inserted, evicted=evicted, epoch=self._epoch)

    def _count_tiers(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Per-tier hits and misses of a single-index (HBM_ONLY or HYBRID) lookup."""
        c, split = self._counters, self.layout.hbm_rows
        hit = slots >= 0
        n_hit = int(hit.sum())
        if self.mode == StorageMode.HBM_ONLY:
            c["hbm_hits"] += n_hit
            c["hbm_misses"] += keys.numel() - n_hit
            return
        in_hbm = slots < split
        c["hbm_hits"] += int((hit & in_hbm).sum())
        c["ddr_hits"] += int((hit & ~in_hbm).sum())
        if n_hit < keys.numel():
            mk = keys[~hit]
            ix = self.index
            hbm_tier = home_bucket(mk, index_hash(mk), ix.num_buckets, ix.split) < ix.split
            c["hbm_misses"] += int(hbm_tier.sum())
            c["ddr_misses"] += int((~hbm_tier).sum())

    def _admitted(self, keys: torch.Tensor, miss: torch.Tensor, admit: bool) -> torch.Tensor:
        """The positions of ``miss`` (occurrences of keys without a row) that admission lets in
        (all of them when ``admit`` is False or the table has no admission)."""
        if admit and self.admission is not None and miss.numel():
            ok = self.admission.admit(keys[miss].to(self.device)).to(miss.device)
            self._counters["admission_rejected"] += int((~ok).sum())
            miss = miss[ok]
        return miss

    def _init_rows(self, ix: HashIndex, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Initial rows for new ``keys`` at ``slots`` of ``ix`` (the table's index)."""
        rids = slots.to(self.device)
        self.store.init(rids + self.row_offset if self.row_offset else rids, keys,
                        self.optimizer.initial_state,
                        self.config.initializer, self._init_mix)
        ix.written[slots] = self.step

    def _values(self, keys: torch.Tensor, rids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(keys.numel(), self.dim, dtype=torch.float32, device=self.device)
        self.store.gather(rids, self.dim, out)
        missing = torch.nonzero(rids < 0).flatten()
        if missing.numel():
            self.backend.init_rows(out, missing, keys[missing], self.dim, 0.0,
                                   self.config.eval_initializer, self._eval_mix)
        return out

    def _take_evicted(self, keys, slots, scores, *, with_rows: bool) -> Evicted:
        """Records rows the table's index evicted (before their slots are reused)."""
        if keys.numel() == 0:
            return self._evicted_none()
        self._epoch += 1
        self.log.add(self.step, keys)
        keys, scores = keys.to(self.device), scores.to(self.device)
        if not with_rows:
            return Evicted(keys=keys, embeddings=None, optimizer_state=None, scores=scores)
        rows = self.store.read(slots.to(self.device) + self.row_offset)
        return Evicted(keys=keys, embeddings=rows[:, :self.dim],
                       optimizer_state=rows[:, self.dim:], scores=scores)

    def _evicted_none(self) -> Evicted:
        empty = self._no_scores
        rows = self.rows[:0]
        return Evicted(keys=empty, embeddings=rows[:, :self.dim],
                       optimizer_state=rows[:, self.dim:], scores=empty)

    def _mark_written(self, rids: torch.Tensor) -> None:
        """Rows ``rids`` (all >= 0) were written at this step: their write step, a STEP score,
        and a cached row's dirty flag."""
        if self.cache is not None:
            self.cache.mark_written(rids)
            return
        self.index.written[rids] = self.step
        if self.config.score == ScorePolicy.STEP:
            self.index.scores[rids] = self.step
