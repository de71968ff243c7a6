"""The planner inside `dynemb train`: tables left to it (`embeddings.storage: auto`, the default)
are placed at start-up from the machine's topology and the first batches' ids, the plan is
printed, the built tables honour it, and metrics.json reports it next to what was measured; a
saved plan (`--plan`) and the plan of a resumed run are used as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynemb.cli import main
from dynemb.errors import ConfigError
from dynemb.train import EmbeddingConfig, TrainConfig, from_dict

SYN = ["--data", "synthetic", "--set", "data.synthetic.num_sparse=4",
       "--set", "data.synthetic.num_dense=3", "--set", "data.synthetic.vocab_sizes=5000",
       "--set", "data.synthetic.eval_samples=1000", "--set", "data.train_eval_samples=0",
       "--set", "checkpoint_at_end=false", "--set", "eval_every=0", "--batch-size", "128"]
"""4 tables of 10,112 rows (1.2 MiB each in hbm with Adam)."""
SMALL_HBM = ["--set", "embeddings.hbm_bytes_per_rank=2500000",
             "--set", "embeddings.hbm_reserve_fraction=0",
             "--set", "embeddings.ddr_bytes_per_host=100000000"]
"""Room in hbm for about two of the four tables whole: the others must go to HYBRID/CACHING."""
ML = ["--data", "movielens-100k", "--batch-size", "128", "--set", "data.train_eval_samples=0",
      "--set", "data.max_eval_samples=2000", "--set", "checkpoint_at_end=false",
      "--set", "eval_every=0"]


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def check_plan_report(metrics: dict, out: Path, *, world_size: int) -> dict:
    """The plan in metrics.json: honoured by the built tables (mode, x, and the bytes per tier
    of every rank's shard equal to the planned ones, less the working set estimate), within
    its budgets, stored as out/plan.json, and beside the measured figures."""
    plan = metrics["plan"]
    assert plan["origin"] == "planned" and plan["topology"]["world_size"] == world_size
    saved = json.loads((out / "plan.json").read_text())
    assert set(saved["tables"]) == set(plan["tables"]) == set(metrics["tables"])
    for name, t in plan["tables"].items():
        assert saved["tables"][name]["mode"] == t["mode"] == t["built_mode"], name
        assert (saved["tables"][name]["cache_load_factor"] == t["cache_load_factor"]
                == t["built_cache_load_factor"]), name
        assert t["measured_hbm_bytes"] == t["predicted_hbm_bytes"] - t["predicted_working_bytes"]
        assert t["predicted_working_bytes"] > 0
        assert t["measured_ddr_bytes"] == t["predicted_ddr_bytes"]
        assert t["measured_same_on_every_rank"], name
        assert 0 <= t["predicted_hbm_hit_rate"] <= 1 and 0 <= t["measured_hbm_hit_rate"] <= 1
        assert t["predicted_ms"] > 0
        assert (t["mode"] == "hbm_only") == (t["measured_ddr_bytes"] == 0)
    assert plan["predicted_hbm_bytes_per_rank"] <= plan["hbm_budget_per_rank"]
    assert plan["predicted_ddr_bytes_per_host"] <= plan["ddr_budget_per_host"]
    assert plan["predicted_ms_per_step"] > 0
    assert plan["measured_step_ms_median"] == metrics["throughput"]["step_ms_median"] > 0
    return plan


def test_movielens_auto_is_planned_printed_honoured_and_reported(tmp_path, capsys):
    out = tmp_path / "ml"
    assert main(["train", *ML, "--steps", "40", "--out", str(out)]) == 0
    m = _metrics(out)
    plan = check_plan_report(m, out, world_size=1)
    # RAM is ample: every lookup is predicted in hbm (a tiny table whose few keys all hash to
    # hbm may go HYBRID: the same predicted time with less hbm, which wins ties)
    for name, t in plan["tables"].items():
        assert t["predicted_hbm_hit_rate"] == 1.0, (name, t)
        assert t["mode"] == "hbm_only" or t["measured_hbm_hit_rate"] == pytest.approx(
            m["tables"][name]["hit_rate"]), (name, t)
    assert plan["tables"]["user"]["mode"] == plan["tables"]["item"]["mode"] == "hbm_only"
    assert plan["profile_steps"] == 32
    # planning (profiles, topology, solve) adds little: the profiled batches are trained on,
    # and numba's start-up is paid once either way
    assert plan["seconds"] < 2.0, plan["seconds"]
    for name, t in plan["tables"].items():  # every hit is an hbm hit
        assert t["measured_hbm_hit_rate"] == pytest.approx(m["tables"][name]["hit_rate"])
    text = capsys.readouterr().out
    assert "plan   planned at start-up" in text and "plan   user" in text
    assert "whole step" in text and "hbm hit rate" in text


def test_synthetic_small_hbm_budget_goes_to_hybrid_or_caching(tmp_path, capsys):
    out = tmp_path / "syn"
    assert main(["train", *SYN, *SMALL_HBM, "--steps", "60", "--out", str(out)]) == 0
    m = _metrics(out)
    plan = check_plan_report(m, out, world_size=1)
    modes = [t["mode"] for t in plan["tables"].values()]
    assert any(mode in ("hybrid", "caching") for mode in modes), modes
    assert plan["topology"]["hbm_bytes_per_rank"] == 2_500_000
    for name, t in plan["tables"].items():
        if t["mode"] != "hbm_only":
            assert t["measured_hbm_bytes"] < 1_000_000 and t["measured_ddr_bytes"] > 400_000
        # predicted: the steady state, once every table holds its 5,000 ids; 60 steps of 128
        # are still filling the tables (a hit is a key seen before), so they measure less
        hits = m["tables"][name]["hit_rate"]
        assert t["measured_hbm_hit_rate"] - 0.02 < t["predicted_hbm_hit_rate"], t
        if t["mode"] == "hybrid":  # ... but the share of the hits served by hbm is the split's
            assert abs(t["predicted_hbm_hit_rate"] - t["measured_hbm_hit_rate"] / hits) < 0.05, \
                (t, hits)
    text = capsys.readouterr().out
    assert any(f"plan   c{i}" in text and mode in text for i, mode in enumerate(modes, 1))


def test_a_budget_nothing_fits_exits_2_naming_the_tier(tmp_path, capsys):
    out = tmp_path / "tight"
    assert main(["train", *SYN, "--steps", "2", "--out", str(out),
                 "--set", "embeddings.hbm_bytes_per_rank=1000",
                 "--set", "embeddings.ddr_bytes_per_host=1000"]) == 2
    err = capsys.readouterr().err
    assert "dynemb train: error:" in err and ("hbm" in err or "ddr" in err), err
    assert not (out / "metrics.json").exists() and not (out / "plan.json").exists()


def test_resume_builds_the_tables_from_the_run_s_own_plan(tmp_path):
    """A resumed run must build its tables as the checkpoint's run did, whatever the budget
    says now: with an ample hbm budget a fresh plan would put every table in hbm."""
    out = tmp_path / "run"
    assert main(["train", *SYN, *SMALL_HBM, "--steps", "4", "--out", str(out),
                 "--set", "checkpoint_at_end=true"]) == 0
    first = _metrics(out)["plan"]["tables"]
    assert any(t["mode"] != "hbm_only" for t in first.values())
    stored = (out / "plan.json").read_text()
    assert main(["train", *SYN, "--steps", "6", "--out", str(out), "--resume"]) == 0
    m = _metrics(out)
    assert m["resumed_from"] == 4 and m["plan"]["origin"] == "resumed"
    for name, t in m["plan"]["tables"].items():
        assert (t["built_mode"], t["built_cache_load_factor"]) == (
            first[name]["mode"], first[name]["cache_load_factor"])
    assert (out / "plan.json").read_text() == stored
    # a fresh run with the ample budget would indeed have placed them otherwise
    assert main(["train", *SYN, "--steps", "2", "--out", str(out), "--overwrite"]) == 0
    assert {t["mode"] for t in _metrics(out)["plan"]["tables"].values()} == {"hbm_only"}


def test_resume_refuses_a_plan_that_disagrees_with_the_run_s(tmp_path, capsys):
    out, other = tmp_path / "run", tmp_path / "other"
    assert main(["train", *SYN, *SMALL_HBM, "--steps", "2", "--out", str(out),
                 "--set", "checkpoint_at_end=true"]) == 0
    assert main(["train", *SYN, "--steps", "1", "--out", str(other)]) == 0  # all in hbm
    capsys.readouterr()
    assert main(["train", *SYN, "--steps", "4", "--out", str(out), "--resume",
                 "--plan", str(other / "plan.json")]) == 2
    assert "places its tables otherwise" in capsys.readouterr().err


def test_a_saved_plan_is_used_as_it_is(tmp_path):
    planned, used = tmp_path / "planned", tmp_path / "used"
    assert main(["train", *SYN, *SMALL_HBM, "--steps", "2", "--out", str(planned)]) == 0
    saved = json.loads((planned / "plan.json").read_text())
    assert main(["train", *SYN, "--steps", "3", "--out", str(used),
                 "--plan", str(planned / "plan.json")]) == 0  # no budget: the plan decides
    plan = _metrics(used)["plan"]
    assert plan["origin"] == "file" and plan["file"] == str(planned / "plan.json")
    for name, t in plan["tables"].items():
        assert t["built_mode"] == saved["tables"][name]["mode"]
        assert t["built_cache_load_factor"] == saved["tables"][name]["cache_load_factor"]
        assert t["measured_ddr_bytes"] == saved["tables"][name]["ddr_bytes"]
    assert json.loads((used / "plan.json").read_text())["tables"] == saved["tables"]


def test_a_plan_of_other_tables_or_another_storage_is_refused(tmp_path, capsys):
    ml, syn = tmp_path / "ml", tmp_path / "syn"
    assert main(["train", *ML, "--steps", "1", "--out", str(ml)]) == 0
    assert main(["train", *SYN, *SMALL_HBM, "--steps", "1", "--out", str(syn)]) == 0
    capsys.readouterr()
    assert main(["train", *SYN, "--steps", "1", "--out", str(tmp_path / "a"),
                 "--plan", str(ml / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "expected a plan of this run's tables ['c1', 'c2', 'c3', 'c4']" in err, err
    assert main(["train", *SYN, "--steps", "1", "--out", str(tmp_path / "b"),
                 "--set", "embeddings.storage=hbm_only",
                 "--plan", str(syn / "plan.json")]) == 2  # the plan has CACHING/HYBRID tables
    assert "but this run configures it hbm_only" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("{\"version\": 99}")
    assert main(["train", *SYN, "--steps", "1", "--out", str(tmp_path / "c"),
                 "--plan", str(tmp_path / "junk.json")]) == 2
    assert "expected a dynemb plan of version" in capsys.readouterr().err


def test_pinned_storage_needs_no_plan_and_clears_a_stale_one(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *SYN, *SMALL_HBM, "--steps", "1", "--out", str(out)]) == 0
    assert (out / "plan.json").is_file()
    assert main(["train", *SYN, "--steps", "2", "--out", str(out), "--overwrite",
                 "--set", "embeddings.storage=caching",
                 "--set", "embeddings.cache_load_factor=0.5"]) == 0
    m = _metrics(out)
    assert m["plan"]["origin"] == "pinned" and "tables" not in m["plan"]
    assert not (out / "plan.json").exists()  # a later --resume must not build from it


def test_a_pinned_mode_gets_its_x_planned_and_ddr_files_go_away(tmp_path):
    """`storage: caching` with no cache_load_factor: the planner picks x; with a ddr_path the
    ddr rows are memory-mapped files there (its free disk is the ddr budget), removed when the
    run ends, so the same command runs again."""
    out, ddr = tmp_path / "run", tmp_path / "ddr"
    args = ["train", *SYN, "--steps", "5", "--out", str(out), "--overwrite",
            "--set", "embeddings.storage=caching", "--set", f"embeddings.ddr_path={ddr}",
            "--set", "embeddings.hbm_bytes_per_rank=1000000",
            "--set", "embeddings.hbm_reserve_fraction=0"]
    for _ in range(2):
        assert main(args) == 0
        plan = check_plan_report(_metrics(out), out, world_size=1)
        assert {t["mode"] for t in plan["tables"].values()} == {"caching"}
        assert plan["topology"]["ddr_bytes_per_host"] > 100 << 20  # the disk under tmp_path
        assert ddr.is_dir() and not list(ddr.glob("*.ddr.rows"))


@pytest.mark.parametrize("data,match", [
    ({"storage": "disk"}, r"EmbeddingConfig\.storage: expected one of \['hbm_only', 'hybrid', "
                          r"'caching', 'auto'\]"),
    ({"cache_load_factor": 0.05}, r"EmbeddingConfig\.cache_load_factor"),
    ({"storage": "hbm_only", "cache_load_factor": 0.5}, r"do not go together"),
    ({"storage": "hbm_only", "ddr_path": "/tmp/x"}, r"do not go together"),
    ({"hbm_bytes_per_rank": -1}, r"EmbeddingConfig\.hbm_bytes_per_rank"),
    ({"ddr_bytes_per_host": 1.5}, r"EmbeddingConfig\.ddr_bytes_per_host"),
    ({"hbm_reserve_fraction": 1}, r"EmbeddingConfig\.hbm_reserve_fraction"),
    ({"profile_steps": 0}, r"EmbeddingConfig\.profile_steps"),
    ({"plan": ""}, r"EmbeddingConfig\.plan"),
])
def test_bad_planning_settings_name_the_field(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(TrainConfig, {"embeddings": data})


def test_storage_defaults_to_auto_and_round_trips():
    emb = EmbeddingConfig()
    assert emb.storage.value == "auto" and emb.cache_load_factor is None
    assert not emb.table_storage().planned
    cfg = from_dict(TrainConfig, {"embeddings": {"storage": "hybrid", "cache_load_factor": 0.3,
                                                 "ddr_path": "d", "hbm_bytes_per_rank": 5}})
    assert cfg.embeddings.table_storage().planned and cfg.embeddings.hbm_bytes_per_rank == 5


def test_planning_trains_on_every_batch_once(tmp_path):
    """The batches the planner profiles are the run's first: a planned run (every table in
    hbm) trains exactly as a run whose tables are given hbm_only, which plans nothing; with a
    background prefetch thread too."""
    for prefetch in (0, 2):
        runs = {}
        for storage in ("auto", "hbm_only"):
            out = tmp_path / f"{storage}{prefetch}"
            assert main(["train", *SYN, "--steps", "40", "--out", str(out),
                         "--set", "log_every=5", "--set", f"data.prefetch={prefetch}",
                         "--set", "embeddings.profile_steps=16",
                         "--set", f"embeddings.storage={storage}"]) == 0
            runs[storage] = _metrics(out)
        auto, pinned = runs["auto"], runs["hbm_only"]
        assert auto["plan"]["profile_steps"] == 16 and pinned["plan"]["origin"] == "pinned"
        assert {t["mode"] for t in auto["plan"]["tables"].values()} == {"hbm_only"}
        assert auto["eval"] == pinned["eval"]
        assert auto["train"]["loss_last_window"] == pinned["train"]["loss_last_window"]
        assert auto["tables"] == pinned["tables"]


# ---------------------------------------------------------------- two gloo ranks

def _rank(rank: int, world_size: int, port: int, args: list[str]) -> None:
    import os  # noqa: PLC0415

    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if main(args) != 0:
        raise SystemExit(f"rank {rank} failed")


def _two_ranks(args: list[str]) -> None:
    """``dynemb train args`` on 2 spawned gloo ranks (as under torchrun), within 120 s."""
    import socket  # noqa: PLC0415
    import time  # noqa: PLC0415

    import torch.multiprocessing as mp  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_rank, args=(2, port, [*args, "--set", "timeout_s=60"]),
                             nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            raise AssertionError("the ranks did not finish in 120 s")


def test_two_gloo_ranks_movielens_plan_once_for_both(tmp_path):
    """The plan is made on rank 0 for 2 ranks (profiled on rank 0's first batches, scaled to
    the job) and every rank builds its shards from it."""
    out = tmp_path / "ml"
    _two_ranks(["train", *ML, "--steps", "12", "--out", str(out)])
    plan = check_plan_report(_metrics(out), out, world_size=2)
    assert {t["mode"] for t in plan["tables"].values()} == {"hbm_only"}
    assert plan["profile_steps"] == 12  # no more than the run trains on


def test_two_gloo_ranks_small_hbm_budget_shards_honour_the_plan(tmp_path):
    out = tmp_path / "syn"
    _two_ranks(["train", *SYN, *SMALL_HBM, "--steps", "40", "--out", str(out)])
    plan = check_plan_report(_metrics(out), out, world_size=2)
    assert plan["profile_steps"] == 32 and plan["topology"]["ranks_per_host"] == 2
    assert any(t["mode"] in ("hybrid", "caching") for t in plan["tables"].values()), plan
    for t in plan["tables"].values():  # a rank's shard: half the rows of the 1-rank table
        if t["mode"] == "hbm_only":
            assert 550_000 < t["measured_hbm_bytes"] < 700_000, t


def test_a_plan_file_with_bad_figures_is_refused_naming_them(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SYN, "--steps", "1", "--out", str(out)]) == 0
    data = json.loads((out / "plan.json").read_text())
    data["tables"]["c2"]["predicted_hit_rate"] = "high"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["train", *SYN, "--steps", "1", "--out", str(tmp_path / "b"),
                 "--plan", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "table 'c2': TableChoice.predicted_hit_rate: expected a number in [0.0, 1.0], found " \
        "'high'" in err
    assert "Traceback" not in err
