"""`dynemb train` planning when something is wrong: a damaged plan.json on resume, budgets
nothing fits (naming where they came from), a bad calibration or LOCAL_WORLD_SIZE, a plan made
for another world size, and rank 0 failing to plan under 2 gloo ranks (both ranks stop with its
error, promptly)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import time
from collections import namedtuple

from dynemb.cli import main

SYN = ["--data", "synthetic", "--set", "data.synthetic.num_sparse=2",
       "--set", "data.synthetic.num_dense=3", "--set", "data.synthetic.vocab_sizes=2000",
       "--set", "data.synthetic.eval_samples=500", "--set", "data.train_eval_samples=0",
       "--set", "checkpoint_at_end=false", "--set", "eval_every=0", "--batch-size", "64"]
TINY_HBM = ["--set", "embeddings.hbm_bytes_per_rank=100000",
            "--set", "embeddings.hbm_reserve_fraction=0"]
"""Less hbm than one table's smallest option needs, so the plan needs ddr."""


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("dynemb train: error: "), err
    return err[-1]


def test_a_damaged_run_plan_on_resume_says_how_to_go_on(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SYN, "--steps", "2", "--out", str(out),
                 "--set", "checkpoint_at_end=true"]) == 0
    (out / "plan.json").write_text('{"version": 1, "tab')  # torn by hand: the run writes atomically
    capsys.readouterr()
    assert main(["train", *SYN, "--steps", "3", "--out", str(out), "--resume"]) == 2
    err = _error(capsys)
    assert f"the plan of the run in {out}" in err and "cannot read it as JSON" in err, err
    assert f"Delete {out / 'plan.json'} to plan the tables again" in err, err
    (out / "plan.json").unlink()  # the fix the message gives works
    assert main(["train", *SYN, "--steps", "3", "--out", str(out), "--resume"]) == 0
    assert json.loads((out / "metrics.json").read_text())["plan"]["origin"] == "planned"


def test_a_damaged_plan_file_says_to_make_it_again(tmp_path, capsys):
    (tmp_path / "p.json").write_text("[")
    assert main(["train", *SYN, "--steps", "1", "--out", str(tmp_path / "run"),
                 "--plan", str(tmp_path / "p.json")]) == 2
    err = _error(capsys)
    assert f"--plan {tmp_path / 'p.json'}" in err and "Make it again with dynemb plan" in err


def test_budgets_nothing_fits_name_where_they_came_from(tmp_path, capsys, monkeypatch):
    """On a CPU host with a ddr_path the ddr budget is the free disk there: a full disk must be
    named, not just 'the ddr budget is 0 bytes'."""
    import dynemb.planner.topology as topology

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(topology.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 0))
    ddr = tmp_path / "ddr"
    assert main(["train", *SYN, *TINY_HBM, "--steps", "1", "--out", str(tmp_path / "run"),
                 "--set", f"embeddings.ddr_path={ddr}"]) == 2
    err = _error(capsys)
    assert "the ddr budget is 0 bytes" in err, err
    assert f"ddr 0 B per host (the free disk under ddr_path {ddr})" in err, err
    assert "(embeddings.hbm_bytes_per_rank)" in err and "set embeddings.hbm_bytes_per_rank" in err
    assert main(["train", *SYN, *TINY_HBM, "--steps", "1", "--out", str(tmp_path / "run2"),
                 "--set", "embeddings.ddr_bytes_per_host=0"]) == 2
    assert "ddr 0 B per host (embeddings.ddr_bytes_per_host)" in _error(capsys)


def test_a_bad_calibration_names_the_setting(tmp_path, capsys):
    (tmp_path / "cal.json").write_text("{}")
    assert main(["train", *SYN, "--steps", "1", "--out", str(tmp_path / "run"),
                 "--set", f"embeddings.calibration={tmp_path / 'cal.json'}"]) == 2
    err = _error(capsys)
    assert err.startswith("dynemb train: error: embeddings.calibration: calibration "), err
    assert "run `dynemb calibrate --out` again" in err


def test_a_malformed_local_world_size_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    assert main(["train", *SYN, "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    assert "LOCAL_WORLD_SIZE: expected the ranks per host, an int >= 1" in _error(capsys)


def test_a_plan_for_another_world_size_is_a_warning(tmp_path, capsys, caplog):
    """A plan made for 4 ranks puts 4 times the rows it planned for on the one rank here: the
    run goes on (the plan is the user's), but says so at WARNING, with the fix."""
    tables = tmp_path / "tables.yaml"
    tables.write_text("- {name: c1, dim: 16, capacity: 2000}\n- {name: c2, dim: 16, "
                      "capacity: 2000}\n")
    topo = tmp_path / "topo.yaml"
    topo.write_text("world_size: 4\nranks_per_host: 4\nhbm_bytes_per_rank: 1GiB\n"
                    "ddr_bytes_per_host: 1GiB\n")
    plan = tmp_path / "plan.json"
    assert main(["plan", "--tables", str(tables), "--topology", str(topo),
                 "--out", str(plan)]) == 0
    with caplog.at_level(logging.INFO, logger="dynemb"):
        assert main(["train", *SYN, "--steps", "1", "--out", str(tmp_path / "run"),
                     "--plan", str(plan)]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and "was made for 4 rank(s), this run has 1" in r.getMessage()]
    assert warned and "4.00 times the rows" in warned[0], caplog.text
    assert "dynemb plan --world-size 1" in warned[0]


# ---------------------------------------------------------------- two gloo ranks

def _rank(rank: int, port: int, args: list[str], queue) -> None:
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    queue.put((rank, code, err.getvalue()))


def test_rank_0_failing_to_plan_stops_both_ranks_with_its_error(tmp_path):
    """Rank 0 plans alone; when nothing fits, rank 1 (waiting for the plan) must not hang nor
    go on alone: both exit 2 with rank 0's message."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["train", *SYN, "--steps", "2", "--out", str(tmp_path / "run"),
            "--set", "timeout_s=60", "--set", "embeddings.hbm_bytes_per_rank=1000",
            "--set", "embeddings.ddr_bytes_per_host=1000"]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    try:
        results = {}
        while len(results) < 2:
            rank, code, err = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            results[rank] = (code, err)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, (code, err) in results.items():
        assert code == 2, (rank, err)
        assert "alone does not fit" in err and "embeddings.hbm_bytes_per_rank" in err, (rank, err)
    assert not (tmp_path / "run" / "plan.json").exists()
