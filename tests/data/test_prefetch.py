"""The background prefetcher keeps order, re-raises the producer's errors and measures waits;
a worker process yields the source's own batches."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from dynemb.data import CriteoTSV, Prefetcher, SyntheticConfig, SyntheticData
from dynemb.data.prefetch import worker_batches
from dynemb.errors import InputError


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_order_and_end(depth):
    with Prefetcher(iter(range(10)), depth) as p:
        assert list(p) == list(range(10))
        assert p.items == 10
        with pytest.raises(StopIteration):
            next(p)


def test_producer_errors_reach_the_consumer():
    def source():
        yield 1
        raise ValueError("bad line 7")

    p = Prefetcher(source(), 2)
    assert next(p) == 1
    with pytest.raises(ValueError, match="bad line 7"):
        next(p)


def test_wait_is_measured_and_close_stops_the_thread():
    def slow():
        for i in itertools.count():
            time.sleep(0.02)
            yield i

    p = Prefetcher(slow(), 2)
    for _ in range(3):
        next(p)
    assert 0.03 < p.wait_s < 1.0
    p.close()
    assert not any(t.name == "dynemb-prefetch" and t.is_alive() for t in threading.enumerate()
                   if t is p._thread)


def test_a_worker_process_yields_the_same_batches_in_order():
    data = SyntheticData(SyntheticConfig(num_dense=2, num_sparse=3, vocab_sizes=100))
    got = [b for _, b in zip(range(3), worker_batches(data, 16, rank=1, world_size=2, start=4))]
    want = [b for _, b in zip(range(3), data.train_batches(16, rank=1, world_size=2, start=4))]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.sparse.values, b.sparse.values)
        assert torch.equal(a.sparse.lengths, b.sparse.lengths)
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)


def test_a_worker_process_raises_the_sources_error_with_its_own_message(tmp_path):
    """A malformed line parsed in the worker reaches the trainer as the same InputError and
    message (not wrapped with the worker's traceback)."""
    path = tmp_path / "bad.tsv"
    good = "\t".join(["1", *["3"] * 13, *["0a"] * 26]) + "\n"
    path.write_text(good + good.replace("\t3\t", "\t--5\t", 1) + good * 3)
    batches = worker_batches(CriteoTSV(path, eval_fraction=0.2), 1)
    assert next(batches).size == 1
    with pytest.raises(InputError) as info:
        next(batches)
    assert str(info.value).startswith(f"{path}:2, field 2 (i1): expected an integer")
    assert "Traceback" not in str(info.value)
