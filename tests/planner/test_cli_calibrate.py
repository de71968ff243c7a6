"""`dynemb calibrate`: runs the calibration with progress, prints the constants it writes (a file
`dynemb plan --calibration` reads); bad flags and unwritable paths fail before any measurement."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from dynemb import planner
from dynemb.cli import main
from dynemb.cli_plan import progress_reporter
from dynemb.planner.cost import EVENTS

FAKE = planner.CostModel(fixed_ns=tuple(float(i) for i in range(8)),
                         per_byte_ns=tuple(0.5 * i for i in range(8)), source="fake machine")


@pytest.fixture
def fake_calibrate(monkeypatch):
    """Replaces the measurement: records its arguments, reports 3 runs, returns FAKE."""
    calls = []

    def fake(**kw):
        calls.append(kw)
        for i in range(3):
            kw["progress"](i, 3, f"run {i}")
        return FAKE

    monkeypatch.setattr(planner, "calibrate", fake)
    return calls


def test_calibrate_prints_and_writes_the_constants(tmp_path, capsys, caplog, fake_calibrate):
    out = tmp_path / "cal.json"
    with caplog.at_level(logging.INFO, logger="dynemb"):
        assert main(["calibrate", "--device", "cpu", "--out", str(out), "--quick"]) == 0
    assert fake_calibrate[0]["device"] == "cpu" and fake_calibrate[0]["quick"] is True
    assert planner.CostModel.load(out) == FAKE
    printed = capsys.readouterr().out
    for event, fixed, per_byte in zip(EVENTS, FAKE.fixed_ns, FAKE.per_byte_ns):
        assert any(line.split() == [event, f"{fixed:.3f}", f"{per_byte:.4f}"]
                   for line in printed.splitlines()), event
    assert "fake machine" in printed and f"calibration written to {out}" in printed
    runs = [r.getMessage() for r in caplog.records if "calibration run" in r.getMessage()]
    assert runs == [f"calibration run {i + 1}/3: run {i}" for i in range(3)]


def test_the_calibration_is_what_plan_uses(tmp_path, capsys, fake_calibrate):
    cal, tables, plan = tmp_path / "cal.json", tmp_path / "t.yaml", tmp_path / "plan.json"
    assert main(["calibrate", "--out", str(cal)]) == 0
    tables.write_text("- {name: t, dim: 4, capacity: 1000}\n")
    topo = tmp_path / "topo.yaml"
    topo.write_text("{world_size: 1, ranks_per_host: 1, hbm_bytes_per_rank: 1GiB, "
                    "ddr_bytes_per_host: 1GiB}\n")
    assert main(["plan", "--tables", str(tables), "--topology", str(topo), "--calibration",
                 str(cal), "--out", str(plan)]) == 0
    assert "cost constants: fake machine" in capsys.readouterr().out
    assert planner.Plan.load(plan).cost_source == "fake machine"


def test_a_quick_calibration_runs_for_real(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    model = planner.CostModel.load(out)
    assert model.device == "cpu" and model.machine["torch_threads"] == 1
    assert "calibrated on" in model.source and model.source in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--out", "{tmp}/missing/cal.json"], "--out {tmp}/missing/cal.json: expected a file"),
    (["--out", "{tmp}"], "expected a file path, found a directory"),
    (["--threads", "0"], "--threads: expected an int >= 1"),
])
def test_bad_flags_fail_before_measuring(tmp_path, capsys, fake_calibrate, args, message):
    assert main(["calibrate", *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dynemb calibrate: error: ") and "\n" not in err
    assert message.format(tmp=tmp_path) in err
    assert fake_calibrate == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_without_a_gpu_is_refused(tmp_path, capsys, fake_calibrate):
    assert main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "c.json")]) == 2
    assert "--device cuda: expected a CUDA device, found none" in capsys.readouterr().err
    assert fake_calibrate == [] and not (tmp_path / "c.json").exists()


def test_the_progress_bar_counts_every_run_and_ends_full():
    """On a terminal the runs show as a tqdm bar, named, ending at n of n."""
    screen = io.StringIO()
    step, done = progress_reporter(True, file=screen)
    for i in range(4):
        step(i, 4, f"run {i}")
    assert "3/4" in screen.getvalue() and "run 3" in screen.getvalue()
    done()
    assert "4/4" in screen.getvalue()
    done()  # finishing twice is harmless
