"""`dynemb train` never overwrites what it should not and never answers bad input with a
traceback: --resume past --steps, a fresh run into an earlier run's directory, malformed data
and config files, an unwritable --out; and --resume at another world size reshards."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dynemb.cli import main

TINY = ["--data", "synthetic", "--set", "data.synthetic.num_sparse=2",
        "--set", "data.synthetic.num_dense=2", "--set", "data.synthetic.vocab_sizes=50",
        "--set", "data.synthetic.eval_samples=200", "--set", "data.train_eval_samples=0",
        "--set", "model.bottom_mlp=[4]", "--set", "model.top_mlp=[4]", "--batch-size", "16"]


def _snapshot(out: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``out``: (mtime in ns, contents)."""
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(out.rglob("*")) if p.is_file()}


def _manifest_step(checkpoint: Path) -> int:
    return json.loads((checkpoint / "manifest.json").read_text())["step"]


@pytest.fixture
def run20(tmp_path: Path) -> Path:
    """A finished 20-step run with checkpoints at steps 10 and 20."""
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "20", "--out", str(out),
                 "--set", "checkpoint_every=10", "--set", "eval_every=0"]) == 0
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == [
        "step-00000010", "step-00000020"]
    return out


def test_resume_below_the_newest_checkpoint_is_refused_and_writes_nothing(run20, capsys):
    """It used to save step-20 state as step-00000010 and exit 0."""
    before = _snapshot(run20)
    capsys.readouterr()
    assert main(["train", *TINY, "--steps", "10", "--out", str(run20), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--resume --steps 10: the newest checkpoint" in err and "at step 20" in err, err
    assert "Pass --steps greater than 20" in err
    assert _snapshot(run20) == before
    assert _manifest_step(run20 / "checkpoints" / "step-00000010") == 10


def test_resume_at_the_newest_checkpoint_has_nothing_to_do(run20, capsys):
    before = _snapshot(run20)
    capsys.readouterr()
    assert main(["train", *TINY, "--steps", "20", "--out", str(run20), "--resume"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert _snapshot(run20) == before


def test_a_checkpoint_whose_name_disagrees_with_its_step_is_refused(run20, capsys):
    """A checkpoint written by the old bug (named step 10, holding step 20) is not resumed."""
    ckpts = run20 / "checkpoints"
    (ckpts / "step-00000010").rename(ckpts / "old")
    (ckpts / "step-00000020").rename(ckpts / "step-00000010")
    assert main(["train", *TINY, "--steps", "30", "--out", str(run20), "--resume"]) == 2
    assert "its name says step 10, its manifest holds step 20" in capsys.readouterr().err


def test_a_fresh_run_into_an_earlier_run_is_refused_unless_overwrite(run20, capsys):
    """It used to delete the earlier run's checkpoints."""
    before = _snapshot(run20)
    capsys.readouterr()
    assert main(["train", *TINY, "--steps", "5", "--out", str(run20)]) == 2
    err = capsys.readouterr().err
    assert f"--out {run20} holds an earlier run" in err
    assert "--resume" in err and "--overwrite" in err
    assert _snapshot(run20) == before
    assert main(["train", *TINY, "--steps", "5", "--out", str(run20), "--overwrite"]) == 0
    assert [p.name for p in (run20 / "checkpoints").iterdir()] == ["step-00000005"]
    assert json.loads((run20 / "metrics.json").read_text())["steps"] == 5
    with pytest.raises(SystemExit):  # one or the other
        main(["train", "--out", str(run20), "--resume", "--overwrite"])


def test_an_empty_or_new_directory_needs_no_overwrite(tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0


def _criteo_file(path: Path, bad_line: int, field: int, text: str) -> Path:
    """50 valid Criteo lines, except field ``field`` of line ``bad_line`` (1-based)."""
    lines = []
    for n in range(1, 51):
        parts = [str(n % 2), *[str(n + j) for j in range(13)],
                 *[f"{(n * 131 + f) % 97:08x}" for f in range(26)]]
        if n == bad_line:
            parts[field] = text
        lines.append("\t".join(parts) + "\n")
    path.write_text("".join(lines))
    return path


BAD_INPUTS = {
    "dense --5": (lambda d: ["--data", f"criteo:{_criteo_file(d / 'a.tsv', 3, 1, '--5')}"],
                  r"a.tsv:3, field 2 (i1): expected an integer"),
    "dense 400 digits": (lambda d: ["--data",
                                    f"criteo:{_criteo_file(d / 'b.tsv', 2, 5, '9' * 400)}"],
                         r"b.tsv:2, field 6 (i5): expected an integer"),
    "category 0x1f": (lambda d: ["--data", f"criteo:{_criteo_file(d / 'c.tsv', 4, 20, '0x1f')}"],
                      r"c.tsv:4, field 21 (c7): expected a hex category"),
    "fake gz": (lambda d: ["--data", "criteo:" + str(_write(d / "d.tsv.gz", b"1\t2\n"))],
                r"d.tsv.gz:1: expected gzip data"),
    "yaml anchor cycle": (lambda d: ["--config", str(_write(d / "e.yaml",
                                                            b"model: &m\n  x: *m\n"))],
                          r"e.yaml, line 1: the value anchored there contains itself"),
    "billion laughs": (lambda d: ["--config", str(_write(d / "f.yaml", _laughs()))],
                       r"f.yaml, line "),
    "non-UTF-8 config": (lambda d: ["--config", str(_write(d / "g.yaml", b"steps: 3\n\xff\n"))],
                         r"g.yaml, line 2: expected UTF-8 text"),
    "out under a file": (lambda d: ["--out", str(_write(d / "h", b"") / "run")],
                         r"h/run: cannot use the run directory"),
    # an --out the checks cannot even look at used to be an OSError traceback
    "out name too long": (lambda d: ["--out", str(d / ("x" * 300))],
                          r"cannot use the run directory (File name too long"),
    "resume out name too long": (lambda d: ["--resume", "--out", str(d / ("x" * 300))],
                                 r"cannot use the run directory (File name too long"),
    "data name too long": (lambda d: ["--data", f"criteo:{d / ('x' * 300)}"],
                           r"cannot read it (File name too long)"),
    "data section not a mapping": (lambda d: ["--set", "data=5", "--data", "synthetic"],
                                   r"--data: sets data.source, but 'data' is 5 in the config"),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _laughs() -> bytes:
    rows = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    rows += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return ("\n".join(rows) + "\n").encode()


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_message_naming_the_file_and_line(tmp_path, capsys, case):
    make_args, expected = BAD_INPUTS[case]
    args = ["train", *TINY, "--steps", "3", "--batch-size", "8", *make_args(tmp_path)]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynemb train: error: ") and expected in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_python_m_dynemb_prints_no_traceback_for_a_malformed_data_file(tmp_path):
    data = _criteo_file(tmp_path / "day.tsv", 2, 30, "de_ad")
    done = subprocess.run([sys.executable, "-m", "dynemb", "train", "--data", f"criteo:{data}",
                           "--steps", "2", "--batch-size", "4", "--out", str(tmp_path / "r"),
                           "--set", "model.bottom_mlp=[4]", "--set", "model.top_mlp=[4]"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"{data}:2, field 31 (c17): expected a hex category" in done.stderr
    assert "Traceback" not in done.stderr



def test_inspect_into_a_closed_pipe_prints_no_traceback(tmp_path):
    """``dynemb inspect PATH | head -1``: the reader leaves before the output is written; it
    used to end in a BrokenPipeError traceback. Now: exit 141, as a shell reports SIGPIPE."""
    from dynemb import EmbeddingBagCollection, TableConfig, checkpoint

    model = EmbeddingBagCollection([TableConfig(name="t", dim=2, features=["f"], capacity=16)])
    checkpoint.save(tmp_path / "ck", model=model, step=1)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "dynemb", "inspect", str(tmp_path / "ck")],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")

# ---------------------------------------------------------------- resume at another world size

def _rank(rank: int, world_size: int, port: int, args: list[str], expected: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if main(args) != expected:
        raise SystemExit(f"rank {rank}: expected exit status {expected}")


def _rank_claim_fails(rank: int, world_size: int, port: int, args: list[str],
                      expected: int) -> None:
    """Rank 0's check of the run directory fails with an error that is not a DynembError."""
    from dynemb.train import loop

    def claim(*_):
        raise RuntimeError("disk on fire")
    loop._claim = claim
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _rank(rank, world_size, port, args, expected)
    except RuntimeError as error:
        if rank != 0 or "disk on fire" not in str(error):
            raise
    if rank == 1 and "rank 0 failed before training: RuntimeError: disk on fire" not in \
            err.getvalue():
        raise SystemExit(f"rank 1 did not name rank 0's error: {err.getvalue()[-2000:]}")


def _two_ranks(args: list[str], expected: int = 0, target=_rank) -> None:
    """Runs ``dynemb train args`` on 2 spawned gloo ranks; each must exit with ``expected``
    within 120 s (a rank left alone in a collective would hang)."""
    ctx = mp.start_processes(target, args=(2, _free_port(), args, expected), nprocs=2,
                             start_method="spawn", join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            raise AssertionError("the ranks did not finish in 120 s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_resume_at_another_world_size_reshards_and_says_so(tmp_path, caplog):
    """Saved over 2 gloo ranks (spawned like torchrun), resumed in one process: it used to
    fail with advice to pass reshard=True, which the CLI cannot. (Between the two, a fresh
    2-rank run into the same directory is refused on both ranks.)"""
    out = tmp_path / "run"
    first = ["train", *TINY, "--steps", "3", "--out", str(out), "--set", "eval_every=0"]
    _two_ranks(first)
    _two_ranks(first, expected=2)  # a fresh run into it: every rank refuses, none hangs
    saved = out / "checkpoints" / "step-00000003"
    assert json.loads((saved / "manifest.json").read_text())["world_size"] == 2
    with caplog.at_level(logging.INFO, logger="dynemb"):
        assert main(["train", *TINY, "--steps", "5", "--out", str(out), "--resume",
                     "--set", "eval_every=0"]) == 0
    log = caplog.text
    assert "saved over 2 rank(s), on 1 rank(s): resharding its tables" in log, log
    assert "resharded from 2 to 1 rank(s)" in log
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["resumed_from"], metrics["steps"], metrics["world_size"]) == (3, 5, 1)
    assert _manifest_step(out / "checkpoints" / "step-00000005") == 5
    rows = sum(t["rows"] for t in metrics["tables"].values())
    assert rows > 0


def test_any_failure_of_rank_0_before_training_stops_every_rank(tmp_path):
    """Rank 0 raising something other than a DynembError while it checks the run directory
    (an OSError used to escape that way) left rank 1 in the broadcast, to fail with a raw gloo
    error once rank 0 was gone (or at the collective timeout): now rank 1 exits 2 naming rank
    0's error."""
    _two_ranks(["train", *TINY, "--steps", "2", "--out", str(tmp_path / "run"),
                "--set", "timeout_s=60"], expected=2, target=_rank_claim_fails)


def test_print_config_shows_every_field_with_its_meaning_and_reads_back(tmp_path, capsys):
    import dataclasses

    from dynemb.train import TrainConfig
    from dynemb.train.config_io import field_docs, from_dict, parse_yaml

    assert main(["train", "--print-config", "--set", "data.split=time", "--steps", "7",
                 "--set", "embeddings.lr=0.5", "--out", str(tmp_path / "never")]) == 0
    text = capsys.readouterr().out
    assert not (tmp_path / "never").exists()  # nothing trained, nothing written
    assert "# Training steps (the total: a resumed run continues up to it).\nsteps: 7" in text
    assert "data:  # " in text and "\n  split: time\n" in text
    config = from_dict(TrainConfig, parse_yaml(text, "printed"))
    assert config.steps == 7 and config.data.split == "time" and config.embeddings.lr == 0.5
    path = tmp_path / "run.yaml"
    path.write_text(text)
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == text

    def undocumented(obj, prefix=""):
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from undocumented(value, prefix + f.name + ".")
            elif not docs.get(f.name):
                yield prefix + f.name
    assert list(undocumented(config)) == []  # every field's meaning is printed
