"""Host synchronisations on the CUDA code path, counted on the CPU.

On a GPU every value read back to the host (``item``, ``int``/``bool``/``float`` of a tensor,
``tolist``, ``cpu``) and every op whose output size depends on the data (``nonzero``,
``unique``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``) waits for the
device to finish all queued work. The triton backend runs the CUDA code path, kernels in
Triton's interpreter here, so counting those calls made from dynemb's own code on the CPU
counts the waits a GPU would have. Targets (issue: the CUDA path): at most one per table per
training or eval forward (the number of entries, which sizes the rest), none in backward, none
to count statistics (``stats()`` reads them when asked).

Some work runs on the host on purpose: a CACHING table's backing store has its index in host
memory (numba kernels). Reads of host tensors never wait for a GPU, so the model marks them
(:class:`Host`): what a read brings back to the host (``triton_lookup.to_host``), the arrays of
a numba-backed index, what the numba backend returns, and whatever is computed from those, until
``.to(device)`` moves it to the device. Calls on marked tensors are not counted.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys

import pytest
import torch

import dynemb
from dynemb.kernels import triton_index, triton_lookup
from dynemb.kernels.backend import NumbaBackend
from dynemb.table.snapshot import INDEX_ARRAYS

pytestmark = pytest.mark.skipif(not triton_index.available(torch.device("cpu")),
                                reason="Triton's interpreter is off")
ROOT = os.path.dirname(dynemb.__file__)
# (not ``numpy``: of a CUDA tensor it raises; the numba backend, which calls it, only ever has
# host tensors)
READS = ("item", "tolist", "cpu", "nonzero", "unique", "unique_consecutive",
         "__bool__", "__int__", "__float__", "__index__", "masked_select", "argwhere")


class Syncs:
    """Calls that wait for the device, by name and by place in dynemb's code."""

    def __init__(self) -> None:
        self.at: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.at.values())

    def __repr__(self) -> str:
        return f"{self.total} host syncs: {dict(self.at)}"


_COUNTING: list[Syncs] = []  # the open count_syncs, if any


class Host(torch.Tensor):
    """A tensor in host memory on the CUDA path (see the module docstring); ``.to(device)``
    gives an unmarked tensor, one on the device. A copy to the device that is not
    ``non_blocking`` waits for the device first (torch synchronises the stream): counted."""

    def to(self, *args, **kwargs):
        out = super().to(*args, **kwargs)
        moved = "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)
        if not moved:
            return out
        frame = sys._getframe(1)
        if _COUNTING and frame.f_code.co_filename.startswith(ROOT) \
                and not kwargs.get("non_blocking"):
            where = os.path.relpath(frame.f_code.co_filename, ROOT)
            _COUNTING[-1].at[f"blocking copy to the device at {where}:{frame.f_lineno}"] += 1
        return out.as_subclass(torch.Tensor)


def _host(x):
    """``x`` (a tensor, or tensors in a tuple or list) marked as host memory."""
    if isinstance(x, torch.Tensor):
        return x.as_subclass(Host)
    if isinstance(x, (tuple, list)):
        return type(x)(_host(v) for v in x)
    return x


def _on_host(*args) -> bool:
    return any(isinstance(a, Host) or (isinstance(a, tuple) and _on_host(*a)) for a in args)


def _masks(idx) -> bool:
    parts = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)


@contextlib.contextmanager
def count_syncs():
    """Counts the sync-causing calls made directly from dynemb's code while it is open."""
    syncs, saved = Syncs(), []

    def patch(owner, name, when=None):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            frame = sys._getframe(1)
            mine = frame.f_code.co_filename.startswith(ROOT) and not _on_host(*args)
            if mine and (when is None or when(*args, **kwargs)):
                where = os.path.relpath(frame.f_code.co_filename, ROOT)
                syncs.at[f"{name} at {where}:{frame.f_lineno}"] += 1
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    for name in READS:
        patch(torch.Tensor, name)
    patch(torch.Tensor, "__getitem__", lambda self, idx: _masks(idx))
    patch(torch.Tensor, "__setitem__", lambda self, idx, value: _masks(idx))
    patch(torch.Tensor, "repeat_interleave", lambda *a, **k: "output_size" not in k)
    for name in ("nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"):
        patch(torch, name)
    patch(torch, "repeat_interleave", lambda *a, **k: "output_size" not in k)
    patch(torch, "where", lambda *a, **k: len(a) + len(k) == 1)
    marks = [(triton_lookup, "to_host")] + [(NumbaBackend, name) for name in (
        "find", "insert", "lookup", "finish", "unpin", "erase")]
    for owner, name in marks:  # what these return is in host memory
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, lambda *a, _f=original, **k: _host(_f(*a, **k)))
    _COUNTING.append(syncs)
    try:
        yield syncs
    finally:
        _COUNTING.pop()
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def test_the_harness_counts_what_waits():
    """A check that reads a flag back is counted; a torch op that does not read is not."""
    t = torch.ones(4)
    with count_syncs() as s:
        dynemb.batch.all_finite(t)
        dynemb.kernels.index_torch.put_where(torch.zeros(4, dtype=torch.int64),
                                             torch.tensor([1, -1]), 3)
    assert s.total == 1 and "__bool__" in repr(s)


def _collection(storage, optimizer=None, bucket=8, **kw):
    opt = optimizer or dynemb.Adam(lr=0.01)
    cfgs = [dynemb.TableConfig(name="t", dim=8, features=["a", "b"], capacity=64,
                               bucket_capacity=bucket, storage=storage, optimizer=opt, **kw),
            dynemb.TableConfig(name="u", dim=4, features=["c"], capacity=64,
                               bucket_capacity=bucket, storage=storage, optimizer=opt,
                               pooling=dynemb.PoolingMode.MEAN, **kw)]
    ebc = dynemb.EmbeddingBagCollection(cfgs, backend="triton")
    for t in ebc.tables.values():  # a backing store's index lives in host memory
        if t.cache is not None:
            for name in INDEX_ARRAYS:
                setattr(t.index, name, _host(getattr(t.index, name)))
    return ebc


def _batch(seed: int, weighted: bool = False) -> dynemb.SparseBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * 8,), generator=g)
    values = torch.randint(0, 500, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return dynemb.SparseBatch(features=["a", "b", "c"], values=values, lengths=lengths,
                              weights=weights)


def _step_syncs(ebc, batch):
    with count_syncs() as forward:
        out = ebc(batch).values()
    loss = out.sum()
    with count_syncs() as backward:
        loss.backward()
    return forward, backward


HYBRID = dynemb.Storage(mode=dynemb.StorageMode.HYBRID, cache_load_factor=0.5)


@pytest.mark.parametrize(("score", "on_full", "storage"), [
    (dynemb.ScorePolicy.LRU, dynemb.OnFull.COUNT, dynemb.Storage()),
    (dynemb.ScorePolicy.LFU, dynemb.OnFull.RAISE, dynemb.Storage()),
    (dynemb.ScorePolicy.STEP, dynemb.OnFull.COUNT, dynemb.Storage()),
    (dynemb.ScorePolicy.LRU, dynemb.OnFull.COUNT, HYBRID),
    (dynemb.ScorePolicy.LFU, dynemb.OnFull.RAISE, HYBRID)], ids=["lru", "lfu", "step",
                                                                   "hybrid-lru", "hybrid-lfu"])
def test_a_step_waits_once_per_table_in_forward_and_never_in_backward(score, on_full, storage):
    """HBM_ONLY, and HYBRID, whose kernels read and write ddr rows in place."""
    ebc = _collection(storage, score=score, on_full=on_full)
    for seed in range(3):  # tables fill up and evict
        ebc(_batch(seed)).values().sum().backward()
    forward, backward = _step_syncs(ebc, _batch(9, weighted=True))
    assert forward.total <= 2, forward  # two tables
    assert backward.total == 0, backward
    assert ebc.tables["t"].stats().evicted > 0
    ebc.eval()
    batch = _batch(10)  # (built and checked on the host)
    with count_syncs() as evaluation:
        ebc(batch)
    assert evaluation.total <= 2, evaluation


@pytest.mark.parametrize("storage", [dynemb.Storage(), HYBRID], ids=["hbm_only", "hybrid"])
def test_admission_is_judged_and_counted_without_a_read(storage):
    """Admission's counters live in an index on the device: the lookup judges the misses and
    counts the sightings there, so its one read stays the only one."""
    ebc = _collection(storage, bucket=32,
                      admission=dynemb.Admission(threshold=2, counter_capacity=64))
    for seed in range(3):
        ebc(_batch(seed)).values().sum().backward()
    before = ebc.tables["t"].stats()
    forward, backward = _step_syncs(ebc, _batch(9))
    assert forward.total <= 2 and backward.total == 0, (forward, backward)
    after = ebc.tables["t"].stats()
    assert after.admission_rejected > before.admission_rejected
    assert after.inserted > before.inserted and after.counter_evictions > 0


@pytest.mark.parametrize("storage", [dynemb.Storage(), dynemb.Storage(
    mode=dynemb.StorageMode.CACHING, cache_load_factor=0.5)], ids=["hbm_only", "caching"])
def test_a_held_lookup_waits_once_and_its_release_never(storage):
    """Pipelines hold a batch's rows from its lookup to its update (``lookup(hold=True)``); a
    CACHING lookup whose entries are all cached holds them in the cache, on the device."""
    t = _collection(storage, bucket=32).tables["t"]
    keys = torch.arange(24)
    with count_syncs() as lookup:
        lk = t.lookup(keys, train=True, hold=True, checked=True)
    assert lk.away == 0 and t.held_rows() == 24
    grads = torch.ones(lk.unique_keys.numel(), t.dim)
    with count_syncs() as update:
        t.apply_gradients(lk, grads)
    assert lookup.total == 1 and update.total == 0, (lookup, update)
    assert t.held_rows() == 0


def test_counts_kept_on_the_device_are_read_by_stats():
    """Non-finite gradient rows are found, skipped and counted on the device; ``stats()`` and a
    saved state read them."""
    ebc = _collection(dynemb.Storage())
    out = ebc(_batch(1)).values()
    grad = torch.zeros_like(out)
    grad[0, 0] = float("nan")
    with count_syncs() as backward:
        out.backward(grad)
    assert backward.total == 0, backward
    st = ebc.tables["t"].stats()
    assert st.nonfinite_grads == 1
    assert ebc.tables["t"].state.settled()["nonfinite_grads"] == 1  # read once, kept
    assert ebc.tables["t"].stats().nonfinite_grads == 1


CACHING = dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.5)


@pytest.mark.parametrize("score", [dynemb.ScorePolicy.LRU, dynemb.ScorePolicy.LFU])
def test_a_caching_step_waits_once_per_table_in_forward_and_never_in_backward(score):
    """The cache evicts (rows written back) and so does the backing store (the table is full),
    and every miss gets a cache row: the cache-first order (``table.cached_once``)."""
    ebc = _collection(CACHING, bucket=32, score=score)
    for seed in range(4):
        ebc(_batch(seed)).values().sum().backward()
    before = ebc.tables["t"].stats()
    forward, backward = _step_syncs(ebc, _batch(9))
    assert forward.total <= 2 and backward.total == 0, (forward, backward)
    after = ebc.tables["t"].stats()
    assert after.cache_evictions > before.cache_evictions and after.write_backs > 0
    assert after.backing_evictions > before.backing_evictions
    ebc.eval()
    batch = _batch(10)
    with count_syncs() as evaluation:
        ebc(batch)
    assert evaluation.total <= 2, evaluation


def test_caching_calls_on_rare_paths_read_a_bounded_number_of_times():
    """Small buckets: a batch's misses overflow a cache bucket (served from the backing store,
    marked written there on the host) or a backing bucket is full of cached rows (some leave
    the cache first): these paths read the device more. A bound that keeps them from growing."""
    ebc = _collection(CACHING)
    for seed in range(3):
        ebc(_batch(seed)).values().sum().backward()
    forward, backward = _step_syncs(ebc, _batch(9))
    assert forward.total <= 10, forward
    assert backward.total <= 3, backward
