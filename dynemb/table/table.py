"""DynamicTable: one rank's dynamic embedding table (hash index + rows + admission + init).

The table owns its configuration, row store and optimizer, and delegates to three objects:

* :class:`~dynemb.table.state.TableState`: what every part shares (step, eviction epoch,
  counters, eviction log, score policy);
* :class:`~dynemb.table.lifecycle.RowLifecycle`: admission, initialisation, eviction records
  and the ``on_full`` decision;
* a resolver that maps keys to rows: :class:`~dynemb.table.resolver.SingleIndexResolver`
  (HBM_ONLY, HYBRID) or :class:`~dynemb.table.caching.CachedResolver` (CACHING), which also
  holds rows for lookups in flight (``dynemb.table.holds``).
"""

from __future__ import annotations

import itertools

import torch

from dynemb.config import InitKind, NonFinite, OnFull, ScorePolicy, StorageMode, TableConfig
from dynemb.errors import CapacityError, InputError
from dynemb.kernels.backend import backend_for
from dynemb.kernels.hashing import home_bucket, index_hash
from dynemb.optim.rules import RowOptimizer
from dynemb.table.admission import AdmissionFilter
from dynemb.table.caching import CachedResolver
from dynemb.table.checks import TableChecks, writes
from dynemb.table.index import HashIndex
from dynemb.table.lifecycle import RowLifecycle
from dynemb.table.memory import storage_layout
from dynemb.table.reports import TableReports
from dynemb.table.resolver import Resolver, SingleIndexResolver
from dynemb.table.scratch import Scratch
from dynemb.table.state import TableState
from dynemb.table.stats import Evicted, ExportBatch, FindResult, InsertResult, Lookup
from dynemb.table.storage import DdrFiles, RowStore, ddr_file_bytes


_TOKENS = itertools.count(1)
"""Each table's ``token`` (its lookups carry it)."""


def canonical_device(device: torch.device | str | None) -> torch.device:
    """``device`` as tensors report it ("cuda" becomes "cuda:0"), default CPU."""
    return torch.empty(0, device=device or "cpu").device


class DynamicTable(TableChecks, TableReports):
    """Rows keyed by raw int64 ids, created on first sight, evicted by score when full.

    Storage (``config.storage``): HBM_ONLY keeps every row on ``device``; HYBRID splits the rows
    by a hash of the key between ``device`` (hbm) and host memory (ddr); CACHING keeps every row
    in a ddr backing store under an hbm cache (write-back: see :meth:`flush`, :meth:`prefetch`).
    The mode changes where rows live, never what training computes.

    Failures change nothing: a call that raises :class:`CapacityError` (``on_full`` RAISE)
    leaves every row, score, admission counter and the step as they were (only
    ``stats().failed_inserts`` counts it), and input errors are raised before anything changes;
    with ``on_full`` WARN/COUNT the call completes and returns what it evicted. Gradient rows
    with NaN or inf follow ``config.nonfinite`` (see :meth:`apply_gradients`).

    Attributes:
        index: the index of every row of the table (CACHING: the backing store's).
        cache: a CACHING table's cache (its :class:`~dynemb.table.caching.CachedResolver`:
            ``cache.index`` is the cache index), None in the other modes; ``cache is not None``
            tells a CACHING table.
        resolver: how keys map to rows (see the module docstring).
        state: the step, eviction epoch, counters and eviction log (``log``).
        life: the row life cycle (admission, initialisation, eviction records, ``on_full``).

    Args:
        config: the table's configuration.
        device: where hbm rows and the index live (default CPU).
        backend: "numba" (compiled CPU kernels, the CPU default), "triton" (Triton kernels, the
            CUDA default) or "torch" (vectorised reference, any device).
    """

    def __init__(self, config: TableConfig, *, device: torch.device | str | None = None,
                 backend: str | None = None) -> None:
        self.config = config
        self.name = config.name
        self.dim = config.dim
        self.device = canonical_device(device)
        self.backend = backend_for(self.device, backend, config.threads)
        self.optimizer = RowOptimizer(config.optimizer, config.dim)
        st = config.storage
        st.require_planned(config.name)
        self.layout = lay = storage_layout(config.capacity, config.bucket_capacity, st.mode,
                                           st.cache_load_factor)
        self.mode = lay.mode
        files = None if st.ddr_path is None else DdrFiles(
            st.ddr_path, config.name, reopen=st.reopen,
            sizes=ddr_file_bytes(lay, config.dim + self.optimizer.state_width))
        self.files = files
        self.store = RowStore(lay.hbm_rows, lay.ddr_rows, config.dim,
                              config.dim + self.optimizer.state_width, self.device, self.backend,
                              files, config.name)
        self.state = TableState(config.score, self.device)
        self.token = next(_TOKENS)
        """Tells this table's lookups from another table's (a copy of the table keeps it)."""
        self.log = self.state.log
        self.admission = (None if config.admission is None
                          else AdmissionFilter(config.admission, self.device, self.backend))
        self.life = RowLifecycle(config, self.state, self.store, self.admission, self.optimizer,
                                 self.device)
        self.resolver = self._resolver(files)
        self.index = self.resolver.table_index
        self.cache: CachedResolver | None = (self.resolver
                                             if isinstance(self.resolver, CachedResolver) else None)
        # ScorePolicy.CUSTOM: the score training lookups give the keys they touch or insert
        # (set it each step, e.g. to a timestamp); None gives new keys the table step.
        self.lookup_score: int | None = None
        # The (U, dim) gradients of a step's entries are summed here, kept between steps: a
        # fresh tensor of that size page-faults on first touch, every step.
        self.grad_scratch = Scratch()
        # dynemb.checkpoint's record of this table's saves and loads (training step -> table
        # step), kept on the table it describes; None until the first save or load.
        self.checkpoint_marks: object | None = None
        # A CACHING table sits in a reference cycle (as it always has): dropping its last
        # reference leaves it to the garbage collector instead of freeing it at once, so one
        # still uncollected at interpreter exit is flushed and closed by the exit hook, and one
        # collected earlier releases its lock unmarked (docs/storage.md, "Closed at exit").
        self._lifetime = self if self.cache is not None else None
        if files is not None:  # checks a reopened store, then marks it open (not clean)
            files.opened(self, check=self.resolver.reopen_check())

    def _resolver(self, files: DdrFiles | None) -> Resolver:
        """The index of every row and the resolver of this table's storage mode (the one place
        the mode decides which)."""
        cfg, lay = self.config, self.layout
        if self.mode == StorageMode.CACHING:  # the backing store's index lives in host memory
            backing = HashIndex(lay.num_buckets, lay.width, torch.device("cpu"),
                                self.store.ddr_backend, alloc=files and files.alloc)
            return CachedResolver(cfg, lay, self.state, self.life, self.store, backing,
                                  self.optimizer, files)
        index = HashIndex(lay.num_buckets, lay.width, self.device, self.backend, split=lay.split)
        return SingleIndexResolver(cfg, lay, self.state, self.life, self.store, index)

    @property
    def step(self) -> int:
        """The table step (``stats().step``): the clock of scores and write steps."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def rows(self) -> torch.Tensor:
        """The hbm rows (hbm_rows, dim + state width): pooling kernels read entries from here."""
        return self.store.hbm

    @property
    def row_offset(self) -> int:
        """Global row id of slot 0 of ``index`` (the backing store's rows follow the cache's)."""
        return self.resolver.row_offset

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
        if out is None:
            out = torch.empty(keys.numel(), self.dim, dtype=torch.float32, device=self.device)
        init = self.config.eval_initializer  # a constant one is written by the probe itself
        fill = init.value if init.kind == InitKind.CONSTANT else None
        fused = self.resolver.locate_rows(keys, out, fill)
        if fused is None:
            rids = self.locate(keys)
            return FindResult(values=self.life.values(keys, rids, out), found=rids >= 0)
        rids, missing = fused
        if fill is None:
            self.life.eval_at(keys, missing, out)
        return FindResult(values=out, found=rids >= 0)

    @writes
    def find_or_insert(self, keys: torch.Tensor, scores: torch.Tensor | None = None) -> InsertResult:
        """Rows of ``keys``, creating (initialising) missing ones; evicts when a bucket is full.

        Admission does not apply here (it filters training lookups). ``scores`` (N,) int64 only
        with ScorePolicy.CUSTOM. With ``on_full`` RAISE a key that cannot get a row raises
        CapacityError and the call changes nothing; WARN/COUNT give it the eval initializer.
        """
        keys = self._keys(keys, "find_or_insert")
        lk = self._resolve(keys, touch=True, insert=True, admit=False,
                           custom=self._scores(scores, keys, "find_or_insert"))
        values = self.life.values(keys, lk.unique_slots[lk.inverse])
        return InsertResult(values=values, inserted=lk.inserted, evicted=lk.evicted)

    @writes
    def insert_or_assign(self, keys: torch.Tensor, values: torch.Tensor,
                         scores: torch.Tensor | None = None,
                         optimizer_state: torch.Tensor | None = None) -> Evicted:
        """Sets the embeddings (and optionally optimizer state) of distinct ``keys`` (N,),
        inserting missing ones. Existing rows keep their optimizer state unless given.

        Raises InputError, changing nothing, for values or state that are not finite as float32;
        CapacityError, changing nothing, if a key cannot get a row (``on_full`` RAISE; with
        WARN/COUNT the other keys are assigned). Returns the rows evicted to make room."""
        keys = self._keys(keys, "insert_or_assign")
        self._check_rows(keys, values, optimizer_state, "insert_or_assign")
        custom = self._scores(scores, keys, "insert_or_assign")
        with self.life.assigning():  # (every new row's embedding is written below)
            lk = self._resolve(keys, touch=True, insert=True, admit=False, custom=custom)
        rids = lk.unique_slots[lk.inverse]
        given = [v.detach() for v in (values, optimizer_state) if v is not None]
        rowless = lk.rowless if lk.rowless is not None else int((rids < 0).sum())
        if rowless:  # only the keys that got a row are written
            ok = rids >= 0
            rids = rids[ok]
            given = [g[ok.to(g.device)] for g in given]
        for g, start in zip(given, (0, self.dim)):
            self.store.write(rids, g.to(self.device), start)
        self.resolver.mark_written(lk.unique_slots)
        return lk.evicted

    @writes
    def load_rows(self, keys: torch.Tensor, embeddings: torch.Tensor,
                  optimizer_state: torch.Tensor, scores: torch.Tensor) -> None:
        """Inserts or overwrites the rows of distinct ``keys`` (N,) exactly: embeddings (N, dim),
        optimizer_state (N, state width), scores (N,) int64 (e.g. from a checkpoint). Counts no
        lookup and leaves ``step`` as it is. All or nothing: raises InputError for rows or state
        that are not finite as float32, CapacityError if a key cannot get a row or placing it
        would evict another row, having changed nothing."""
        keys = self._keys(keys, "load_rows")
        self._check_rows(keys, embeddings, optimizer_state, "load_rows", "embeddings")
        self._check_shape("scores", scores, (keys.numel(),))
        if scores.dtype.is_floating_point or scores.dtype == torch.bool:  # (NaN, 1.7: no score)
            raise InputError(f"table {self.name!r}: load_rows expects integer scores, found "
                             f"{scores.dtype}; nothing was loaded.")
        slots, failed = self.resolver.place(keys)
        if failed:
            raise CapacityError(
                f"table {self.name!r}: load_rows cannot place {failed} of {keys.numel()} rows "
                f"without evicting others (their buckets are full; capacity {self.capacity()}, "
                f"size {self.size()}); nothing was loaded. Load into a table with more capacity.")
        rids = slots.to(self.device) + self.row_offset
        self.store.write(rids, embeddings.detach().to(self.device, torch.float32))
        self.store.write(rids, optimizer_state.detach().to(self.device, torch.float32), self.dim)
        ix = self.index
        ix.scores[slots] = scores.to(ix.scores)
        ix.written[slots] = self.step

    @writes
    def erase(self, keys: torch.Tensor) -> int:
        """Removes ``keys`` that are present; returns how many were."""
        keys = torch.unique(self._keys(keys, "erase"))
        gone = self.resolver.erase(keys)
        n = int((gone >= 0).sum())
        if n:
            st = self.state
            st.step += 1  # a write: exports since the previous step see it
            st.counters["erased"] += n
            st.evicted(keys[(gone >= 0).to(keys.device)])
        return n

    @writes
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
        self.resolver.flush()  # a CACHING table's rows go to the backing store first
        ix = self.index
        slots = ix.occupied(min(start, self.capacity()), min(start + count, self.capacity()))
        if since_step is not None:
            slots = slots[ix.written[slots] > since_step]
        rows = self.store.read(slots.to(self.device) + self.row_offset)
        return ExportBatch(keys=ix.keys[slots].to(self.device), embeddings=rows[:, :self.dim],
                           optimizer_state=rows[:, self.dim:],
                           scores=ix.scores[slots].to(self.device))

    @writes
    def flush(self) -> int:
        """CACHING: writes every dirty cached row (and every cached row's score) back to the
        backing store, and with ``ddr_path`` syncs its files to disk; returns the rows written.
        Other modes hold no copies: 0."""
        return self.resolver.flush()

    @writes
    def prefetch(self, keys: torch.Tensor) -> int:
        """CACHING: brings the rows of ``keys`` that are in the backing store into the cache
        ahead of their lookup (new keys are created by the lookup itself); returns how many
        rows it fetched. Changes no row and no training result. Other modes: 0."""
        keys = self._keys(keys, "prefetch")
        return self.resolver.prefetch(keys)

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
        """Ends this table's use of its ``ddr_path`` store (nothing to do without one): writes
        the cached rows back (CACHING), syncs the files, writes the header and the clean-shutdown
        marker that ``Storage(reopen=True | "auto")`` needs, and releases the store's lock. With
        ``delete_files``, a store this table created is removed instead (a reopened one is
        closed as above). A table whose call was interrupted part way (:attr:`interrupted`)
        only releases the lock: its store stays unmarked, torn. Idempotent; a closed table
        refuses further lookups. Tables still open at interpreter exit are closed then."""
        files = self.files
        if files is None or files.closed:
            return
        if delete_files and not files.reopened:
            files.delete()
            return
        if self.interrupted:  # its rows may be half written: never mark them clean
            files.close(None, clean=False)
            return
        if not files.replaced():  # (files removed under the table: close() only warns)
            self.flush()
        files.close(self.resolver.store_header())

    # ------------------------------------------------------------------ module path

    @writes
    def lookup(self, keys: torch.Tensor, *, train: bool, keep_evicted: bool = False,
               hold: bool = False, checked: bool = False) -> Lookup:
        """Resolves (N,) keys for a module: in training rows are created (through admission) and
        scores touched; in eval nothing changes. Evictions are always counted and their keys and
        scores returned; their rows are copied out only with ``keep_evicted`` (a copy the
        single-tier training path does not need). ``hold``: the rows it resolved stay in place
        (no later call evicts them) until :meth:`apply_gradients` or :meth:`release` of the
        returned lookup (see ``dynemb.table.holds``); a call that raises holds nothing.
        ``checked``: the keys come from a validated :class:`~dynemb.SparseBatch` (a 1-D int64
        tensor free of the reserved key) and are not checked again (on a GPU that would wait
        for the device)."""
        keys = self._keys(keys, "lookup", checked)
        custom = None
        if train and self.config.score == ScorePolicy.CUSTOM and self.lookup_score is not None:
            custom = torch.full_like(keys, int(self.lookup_score))
        lk = self._resolve(keys, touch=train, insert=train, admit=True, custom=custom,
                           keep_evicted=keep_evicted)
        lk.table = self.token
        if hold:
            self.resolver.hold(lk)
        return lk

    def embeddings(self, lk: Lookup) -> torch.Tensor:
        """(U, dim) float32: the row of each unique entry, or its eval-initializer row."""
        return self.life.values(lk.unique_keys, self.current_slots(lk))

    def sources(self, lk: Lookup) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each entry's embedding is, for the pooling kernels: ``src`` (U,) int64 is the
        hbm row (of ``rows``), or ``-1 - m`` for row m of ``extra`` (M, dim): the entries in ddr
        and the eval-initializer rows of entries without a row. Rows are located again if rows
        were evicted since the lookup."""
        counted = lk.away if lk.epoch == self.state.epoch else None  # (current_slots moves it)
        rids = self.current_slots(lk)
        if counted == 0:  # every entry in hbm: nothing to find
            return rids, torch.empty(0, self.dim, dtype=torch.float32, device=self.device)
        away = rids < 0 if self.store.ddr is None else (rids < 0) | (rids >= self.layout.hbm_rows)
        away = (torch.nonzero(away) if counted is None
                else torch.nonzero_static(away, size=counted)).flatten()
        extra = torch.empty(away.numel(), self.dim, dtype=torch.float32, device=self.device)
        src = rids
        if away.numel():
            if self.store.ddr is None:  # no row: the eval initializer's
                self.life.eval_rows(lk.unique_keys[away], extra)
            else:
                self.life.values(lk.unique_keys[away], rids[away], extra,
                                 rowless=None if counted is None else lk.rowless)
            src = rids.clone()
            src[away] = -1 - torch.arange(away.numel(), device=self.device)
        return src, extra

    def current_slots(self, lk: Lookup) -> torch.Tensor:
        """The lookup's row ids, located again by key if rows were evicted, moved or erased
        since (a key that lost its row gets -1 and is counted in ``stats().stale_updates``)."""
        st = self.state
        if lk.epoch == st.epoch:
            return lk.unique_slots
        now = torch.where(lk.unique_slots >= 0, self.locate(lk.unique_keys), -1)
        st.count_on_device("stale_updates", ((lk.unique_slots >= 0) & (now < 0)).sum())
        lk.unique_slots, lk.epoch = now, st.epoch
        lk.away = lk.rowless = None  # (no longer counted)
        return now

    @writes
    def apply_gradients(self, lk: Lookup, grads: torch.Tensor, *, clip: bool = True) -> None:
        """Applies the fused optimizer: ``grads`` (U, dim) are the summed gradients per entry.

        Gradient rows holding NaN or inf (as float32) are counted in ``stats().nonfinite_grads``
        and handled by ``config.nonfinite``: SKIP leaves their rows and state as they were,
        RAISE raises :class:`InputError` before updating anything, APPLY applies them.
        ``clip=False`` skips ``max_grad_norm`` clipping (a sharded table is clipped by the norm
        over all shards before this call); clipping norms count finite rows only. Releases the
        lookup's holds (``lookup(hold=True)``) when it returns, and also when it raises: the
        lookup is spent either way. Raises InputError, changing nothing, for another table's
        lookup, and for ``grads`` of another shape or device (releasing the lookup's holds)."""
        if lk.table is not None and lk.table != self.token:
            raise InputError(f"table {self.name!r}: apply_gradients got a lookup made by another "
                             "table; apply it on the table that looked it up (nothing changed).")
        try:
            self._apply(lk, grads, clip)
        finally:
            if lk.holds is not None:
                self.release(lk)

    def _apply(self, lk: Lookup, grads: torch.Tensor, clip: bool) -> None:
        want = (lk.unique_slots.numel(), self.dim)
        if not isinstance(grads, torch.Tensor) or tuple(grads.shape) != want \
                or not grads.is_floating_point() or grads.device != self.device:
            found = (f"{grads.dtype} {tuple(grads.shape)} on {grads.device}"
                     if isinstance(grads, torch.Tensor) else type(grads).__name__)
            raise InputError(f"table {self.name!r}: apply_gradients expects grads as a float "
                             f"tensor of shape {want} (one row per entry of the lookup) on "
                             f"{self.device}, found {found}; nothing was updated.")
        grads = grads.to(torch.float32).contiguous()
        if self.backend.reads_wait and self.config.nonfinite != NonFinite.RAISE:
            rids = self._device_gradient_rows(lk, grads)
            bad = 0
        else:
            rids, bad = self.gradient_rows(lk, grads)
        if bad:
            self.state.counters["nonfinite_grads"] += bad
            if self.config.nonfinite == NonFinite.RAISE:
                raise InputError(
                    f"table {self.name!r}: {bad} gradient row(s) hold NaN or inf at optimizer "
                    f"step {self.optimizer.step + 1}; expected finite gradients. Nothing was "
                    "updated (TableConfig.nonfinite='raise'). Find where the loss became "
                    "non-finite (a lower learning rate often helps), or choose nonfinite='skip' "
                    "to skip such rows and count them.")
        self.optimizer.apply(self.store.parts(rids), grads, clip=clip)
        self.resolver.mark_written(rids, cached_only=lk.away == 0)

    def _device_gradient_rows(self, lk: Lookup, grads: torch.Tensor) -> torch.Tensor:
        """:meth:`gradient_rows` without reading the device (SKIP and APPLY): the rows with NaN
        or inf are found and counted there, and read when ``stats()`` asks."""
        rids = self.current_slots(lk)
        bad = (rids >= 0) & ~torch.isfinite(grads).all(dim=1)
        self.state.count_on_device("nonfinite_grads", bad.sum())
        return torch.where(bad, -1, rids) if self.config.nonfinite == NonFinite.SKIP else rids

    def gradient_rows(self, lk: Lookup, grads: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(row ids (U,) that an update with ``grads`` (U, dim) float32 writes, the number of
        the lookup's rows whose gradient holds NaN or inf). With ``nonfinite`` SKIP those rows
        are -1 (not updated), like entries without a row. Counts nothing."""
        rids = self.current_slots(lk)
        if self.backend.all_finite(grads):
            return rids, 0
        bad = (rids >= 0) & ~torch.isfinite(grads).all(dim=1)
        n_bad = int(bad.sum())
        if n_bad and self.config.nonfinite == NonFinite.SKIP:
            rids = torch.where(bad, -1, rids)
        return rids, n_bad

    def locate(self, keys: torch.Tensor) -> torch.Tensor:
        """Global row id of each key (N,) or -1, touching nothing."""
        return self.resolver.locate(keys)

    # ------------------------------------------------------------------ holds

    def release(self, lk: Lookup) -> None:
        """Drops the holds of ``lk`` (a lookup of this table made with ``hold=True``): its rows
        become evictable again, unless another lookup in flight holds them too. A no-op for a
        lookup that holds nothing (never held, or released already, e.g. by
        ``apply_gradients``). See ``dynemb.table.holds``."""
        self.resolver.release(lk, self.name)

    def held_rows(self) -> int:
        """Rows (slots) held right now by lookups in flight; 0 once every held lookup has been
        released or applied."""
        return self.resolver.held_rows()

    # ------------------------------------------------------------------ internals

    def _resolve(self, keys: torch.Tensor, *, touch: bool, insert: bool, admit: bool,
                 custom: torch.Tensor | None, keep_evicted: bool = True) -> Lookup:
        """Finds (touching, with ``touch``) and inserts (with ``insert``) the keys of one call.

        With ``on_full`` RAISE an inserting call is atomic: scores touched by the find pass are
        journaled, the insert kernel places every new key or changes nothing, and a failure
        undoes the touches, pins, step and counters before raising
        (``RowLifecycle.refuse``). Nothing else changes before the insert kernel has succeeded
        (admission only judges until then).
        """
        st = self.state
        custom = st.no_scores if custom is None else custom
        atomic = insert and self.config.on_full == OnFull.RAISE
        saved = st.snapshot() if atomic else None
        if touch:
            st.touch(keys.numel())
        return self.resolver.resolve(keys, touch=touch, insert=insert, admit=admit,
                                     custom=custom, keep_evicted=keep_evicted, saved=saved)
