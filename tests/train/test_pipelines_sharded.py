"""Training pipelines over sharded collections, 2 gloo ranks (one torch thread each): exactly
the eager loop, semi_sync as its schedule, uneven iterators, drain + checkpoint + resume."""

from __future__ import annotations

import pytest
import torch

import _pipes as P

EXACT = ("base", "sparse_dist", "fused_sparse_dist", "prefetch")


def _equal(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_exact_pipelines_equal_the_eager_loop_on_two_ranks(tmp_path):
    """Every optimizer; SUM, MEAN and sequence tables; a full evicting table and a CACHING one
    at x = 0.1; batch i+1 reuses the keys batch i updated."""
    results = P.spawn(P.job_exact, 2, tmp_path, EXACT, list(P.OPTIMIZERS))
    for res in results:
        for opt in P.OPTIMIZERS:
            want = res["eager", opt]
            for kind in EXACT:
                got = res[kind, opt]
                _equal(got["losses"], want["losses"])
                P.assert_same(got["state"], want["state"])
                assert got["stale"] == 0 and got["held"] == 0, (kind, opt)


@pytest.mark.parametrize("start_batch,stash", [(0, True), (3, False)])
def test_semi_sync_on_two_ranks_follows_its_schedule(tmp_path, start_batch, stash):
    for res in P.spawn(P.job_semi_sync, 2, tmp_path, start_batch, stash):
        _equal(res["got"], res["want"])
        P.assert_same(res["state"], res["ref"])


def test_uneven_iterators_stop_every_rank_at_the_same_step(tmp_path):
    results = P.spawn(P.job_uneven, 2, tmp_path, P.PIPELINES)
    for kind in results[0]:
        assert [r[kind]["steps"] for r in results] == [5, 5], kind
        assert [r[kind]["dropped"] for r in results] == [1, 0], kind


def test_drain_save_and_resume_equals_the_uninterrupted_run(tmp_path):
    results = P.spawn(P.job_resume, 2, tmp_path, str(tmp_path / "ck"))
    for res in results:
        assert res["refused"] is not None and "drain()" in res["refused"]
        _equal(res["got"], res["want"])
        P.assert_same(res["state"], res["ref"])


def test_an_iterator_that_raises_on_one_rank_stops_every_rank(tmp_path):
    r0, r1 = P.spawn(P.job_iterator_raises, 2, tmp_path)
    assert r1["kind"] == "OSError" and "went away" in r1["msg"]
    assert r0["kind"] == "DynembError" and "iterator of rank 1 raised" in r0["msg"]
    assert r0["held"] == r1["held"] == 0


def test_the_dense_part_in_ddp_is_the_manual_gradient_sum_and_pipelines_keep_it(tmp_path):
    """Sharded collection on its own group, the MLP in DistributedDataParallel: a pipeline
    trains exactly as the eager loop of the same setup (sparse_dist) or as its schedule
    (semi_sync differs), and DDP's averaged gradients equal the manual sum of loss / W."""
    for res in P.spawn(P.job_ddp, 2, tmp_path):
        ref = res["ddp_eager"]
        got = res["ddp_sparse_dist"]
        _equal(got["losses"], ref["losses"])
        P.M.assert_same_tables(got["tables"], ref["tables"])
        for k, v in ref["dense"].items():
            assert torch.equal(got["dense"][k], v), k
        assert not all(torch.equal(a, b) for a, b in zip(res["ddp_semi_sync"]["losses"],
                                                          ref["losses"]))
        manual = res["manual"]
        for a, b in zip(manual["losses"], ref["losses"], strict=True):
            assert torch.allclose(a, b, atol=1e-6)
        for k, v in ref["dense"].items():
            assert torch.allclose(manual["dense"][k], v, atol=1e-6), k
