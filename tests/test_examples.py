"""The examples the README points to run, and do what they say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_2 = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
"""torchrun with two ranks; --standalone binds the rendezvous to a port it picks itself, so no
free port is guessed (and raced for) here."""


def _run(*args: str) -> str:
    """Runs ``python *args`` and returns its stdout; a failure shows both streams' ends."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                                  f"\n--- stderr\n{proc.stderr[-8000:]}")
    return proc.stdout


def test_quickstart_trains_and_the_loss_falls():
    out = _run(str(ROOT / "examples" / "quickstart.py"), "--steps", "150")
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", out).groups())
    assert last < first - 0.03, out
    assert "table user: 2,000 rows" in out


def test_sharded_example_runs_under_torchrun():
    """README/docs/sharding.md: `torchrun --nproc-per-node 2 examples/torchrun_sharded.py`."""
    out = _run(*TORCHRUN_2, str(ROOT / "examples" / "torchrun_sharded.py"), "--steps", "100")
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", out).groups())
    assert last < first, out
    assert re.search(r"table user: rows per rank \[\d+, \d+\]", out), out


def _readme_block(heading: str) -> str:
    """The first ```python block after README heading ``heading``."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading):]
    return section[section.index("```python") + len("```python"):section.index("```\n", 10)]


def test_readme_api_block_runs():
    """The README's "Python API in 20 lines" block is executed as written."""
    code = _readme_block("## The Python API in 20 lines")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102  (our own README)
    table = scope["table"]
    assert table.size() == 4 and table.stats().optimizer_step == 1


def test_readme_storage_block_runs():
    """The README's storage-tier block runs as written, and its formula splits the tiers."""
    code = _readme_block("## Storage tiers")
    scope: dict = {}
    exec(compile("import dynemb\n" + code, "README.md", "exec"), scope)  # noqa: S102
    mem = scope["dynemb"].table_memory(scope["table"])
    assert 0 < mem.hbm_bytes < mem.ddr_bytes


def test_readme_planner_block_runs():
    """The README's planner block runs as written on three tables: every table gets a planned,
    buildable storage within the budget."""
    import torch

    import dynemb

    code = _readme_block("## Planning where tables live")
    auto = dynemb.Storage(mode=dynemb.StorageMode.AUTO)
    tables = [dynemb.TableConfig(name=n, dim=128, features=[n], capacity=cap,
                                 optimizer=dynemb.Adam(), storage=auto)
              for n, cap in (("item", 1 << 30), ("user", 1 << 29), ("ads", 1 << 20))]
    scope = {"tables": tables, "sample_ids": torch.randint(0, 1 << 20, (100_000,))}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102  (our own README)
    plan, planned = scope["plan"], scope["tables"]
    assert all(t.storage.planned for t in planned)
    assert plan.hbm_bytes_per_rank <= scope["topo"].hbm_budget
    assert plan.tables["item"].mode != dynemb.StorageMode.HBM_ONLY  # 1.6 TiB cannot stay in hbm


def test_readme_torchrec_block_runs():
    """The README's torchrec block runs as written: torchrec's DLRM over dynemb tables."""
    code = _readme_block("## Coming from torchrec")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102  (our own README)
    assert scope["pooled"].values().shape == (2, 16)
    assert scope["logits"].shape == (2, 1)
    assert scope["batch"].features == ("user", "item")


def _torchrec_dlrm(*launch: str) -> str:
    return _run(*launch, str(ROOT / "examples" / "torchrec_dlrm.py"), "--steps", "120")


def test_torchrec_dlrm_example_learns_in_one_process_and_under_torchrun():
    """examples/torchrec_dlrm.py: torchrec's DLRM over dynemb tables on MovieLens 100K."""
    for out, ranks in ((_torchrec_dlrm(), 1), (_torchrec_dlrm(*TORCHRUN_2), 2)):
        first, last, auc = map(float, re.search(r"loss (\S+) -> (\S+); eval AUC (\S+)",
                                                out).groups())
        assert last < first and auc > 0.72, out
        assert f"({ranks} rank(s))" in out and "(20,000 samples)" in out, out
