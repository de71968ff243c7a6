"""Adversarial review of the training pipelines on 3 gloo ranks (one spawned job): a model with
a sharded and an unsharded collection in hard cases against the eager loop, uneven iterators,
and a batch rejected on one rank only."""

from __future__ import annotations

import torch

import _pipes as P
import _review_jobs as R
from dynemb.train.pipelines import LEAD


def test_pipelines_on_three_ranks(tmp_path):
    results = P.spawn(R.job_ranks, 3, tmp_path)
    for rank, res in enumerate(results):
        want = res["want"]
        for kind in R.EXACT:
            got = res[kind]
            assert len(got["losses"]) == len(want["losses"]) == 8, kind
            for g, w in zip(got["losses"], want["losses"]):
                assert torch.equal(g, w), (kind, rank)
            P.M.assert_same_tables(got["state"]["tables"], want["state"]["tables"])
            for p, q in zip(got["state"]["dense"], want["state"]["dense"]):
                assert torch.equal(p, q), (kind, rank)
            for g, w in zip(got["wgrads"], want["wgrads"]):
                assert torch.equal(g, w), (kind, rank)
            assert got["held"] == 0, (kind, rank)
        assert all(n > 0 for n in want["evicted"]), (rank, want["evicted"])  # (the shards really were full)
        for kind, u in res["uneven"].items():
            assert (u["steps"], u["dropped"], u["more"], u["held"]) == \
                (4, int(rank < 2), 2, 0), (kind, rank, u)
        for kind, r in res["rejected"].items():
            # batch 3 is staged `lead` batches early: every rank raises in that same call
            assert r["steps"] == 3 - LEAD[kind], (kind, rank, r)
            assert r["error"] is not None and r["error"][0] == "InputError", (kind, rank, r)
            assert ("zz" in r["error"][1]) if rank == 1 else \
                ("rank(s) [1] rejected" in r["error"][1]), (kind, rank, r)
            assert r["held"] == 0 and r["after"] == 0, (kind, rank)
        for kind, c in res["closed_early"].items():  # then eager and a new pipeline go on
            assert (c["held"], c["more"], c["after"]) == (0, 3, 0), (kind, rank, c)
