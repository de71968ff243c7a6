"""Sharded collections under misuse and failure: ranks at different steps or phases (a skipped
backward, an extra forward, routing_stats while another rank owes a backward) raise DynembError
on every rank naming the rank and the step; a rank that is killed, exits or hangs mid-run is
named on the surviving ranks within the collective timeout; a rank that cannot build its shards
fails every rank; collections built on a subgroup first do not keep the world from training
together; and ``dynemb train`` takes its collective timeout from ``TrainConfig.timeout_s``.

Every job is spawned (gloo on 127.0.0.1, one torch thread per rank) by ``_faults.spawn``.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest
import torch

from dynemb.errors import CapacityError, ConfigError
from dynemb.train import TrainConfig, from_dict, train

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _faults as F  # noqa: E402
import _harness as H  # noqa: E402

CLOSE = dict(atol=1e-6, rtol=1e-6)
LOSS_TIMEOUT_S = 20.0  # a vanished rank is reported long before this
_jobs: dict[int, dict[int, dict]] = {}


@pytest.fixture(scope="module")
def steps_job(tmp_path_factory):
    """``steps_job(W)``: every rank's results of the step-mismatch job (spawned once per W)."""

    def get(world_size: int) -> dict[int, dict]:
        if world_size not in _jobs:
            out = tmp_path_factory.mktemp(f"steps{world_size}")
            _jobs[world_size] = F.spawn("steps", world_size, out)
        ranks = _jobs[world_size]
        assert sorted(ranks) == list(range(world_size)), "a rank died (gloo aborted it?)"
        for r, res in ranks.items():
            assert "__error__" not in res, (r, res["__error__"])
        return ranks

    return get


def _all_raise(ranks: dict[int, dict], scenario: str, words: list[str]) -> None:
    for r, res in ranks.items():
        assert scenario in res, f"rank {r} never finished {scenario} (it hung or aborted)"
        kind, msg, _ = res[scenario]
        assert kind == "DynembError", (r, kind, msg)
        assert all(w in msg for w in words), (r, msg)
        assert f"(rank {r})" in msg


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_skipped_backward_raises_on_every_rank(steps_job, world_size):
    """The last rank leaves out the backward of step 3: it meets the others' backward header
    with its forward header of step 4, and every rank raises (before: gloo aborted a rank)."""
    last = world_size - 1
    others = "rank 0" if world_size == 2 else "ranks 0, 1"
    _all_raise(steps_job(world_size), "skip_backward", [
        f"{others} at backward of step 3", f"rank {last} at forward of step 4",
        f"rank {last} called forward again without the backward of step 3"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_extra_forward_raises_on_every_rank(steps_job, world_size):
    """The sequence collection: rank 0 calls forward twice at step 2 (before its backward)."""
    others = "rank 1" if world_size == 2 else "ranks 1, 2"
    _all_raise(steps_job(world_size), "extra_forward", [
        f"{others} at backward of step 2", "rank 0 at forward of step 3"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_collections_go_on_after_a_step_mismatch(steps_job, world_size):
    """The refused calls are not steps on any rank, so both collections train on together."""
    for r, res in steps_job(world_size).items():
        assert res["usable_after"][0] == "ok", (r, res["usable_after"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_grad_on_one_rank_raises_on_every_rank(steps_job, world_size):
    """Rank 0 calls forward under torch.no_grad(), the others with grad: every rank raises
    InputError naming the modes, and nothing is counted as a step (the next scenario, two
    calls per step, runs on)."""
    modes = str(["train+no_grad"] + ["train+grad"] * (world_size - 1))
    for r, res in steps_job(world_size).items():
        kind, msg, _ = res["grad_mismatch"]
        assert kind == "InputError" and modes in msg, (r, kind, msg)
        assert res["twice_per_step"][0] == "ok", (r, res["twice_per_step"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_routing_stats_while_a_rank_owes_a_backward_raises_on_every_rank(steps_job, world_size):
    """The last rank skips the last step's backward and calls routing_stats (before: the others
    waited in the backward header until the collective timeout, and the group was lost); the
    collection is usable afterwards."""
    last = world_size - 1
    others = "rank 0" if world_size == 2 else "ranks 0, 1"
    ranks = steps_job(world_size)
    _all_raise(ranks, "stats_after_skip", [
        f"{others} at backward of step 2", f"rank {last} at routing_stats after step 2"])
    for r, res in ranks.items():
        assert res["stats_again"][0] == "ok", (r, res["stats_again"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_cannot_build_its_shards_fails_every_rank(steps_job, world_size):
    """The last rank's allocation fails (a RuntimeError, not a DynembError): every rank raises
    ConfigError naming it (before: only that rank raised, the others waited for it)."""
    last = world_size - 1
    for r, res in steps_job(world_size).items():
        kind, msg, _ = res["build_fails"]
        assert kind == "ConfigError", (r, kind, msg)
        assert f"(rank {last}): could not build its shards: DefaultCPUAllocator" in msg, msg
        assert (r == last) or f"rank(s) [{last}] failed" in msg, msg


def test_a_collection_on_a_subgroup_first_does_not_break_the_world(steps_job):
    """Ranks 0 and 1 build and train a collection on their own group, ranks 1 and 2 on another
    (overlapping) one; then all 3 ranks build one on the world (before: its digest counted
    collections per process, so the ranks disagreed and every forward raised ConfigError). It
    trains exactly as one process would."""
    ranks = steps_job(3)
    for r, res in ranks.items():
        assert res["subgroup"][0] == "ok", (r, res["subgroup"])
    case = F.SUBGROUP_CASE
    recs = [ranks[r]["subgroup_rec"] for r in range(3)]
    ref = H.single_process(case, 3)
    for step in range(case.steps):
        torch.testing.assert_close(torch.cat([rec["out"][step] for rec in recs]),
                                   ref["out"][step], **CLOSE)
    for table in case.tables:
        parts = [rec["rows"][table.name] for rec in recs]
        keys = torch.cat([p["keys"] for p in parts])
        order = torch.argsort(keys)
        assert torch.equal(keys[order], ref["rows"][table.name]["keys"])
        for field in ("embeddings", "optimizer_state"):
            got = torch.cat([p[field] for p in parts])[order]
            torch.testing.assert_close(got, ref["rows"][table.name][field], **CLOSE)


@pytest.mark.parametrize("world_size,victim,when,how,where", [
    (2, 1, "forward", "kill", "forward of step 3 (header exchange)"),  # the survivor waits here
    (2, 1, "ids", "kill", "forward of step 3 (id all-to-all)"),  # in InputDist.wait()
    (3, 0, "backward", "kill", "backward of step 3 (header exchange)"),  # rank 0 held the store
    (2, 0, "backward", "exit", "backward of step 3 (header exchange)"),  # leaves without a word
    (2, 0, "optimizer", "kill", "backward of step 3 (optimizer all-reduce)"),  # clipping norms
    (2, 0, "build", "kill", "the shard-time check"),  # while the survivor builds the collection
])
def test_a_lost_peer_is_named_on_every_survivor(tmp_path, world_size, victim, when, how, where):
    ranks = F.spawn("victim", world_size, tmp_path, timeout_s=LOSS_TIMEOUT_S, victim=victim,
                    when=when, how=how)  # on a group with this timeout
    survivors = [r for r in range(world_size) if r != victim]
    assert sorted(ranks) == survivors
    for r in survivors:
        res = ranks[r]
        assert "__error__" not in res, res["__error__"]
        kind, msg, seconds = res["lost"]
        assert kind == "DynembError", (r, kind, msg)
        assert f"(rank {r}): lost rank {victim} during {where}:" in msg, msg
        assert "restart" in msg and "Transport error" in msg
        assert seconds < LOSS_TIMEOUT_S, seconds  # the victim died 1 s into the step
        if when == "build":
            continue
        kind, msg, seconds = res["again"]  # the collection refuses at once afterwards
        assert kind == "DynembError" and "an earlier collective" in msg and seconds < 1.0


def test_a_hung_peer_is_named_after_the_collective_timeout(tmp_path):
    """Rank 1 hangs before its forward of step 3; rank 0 waits the group's 2 s timeout, then
    says which rank never reached the header exchange."""
    ranks = F.spawn("victim", 2, tmp_path, timeout_s=2.0, victim=1, when="forward", how="hang")
    kind, msg, seconds = ranks[0]["lost"]
    assert kind == "DynembError", (kind, msg)
    assert "forward of step 3 (header exchange) timed out: rank 1 never reached it" in msg, msg
    assert "timeout_s" in msg
    assert 2.0 <= seconds < 10.0, seconds


@pytest.mark.parametrize("at,where", [("step", "the dense gradients' all-reduce"),
                                      ("end", "the barrier that ends the run")])
def test_dynemb_train_collectives_name_a_lost_rank(tmp_path, at, where):
    """The training loop's own collectives (the dense gradients' all-reduce; the barrier before
    a group made by ``environment`` is torn down) say which rank vanished too, instead of gloo's
    RuntimeError."""
    ranks = F.spawn("dense_victim", 2, tmp_path, victim=1, at=at, port=H.free_port())
    kind, msg, seconds = ranks[0]["lost"]
    assert kind == "DynembError", (kind, msg)
    assert f"dynemb train (rank 0): lost rank 1 during {where}" in msg, msg
    assert seconds < LOSS_TIMEOUT_S


# ---------------------------------------------------------------- the timeout as a config field


def test_timeout_s_is_a_validated_train_config_field():
    assert TrainConfig().timeout_s == 600.0
    assert TrainConfig(timeout_s=2.5).timeout_s == 2.5
    for bad in (0, -1.0, float("nan"), "60", True, 10**9):
        with pytest.raises(ConfigError, match=r"TrainConfig\.timeout_s"):
            TrainConfig(timeout_s=bad)
    cfg = from_dict(TrainConfig, {"timeout_s": 30})
    assert cfg.timeout_s == 30


def test_dynemb_train_makes_its_group_with_timeout_s(monkeypatch, tmp_path):
    """Under torchrun (WORLD_SIZE > 1) ``train`` initialises gloo with ``timeout_s``."""
    import dynemb.train.parallel as parallel

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise Stop

    monkeypatch.setattr(parallel.dist, "init_process_group", fake_init)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    threads = torch.get_num_threads()
    try:
        with pytest.raises(Stop):
            train(TrainConfig(out=str(tmp_path / "run"), timeout_s=7.5))
    finally:
        torch.set_num_threads(threads)
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(seconds=7.5)}


# ---------------------------------------------------------------- what counts as a lost peer


def test_only_transport_errors_are_reported_as_a_lost_peer():
    from dynemb.distributed import comm

    assert comm.is_transport_error(comm.TransportError("x"))
    assert comm.is_transport_error(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection "
                                                "closed by peer [127.0.0.1]:1234"))
    assert comm.is_transport_error(RuntimeError("Timed out waiting 2000ms for recv operation"))
    for other in (RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"),
                  CapacityError("table 'a' is full"), ValueError("gloo")):
        assert not comm.is_transport_error(other)
    # no process group here: nothing to probe, the message still says what happened
    msg = comm.peer_loss_message("X (rank 0)", "forward of step 2 (header exchange)",
                                 comm.TransportError("Timed out waiting 2000ms", absent=[2, 3]),
                                 None)
    assert msg.startswith("X (rank 0): forward of step 2 (header exchange) timed out: ranks 2, 3 "
                          "never reached it"), msg
    assert "timeout_s" in msg and "restart" in msg
