"""Thread counts (``TableConfig.threads``): a collection trained with 1, 2 or 3 threads per call
gives bit-identical pooled outputs, weight gradients, rows, optimizer state, scores, counters
and eviction records, on tables that fill up and evict (HBM_ONLY and HYBRID, every optimizer,
SUM and MEAN pooling, weighted ids).

Two ways: every call split however small (``MIN_PER_PART`` 1, so each kernel runs its parts at
once even on a few ids), and calls large enough that the library splits them itself.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import dynemb
from dynemb.config import Storage, StorageMode
from dynemb.errors import ConfigError
from dynemb.kernels import threads

OPTIMIZERS = {
    "sgd": dynemb.SGD(lr=0.1),
    "adagrad": dynemb.Adagrad(lr=0.1),
    "rowwise_adagrad": dynemb.RowWiseAdagrad(lr=0.1),
    "adam": dynemb.Adam(lr=0.01),
}
STEPS = 4


def _tables(optimizer, n_threads: int, capacity: int) -> list[dynemb.TableConfig]:
    hybrid = Storage(mode=StorageMode.HYBRID, cache_load_factor=0.5)
    width = 8 if capacity < 1024 else 128  # buckets enough for three parts
    return [
        dynemb.TableConfig(name="a", dim=8, features=("f0", "f1"), capacity=capacity,
                           optimizer=optimizer, bucket_capacity=width, threads=n_threads),
        dynemb.TableConfig(name="b", dim=5, features=("f2",), capacity=capacity,
                           optimizer=optimizer, pooling=dynemb.PoolingMode.MEAN,
                           bucket_capacity=width, storage=hybrid, threads=n_threads),
    ]


def _batches(batch: int, span: int) -> list[dynemb.SparseBatch]:
    """Zipf-like ids over ``span`` keys (more than the tables hold), 0-6 per bag, weighted."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 7, (3 * batch,), generator=g)
        n = int(lengths.sum())
        ids = (torch.rand(n, generator=g) ** 3 * span).long() * 7919 - span
        out.append(dynemb.SparseBatch(features=["f0", "f1", "f2"], values=ids, lengths=lengths,
                                      weights=torch.rand(n, generator=g) + 0.5))
    return out


def _train(optimizer, n_threads: int, batch: int, capacity: int, span: int) -> dict:
    torch.manual_seed(0)
    ebc = dynemb.EmbeddingBagCollection(_tables(optimizer, n_threads, capacity))
    proj = torch.randn(batch, 8 + 8 + 5, generator=torch.Generator().manual_seed(3))
    seen: dict[str, list] = {"out": [], "wgrad": []}
    for b in _batches(batch, span):
        w = b.weights.clone().requires_grad_(True)
        b = dynemb.SparseBatch(features=b.features, values=b.values, lengths=b.lengths,
                               weights=w)
        out = ebc(b).values()
        (out * proj).sum().backward()
        seen["out"].append(out.detach())
        seen["wgrad"].append(w.grad)
    for name, t in ebc.tables.items():
        e = t.export_batch(0, t.capacity())
        seen[name] = (e.keys, e.embeddings, e.optimizer_state, e.scores)
        seen[name + " stats"] = t.stats()
    return seen


def _same(a: dict, b: dict) -> None:
    for name in a:
        if name.endswith("stats"):
            assert a[name] == b[name], name
            continue
        for x, y in zip(a[name], b[name], strict=True):
            assert torch.equal(x, y), name


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_thread_counts_agree_bit_for_bit_on_calls_split_however_small(name):
    with mock.patch.object(threads, "MIN_PER_PART", 1):
        runs = [_train(OPTIMIZERS[name], n, batch=6, capacity=64, span=200) for n in (1, 2, 3)]
    assert runs[0]["a stats"].evicted > 0
    _same(runs[0], runs[1])
    _same(runs[0], runs[2])


def test_thread_counts_agree_bit_for_bit_at_the_sizes_the_library_splits():
    assert threads.parts_for(3, 3 * 700 * 3) == 3  # these calls are split
    runs = [_train(OPTIMIZERS["adam"], n, batch=700, capacity=4096, span=20000)
            for n in (1, 2, 3)]
    assert runs[0]["a stats"].evicted > 0
    _same(runs[0], runs[1])
    _same(runs[0], runs[2])


def test_threads_must_be_a_positive_count():
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ConfigError, match="threads"):
            dynemb.TableConfig(name="t", dim=4, features=("f",), capacity=8, threads=bad)
    assert dynemb.TableConfig(name="t", dim=4, features=("f",), capacity=8).threads is None


@pytest.fixture(params=["openmp", "pool"])
def dispatch(request, monkeypatch):
    """run_parts on torch's OpenMP threads (where this torch has them) and on the pool."""
    if request.param == "pool":
        monkeypatch.setattr(threads, "_openmp", lambda: None)
    elif threads._openmp() is None:
        pytest.skip("this torch does not run its ops on GNU OpenMP")
    return request.param


def test_run_parts_waits_for_every_part_and_raises_a_parts_error(dispatch):
    ended = []

    def part(p):
        if p == 1:
            raise ValueError("part 1 failed")
        ended.append(p)
        return p

    with pytest.raises(ValueError, match="part 1 failed"):
        threads.run_parts(part, 3)
    assert sorted(ended) == [0, 2]
    assert threads.run_parts(lambda p: p * 10, 3) == [0, 10, 20]
    assert threads.ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]

    def fails_after_0(p):
        if p:
            raise ValueError(f"part {p}")

    with pytest.raises(ValueError, match="part 1"):  # the first part's error, in part order
        threads.run_parts(fails_after_0, 4)

    def interrupted(p):
        if p == 2:
            raise KeyboardInterrupt
        return p

    with pytest.raises(KeyboardInterrupt):  # an interrupt in a part is raised, not swallowed
        threads.run_parts(interrupted, 3)


def test_run_parts_runs_its_parts_at_once_on_other_threads(dispatch):
    """Each part waits for the others at a barrier: the call only returns if all of them ran
    at the same time. On torch's OpenMP threads none of them is a thread of the pool."""
    import threading
    barrier = threading.Barrier(3, timeout=30)

    def part(p):
        barrier.wait()
        return threading.current_thread().name

    names = threads.run_parts(part, 3)
    assert threading.current_thread().name in names and len(set(names)) == 3
    on_pool = [n for n in names if n.startswith("dynemb-kernel")]
    assert len(on_pool) == (2 if dispatch == "pool" else 0)


def test_run_parts_inside_a_part_and_from_several_threads_at_once(dispatch):
    from concurrent.futures import ThreadPoolExecutor

    def nested(p):
        return threads.run_parts(lambda q: (p, q), 3)

    assert threads.run_parts(nested, 2) == [[(p, q) for q in range(3)] for p in range(2)]

    def calls(c):
        return [threads.run_parts(lambda p: (c, k, p), 3) for k in range(30)]

    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(calls, range(4)))
    assert got == [[[(c, k, p) for p in range(3)] for k in range(30)] for c in range(4)]


def _in_child(conn) -> None:
    import threading
    barrier = threading.Barrier(2, timeout=30)
    try:
        conn.send(threads.run_parts(lambda p: (barrier.wait(), p)[1], 2))
    except BaseException as e:  # noqa: BLE001
        conn.send(repr(e))


@pytest.mark.parametrize("parent", ["split a call", "ran a torch op only"])
def test_a_forked_child_runs_its_parts_on_a_pool_of_its_own(parent, monkeypatch):
    """GNU OpenMP's threads do not survive a fork: a child (a data-loader worker) of a process
    that ran OpenMP, through a split call or a parallel op of torch's, runs its parts on the
    pool."""
    import multiprocessing as mp
    if parent == "split a call":
        assert threads.run_parts(lambda p: p, 2) == [0, 1]
    else:
        monkeypatch.setattr(threads, "_omp", [])  # not looked up yet
        with torch.inference_mode():
            before = torch.get_num_threads()
            torch.set_num_threads(2)
            try:
                torch.ones(1 << 20).sum()  # torch's own OpenMP threads start
            finally:
                torch.set_num_threads(before)
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_in_child, args=(there,))
    child.start()
    try:
        assert here.poll(60), "the child's call did not return"
        assert here.recv() == [0, 1]
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_run_parts_runs_the_parts_itself_once_the_pool_takes_no_work(monkeypatch):
    """At interpreter exit Python stops thread pools before exit hooks (a ddr store's flush)
    run their kernels: the parts then run on the calling thread, in order."""
    from concurrent.futures import ThreadPoolExecutor
    monkeypatch.setattr(threads, "_openmp", lambda: None)
    stopped = ThreadPoolExecutor(2)
    stopped.shutdown()
    monkeypatch.setattr(threads, "_executor", lambda: stopped)
    assert threads.run_parts(lambda p: p * 10, 4) == [0, 10, 20, 30]

    class TakesOne:  # a pool that takes one part, then refuses
        def __init__(self) -> None:
            self.pool, self.taken = ThreadPoolExecutor(1), 0

        def submit(self, fn, *args):
            if self.taken:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self.taken += 1
            return self.pool.submit(fn, *args)

    def part(p):
        if p in (1, 3):
            raise ValueError(f"part {p} failed")
        return p

    pool = TakesOne()
    monkeypatch.setattr(threads, "_executor", lambda: pool)
    with pytest.raises(ValueError, match="part 1 failed"):  # the first part's error
        threads.run_parts(part, 4)
    assert threads.run_parts(lambda p: p, 4) == [0, 1, 2, 3] and pool.taken == 1
    pool.pool.shutdown()
