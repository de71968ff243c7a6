"""`dynemb train` end to end through the CLI API: a tiny synthetic run (metrics.json,
config.yaml, the summary), learning to near the best achievable AUC, checkpoints, and a 2-rank
gloo run that matches one process fed the same global batches."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
import yaml

from dynemb.cli import main
from dynemb.train import TrainConfig, from_dict

TINY = ["--data", "synthetic", "--set", "data.synthetic.num_sparse=4",
        "--set", "data.synthetic.num_dense=3", "--set", "data.synthetic.vocab_sizes=200",
        "--set", "data.synthetic.eval_samples=2000", "--set", "data.train_eval_samples=1000",
        "--set", "checkpoint_at_end=false"]


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def test_tiny_synthetic_run_writes_metrics_config_and_summary(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["train", *TINY, "--steps", "30", "--batch-size", "64", "--out", str(out),
                 "--set", "eval_every=10", "--set", "log_every=10"]) == 0
    m = _metrics(out)
    assert (m["steps"], m["batch_size"], m["world_size"], m["resumed_from"]) == (30, 64, 1, None)
    assert 0 < m["eval"]["auc"] < 1 and 0 < m["eval"]["log_loss"] < 1
    assert m["eval"]["samples"] == 2000 and 0.5 < m["eval"]["best_auc"] < 1
    assert m["train"]["samples"] == 1000 and 0 < m["train"]["auc"] < 1
    assert [h["step"] for h in m["history"]] == [10, 20, 30]
    assert m["history"][-1]["eval_auc"] == m["eval"]["auc"]
    assert set(m["tables"]) == {"c1", "c2", "c3", "c4"}
    for t in m["tables"].values():
        assert 0 < t["rows"] <= 200 and t["lookups"] == 30 * 64 and 0 < t["hit_rate"] <= 1
        assert t["evicted"] == 0 and t["failed_inserts"] == 0
    thr = m["throughput"]
    assert thr["samples_per_s"] > 0 and 0 <= thr["data_wait_share"] < 1
    assert thr["wall_s"] >= thr["train_s"] > 0 and m["memory"]["peak_rss_mib"] > 0
    saved = from_dict(TrainConfig, yaml.safe_load((out / "config.yaml").read_text()))
    assert saved.out == str(out) and saved.steps == 30 and saved.data.synthetic.num_sparse == 4
    summary = capsys.readouterr().out
    assert "eval   AUC" in summary and "best achievable" in summary and "table c1" in summary


def test_synthetic_training_gets_within_0_02_of_the_best_auc(tmp_path):
    out = tmp_path / "learn"
    assert main(["train", "--data", "synthetic", "--steps", "800", "--batch-size", "256",
                 "--out", str(out), "--set", "data.synthetic.num_sparse=6",
                 "--set", "data.synthetic.num_dense=4", "--set", "data.synthetic.vocab_sizes=50",
                 "--set", "data.synthetic.num_interactions=2",
                 "--set", "data.synthetic.eval_samples=5000", "--set", "embeddings.lr=0.01",
                 "--set", "dense_optimizer.lr=0.003", "--set", "data.train_eval_samples=0",
                 "--set", "checkpoint_at_end=false"]) == 0
    ev = _metrics(out)["eval"]
    assert ev["best_auc"] - 0.02 < ev["auc"] <= ev["best_auc"] + 0.005, ev


def test_checkpoints_are_saved_and_pruned(tmp_path):
    out = tmp_path / "ckpt"
    args = ["train", *TINY[:-2], "--steps", "6", "--batch-size", "32", "--out", str(out),
            "--set", "checkpoint_every=2", "--set", "keep_checkpoints=2"]
    assert main(args) == 0
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000006"]
    assert (out / "checkpoints" / "step-00000006" / "manifest.json").is_file()
    assert main([*args, "--steps", "2", "--overwrite"]) == 0  # a fresh run replaces them
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]


def test_errors_exit_2_with_the_message(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "2", "--out", str(tmp_path / "r"), "--resume"]) == 2
    assert "--resume: expected a checkpoint" in capsys.readouterr().err
    assert main(["train", "--set", "model.top_mlp=[0]"]) == 2
    assert "ModelConfig.top_mlp" in capsys.readouterr().err


def test_python_m_dynemb():
    done = subprocess.run([sys.executable, "-m", "dynemb", "train", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--batch-size" in done.stdout and "--resume" in done.stdout


# ---------------------------------------------------------------- two gloo ranks

ML = ["train", "--data", "movielens-100k", "--steps", "30", "--batch-size", "128",
      "--set", "data.train_eval_samples=2001", "--set", "data.eval_batch_size=2000",
      "--set", "checkpoint_at_end=false",
      "--set", "eval_every=15", "--set", "log_every=5"]


def _rank(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if main([*ML, "--out", out]) != 0:
        raise SystemExit(f"rank {rank} failed")


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_match_one_process(tmp_path):
    """MovieLens: W ranks take slices of the same global batch, so two sharded ranks train what
    one process trains (up to float summation order). The 2001 train samples scored at the end
    give rank 1 one batch more than rank 0, which feeds an empty batch meanwhile."""
    two = tmp_path / "two"
    mp.start_processes(_rank, args=(2, _free_port(), str(two)), nprocs=2, start_method="spawn",
                       join=True)
    one = tmp_path / "one"
    assert main([*ML, "--out", str(one)]) == 0
    m2, m1 = _metrics(two), _metrics(one)
    assert m2["world_size"] == 2 and m1["world_size"] == 1
    for part in ("eval", "train"):
        assert m2[part]["samples"] == m1[part]["samples"]
        assert math.isclose(m2[part]["auc"], m1[part]["auc"], abs_tol=2e-3), (m2[part], m1[part])
    for h2, h1 in zip(m2["history"], m1["history"], strict=True):
        assert h2["step"] == h1["step"]
        assert math.isclose(h2["train_loss"], h1["train_loss"], abs_tol=2e-3)
    for name, t in m1["tables"].items():  # the same ids were seen: the same rows, summed
        two_t = m2["tables"][name]
        assert two_t["rows"] == t["rows"]
        for key in ("rows", "lookups", "hits", "hbm_hits", "evicted", "hbm_bytes", "ddr_bytes"):
            assert len(two_t["per_rank"][key]) == 2 and sum(two_t["per_rank"][key]) == two_t[key]
        assert two_t["hbm_bytes"] > 0 and 0 < two_t["hbm_hit_rate"] <= 1
    assert len(m2["memory"]["peak_rss_mib_per_rank"]) == 2
    assert m2["memory"]["peak_rss_mib"] == max(m2["memory"]["peak_rss_mib_per_rank"])
    assert (two / "config.yaml").is_file()


def _rows(checkpoint: Path) -> dict:
    """Every table's (keys, embeddings, optimizer state, scores), sorted by key."""
    from safetensors.torch import load_file

    out = {}
    for table in sorted((checkpoint / "tables").iterdir()):
        parts = [load_file(p) for p in sorted(table.glob("rank*.part*.safetensors"))]
        cols = {n: torch.cat([p[n] for p in parts]) for n in ("keys", "embeddings",
                                                               "optimizer_state", "scores")}
        order = torch.argsort(cols["keys"])
        out[table.name] = {n: c[order] for n, c in cols.items()}
    return out


def test_resume_continues_exactly_like_one_run(tmp_path):
    """2N steps in one run == N steps, checkpoint, --resume, N more: same losses, AUCs, rows."""
    base = ["train", *TINY[:-2], "--batch-size", "32", "--set", "eval_every=4",
            "--set", "log_every=4"]  # loss windows of 4 steps: the same in both runs
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main([*base, "--steps", "8", "--out", str(straight)]) == 0
    assert main([*base, "--steps", "4", "--out", str(resumed)]) == 0
    assert main([*base, "--steps", "8", "--out", str(resumed), "--resume"]) == 0
    a, b = _metrics(straight), _metrics(resumed)
    assert b["resumed_from"] == 4 and a["resumed_from"] is None
    assert a["eval"] == b["eval"]
    assert a["train"]["auc"] == b["train"]["auc"] and a["train"]["log_loss"] == b["train"]["log_loss"]
    for key in ("eval_auc", "eval_log_loss", "train_loss"):
        assert a["history"][-1][key] == b["history"][-1][key], key
    ra, rb = (_rows(out / "checkpoints" / "step-00000008") for out in (straight, resumed))
    assert ra.keys() == rb.keys() and len(ra) == 4
    for name in ra:
        for col in ra[name]:
            assert torch.equal(ra[name][col], rb[name][col]), (name, col)


def test_default_movielens_run_beats_logistic_regression(tmp_path):
    """The default `make train` job: eval AUC >= 0.78 on the random split (one-hot logistic
    regression: 0.774)."""
    out = tmp_path / "ml"
    assert main(["train", "--out", str(out), "--set", "checkpoint_at_end=false"]) == 0
    m = _metrics(out)
    assert "movielens" in json.dumps(m["data"]) and m["eval"]["auc"] >= 0.78, m["eval"]


def test_inspect_prints_a_run_checkpoint(tmp_path, capsys):
    out = tmp_path / "insp"
    assert main(["train", *TINY[:-2], "--steps", "2", "--batch-size", "16", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out / "checkpoints" / "step-00000002"), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "table 'embeddings/c1'" in text and "verified" in text and "rows" in text
    assert main(["inspect", str(tmp_path / "missing")]) == 1


def test_train_pipelines_train_exactly_as_base_and_report_their_split(tmp_path, capsys):
    """`dynemb train --pipeline KIND`: the exact kinds give base's losses, AUCs and rows (one
    pipeline per stretch between evaluations and checkpoints); semi_sync trains and differs;
    metrics.json and the summary name the pipeline and its time split."""
    base = ["train", *TINY[:-2], "--batch-size", "32", "--steps", "10",
            "--set", "eval_every=4", "--set", "log_every=3", "--set", "checkpoint_every=5"]
    runs = {}
    for kind in ("base", "sparse_dist", "fused_sparse_dist", "semi_sync"):
        out = tmp_path / kind
        assert main([*base, "--pipeline", kind, "--out", str(out)]) == 0
        runs[kind] = (_metrics(out), _rows(out / "checkpoints" / "step-00000010"))
    summary = capsys.readouterr().out
    assert "pipeline fused_sparse_dist:" in summary and "lookup" in summary
    ref, ref_rows = runs["base"]
    for kind, (m, rows) in runs.items():
        pipe = m["pipeline"]
        assert pipe["kind"] == kind
        assert set(pipe["split_s"]) == {"data", "input_dist", "lookup", "prefetch",
                                        "output_dist", "dense", "backward", "optimizer"}
        assert pipe["split_s"]["lookup"] > 0 and pipe["split_s"]["dense"] > 0
        keep = ("step", "eval_auc", "eval_log_loss", "train_loss")
        same = [{k: h[k] for k in keep} for h in m["history"]] == [
            {k: h[k] for k in keep} for h in ref["history"]] and all(
            torch.equal(rows[t][c], ref_rows[t][c]) for t in ref_rows for c in ref_rows[t])
        assert same == (kind != "semi_sync"), kind
