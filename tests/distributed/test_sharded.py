"""Sharded collections on 2 and 3 gloo ranks equal a single-process collection fed the
concatenation of the ranks' batches: outputs, weight gradients, and after 5 training steps every
row, optimizer state and score, to 1e-6; plus misuse errors raised on every rank.

One spawned job per world size runs every case (spawning costs seconds); each case is then
checked by its own test here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import dynemb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

pytestmark = pytest.mark.slow
CLOSE = dict(atol=1e-6, rtol=1e-6)
WORLD_SIZES = (2, 3)
CASES = {c.name: c for c in H.cases()}
_jobs: dict[int, list[dict]] = {}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """``job(W)``: every rank's results of the equivalence job on W ranks (spawned once)."""

    def get(world_size: int) -> list[dict]:
        if world_size not in _jobs:
            out = tmp_path_factory.mktemp(f"w{world_size}")
            _jobs[world_size] = H.spawn("equivalence", world_size, out)
        return _jobs[world_size]

    return get


def _wgrad_per_rank(case: H.Case, step: int, world_size: int, ref: torch.Tensor):
    """Splits the global batch's (N,) weight gradient into each rank's (N_r,), in its order."""
    batches = [H.rank_batch(case, step, r, world_size) for r in range(world_size)]
    pieces, lo = {}, 0
    for f in case.features:
        for r, b in enumerate(batches):
            n = b.feature(f)[0].numel()
            pieces[r, f] = ref[lo:lo + n]
            lo += n
    return [torch.cat([pieces[r, f] for f in case.features]) for r in range(world_size)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_equals_single_process(job, world_size, name):
    case = CASES[name]
    ranks = [r[name] for r in job(world_size)]
    ref = H.single_process(case, world_size)
    for step in range(case.steps + case.eval_steps):
        if case.kind == "ebc":
            got = torch.cat([r["out"][step] for r in ranks])
            torch.testing.assert_close(got, ref["out"][step], **CLOSE)
        else:
            for f in case.features:
                got = torch.cat([r["out"][step][f] for r in ranks])
                torch.testing.assert_close(got, ref["out"][step][f], **CLOSE)
        if ref["wgrad"][step] is not None:
            want = _wgrad_per_rank(case, step, world_size, ref["wgrad"][step])
            for r, res in enumerate(ranks):
                asked = r not in case.unweighted_ranks + case.no_wgrad_ranks
                assert (res["wgrad"][step] is not None) == asked, (r, step)
                if asked:
                    torch.testing.assert_close(res["wgrad"][step], want[r], **CLOSE)
    for table in case.tables:
        parts = [r["rows"][table.name] for r in ranks]
        for r, p in enumerate(parts):  # every row lives on its owner
            owner = dynemb.distributed.route_table(p["keys"], table, world_size)
            assert bool((owner == r).all()), (table.name, r)
        keys = torch.cat([p["keys"] for p in parts])
        order = torch.argsort(keys)
        want = ref["rows"][table.name]
        assert torch.equal(keys[order], want["keys"]), table.name
        assert want["keys"].numel() > 0
        for field in ("embeddings", "optimizer_state", "scores"):
            got = torch.cat([p[field] for p in parts])[order]
            torch.testing.assert_close(got, want[field], **CLOSE, msg=f"{table.name} {field}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_routing_stats_and_shard_capacity(job, world_size):
    ranks = job(world_size)
    case = CASES["hash_roundrobin-sgd"]
    stats = [r[case.name]["stats"] for r in ranks]
    assert all(s == stats[0] for s in stats)  # the same report on every rank
    for table in case.tables:
        t = stats[0]["tables"][table.name]
        total_ids = sum(
            H.rank_batch(case, step, r, world_size).feature(f)[0].numel()
            for step in range(case.steps) for r in range(world_size) for f in table.features)
        assert sum(t["ids_received"]) == total_ids
        assert 0 < sum(t["unique_keys_received"]) <= total_ids
        assert t["rows_stored"] == [r[case.name]["sizes"][table.name] for r in ranks]
        assert t["ids_max_over_mean"] == pytest.approx(
            max(t["ids_received"]) * world_size / total_ids)
        for r in ranks:  # each shard holds ceil(capacity / W) rows, rounded up to buckets
            cap = r[case.name]["capacity"][table.name]
            assert -(-table.capacity // world_size) <= cap < table.capacity
    assert stats[0]["steps"] == case.steps
    assert all(b > 0 for b in stats[0]["bytes_sent"])


MISUSE = {
    "different_tables": ("ConfigError", ["tables", "'b'", "'c'"]),
    "different_field": ("ConfigError", ["table 'b'", "dim"]),
    "filled_source": ("ConfigError", ["already hold rows", "'a'"]),
    "bad_batch": ("InputError", ["batch"]),
    "weighted_ec": ("InputError", ["weights"]),
    "mode_mismatch": ("InputError", ["train/eval"]),
    "order_mismatch": ("ConfigError", ["same order"]),
    "twin_order_mismatch": ("ConfigError", ["same order"]),
    "not_a_collection": ("ConfigError", ["EmbeddingBagCollection", "Linear"]),
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("scenario", sorted(MISUSE))
def test_misuse_raises_on_every_rank(job, world_size, scenario):
    kind, words = MISUSE[scenario]
    for r, res in enumerate(job(world_size)):
        got_kind, msg = res["misuse"][scenario]
        assert got_kind == kind, (r, got_kind, msg)
        assert all(w in msg for w in words) or r != 0 or scenario == "bad_batch", (r, msg)
    msg0 = job(world_size)[0]["misuse"]["bad_batch"][1]
    assert "unknown ['other']" in msg0  # the rank with the bad batch names the problem


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_group_usable_after_errors(job, world_size):
    assert all(r["misuse"]["recovered"] == ("ok", "") for r in job(world_size))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_an_owner_side_failure_raises_on_every_rank(job, world_size):
    """Only rank 1 owns the keys and its shard is full: rank 1 raises its CapacityError, every
    other rank a DynembError naming rank 1, and nobody hangs (the job finished)."""
    for r, res in enumerate(job(world_size)):
        kind, msg = res["misuse"]["owner_full"]
        if r == 1:
            assert kind == "CapacityError" and "'full'" in msg, msg
        else:
            assert kind == "DynembError" and "rank 1's owner lookup failed" in msg, msg


def test_world_size_change_is_refused(job):
    res = [r["misuse"]["world_size_changed"] for r in job(3)]
    for kind, msg in res[:2]:
        assert kind == "ConfigError" and "sharded over 3 ranks" in msg and "now has 2" in msg
    assert res[2][0] == "skipped"
