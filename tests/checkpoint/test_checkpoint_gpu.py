"""CUDA tables: a checkpoint of tables on the GPU loads into CPU tables and back, row for row.

Marked ``gpu``; skipped on a machine without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import checkpoint

import _models as M

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cpu(snap: dict) -> dict:
    """A snapshot with every tensor on the CPU."""
    out = {}
    for key, rec in snap.items():
        out[key] = {f: v.cpu() if isinstance(v, torch.Tensor) else v for f, v in rec.items()}
        if "admission" in rec:
            out[key]["admission"] = tuple(t.cpu() for t in rec["admission"])
    return out


def test_cuda_tables_round_trip_through_cpu(tmp_path):
    gpu = dynemb.EmbeddingBagCollection(M.tables(), device="cuda")
    for step in range(3):
        b, _ = M.batch(step, size=32, id_high=500)
        gpu(b).values().sum().backward()
    checkpoint.save(tmp_path / "g", model=gpu, step=3)
    want = _cpu(M.snapshot(gpu))
    cpu = dynemb.EmbeddingBagCollection(M.tables())
    assert checkpoint.load(tmp_path / "g", model=cpu) == 3
    M.assert_same_tables(M.snapshot(cpu), want)
    checkpoint.save(tmp_path / "c", model=cpu, step=3)
    back = dynemb.EmbeddingBagCollection(M.tables(), device="cuda")
    checkpoint.load(tmp_path / "c", model=back)
    M.assert_same_tables(_cpu(M.snapshot(back)), want)
