"""``find`` on the compiled backend probes and copies rows in one pass
(``index_numba.find_rows``): its values and ``found`` equal the torch reference's, element for
element, over both tiers of a HYBRID table and a memory-mapped one, with keys missing, repeated
and split over 1, 2 and 3 threads; the rows of missing keys written by the probe (a constant
eval initializer) or after it (any other)."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import Initializer, InitKind, Storage, StorageMode
from dynemb.config import ZEROS


_EVAL = {"uniform": Initializer(kind=InitKind.UNIFORM, low=1.0, high=2.0),
         "constant": Initializer(kind=InitKind.CONSTANT, value=0.3), "zeros": ZEROS}


def _table(backend: str, storage: Storage, threads: int, init: str) -> dynemb.DynamicTable:
    cfg = dynemb.TableConfig(name="t", dim=5, features=["f"], capacity=16384, bucket_capacity=16,
                             optimizer=dynemb.Adam(lr=0.1), storage=storage, threads=threads,
                             eval_initializer=_EVAL[init])
    return dynemb.DynamicTable(cfg, backend=backend)


@pytest.mark.parametrize(("threads", "init"), [(1, "uniform"), (2, "uniform"), (3, "uniform"),
                                               (1, "constant"), (3, "constant"), (2, "zeros")])
@pytest.mark.parametrize("storage", ["hbm_only", "hybrid", "hybrid_files"])
def test_find_copies_rows_in_the_probe_as_the_reference_does(storage, threads, init, tmp_path):
    def st(name: str) -> Storage:
        if storage == "hbm_only":
            return Storage()
        path = {"ddr_path": str(tmp_path / name)} if storage == "hybrid_files" else {}
        return Storage(mode=StorageMode.HYBRID, cache_load_factor=0.3, **path)

    ours, ref = _table("numba", st("ours"), threads, init), _table("torch", st("ref"), 1, init)
    g = torch.Generator().manual_seed(threads)
    stored = torch.randint(-(2**62), 2**62, (3000,), generator=g)
    for t in (ours, ref):
        t.find_or_insert(stored)
        t.insert_or_assign(stored, torch.randn(3000, 5, generator=torch.Generator().manual_seed(1)))
    absent = torch.randint(-(2**62), 2**62, (1500,), generator=g)
    keys = torch.cat([stored, stored[:700], absent])[torch.randperm(5200, generator=g)]
    out = torch.full((keys.numel(), 5), float("nan"))
    assert ours.resolver.locate_rows(keys, out) is not None  # the one-pass path is taken
    if storage != "hbm_only":
        rids = ours.locate(keys)
        split = ours.store.split
        assert bool((rids >= split).any()) and bool(((rids >= 0) & (rids < split)).any())
    got, want = ours.find(keys), ref.find(keys)
    assert torch.equal(got.found, want.found) and int((~got.found).sum()) == 1500
    assert torch.equal(got.values, want.values)
    out = torch.full_like(out, float("nan"))
    assert ours.find(keys, out=out).values.data_ptr() == out.data_ptr()
    assert torch.equal(out, want.values)
    empty = ours.find(keys[:0])
    assert empty.values.shape == (0, 5) and empty.found.numel() == 0
