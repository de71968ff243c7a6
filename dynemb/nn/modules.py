"""EmbeddingBagCollection (pooled) and EmbeddingCollection (one row per id) over dynamic tables.

One lookup per table per forward: the ids of all its features are resolved together into U
unique entries. EmbeddingBagCollection pools straight from the row store (kernels/pooling_*)
and its backward sums the gradient per entry; EmbeddingCollection materialises the (U, dim)
rows as one autograd tensor. Either way the summed (U, dim) gradient reaches the table's fused
optimizer in backward, which updates the rows in place.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynemb.batch import SparseBatch, check_feature_policy, check_keys, check_table_lengths
from dynemb.config import PoolingMode, TableConfig
from dynemb.errors import ConfigError, InputError
from dynemb.interop import bag_configs, is_kjt, sequence_configs
from dynemb.kernels.backend import backend_for
from dynemb.nn.grouped import GroupStep, TableGroup, groupable
from dynemb.nn.staging import Stageable, Staged, check_idle
from dynemb.table import snapshot
from dynemb.table.memory import storage_layout
from dynemb.table.table import DynamicTable, Lookup, canonical_device


@dataclass
class _LookupState:
    """What the autograd boundary needs: the table, its resolved lookup, and the (U, dim) rows
    the lookup read."""

    table: DynamicTable
    lookup: Lookup
    rows: torch.Tensor | None
    """(U, dim); handed to autograd (and dropped here) by the training forward."""
    lengths: torch.Tensor
    """(F·B,) int64 bag lengths, feature-major."""
    timer: Callable = contextlib.nullcontext
    """``timer("backward")`` times the backward (the collection's stage timers)."""


class _RowsFn(torch.autograd.Function):
    """(U, dim) rows of one lookup; backward applies the fused optimizer to them."""

    @staticmethod
    def forward(ctx, state: _LookupState, anchor: torch.Tensor) -> torch.Tensor:
        ctx.state = state
        rows, state.rows = state.rows, None  # its grad_fn will be this node: no cycle
        return rows

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        state = ctx.state
        with state.timer("backward"):
            state.table.apply_gradients(state.lookup, grad)
        return None, None


@dataclass
class _PoolState:
    """One table's pooled lookup: F features x B bags over the lookup's U entries."""

    table: DynamicTable
    lookup: Lookup
    lengths: torch.Tensor
    """(F·B,) int64 bag lengths, feature-major."""
    weights: torch.Tensor
    """(N,) float32 per-id weights, or empty."""
    batch: int
    mean: bool
    values: torch.Tensor | None = None
    """(B, F·dim) the pooled output, computed by the lookup stage."""
    timer: Callable = contextlib.nullcontext
    """``timer("backward")`` times the backward (the collection's stage timers)."""
    entries: torch.Tensor | None = None
    """(U, dim) the entries' embeddings as forward saw them (kept only when the weights need a
    gradient: backward must not read rows an update may have changed since)."""

    def pool(self, keep_entries: bool = False) -> torch.Tensor:
        """(B, F·dim) float32 pooled output."""
        t = self.table
        out = torch.empty(self.batch, len(t.config.features) * t.dim, dtype=torch.float32,
                          device=t.device)
        if out.numel() == 0:
            return out
        src, extra = t.sources(self.lookup)
        t.backend.pool(t.rows, extra, src, self.lookup.inverse, self.lengths, self.weights,
                       self.batch, t.dim, self.mean, out)
        if keep_entries:
            self.entries = t.embeddings(self.lookup)
        return out

    def backward(self, gout: torch.Tensor, want_wgrad: bool) -> torch.Tensor:
        """Sums ``gout`` (B, F·dim) per entry into the fused optimizer; returns the weights'
        gradient (N,) (empty unless ``want_wgrad``)."""
        t, lk = self.table, self.lookup
        scratch = t.grad_scratch.empty if gout.numel() else t.grad_scratch.zeros
        grads = scratch(lk.unique_keys.numel(), t.dim, t.device)  # pool_backward overwrites
        wgrad = torch.empty(self.weights.numel() if want_wgrad else 0, dtype=torch.float32,
                            device=t.device)
        if gout.numel():
            if want_wgrad:  # read the entries as forward saw them
                rows, extra = self.entries, self.entries[:0]
                src = torch.arange(rows.shape[0], device=t.device)
            else:  # the kernels read entries only for the weights' gradient
                rows, extra, src = t.rows, t.rows[:0, :t.dim], lk.inverse[:0]
            t.backend.pool_backward(gout.to(torch.float32).contiguous(), rows, extra, src,
                                    lk.inverse, self.lengths, self.weights, self.batch, t.dim,
                                    self.mean, grads, wgrad)
        t.apply_gradients(lk, grads)
        return wgrad


class _GroupFn(torch.autograd.Function):
    """(B, group width) pooled embeddings of a collection's grouped tables
    (``dynemb.nn.grouped``); backward sums the gradient per entry and applies each table's
    fused optimizer, one compiled call for the whole group."""

    @staticmethod
    def forward(ctx, step: GroupStep, anchor: torch.Tensor) -> torch.Tensor:
        ctx.step = step
        values, step.values = step.values, None  # its grad_fn will be this node: no cycle
        return values

    @staticmethod
    def backward(ctx, gout: torch.Tensor):
        with ctx.step.timer("backward"):
            ctx.step.backward(gout)
        return None, None


class _PooledFn(torch.autograd.Function):
    """(B, F·dim) pooled embeddings of one table, computed from the row store; backward sums
    the gradient per unique entry, hands it to the fused optimizer, and returns the gradient of
    the per-id weights."""

    @staticmethod
    def forward(ctx, state: _PoolState, anchor: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.state = state
        values, state.values = state.values, None  # its grad_fn will be this node: no cycle
        return values

    @staticmethod
    def backward(ctx, gout: torch.Tensor):
        want_w = ctx.needs_input_grad[2]
        with ctx.state.timer("backward"):
            wgrad = ctx.state.backward(gout, want_w)
        return None, None, (wgrad if want_w else None)


class KeyedEmbeddings:
    """Pooled embeddings of several features: ``values()`` (B, Σdim) in ``keys()`` order."""

    def __init__(self, keys: Sequence[str], dims: Sequence[int], values: torch.Tensor) -> None:
        self._keys = tuple(keys)
        self._dims = tuple(dims)
        self._values = values
        starts = [0]
        for d in self._dims:
            starts.append(starts[-1] + d)
        self._slices = {k: (starts[i], starts[i + 1]) for i, k in enumerate(self._keys)}

    def keys(self) -> tuple[str, ...]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def dims(self) -> tuple[int, ...]:
        return self._dims

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._slices:
            raise KeyError(f"no feature {key!r}; have {list(self._keys)}")
        lo, hi = self._slices[key]
        return self._values[:, lo:hi]

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: self[k] for k in self._keys}

    def to_keyed_tensor(self):  # noqa: ANN201  (torchrec's KeyedTensor; torchrec is optional)
        """torchrec's ``KeyedTensor`` of these embeddings (the same values, ``key_dim=1``)."""
        from dynemb.interop import keyed_tensor  # noqa: PLC0415

        return keyed_tensor(self)

    def length_per_key(self) -> list[int]:
        """The dim of each key (torchrec's ``KeyedTensor.length_per_key``)."""
        return list(self._dims)

    def __repr__(self) -> str:
        return f"KeyedEmbeddings(keys={list(self._keys)}, values={tuple(self._values.shape)})"


@dataclass(frozen=True)
class JaggedEmbeddings:
    """Unpooled embeddings of one feature: ``values`` (N, dim), one row per id, and the bag
    ``lengths`` (B,)."""

    values: torch.Tensor
    lengths: torch.Tensor

    def offsets(self) -> torch.Tensor:
        """(B + 1,) start of each bag in ``values``, then N."""
        return torch.cat([self.lengths.new_zeros(1), torch.cumsum(self.lengths, 0)])

    def split(self) -> list[torch.Tensor]:
        """One (length, dim) tensor per sample."""
        return list(torch.split(self.values, self.lengths.tolist()))

    def to_jagged_tensor(self):  # noqa: ANN201  (torchrec's JaggedTensor; torchrec is optional)
        """torchrec's ``JaggedTensor`` of these embeddings (see ``dynemb.interop``)."""
        from dynemb.interop import jagged_tensors  # noqa: PLC0415

        return jagged_tensors({"": self})[""]


def describe_table(config: TableConfig) -> str:
    """One line of a collection's repr: a table's features, geometry, storage and optimizer."""
    st = config.storage
    storage = st.mode.value if st.cache_load_factor in (None, 1.0) else \
        f"{st.mode.value} x={st.cache_load_factor}"
    return (f"{config.name}: features {list(config.features)}, dim {config.dim}, capacity "
            f"{config.capacity:,}, {storage}, {type(config.optimizer).__name__}")


class TablesStayPut(Stageable):
    """A module whose tables are not parameters: ``.to()``, ``.cuda()``, ``.half()`` and the
    like would convert the modules around it and leave its tables where and as they are, so
    they raise instead (see :meth:`_apply`)."""

    device: torch.device

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001  (nn.Module's signature)
        probe = torch.zeros(1, device=self.device)
        moved = fn(probe)
        if moved.device != probe.device or moved.dtype != probe.dtype:
            raise ConfigError(
                f"{type(self).__name__}: its tables are float32 on {self.device} and cannot be "
                f"moved or converted (to {moved.dtype} on {moved.device}): their rows are not "
                "parameters. Build the collection on the device you want (device=...), and "
                "convert or move only the dense submodules (e.g. model.mlp.half()).")
        return super()._apply(fn, recurse)


_DENSE_ONLY = contextvars.ContextVar("dynemb_dense_only", default=False)


@contextlib.contextmanager
def dense_only() -> Iterator[None]:
    """Within it, collections leave their tables out of ``state_dict()`` and
    ``load_state_dict()``: a model's dense state alone (what ``dynemb.checkpoint`` writes
    beside the tables it saves its own way)."""
    token = _DENSE_ONLY.set(True)
    try:
        yield
    finally:
        _DENSE_ONLY.reset(token)


def leaving_tables_out() -> bool:
    """Whether a :func:`dense_only` block is running."""
    return _DENSE_ONLY.get()


class _Collection(TablesStayPut):
    """What both collections share: the configs (checked when built), the tables, built on
    first use (:attr:`tables`), and the batch checks."""

    def __init__(self, tables: Sequence[TableConfig], *, device: torch.device | str | None = None,
                 backend: str | None = None, feature_policy: str = "strict") -> None:
        super().__init__()
        self.feature_policy = check_feature_policy(feature_policy, type(self).__name__)
        tables = list(tables)
        if not tables or not all(isinstance(t, TableConfig) for t in tables):
            raise ConfigError(f"{type(self).__name__}: expected a non-empty list of TableConfig, "
                              f"found {tables!r}.")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"{type(self).__name__}: table names must be distinct, found {names}.")
        owner: dict[str, str] = {}
        for t in tables:
            for f in t.features:
                if f in owner:
                    raise ConfigError(f"{type(self).__name__}: feature {f!r} is in tables "
                                      f"{owner[f]!r} and {t.name!r}; a feature has one table.")
                owner[f] = t.name
        self.device = canonical_device(device)
        self.backend_name: str = backend_for(self.device, backend).name
        for t in tables:  # what building would refuse about the geometry, refused now
            t.storage.require_planned(t.name)
            storage_layout(t.capacity, t.bucket_capacity, t.storage.mode,
                           t.storage.cache_load_factor)
        self.configs: tuple[TableConfig, ...] = tuple(tables)
        self.feature_names: tuple[str, ...] = tuple(f for t in tables for f in t.features)
        self._tables: dict[str, DynamicTable] | None = None
        self._anchor = torch.zeros(0, requires_grad=True)

    def embedding_bag_configs(self) -> list:
        """torchrec ``EmbeddingBagConfig`` objects of the tables (what torchrec models such as
        its DLRM read from their sparse arch; needs torchrec)."""
        return bag_configs(self.configs)

    def embedding_configs(self) -> list:
        """torchrec ``EmbeddingConfig`` objects of the tables (needs torchrec)."""
        return sequence_configs(self.configs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001
        """Each table's state as tensors that view its live storage (``dynemb.table.snapshot``):
        ``{prefix}tables.{name}.{array}``; none for a collection never built (used)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if leaving_tables_out() or not self.built:  # never built: nothing to save, none built
            return
        what = f"{type(self).__name__}.state_dict()"
        check_idle(self, what)
        for name, table in self.tables.items():
            for k, v in snapshot.state(table, f"{what}, table {name!r}").items():
                destination[f"{prefix}tables.{name}.{k}"] = v

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,  # noqa: ANN001
                              missing_keys, unexpected_keys, error_msgs):
        """Restores each table exactly from a state of the same geometry (else ConfigError
        naming the difference). Every table's entries are checked before any table changes; as
        torch does for parameters, the tables whose entries are all there load, and missing or
        unknown entries are reported (``load_state_dict`` raises on them unless
        ``strict=False``)."""
        ours = f"{prefix}tables."
        super()._load_from_state_dict(
            {k: v for k, v in state_dict.items() if not k.startswith(ours)}, prefix,
            local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        found = {k[len(ours):] for k in state_dict if k.startswith(ours)}
        if leaving_tables_out() or (not found and not self.built):
            return  # a state of a collection never built: this one stays unbuilt too
        what = f"{type(self).__name__}.load_state_dict()"
        check_idle(self, what)
        plans = []
        for name, table in self.tables.items():
            need = [f"{name}.{n}" for n in snapshot.names(table)]
            absent = [ours + n for n in need if n not in found]
            found.difference_update(need)
            if absent:
                missing_keys.extend(absent)
                continue
            entries = {n[len(name) + 1:]: state_dict[ours + n] for n in need}
            plans.append((table, entries,
                          snapshot.checked(table, entries, f"{what}, table {name!r}")))
        unexpected_keys.extend(ours + k for k in sorted(found))
        for table, entries, meta in plans:
            snapshot.load(table, entries, meta)

    def extra_repr(self) -> str:
        return "\n".join([*map(describe_table, self.configs),
                          f"device={self.device}, backend={self.backend_name}, "
                          f"feature_policy={self.feature_policy!r}, built={self.built}"])

    @property
    def tables(self) -> dict[str, DynamicTable]:
        """The tables by name. They are built (their memory allocated, their ddr files created
        or reopened) on first use, here or in ``forward``: a collection that is only sharded
        (``dynemb.distributed.shard``) never allocates its full-size tables."""
        if self._tables is None:
            self._tables = self._build()
        return self._tables

    @property
    def built(self) -> bool:
        """Whether the tables exist yet (see :attr:`tables`)."""
        return self._tables is not None

    def _build(self) -> dict[str, DynamicTable]:
        tables: dict[str, DynamicTable] = {}
        try:
            for c in self.configs:
                tables[c.name] = DynamicTable(c, device=self.device, backend=self.backend_name)
        except BaseException:
            for t in tables.values():  # release the stores of the ones already built
                t.close(delete_files=True)
            raise
        return tables

    def close(self, *, delete_files: bool = False) -> None:
        """Closes the tables built so far (``DynamicTable.close``: flushes and releases their
        ddr stores, marking them cleanly closed; nothing to do for tables without files)."""
        for t in (self._tables or {}).values():
            t.close(delete_files=delete_files)

    def _check_batch(self, batch: SparseBatch) -> SparseBatch:
        """The batch the tables read (a torchrec KeyedJaggedTensor converted; see
        ``feature_policy``), or InputError."""
        if is_kjt(batch):
            batch = SparseBatch.from_kjt(batch)
        if not isinstance(batch, SparseBatch):
            raise InputError(f"{type(self).__name__}: expected a SparseBatch, found {type(batch).__name__}.")
        return batch.require_features(self.feature_names, type(self).__name__,
                                      self.feature_policy)

    def stage_input(self, batch: SparseBatch) -> Staged:
        """Queues a batch a pipeline will pass to forward (checking it now)."""
        return self._stage(batch, self._check_batch)

    def stage_prefetch(self, staged: Staged) -> int:
        """Brings the rows of a staged batch that the ddr backing stores of CACHING tables hold
        into their caches; returns how many rows were fetched."""
        fetched = 0
        with self._timed("prefetch"):
            for table in self.tables.values():
                if table.cache is not None:
                    fetched += table.prefetch(self._table_ids(table, staged.state)[0])
        return fetched

    def _eager(self, batch: SparseBatch) -> Staged:
        """A batch looked up now (no pipeline attached)."""
        staged = Staged(batch=batch, training=self.training, grad=torch.is_grad_enabled(),
                        state=self._check_batch(batch))
        self.stage_lookup(staged)
        return staged

    def _lookup(self, table: DynamicTable, keys: torch.Tensor, staged: Staged) -> Lookup:
        """The table's lookup of a staged batch's keys; when a pipeline that pulls ahead drives
        the collection and the batch will update, its rows are held until its backward (or its
        release)."""
        if self._holds(staged):
            lk = table.lookup(keys, train=self.training, hold=True, checked=True)
            staged.holds.append((table, lk))
            return lk
        return table.lookup(keys, train=self.training, checked=True)

    def _table_ids(self, table: DynamicTable, batch: SparseBatch):
        """All ids of ``table``'s features, feature after feature: (keys (N,), lengths (F·B,)
        int64, weights (N,) or None), on the module's device, checked against each other (a
        batch whose tensors were changed after construction must not reach the kernels)."""
        parts = [batch.feature(f) for f in table.config.features]
        keys = torch.cat([p[0] for p in parts])
        lengths = torch.cat([p[1] for p in parts])
        if not table.backend.reads_wait:  # the triton kernels are safe with any lengths, and
            check_keys(keys, f"table {table.name!r}: lookup")  # a check waits for the GPU
            check_table_lengths(lengths, keys.numel(), table.name)
        keys = keys.to(self.device)
        lengths = lengths.to(self.device, torch.int64).contiguous()
        weights = None if batch.weights is None else torch.cat([p[2] for p in parts])
        return keys, lengths, weights


class EmbeddingBagCollection(_Collection):
    """Pooled lookups: for each feature, the SUM or MEAN (table ``pooling``) of its bag's rows,
    optionally weighted per id; MEAN divides the weighted sum by the bag length (an empty bag
    gives zeros). Returns :class:`KeyedEmbeddings` (B, Σdim).

    Args:
        tables: table configs (distinct names; each feature in one table).
        device: where tables live and outputs are made (default CPU). Tables are not
            ``nn.Parameter``s: ``Module.to()``, ``.cuda()``, ``.half()`` and the like raise
            (they would leave the tables behind); choose the device here. ``state_dict()``
            holds each table's state as tensors viewing its storage, and ``load_state_dict``
            restores it exactly into a collection of the same tables (``dynemb.checkpoint``
            also saves across world sizes and geometries).
        backend: kernel backend, "numba", "torch" or "triton" (default: numba on CPU, triton
            on CUDA).
        feature_policy: batch features no table reads are refused ("strict", the default) or
            skipped ("ignore", as torchrec's collections do).
    """

    _group: TableGroup | bool | None = None
    """The grouped tables (``dynemb.nn.grouped``), False when none is groupable; made on the
    first step that can run grouped."""

    @torch.compiler.disable  # a graph break: torch.compile never traces the tables
    def forward(self, batch: SparseBatch) -> KeyedEmbeddings:
        staged = self._take(batch) if self._stages is not None else self._eager(batch)
        pieces: dict[str, tuple[torch.Tensor, int, int]] = {}  # table -> (tensor, columns)
        for state, weights in staged.out:
            if isinstance(state, GroupStep):
                values = _GroupFn.apply(state, self._anchor)
                for t, (lo, hi) in zip(state.group.tables, state.group.cols):
                    pieces[t.name] = (values, lo, hi)
                continue
            values = state.values
            if staged.updates:
                values = _PooledFn.apply(state, self._anchor, weights)
            pieces[state.table.name] = (values, 0, values.shape[1])
        keys = [f for c in self.configs for f in c.features]
        dims = [c.dim for c in self.configs for _ in c.features]
        return KeyedEmbeddings(keys, dims, _columns([pieces[c.name] for c in self.configs]))

    def stage_lookup(self, staged: Staged) -> None:
        """Looks the batch up in every table and pools it (rows held until its backward when
        a pipeline drives the collection); a training step runs its groupable tables grouped
        (``dynemb.nn.grouped``)."""
        with self._timed("lookup"):
            out, grouped, group = [], set(), self._group_for(staged)
            if group is not None:
                step = group.lookup(staged.state, self._timed, hold=self._holds(staged))
                out.append((step, None))
                staged.holds += step.held
                grouped = set(group.tables)
            for table in self.tables.values():
                if table in grouped:
                    continue
                state, weights = self._pool_state(table, staged)
                state.values = state.pool(keep_entries=staged.updates and weights.requires_grad)
                state.timer = self._timed
                out.append((state, weights))
        staged.out = out

    def _group_for(self, staged: Staged) -> TableGroup | None:
        """The group a step runs its groupable tables in, or None (the per-table path): a step
        that updates rows, with at least one sample, whose per-id weights (if any) need no
        gradient."""
        batch = staged.state
        weights = batch.weights
        if (not staged.updates or batch.batch_size == 0
                or (weights is not None and weights.requires_grad)):
            return None
        if self._group is None:
            tables = [t for t in self.tables.values() if groupable(t)]
            self._group = TableGroup(tables, _fallback_state) if tables else False
        return self._group or None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_group", None)  # the addresses of these tables' arrays, not a copy's
        return state

    def _pool_state(self, table: DynamicTable, staged: Staged) -> tuple[_PoolState, torch.Tensor]:
        """The table's lookup over all its features, and the weights tensor autograd should see."""
        batch = staged.state
        keys, lengths, weights = self._table_ids(table, batch)
        if weights is None:
            weights = torch.empty(0, dtype=torch.float32, device=self.device)
        else:
            weights = weights.to(device=self.device, dtype=torch.float32)
        lk = self._lookup(table, keys, staged)
        state = _PoolState(table=table, lookup=lk, lengths=lengths,
                           weights=weights.detach().contiguous(), batch=batch.batch_size,
                           mean=table.config.pooling == PoolingMode.MEAN)
        return state, weights


def _fallback_state(table: DynamicTable, lk: Lookup, lengths: torch.Tensor,
                    weights: torch.Tensor, batch: int) -> _PoolState:
    """A grouped table's own pooled state (``TableGroup``'s ``make_state``)."""
    return _PoolState(table=table, lookup=lk, lengths=lengths, weights=weights, batch=batch,
                      mean=table.config.pooling == PoolingMode.MEAN)


def _columns(pieces: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
    """The column ranges ``(tensor, lo, hi)`` side by side; adjacent ranges of one tensor are
    taken as one slice (a whole tensor as it is)."""
    merged: list[list] = []
    for values, lo, hi in pieces:
        if merged and merged[-1][0] is values and merged[-1][2] == lo:
            merged[-1][2] = hi
        else:
            merged.append([values, lo, hi])
    cols = [v if (lo, hi) == (0, v.shape[1]) else v[:, lo:hi] for v, lo, hi in merged]
    return cols[0] if len(cols) == 1 else torch.cat(cols, dim=1)


class EmbeddingCollection(_Collection):
    """Unpooled lookups: one row per id. Returns ``{feature: JaggedEmbeddings}``. Per-id weights
    are not used here: a weighted batch is refused."""

    @torch.compiler.disable  # a graph break: torch.compile never traces the tables
    def forward(self, batch: SparseBatch) -> dict[str, JaggedEmbeddings]:
        staged = self._take(batch) if self._stages is not None else self._eager(batch)
        out: dict[str, JaggedEmbeddings] = {}
        for state in staged.out:
            table, lk = state.table, state.lookup
            rows = _RowsFn.apply(state, self._anchor) if staged.updates else state.rows
            bags = state.lengths.view(len(table.config.features), staged.state.batch_size)
            counts = bags.sum(dim=1).tolist()
            for name, inv, bag_lengths in zip(table.config.features, lk.inverse.split(counts), bags):
                out[name] = JaggedEmbeddings(values=F.embedding(inv, rows), lengths=bag_lengths)
        return out

    def _check_batch(self, batch: SparseBatch) -> SparseBatch:
        batch = super()._check_batch(batch)
        if batch.weights is not None:
            raise InputError("EmbeddingCollection: the batch has per-id weights, which an "
                             "unpooled lookup cannot apply; pass the batch without weights.")
        return batch

    def stage_lookup(self, staged: Staged) -> None:
        """Looks the batch up in every table and reads the rows (held until its backward when
        a pipeline drives the collection)."""
        with self._timed("lookup"):
            out = []
            for table in self.tables.values():
                keys, lengths, _ = self._table_ids(table, staged.state)
                lk = self._lookup(table, keys, staged)
                out.append(_LookupState(table, lk, table.embeddings(lk), lengths, self._timed))
        staged.out = out
