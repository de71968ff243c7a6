"""A world of one rank, in the test process: the sharded collections equal the plain ones, the
stage API (input_dist, then pooled/sequence) equals forward, errors without a process group; and,
on a machine with CUDA, the same with nccl on one GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dynemb
from dynemb.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

CLOSE = dict(atol=1e-6, rtol=1e-6)
CASES = {c.name: c for c in H.cases()}


def test_shard_needs_an_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    ebc = dynemb.EmbeddingBagCollection(CASES["hash_roundrobin-sgd"].tables)
    with pytest.raises(ConfigError, match="init_process_group"):
        dynemb.distributed.shard(ebc)



def _compare(case: H.Case, got: dict, want: dict) -> None:
    for step, (g, w) in enumerate(zip(got["out"], want["out"])):
        if case.kind == "ebc":
            torch.testing.assert_close(g, w, **CLOSE)
        else:
            for f in case.features:
                torch.testing.assert_close(g[f], w[f], **CLOSE)
        if want["wgrad"][step] is not None:
            torch.testing.assert_close(got["wgrad"][step], want["wgrad"][step], **CLOSE)
    for name, rows in want["rows"].items():
        for field, value in rows.items():
            torch.testing.assert_close(got["rows"][name][field], value, **CLOSE)


@pytest.mark.parametrize("name", ["roundrobin-adam", "continuous-adagrad", "eval-mode",
                                  "empty-feature-and-empty-batch", "ec-sequence"])
def test_world_of_one_equals_single_process(group_of_one, name):
    case = CASES[name]
    steps = [H.local_slices(case, s, 1) for s in range(case.steps + case.eval_steps)]
    sharded = dynemb.distributed.shard(H.collection(case))
    got = H.run_case(case, sharded, [b[0] for _, _, b in steps],
                     [(g, off[0]) for g, off, _ in steps])
    _compare(case, got, H.single_process(case, 1))
    stats = sharded.routing_stats()
    assert stats.steps == case.steps + case.eval_steps
    for t in stats.tables.values():
        assert t.ids_max_over_mean == t.rows_max_over_mean == 1.0
    assert stats.bytes_sent == (0,)  # nothing leaves a world of one


def test_stage_api_equals_forward(group_of_one):
    case = CASES["hash_roundrobin-adam"]
    a = dynemb.distributed.shard(H.collection(case))
    b = dynemb.distributed.shard(H.collection(case))
    for step in range(3):
        batch = H.rank_batch(case, step, 0, 1)
        inp = b.input_dist(batch)  # ids in flight; a pipeline overlaps dense work here
        out_b = b.pooled(inp.wait()).values()
        out_a = a(batch).values()
        torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
        (out_a.sum() + out_b.sum()).backward()
    for name in a.tables:
        ea, eb = H.export(a.tables[name]), H.export(b.tables[name])
        assert torch.equal(ea["embeddings"], eb["embeddings"])


def test_shard_keeps_mode_device_backend_and_capacity(group_of_one):
    case = CASES["torch-backend"]
    ebc = H.collection(case).eval()
    sharded = dynemb.distributed.shard(ebc)
    assert not sharded.training and sharded.world_size == 1 and sharded.rank == 0
    for cfg in case.tables:
        t = sharded.tables[cfg.name]
        assert t.backend.name == "torch" and t.capacity() >= cfg.capacity
    assert sharded.configs == tuple(case.tables)
    assert isinstance(sharded, dynemb.distributed.ShardedEmbeddingBagCollection)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nccl)")
def test_nccl_world_of_one_on_gpu(tmp_path):
    """nccl needs CUDA tensors: the shards live on the GPU and use the torch kernels."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        case = CASES["hash_roundrobin-adam"]
        sharded = dynemb.distributed.ShardedEmbeddingBagCollection(case.tables, device="cuda")
        ref = dynemb.EmbeddingBagCollection(case.tables)
        for step in range(3):
            batch = H.rank_batch(case, step, 0, 1)
            out = sharded(batch.to("cuda")).values()
            want = ref(batch).values()
            torch.testing.assert_close(out.cpu(), want, **CLOSE)
            out.sum().backward()
            want.sum().backward()
        for name in ref.tables:
            got, exp = H.export(sharded.tables[name]), H.export(ref.tables[name])
            torch.testing.assert_close(got["embeddings"].cpu(), exp["embeddings"], **CLOSE)
    finally:
        dist.destroy_process_group()


def test_load_is_logged_periodically_at_debug(group_of_one, caplog):
    case = CASES["hash_roundrobin-sgd"]
    sharded = dynemb.distributed.shard(H.collection(case), log_every=2)
    with caplog.at_level("DEBUG", logger="dynemb.distributed.base"):
        for step in range(4):
            sharded(H.rank_batch(case, step, 0, 1)).values().sum().backward()
    lines = [r.getMessage() for r in caplog.records if "unique keys received" in r.getMessage()]
    assert len(lines) == 2 * len(case.tables)  # after steps 2 and 4, one line per table
    assert lines[0].startswith("rank 0/1 table 'a' after 2 steps")
    sharded.reset_routing_stats()
    assert sharded.routing_stats().steps == 0


def test_max_over_mean():
    from dynemb.distributed import max_over_mean

    assert max_over_mean([2, 2]) == 1.0 and max_over_mean([3, 1]) == 1.5
    assert max_over_mean([0, 0]) == 1.0 and max_over_mean([]) == 1.0
    stats = dynemb.distributed.TableRoutingStats(ids_received=(4, 0), unique_keys_received=(1, 1),
                                                 rows_stored=(0, 0))
    assert stats.as_dict()["ids_max_over_mean"] == 2.0 and stats.rows_max_over_mean == 1.0


def test_weight_gradient_uses_the_rows_forward_saw(group_of_one):
    """Two forwards, then one backward: the second step's update must not leak into the first's
    weight gradient (as in the single-process collection)."""
    cfg = dynemb.TableConfig(name="t", dim=2, features=["f"], capacity=64,
                             optimizer=dynemb.SGD(lr=1.0))
    sharded = dynemb.distributed.ShardedEmbeddingBagCollection([cfg])
    sharded.tables["t"].insert_or_assign(torch.tensor([1]), torch.ones(1, 2))
    w1 = torch.ones(1, requires_grad=True)
    w2 = torch.ones(1, requires_grad=True)
    b1 = dynemb.SparseBatch(features=["f"], values=torch.tensor([1]), lengths=torch.tensor([1]),
                            weights=w1)
    b2 = dynemb.SparseBatch(features=["f"], values=torch.tensor([1]), lengths=torch.tensor([1]),
                            weights=w2)
    (sharded(b1).values().sum() + sharded(b2).values().sum()).backward()
    assert w1.grad.tolist() == [2.0] and w2.grad.tolist() == [2.0]
    assert sharded.tables["t"].find(torch.tensor([1])).values.tolist() == [[-1.0, -1.0]]


def test_a_batch_changed_after_construction_is_refused(group_of_one):
    from dynemb.errors import InputError

    sharded = dynemb.distributed.shard(H.collection(CASES["hash_roundrobin-sgd"]))
    batch = H.rank_batch(CASES["hash_roundrobin-sgd"], 0, 0, 1)
    batch.lengths[0] += 5
    with pytest.raises(InputError, match="changed after"):
        sharded(batch)
    batch = H.rank_batch(CASES["hash_roundrobin-sgd"], 0, 0, 1)
    batch.values = batch.values.int()  # as the single-process collection refuses it
    with pytest.raises(InputError, match="expected int64 ids"):
        sharded(batch)
    ok = H.rank_batch(CASES["hash_roundrobin-sgd"], 1, 0, 1)
    sharded(ok).values().sum().backward()  # the next step runs


@pytest.mark.parametrize("name", ["hash_roundrobin-sgd", "ec-sequence"])
def test_a_sharded_step_leaves_no_reference_cycle(group_of_one, name, cyclic_garbage):
    """As in one process (``nn/test_modules.py``): a step's outputs and autograd nodes are freed
    with the step's last reference, not left to the garbage collector."""
    case = CASES[name]
    sharded = dynemb.distributed.shard(H.collection(case))

    def step(s):
        out = sharded(H.rank_batch(case, s, 0, 1))
        parts = [out.values()] if case.kind == "ebc" else [j.values for j in out.values()]
        sum(p.sum() for p in parts).backward()

    step(0)
    assert cyclic_garbage(lambda: step(1)) == []
