"""The examples the README points to run, and do what they say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_trains_and_the_loss_falls():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "150"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", out).groups())
    assert last < first - 0.03, out
    assert "table user: 2,000 rows" in out
