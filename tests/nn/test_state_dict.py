"""A collection's state_dict holds its tables as views of their live storage, and
load_state_dict restores them exactly: training on after a reload equals training on without
one, bit for bit, in every storage mode (CACHING with a memory-mapped ddr tier too), through
torch.save/torch.load(weights_only=True); another geometry, missing entries and lookups in
flight are refused before anything changes."""

from __future__ import annotations

import io

import pytest
import torch

import dynemb
from dynemb.errors import CheckpointError, ConfigError
from dynemb.nn import dense_only
from dynemb.table.snapshot import decode, encode

MODES = ["hbm_only", "hybrid", "caching", "caching_mmap"]


def storage(mode: str, tmp_path) -> dynemb.Storage:
    if mode == "hbm_only":
        return dynemb.Storage()
    if mode == "hybrid":
        return dynemb.Storage(mode=dynemb.StorageMode.HYBRID, cache_load_factor=0.25)
    path = str(tmp_path / "ddr") if mode == "caching_mmap" else None
    return dynemb.Storage(mode=dynemb.StorageMode.CACHING, cache_load_factor=0.25, ddr_path=path)


def configs(mode: str, tmp_path, *, capacity: int = 256, dim: int = 8) -> list:
    """Two small tables that fill and evict, one through admission and with an eviction log, Adam
    and row-wise Adagrad."""
    return [dynemb.TableConfig(name="u", dim=dim, features=["u"], capacity=capacity,
                               optimizer=dynemb.Adam(lr=0.05), storage=storage(mode, tmp_path),
                               admission=dynemb.Admission(threshold=2, counter_capacity=512)),
            dynemb.TableConfig(name="i", dim=8, features=["i", "j"], capacity=128,
                               optimizer=dynemb.RowWiseAdagrad(lr=0.1))]


def batches(n: int, seed: int = 0) -> list[dynemb.SparseBatch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 1000, (96,), generator=g).tolist()
        out.append(dynemb.SparseBatch.from_dict({
            "u": [[x % 500] for x in ids[:32]] + [[x % 300] for x in ids[:8]],
            "i": [[x] for x in ids[32:72]], "j": [[x, x + 1] for x in ids[56:]]}))
    return out


class Model(torch.nn.Module):
    def __init__(self, tables: list, kind: str = "bag") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.sparse = (dynemb.EmbeddingBagCollection(tables) if kind == "bag"
                       else dynemb.EmbeddingCollection(tables))
        self.mlp = torch.nn.Linear(8, 1)

    def forward(self, batch: dynemb.SparseBatch) -> torch.Tensor:
        out = self.sparse(batch)
        if self.kind == "bag":
            return self.mlp(out["u"] + out["i"] * out["j"]).pow(2).mean()
        return sum(self.mlp(out[f].values).pow(2).mean() for f in ("u", "i", "j"))


def train(model: Model, data: list, opt: torch.optim.Optimizer) -> list[float]:
    losses = []
    for b in data:
        loss = model(b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def saved(obj: object) -> object:
    """``obj`` through torch.save and torch.load (weights_only: tensors only)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_equal_states(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("kind", ["bag", "sequence"])
@pytest.mark.parametrize("mode", MODES)
def test_training_on_after_a_reload_equals_training_on(mode, kind, tmp_path):
    data = batches(24)
    a = Model(configs(mode, tmp_path / "a"), kind)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    train(a, data[:12], opt_a)
    a.sparse.tables["u"].track_evictions()  # an eviction log to carry over too
    train(a, data[12:14], opt_a)
    state = saved({"model": a.state_dict(), "opt": opt_a.state_dict()})
    assert any(k.startswith("sparse.tables.u.rows.") for k in state["model"])

    b = Model(configs(mode, tmp_path / "b"), kind)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    assert not b.load_state_dict(state["model"]).missing_keys
    opt_b.load_state_dict(state["opt"])
    assert_equal_states(b.state_dict(), a.state_dict())
    assert train(b, data[14:], opt_b) == train(a, data[14:], opt_a)
    assert_equal_states(b.state_dict(), a.state_dict())
    for name in ("u", "i"):
        assert b.sparse.tables[name].stats() == a.sparse.tables[name].stats()
    assert torch.equal(b.sparse.tables["u"].evicted_since(13),
                       a.sparse.tables["u"].evicted_since(13))
    u, i = a.sparse.tables["u"].stats(), a.sparse.tables["i"].stats()
    assert u.evicted > 0 and u.admission_rejected > 0 and i.evicted > 0


def test_the_state_views_the_live_storage(tmp_path):
    m = Model(configs("caching_mmap", tmp_path))
    train(m, batches(3), torch.optim.SGD(m.parameters(), lr=0.1))
    t = m.sparse.tables["u"]
    state = m.sparse.state_dict()
    assert state["tables.u.rows.hbm"].data_ptr() == t.store.hbm.data_ptr()
    assert state["tables.u.rows.ddr"].data_ptr() == t.store.ddr.data_ptr()  # the mapped file
    assert state["tables.u.index.keys"].data_ptr() == t.index.keys.data_ptr()
    assert state["tables.u.cache.keys"].data_ptr() == t.cache.index.keys.data_ptr()
    before = state["tables.u.rows.hbm"].clone()
    train(m, batches(2, seed=5), torch.optim.SGD(m.parameters(), lr=0.1))
    assert not torch.equal(before, state["tables.u.rows.hbm"])  # a view: it moved with training
    meta = decode(state["tables.u.meta"], "meta")
    assert meta["geometry"]["mode"] == "caching" and meta["step"] == 3


def test_every_entry_is_a_tensor_and_reloads_after_to_and_back(tmp_path):
    m = Model(configs("hbm_only", tmp_path))
    train(m, batches(4), torch.optim.SGD(m.parameters(), lr=0.1))
    state = {k: v.clone() for k, v in m.state_dict().items()}
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    fresh = Model(configs("hbm_only", tmp_path))
    fresh.load_state_dict({k: v.to(torch.device("cpu")) for k, v in state.items()})
    assert_equal_states(fresh.state_dict(), m.state_dict())


@pytest.mark.parametrize("change, named", [
    ({"capacity": 512}, "capacity 256 in the state but 512 here"),
    ({"dim": 16}, "dim 8 in the state but 16 here"),
])
def test_another_geometry_is_refused_before_anything_changes(change, named, tmp_path):
    src = Model(configs("hbm_only", tmp_path))
    train(src, batches(3), torch.optim.SGD(src.parameters(), lr=0.1))
    dst = dynemb.EmbeddingBagCollection(configs("hbm_only", tmp_path, **change))
    dst.tables  # noqa: B018  (built: an empty table of its own geometry)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ConfigError, match=named) as e:
        dst.load_state_dict(src.sparse.state_dict())
    assert "dynemb.checkpoint" in str(e.value)
    assert_equal_states(dst.state_dict(), before)


def test_missing_and_unknown_entries_are_reported_as_torch_reports_them(tmp_path):
    src = dynemb.EmbeddingBagCollection(configs("hbm_only", tmp_path))
    src.tables  # noqa: B018  (built: a collection never built saves no tables)
    state = dict(src.state_dict())
    del state["tables.i.rows.hbm"]
    state["tables.i.surprise"] = torch.zeros(1)
    dst = dynemb.EmbeddingBagCollection(configs("hbm_only", tmp_path))
    dst.tables["u"].insert_or_assign(torch.tensor([7]), torch.ones(1, 8))
    with pytest.raises(RuntimeError, match="tables.i.rows.hbm") as e:
        dst.load_state_dict(state)
    assert "tables.i.surprise" in str(e.value)
    assert dst.tables["u"].size() == 0  # as torch does with parameters: what is whole loads
    dst.tables["i"].insert_or_assign(torch.tensor([7]), torch.ones(1, 8))
    result = dst.load_state_dict(state, strict=False)
    assert result.missing_keys == ["tables.i.rows.hbm"]
    assert result.unexpected_keys == ["tables.i.surprise"]
    assert dst.tables["i"].size() == 1  # a table missing an entry is left as it was


def test_a_lookup_in_flight_is_refused(tmp_path):
    ebc = dynemb.EmbeddingBagCollection(configs("hbm_only", tmp_path))
    t = ebc.tables["i"]
    lk = t.lookup(torch.tensor([1, 2, 3]), train=True, hold=True)
    with pytest.raises(ConfigError, match="3 row.* held by lookups in flight"):
        ebc.state_dict()
    t.release(lk)
    ebc.state_dict()


def test_a_closed_table_is_refused_not_read(tmp_path):
    ebc = dynemb.EmbeddingBagCollection(configs("caching_mmap", tmp_path))
    ebc.tables  # noqa: B018  (built)
    state = {k: v.clone() for k, v in ebc.state_dict().items()}
    ebc.close()
    with pytest.raises(ConfigError, match="table 'u' was closed"):
        ebc.state_dict()
    with pytest.raises(ConfigError, match="table 'u' was closed"):
        ebc.load_state_dict(state)


def test_a_pipeline_with_batches_in_flight_is_refused(tmp_path):
    m = Model(configs("hbm_only", tmp_path))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pipe = dynemb.train.pipeline("sparse_dist", model=m, optimizer=opt,
                                 loss_fn=lambda out, batch: out, forward=lambda model, b: model(b))
    it = iter(batches(4))
    pipe.progress(it)
    with pytest.raises(CheckpointError, match="drain"):
        m.state_dict()
    pipe.drain()
    pipe.close()
    m.state_dict()


def test_dense_only_leaves_the_tables_out(tmp_path):
    m = Model(configs("hbm_only", tmp_path))
    with dense_only():
        state = m.state_dict()
        assert sorted(state) == ["mlp.bias", "mlp.weight"]
        m.load_state_dict(state)  # strict, and the tables are not missed


def test_a_checkpoint_still_saves_the_dense_part_alone(tmp_path):
    m = Model(configs("hbm_only", tmp_path))
    train(m, batches(2), torch.optim.SGD(m.parameters(), lr=0.1))
    dynemb.checkpoint.save(tmp_path / "ck", model=m, step=2)
    dense = torch.load(tmp_path / "ck" / "dense" / "rank00000.pt", weights_only=False)
    assert sorted(dense["model"]) == ["mlp.bias", "mlp.weight"]
    fresh = Model(configs("hbm_only", tmp_path))
    dynemb.checkpoint.load(tmp_path / "ck", model=fresh)
    assert torch.equal(fresh.mlp.weight, m.mlp.weight)
    assert {n: t.size() for n, t in fresh.sparse.tables.items()} == \
        {n: t.size() for n, t in m.sparse.tables.items()}


def test_a_kept_state_whose_table_trained_on_is_refused_not_half_applied(tmp_path):
    m = Model(configs("hbm_only", tmp_path))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    train(m, batches(2), opt)
    same = m.sparse.state_dict()
    m.sparse.load_state_dict(same)  # unchanged since: a no-op
    train(m, batches(1, seed=3), opt)
    before = {k: v.clone() for k, v in m.sparse.state_dict().items()}
    with pytest.raises(ConfigError, match="has changed since"):
        m.sparse.load_state_dict(same)  # its arrays moved on, its meta did not
    assert_equal_states(m.sparse.state_dict(), before)


def test_a_bad_entry_in_a_later_table_changes_no_table(tmp_path):
    src = Model(configs("hbm_only", tmp_path / "s"))
    train(src, batches(2), torch.optim.SGD(src.parameters(), lr=0.1))
    good = {k: v.clone() for k, v in src.sparse.state_dict().items()}
    dst = dynemb.EmbeddingBagCollection(configs("hbm_only", tmp_path / "d"))
    dst.tables["u"].insert_or_assign(torch.tensor([7]), torch.ones(1, 8))
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    meta = decode(good["tables.i.meta"], "meta")

    bad_states = {
        "a meta without optimizer_step": {"tables.i.meta": encode(
            {k: v for k, v in meta.items() if k != "optimizer_step"})},
        "a meta with a string step": {"tables.i.meta": encode({**meta, "step": "7"})},
        "a float meta": {"tables.i.meta": good["tables.i.meta"].float()},
        "negative log lengths": {"tables.i.eviction_log.lengths": torch.tensor([-1, 1]),
                                 "tables.i.eviction_log.steps": torch.tensor([1, 2])},
    }
    for why, change in bad_states.items():
        with pytest.raises(ConfigError):
            dst.load_state_dict({**good, **change})
        assert_equal_states(dst.state_dict(), before), why
    lk = dst.tables["i"].lookup(torch.tensor([1]), train=True, hold=True)
    with pytest.raises(ConfigError, match="held by lookups in flight"):
        dst.load_state_dict(good)
    dst.tables["i"].release(lk)
    assert torch.equal(dst.state_dict()["tables.u.rows.hbm"], before["tables.u.rows.hbm"])
    assert dst.tables["u"].size() == 1  # "u" was not loaded before "i" refused


def test_a_numpy_lookup_score_is_saved(tmp_path):
    import numpy as np

    cfg = [dynemb.TableConfig(name="t", dim=4, features=["f"], capacity=128,
                              score=dynemb.ScorePolicy.CUSTOM)]
    ebc = dynemb.EmbeddingBagCollection(cfg)
    ebc.tables["t"].lookup_score = np.int64(5)
    assert decode(ebc.state_dict()["tables.t.meta"], "meta")["lookup_score"] == 5


def test_a_collection_never_built_saves_no_tables_and_builds_none(tmp_path):
    ebc = dynemb.EmbeddingBagCollection(configs("hbm_only", tmp_path))
    assert ebc.state_dict() == {} and not ebc.built
    other = dynemb.EmbeddingBagCollection(configs("hbm_only", tmp_path))
    other.load_state_dict(ebc.state_dict())
    assert not other.built


def _rows(ebc: dynemb.EmbeddingBagCollection, name: str, keys: torch.Tensor):
    r = ebc.tables[name].find(keys)
    return r.found, r.values


def test_a_torch_backend_state_is_refused_by_a_probing_backend_and_moves_by_checkpoint(
        tmp_path):
    """The torch reference puts a key in its bucket's first free slot, numba and triton probe
    from its start slot: a torch state loaded slot for slot into numba would lose most rows."""
    keys = torch.arange(0, 700, 7)  # 100 keys: most of table i's 128 rows
    src = Model(configs("hbm_only", tmp_path))
    src.sparse = dynemb.EmbeddingBagCollection(configs("hbm_only", tmp_path), backend="torch")
    train(src, batches(4), torch.optim.SGD(src.parameters(), lr=0.1))
    for name in ("u", "i"):
        src.sparse.tables[name].find_or_insert(keys)  # full buckets: keys far from their start
    dst = dynemb.EmbeddingBagCollection(configs("hbm_only", tmp_path))
    dst.tables  # noqa: B018  (built)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ConfigError, match="backend='torch'") as e:
        dst.load_state_dict(saved(src.sparse.state_dict()))
    assert "dynemb.checkpoint" in str(e.value)
    assert_equal_states(dst.state_dict(), before)
    # the other way loads slot for slot: the reference compares whole buckets
    back = dynemb.EmbeddingBagCollection(configs("hbm_only", tmp_path), backend="torch")
    back.load_state_dict(saved(dst.state_dict()))
    # and the checkpoint route inserts by key, so every row reaches the numba table
    dynemb.checkpoint.save(tmp_path / "ck", model=src, step=4)
    fresh = Model(configs("hbm_only", tmp_path))
    dynemb.checkpoint.load(tmp_path / "ck", model=fresh)
    for name in ("u", "i"):
        found, values = _rows(fresh.sparse, name, keys)
        want_found, want = _rows(src.sparse, name, keys)
        assert bool(want_found.all()) and torch.equal(found, want_found)
        assert torch.equal(values, want)
