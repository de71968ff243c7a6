"""NaN gradients in a sharded collection (gloo, 2 spawned ranks): a table with nonfinite RAISE
makes every rank raise and no rank update any table; a SKIP table with max_grad_norm skips the
NaN rows and clips the others by the norm of the finite rows over all shards, like one process."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

import dynemb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
import _nonfinite_job as J  # noqa: E402

WORLD = 2


def _single_process() -> dict[str, dict[str, torch.Tensor]]:
    """The same steps in one process (the RAISE step, which updates nothing, left out)."""
    ebc = dynemb.EmbeddingBagCollection(J.tables())
    n = len(J.BAGS["fa"])
    for col in J.STEPS:
        if col == 0:
            continue
        J.step(ebc, J.batch(0, n), J.weights(0, n, col))
    return {name: H.export(t) for name, t in ebc.tables.items()}


def _merged(exports: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name in exports[0]:
        parts = [e[name] for e in exports]
        keys = torch.cat([p["keys"] for p in parts])
        order = torch.argsort(keys)
        out[name] = {f: torch.cat([p[f] for p in parts])[order] for f in parts[0]}
    return out


def test_nonfinite_gradients_in_sharded_tables(tmp_path):
    mp.start_processes(J.run, args=(WORLD, H.free_port(), str(tmp_path)), nprocs=WORLD,
                       start_method="spawn", join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r in res:
        assert "__error__" not in r, r.get("__error__")
    # Step 1 (RAISE table a): every rank raised InputError; the owner of key 5 with the
    # table's own error, the other naming that rank; no row or optimizer state changed on any
    # rank (the forward's lookup did touch the LRU scores, as every forward does).
    errors = [r["errors"][1] for r in res]
    assert all(e is not None and e[0] == "InputError" for e in errors), errors
    owner = [i for i, e in enumerate(errors) if "table 'a': 1 gradient row(s)" in e[1]]
    assert len(owner) == 1, errors
    other = errors[1 - owner[0]][1]
    assert "other ranks" in other and f"'a': [{owner[0]}]" in other
    for r in res:
        for name in ("a", "b"):
            for f in ("keys", "embeddings", "optimizer_state"):
                assert torch.equal(r["exports"][0][name][f], r["exports"][1][name][f]), (name, f)
    assert [r["nonfinite"]["a"] for r in res] == [1 if i == owner[0] else 0 for i in range(WORLD)]
    # Step 2 (SKIP table b, clipped): nothing raised; key 9's row is as it was; everything
    # equals one process doing the same.
    assert all(r["errors"][2] is None for r in res)
    assert sum(r["nonfinite"]["b"] for r in res) == 1
    got, want = _merged([r["exports"][2] for r in res]), _single_process()
    for name in ("a", "b"):
        for f in ("keys", "embeddings", "optimizer_state"):  # (scores: one more forward)
            torch.testing.assert_close(got[name][f], want[name][f], atol=1e-6, rtol=1e-6)
    before, after = _merged([r["exports"][1] for r in res])["b"], got["b"]
    nine = int((after["keys"] == 9).nonzero())
    assert torch.equal(after["embeddings"][nine], before["embeddings"][nine])
    assert bool(torch.isfinite(after["embeddings"]).all())
