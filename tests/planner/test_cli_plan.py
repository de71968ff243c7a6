"""`dynemb plan`: reads a tables file and a topology, prints the plan it writes (the same numbers),
the written plan loads back and is honoured by the tables built from it; data sources give the
profiles; every bad input is one line and exit status 2; --plot writes a PNG of the planner's own
predictions; importing dynemb never imports matplotlib."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dynemb
from dynemb import planner
from dynemb.cli import main
from dynemb.cli_plan import parse_bytes, read_tables, read_topology, x_grid
from dynemb.config import Storage, StorageMode
from dynemb.distributed import shard_config
from dynemb.planner.plot import hit_rate_curve
from dynemb.planner.report import human_bytes
from dynemb.planner.sources import profiles_from_batches
from dynemb.table.memory import working_set_bytes

COST = planner.CostModel(
    fixed_ns=(100.0, 50.0, 300.0, 20.0, 400.0, 800.0, 1000.0, 2000.0), per_byte_ns=(0.0,) * 8,
    source="test constants")
TABLES = """\
tables:
  - name: skewed
    dim: 16
    capacity: 20000
    optimizer: {name: adam, lr: 0.001}
    profile: {lookups_per_step: 4096, zipf_alpha: 1.2, num_ids: 18000}
  - name: uniform
    dim: 16
    capacity: 20000
    optimizer: rowwise_adagrad
    profile: {lookups_per_step: 4096, num_ids: 18000}
  - name: pinned
    features: [p1, p2]
    dim: 8
    capacity: 8000
    storage: {mode: hybrid, cache_load_factor: 0.5}
    profile: {lookups_per_step: 1024}
"""
TOPOLOGY = "world_size: 2\nranks_per_host: 2\nhbm_bytes_per_rank: 3MiB\nddr_bytes_per_host: 1GiB\n"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {"tables": tmp_path / "tables.yaml", "topology": tmp_path / "topo.yaml",
             "calibration": tmp_path / "cal.json", "out": tmp_path / "plan.json"}
    paths["tables"].write_text(TABLES)
    paths["topology"].write_text(TOPOLOGY)
    COST.save(paths["calibration"])
    return paths


def _args(files: dict[str, Path], *extra: str) -> list[str]:
    return ["plan", "--tables", str(files["tables"]), "--topology", str(files["topology"]),
            "--out", str(files["out"]), *extra]


def _rows(stdout: str) -> dict[str, list[str]]:
    """The printed table's rows by table name (cells split on runs of spaces)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("table "))
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("-"):
            break
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return rows


def test_plan_prints_what_it_writes_and_the_built_tables_honour_it(files, capsys):
    assert main(_args(files, "--calibration", str(files["calibration"]))) == 0
    out = capsys.readouterr().out
    plan = planner.Plan.load(files["out"])
    tables, profiles = read_tables(files["tables"])
    topo = read_topology(files["topology"])
    # the command plans exactly what the library plans with the same inputs
    direct = planner.plan(tables, topo, profiles=profiles, calibration=COST)
    assert plan.tables == direct.tables and plan.topology == topo
    assert plan.cost_source == "test constants" and "cost constants: test constants" in out
    assert f"cost constants read from {files['calibration']}" in out
    # every printed number is the plan's
    rows = _rows(out)
    assert list(rows) == ["skewed", "uniform", "pinned"]
    for name, c in plan.tables.items():
        mode, x, hit, hbm, hbm_unit, ddr, ddr_unit, ms, *_ = rows[name]
        assert (mode, float(x), float(hit)) == (c.mode.value, c.cache_load_factor,
                                                round(c.predicted_hit_rate, 3))
        assert f"{hbm} {hbm_unit}" == human_bytes(c.hbm_bytes)
        assert f"{ddr} {ddr_unit}" == human_bytes(2 * c.ddr_bytes)  # 2 ranks per host
        assert float(ms) == round(c.predicted_ms, 4)
    assert plan.tables["pinned"].pinned and "pinned" in " ".join(rows["pinned"])
    assert f"hbm per rank: {human_bytes(plan.hbm_bytes_per_rank)} of 3.00 MiB" in out
    assert f"ddr per host: {human_bytes(plan.ddr_bytes_per_host)} of 1.00 GiB" in out
    assert plan.hbm_bytes_per_rank <= topo.hbm_budget
    # the tight hbm budget forces a ddr tier on some table; the pinned one keeps its own
    assert any(c.mode != StorageMode.HBM_ONLY for n, c in plan.tables.items() if n != "pinned")
    configs = plan.apply(tables)
    assert configs[2].storage == Storage(mode=StorageMode.HYBRID, cache_load_factor=0.5)
    for config, name in zip(configs, plan.tables):
        c = plan.tables[name]
        built = dynemb.DynamicTable(shard_config(config, 2, rank=1))
        assert built.mode == c.mode
        work = working_set_bytes(config, math.ceil(profiles[name].lookups_per_step / 2), 2)
        mem = built.memory_usage()
        assert (mem.hbm_bytes + work, mem.ddr_bytes) == (c.hbm_bytes, c.ddr_bytes)


def test_without_a_calibration_the_device_defaults_are_used_and_named(files, capsys):
    files["tables"].write_text("- {name: t, dim: 4, capacity: 1000}\n")
    assert main(_args(files)) == 0
    out = capsys.readouterr().out
    source = planner.default_cost_model("cpu").source
    assert f"cost constants: {source}" in out
    assert planner.Plan.load(files["out"]).cost_source == source
    assert "default profile (uniform)" in out  # no profile: block, no --data


SYNTHETIC = """\
batch_size: 64
data:
  source: synthetic
  synthetic: {num_sparse: 2, num_dense: 1, vocab_sizes: 3000, alpha: 1.1, eval_samples: 10}
"""


def test_profiles_come_from_the_data_source(files, capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(SYNTHETIC)
    files["tables"].write_text("- {name: c1, dim: 8, capacity: 4000}\n"
                               "- {name: both, features: [c1, c2], dim: 8, capacity: 8000}\n"
                               "- {name: given, features: [nope], dim: 8, capacity: 100,\n"
                               "   profile: {lookups_per_step: 10}}\n")
    assert main(_args(files, "--config", str(config), "--profile-steps", "3")) == 0
    out = capsys.readouterr().out
    assert "profiles measured on 3 batches of 64 from synthetic" in out
    assert "profile from data" in " ".join(_rows(out)["both"])
    # the same profiles as measuring the source's first 3 batches of 64 directly
    from dynemb.train import TrainConfig, from_dict
    from dynemb.train.config_io import read_file
    from dynemb.train.setup import make_source

    tables, given = read_tables(files["tables"])
    source = make_source(from_dict(TrainConfig, read_file(config)).data)
    profiles = profiles_from_batches(source.train_batches(64), tables[:2], steps=3)
    assert profiles["both"].lookups_per_step == 2 * 64
    direct = planner.plan(tables, read_topology(files["topology"]),
                          profiles={**profiles, **given})
    assert planner.Plan.load(files["out"]).tables == direct.tables


def test_movielens_features_are_profiled(files, capsys):
    files["tables"].write_text("- {name: user, dim: 8, capacity: 2048}\n"
                               "- {name: side, features: [age, gender], dim: 4, capacity: 64}\n")
    assert main(_args(files, "--data", "movielens-100k", "--batch-size", "128",
                      "--profile-steps", "2")) == 0
    assert "profiles measured on 2 batches of 128 from movielens-100k" in capsys.readouterr().out
    assert set(planner.Plan.load(files["out"]).tables) == {"user", "side"}


BAD_TABLES = {
    "dim: 0": ("- {name: a, dim: 0, capacity: 10}", "tables[0] (a)", "dim: expected an int >= 1"),
    "enum": ("- {name: a, dim: 4, capacity: 10, score: lruu}", "tables[0] (a).score",
             "expected one of ['lru'"),
    "unknown key": ("- {name: a, dim: 4, capacity: 10, colour: red}", "tables[0] (a)",
                    "unknown key(s) ['colour']"),
    "storage mode": ("- {name: a, dim: 4, capacity: 10, storage: {mode: cachng}}",
                     "tables[0] (a).storage.mode", "found 'cachng'"),
    "storage x": ("- {name: a, dim: 4, capacity: 10, storage: {cache_load_factor: 0.05}}",
                  "tables[0] (a).storage", "cache_load_factor: expected a number in [0.1, 1.0]"),
    "optimizer": ("- {name: a, dim: 4, capacity: 10, optimizer: lamb}", "tables[0] (a).optimizer",
                  "found 'lamb'"),
    "optimizer field": ("- {name: a, dim: 4, capacity: 10, optimizer: {name: adam, betas: 3}}",
                        "tables[0] (a).optimizer", "Adam.betas"),
    "profile": ("- {name: a, dim: 4, capacity: 10, profile: {zipf_alpha: 1}}",
                "tables[0] (a).profile", "expected a mapping with lookups_per_step"),
    "profile alpha": ("- {name: a, dim: 4, capacity: 10, profile: {lookups_per_step: 1, "
                      "zipf_alpha: 9}}", "tables[0] (a).profile", "zipf_alpha"),
    "twice": ("- {name: a, dim: 4, capacity: 10}\n- {name: a, dim: 4, capacity: 10}",
              "tables[1] (a)", "used twice"),
    "not a list": ("name: a", "tables file", "expected a list of tables"),
    "yaml": ("- [1, 2", "tables file", "not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_a_bad_tables_file_is_one_line_naming_the_file_and_field(files, capsys, case):
    text, where, what = BAD_TABLES[case]
    files["tables"].write_text(text + "\n")
    assert main(_args(files)) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"dynemb plan: error: tables file {files['tables']}") and "\n" not in err
    assert where in err and what in err, err
    assert captured.out == "" and not files["out"].exists()


BAD_RUNS = {
    "missing tables": (["--tables", "{tmp}/none.yaml"], "cannot read it"),
    "topology field": (["--topology", "{tmp}/t.yaml"], "ranks_per_host: expected at most"),
    "topology bytes": (["--topology", "{tmp}/b.yaml"], "expected a byte count"),
    "calibration": (["--calibration", "{tmp}/t.yaml"], "calibration '{tmp}/t.yaml': cannot"),
    "infeasible": (["--tables", "{tmp}/big.yaml"], "alone does not fit"),
    "feature": (["--tables", "{tmp}/p.yaml", "--data", "synthetic"],
                "table 'p' reads feature(s) ['p1', 'p2'] that synthetic does not have"),
    "out": (["--out", "{tmp}/no/plan.json"], "--out {tmp}/no/plan.json: expected a file"),
    "plot": (["--plot", "{tmp}"], "--plot {tmp}: expected a file path, found a directory"),
    "x-step": (["--x-step", "0"], "--x-step: expected a number"),
    "overrides": (["--ranks-per-host", "3"], "ranks_per_host: expected at most world_size (2)"),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_bad_inputs_are_one_line_and_exit_2(files, capsys, tmp_path, case):
    (tmp_path / "t.yaml").write_text(TOPOLOGY.replace("ranks_per_host: 2", "ranks_per_host: 3"))
    (tmp_path / "b.yaml").write_text(TOPOLOGY.replace("3MiB", "3 megs"))
    (tmp_path / "big.yaml").write_text("- {name: big, dim: 64, capacity: 1000000}\n")
    (tmp_path / "p.yaml").write_text("- {name: c1, dim: 4, capacity: 100}\n"
                                     "- {name: p, features: [p1, p2], dim: 4, capacity: 100}\n")
    extra, message = BAD_RUNS[case]
    extra = [e.format(tmp=tmp_path) for e in extra]
    assert main(_args(files, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dynemb plan: error: ") and "\n" not in err, err
    assert message.format(tmp=tmp_path) in err, err
    assert not files["out"].exists()


def test_an_error_has_no_traceback_from_the_command_line(files):
    files["tables"].write_text("- {name: a, dim: 0, capacity: 10}\n")
    proc = subprocess.run([sys.executable, "-m", "dynemb", *_args(files)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("dynemb plan: error: tables file")
    assert "Traceback" not in proc.stderr


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_is_a_png(files, capsys, tmp_path):
    png = tmp_path / "plan.png"
    assert main(_args(files, "--plot", str(png))) == 0
    assert f"plot written to {png}" in capsys.readouterr().out
    width, height = _png_size(png)
    assert width >= 400 and height >= 300


def test_plotted_curves_are_the_planner_predictions(files):
    """The chosen point lies on its mode's curve: the plot draws the predictions planned with."""
    tables, profiles = read_tables(files["tables"])
    topo = read_topology(files["topology"])
    result = planner.plan(tables, topo, profiles=profiles, calibration=COST)
    for c in tables:
        choice = result.tables[c.name]
        curve = dict(hit_rate_curve(c, profiles[c.name], topo, choice.mode,
                                    xs=[choice.cache_load_factor]))
        assert curve[choice.cache_load_factor] == pytest.approx(choice.predicted_hit_rate,
                                                                abs=1e-12)
    caching = hit_rate_curve(tables[0], profiles["skewed"], topo, StorageMode.CACHING)
    hybrid = hit_rate_curve(tables[0], profiles["skewed"], topo, StorageMode.HYBRID)
    assert caching[-1][0] == hybrid[-1][0] == 1.0
    assert caching[0][1] > hybrid[0][1] + 0.3  # a skewed table: a small cache already hits


def test_importing_dynemb_does_not_import_matplotlib():
    code = ("import sys, dynemb, dynemb.cli, dynemb.cli_plan, dynemb.planner.plot; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_tables_file_forms_and_defaults(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("- name: a\n  dim: 4\n  capacity: 100\n"
                    "- name: b\n  dim: 4\n  capacity: 100\n  storage: caching\n"
                    "  optimizer: {name: adagrad, lr: 0.1, eps: 1.0e-6}\n  score: lfu\n"
                    "  admission: {threshold: 3}\n  initializer: {kind: uniform, low: -0.1}\n"
                    "- name: c\n  dim: 4\n  capacity: 100\n"
                    "  storage: {cache_load_factor: 0.3, ddr_path: /tmp/x}\n")
    tables, profiles = read_tables(path)
    a, b, c = tables
    assert profiles == {} and a.features == ("a",) and a.storage == Storage(mode=StorageMode.AUTO)
    assert b.storage == Storage(mode=StorageMode.CACHING)
    assert b.optimizer == dynemb.Adagrad(lr=0.1, eps=1e-6) and b.score == dynemb.ScorePolicy.LFU
    assert b.admission == dynemb.Admission(threshold=3)
    assert b.initializer.kind == dynemb.InitKind.UNIFORM
    assert c.storage == Storage(mode=StorageMode.AUTO, cache_load_factor=0.3, ddr_path="/tmp/x")
    path.write_text("tables:\n  - {name: a, dim: 4, capacity: 100}\n")
    assert read_tables(path)[0] == [a]


def test_byte_counts_and_the_x_grid():
    assert parse_bytes(5, "w") == 5
    assert parse_bytes("2MiB", "w") == 2 << 20 and parse_bytes("1.5 GB", "w") == 1_500_000_000
    assert parse_bytes("80GiB", "w") == 80 << 30 and parse_bytes("1tib", "w") == 1 << 40
    for bad in ("-1", "1 gigabyte", -3, True, 1.5):
        with pytest.raises(dynemb.errors.ConfigError, match="w: expected a byte count"):
            parse_bytes(bad, "w")
    assert x_grid(0.1) == planner.FACTORS
    assert x_grid(0.05) == tuple(round(0.1 + 0.05 * i, 2) for i in range(18))
    assert x_grid(0.5) == (0.1, 0.6)


def test_a_finer_grid_is_used(files, capsys):
    files["tables"].write_text("- {name: t, dim: 16, capacity: 20000, storage: hybrid,\n"
                               "   profile: {lookups_per_step: 4096}}\n")
    files["topology"].write_text(TOPOLOGY.replace("3MiB", "1400KiB"))
    for step, grid in (("0.1", planner.FACTORS), ("0.025", x_grid(0.025))):
        assert main(_args(files, "--x-step", step, "--calibration",
                          str(files["calibration"]))) == 0
        choice = planner.Plan.load(files["out"]).tables["t"]
        tables, profiles = read_tables(files["tables"])
        direct = planner.plan(tables, read_topology(files["topology"]), profiles=profiles,
                              calibration=COST, factors=grid)
        assert choice == direct.tables["t"] and choice.mode == StorageMode.HYBRID
    assert choice.cache_load_factor not in planner.FACTORS  # between the coarse grid's points
    capsys.readouterr()


def test_plan_json_is_versioned(files, capsys):
    assert main(_args(files)) == 0
    data = json.loads(files["out"].read_text())
    assert data["version"] == 1 and set(data["tables"]) == {"skewed", "uniform", "pinned"}
    data["version"] = 99
    files["out"].write_text(json.dumps(data))
    with pytest.raises(dynemb.errors.PlanningError, match="version"):
        planner.Plan.load(files["out"])
    capsys.readouterr()


REPO = Path(__file__).resolve().parents[2]


def test_the_documented_example_is_what_the_command_prints(tmp_path, capsys, monkeypatch):
    """docs/planner.md shows the command's output for docs/planner-example: it must stay true
    (after a change of the model, run the command shown there from the repository root and
    paste its output; the plot is written next to the files)."""
    doc = (REPO / "docs" / "planner.md").read_text()
    block = doc.split("<!-- example-output")[1].split("```text\n")[1].split("```")[0]
    command, *shown = block.strip().splitlines()
    assert command.startswith("$ dynemb plan ")
    args = command.split()[3:]
    example = REPO / "docs" / "planner-example"
    assert (example / "plan.png").is_file() and _png_size(example / "plan.png")[0] > 0
    monkeypatch.chdir(tmp_path)
    args = [str(REPO / a) if a.startswith("docs/") else a for a in args]
    plot = tmp_path / "plan.png"
    args[args.index("--plot") + 1] = str(plot)
    assert main(["plan", *args]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[:-2] == shown[:-2], "\n".join(printed)
    assert plot.is_file() and (tmp_path / "plan.json").is_file()


def test_from_machine_reads_this_machine_with_overrides(files, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = ["plan", "--tables", str(files["tables"]), "--from-machine", "--world-size", "4",
            "--ranks-per-host", "2", "--device", "cpu", "--out", str(files["out"])]
    assert main(args) == 0
    topo = planner.Plan.load(files["out"]).topology
    assert (topo.world_size, topo.ranks_per_host, topo.device) == (4, 2, "cpu")
    assert (topo.hbm_reserve_fraction, topo.ddr_reserve_fraction) == (0.15, 0.1)
    assert "topology: 4 rank(s), 2 per host (2 host(s)), device cpu" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_from_machine_with_cuda_on_a_cpu_host_is_one_line(files, capsys):
    assert main(["plan", "--tables", str(files["tables"]), "--device", "cuda", "--out",
                 str(files["out"])]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("dynemb plan: error: --device cuda: this machine has no CUDA device to read "
                   "the topology from; give --topology FILE, or use --device cpu.")
