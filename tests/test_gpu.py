"""CUDA path: tables on the GPU (the Triton kernels by default, or the torch kernels) must match
the CPU (numba) results.

Marked ``gpu``; skipped on a machine without CUDA (CI has none).
"""

from __future__ import annotations

import pytest
import torch

import dynemb

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _tables(optimizer, storage=None):
    storage = storage or dynemb.Storage()
    return [dynemb.TableConfig(name="t", dim=8, features=["a", "b"], capacity=1 << 12,
                               optimizer=optimizer, pooling=dynemb.PoolingMode.MEAN,
                               storage=storage),
            dynemb.TableConfig(name="u", dim=4, features=["c"], capacity=1 << 12,
                               optimizer=optimizer, score=dynemb.ScorePolicy.LFU,
                               admission=dynemb.Admission(threshold=2, counter_capacity=256),
                               storage=storage)]


def _batch(step: int) -> dynemb.SparseBatch:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 6, (3 * 16,), generator=g)
    values = torch.randint(-1000, 1000, (int(lengths.sum()),), generator=g) * 7919
    weights = torch.rand(values.numel(), generator=g) + 0.5
    return dynemb.SparseBatch(features=["a", "b", "c"], values=values, lengths=lengths,
                              weights=weights)


@pytest.mark.parametrize("optimizer", [dynemb.SGD(lr=0.1), dynemb.RowWiseAdagrad(lr=0.1),
                                       dynemb.Adagrad(lr=0.1), dynemb.Adam(lr=0.01)],
                         ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("storage", [
    dynemb.Storage(),
    dynemb.Storage(mode=dynemb.StorageMode.HYBRID, cache_load_factor=0.3),
    dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.1)],
    ids=["hbm_only", "hybrid", "caching"])
@pytest.mark.parametrize("backend", [None, "torch"], ids=["triton", "torch"])
def test_cuda_tables_match_cpu(optimizer, storage, backend):
    """A CUDA table in any storage mode (hbm on the GPU, ddr in pinned host memory) trains like
    the CPU HBM_ONLY table."""
    cpu = dynemb.EmbeddingBagCollection(_tables(optimizer))
    gpu = dynemb.EmbeddingBagCollection(_tables(optimizer, storage), device="cuda",
                                        backend=backend)
    if storage.mode != dynemb.StorageMode.HBM_ONLY:
        assert gpu.tables["t"].store.ddr.is_pinned() and gpu.tables["t"].rows.is_cuda
    assert gpu.tables["t"].backend.name == (backend or "triton")
    proj = torch.randn(16, 20, generator=torch.Generator().manual_seed(0))
    for step in range(5):
        batch = _batch(step)
        out_c = cpu(batch).values()
        out_g = gpu(batch.to("cuda")).values()
        assert out_g.is_cuda
        torch.testing.assert_close(out_g.cpu(), out_c, atol=1e-5, rtol=1e-5)
        (out_c * proj).sum().backward()
        (out_g * proj.cuda()).sum().backward()
    for name in ("t", "u"):
        a, b = cpu.tables[name], gpu.tables[name]
        ea, eb = a.export_batch(0, a.capacity()), b.export_batch(0, b.capacity())
        oa, ob = torch.argsort(ea.keys), torch.argsort(eb.keys.cpu())
        assert torch.equal(ea.keys[oa], eb.keys.cpu()[ob])
        torch.testing.assert_close(eb.embeddings.cpu()[ob], ea.embeddings[oa], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(eb.optimizer_state.cpu()[ob], ea.optimizer_state[oa],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(eb.scores.cpu()[ob], ea.scores[oa])
        assert a.stats().admission_rejected == b.stats().admission_rejected


@pytest.mark.parametrize(("storage", "admission"), [
    (dynemb.Storage(), None),
    (dynemb.Storage(), dynemb.Admission(threshold=2)),
    (dynemb.Storage(mode=dynemb.StorageMode.HYBRID, cache_load_factor=0.3), None),
    (dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.3), None)],
    ids=["hbm_only", "hbm_only-admission", "hybrid", "caching"])
def test_a_cuda_step_synchronises_once_per_table_in_forward_and_never_in_backward(storage,
                                                                                 admission):
    """torch's own count of the calls that wait for the GPU (``set_sync_debug_mode``): the one
    read per table and lookup (``tests/test_host_syncs.py`` models this on the CPU)."""
    import warnings  # noqa: PLC0415

    cfgs = [dynemb.TableConfig(name=n, dim=8, features=[f], capacity=1 << 12, storage=storage,
                               optimizer=dynemb.Adam(lr=0.01), admission=admission)
            for n, f in (("t", "a"), ("u", "b"))]
    ebc = dynemb.EmbeddingBagCollection(cfgs, device="cuda")
    g = torch.Generator().manual_seed(0)

    def batch():
        values = torch.randint(0, 1 << 13, (2 * 64,), generator=g)
        return dynemb.SparseBatch(features=["a", "b"], values=values,
                                  lengths=torch.ones(2 * 64, dtype=torch.int64)).to("cuda")

    for _ in range(4):  # the tables fill (CACHING: its cache evicts)
        ebc(batch()).values().sum().backward()
    b = batch()
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as forward:
            warnings.simplefilter("always")
            out = ebc(b).values()
        with warnings.catch_warnings(record=True) as backward:
            warnings.simplefilter("always")
            out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    waits = [str(w.message) for w in forward if "synchroniz" in str(w.message)]
    assert len(waits) <= 2, waits
    assert not [w for w in backward if "synchroniz" in str(w.message)]
