"""Single-process round trips: train, save, load into a fresh model, continue: the same rows,
optimizer state, scores, admission counters, outputs and losses as uninterrupted training; the
files are plain safetensors; ``inspect`` describes them."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import dynemb
from dynemb import checkpoint
from dynemb.cli import main as cli_main
from dynemb.checkpoint import inspect, reader, writer

import _models as M

STEPS, CUT = 8, 4


def fresh(kind=dynemb.EmbeddingBagCollection, **kw):
    model = M.Tiny(kind(M.tables(**kw)))
    return model, torch.optim.Adam(model.mlp.parameters(), lr=0.01)


def test_resume_equals_uninterrupted_training(tmp_path):
    ref, ref_opt = fresh()
    ref_out = M.train(ref, ref_opt, range(STEPS))

    model, opt = fresh()
    M.train(model, opt, range(CUT))
    checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=CUT)
    before = M.snapshot(model)
    resumed, resumed_opt = fresh()
    assert checkpoint.load(tmp_path / "ck", model=resumed, dense_optimizer=resumed_opt) == CUT
    M.assert_same_tables(M.snapshot(resumed), before)
    assert any(r["admission"][0].numel() for r in before.values() if "admission" in r)
    out = M.train(resumed, resumed_opt, range(CUT, STEPS))
    for (loss, logits), (ref_loss, ref_logits) in zip(out, ref_out[CUT:]):
        assert loss == ref_loss
        assert torch.equal(logits, ref_logits)
    M.assert_same_tables(M.snapshot(resumed), M.snapshot(ref))
    for p, q in zip(resumed.mlp.parameters(), ref.mlp.parameters()):
        assert torch.equal(p, q)


def test_sequence_collection_and_torch_backend(tmp_path):
    ec = dynemb.EmbeddingCollection(M.tables(), backend="torch")
    b, _ = M.batch(0)
    out = ec(b)
    sum(v.values.sum() for v in out.values()).backward()
    checkpoint.save(tmp_path / "ec", model=ec, step=1)
    other = dynemb.EmbeddingCollection(M.tables())  # numba backend: the rows are the same
    assert checkpoint.load(tmp_path / "ec", model=other) == 1
    M.assert_same_tables(M.snapshot(other), M.snapshot(ec))


def test_many_parts_and_small_read_windows(tmp_path, monkeypatch):
    """Shard files hold PART_BYTES of rows each; loads read READ_ROWS rows at a time."""
    model, opt = fresh(capacity=4096)
    for s in range(3):
        M.train(model, opt, range(s, s + 1), id_high=1500, size=40)
    monkeypatch.setattr(writer, "PART_BYTES", 1000)  # a few dozen rows per part
    monkeypatch.setattr(reader, "READ_ROWS", 7)
    checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=3)
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    parts = manifest["tables"]["sparse/a"]["ranks"][0]["parts"]
    assert len(parts) > 3 and sum(p["rows"] for p in parts) == model.sparse.tables["a"].size()
    other, other_opt = fresh(capacity=4096)
    checkpoint.load(tmp_path / "ck", model=other, dense_optimizer=other_opt)
    M.assert_same_tables(M.snapshot(other), M.snapshot(model))


def test_files_are_plain_safetensors_and_manifest_fields(tmp_path):
    model, opt = fresh()
    M.train(model, opt, range(3))
    checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=3)
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert (m["format"], m["format_version"], m["kind"], m["step"], m["world_size"]) == \
        ("dynemb-checkpoint", checkpoint.FORMAT_VERSION, "full", 3, 1)
    assert m["library_version"] == dynemb.__version__
    a = m["tables"]["sparse/a"]
    assert (a["routing"], a["storage_mode"], a["optimizer"]["type"], a["dim"]) == \
        ("hash_roundrobin", "hbm_only", "Adam", 4)
    assert a["config"]["capacity"] == 512 and a["optimizer"]["lr"] == 0.05
    assert m["dense"]["optimizer"] == "torch.optim.adam.Adam"
    for rel, entry in m["files"].items():
        assert (tmp_path / "ck" / rel).stat().st_size == entry["bytes"]
        assert len(entry["sha256"]) == 64
    part = load_file(tmp_path / "ck" / a["ranks"][0]["parts"][0]["file"])
    want = M.export(model.sparse.tables["a"])
    order = torch.argsort(part["keys"])
    for f in ("keys", "embeddings", "optimizer_state", "scores"):
        assert torch.equal(part[f][order], want[f])
    adm = load_file(tmp_path / "ck" / m["tables"]["sparse/b"]["ranks"][0]["admission"]["file"])
    assert set(adm) == {"keys", "counts"}


def test_save_replaces_previous_checkpoint_and_refuses_other_dirs(tmp_path):
    model, opt = fresh()
    M.train(model, opt, range(2))
    checkpoint.save(tmp_path / "ck", model=model, step=2)
    M.train(model, opt, range(2, 4))
    checkpoint.save(tmp_path / "ck", model=model, step=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporary leftovers
    other, _ = fresh()
    assert checkpoint.load(tmp_path / "ck", model=other) == 4
    M.assert_same_tables(M.snapshot(other), M.snapshot(model))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(checkpoint.CheckpointError, match="not a dynemb checkpoint"):
        checkpoint.save(tmp_path / "mine", model=model, step=4)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_load_into_trained_model_replaces_every_row(tmp_path):
    model, opt = fresh()
    M.train(model, opt, range(2))
    checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=2)
    want = M.snapshot(model)
    M.train(model, opt, range(2, 6), seed=1, id_high=200)  # new keys, more steps
    checkpoint.load(tmp_path / "ck", model=model, dense_optimizer=opt)
    M.assert_same_tables(M.snapshot(model), want)


def test_inspect_describes_and_verifies(tmp_path, capsys):
    model, opt = fresh()
    M.train(model, opt, range(3))
    checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=3)
    text = inspect.describe(tmp_path / "ck")
    rows_a = model.sparse.tables["a"].size()
    assert "kind full, step 3, world size 1" in text
    assert "table 'sparse/a': dim 4, optimizer Adam(" in text and "routing hash_roundrobin" in text
    assert f"total {rows_a:,} rows" in text
    assert cli_main(["inspect", str(tmp_path / "ck"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verified" in out and "table 'sparse/b'" in out
    assert cli_main(["inspect", str(tmp_path / "ck"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    assert cli_main(["inspect", str(tmp_path / "nothing")]) == 1
    assert "not a directory" in capsys.readouterr().err



def test_sharded_collection_at_the_root_and_plain_twin(tmp_path, group_of_one):
    """A sharded collection over one rank (the model itself) and the plain collection share
    table names and routing: each loads the other's checkpoint without reshard."""
    sharded = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(M.tables()))
    b, _ = M.batch(0)
    sharded(b).values().sum().backward()
    checkpoint.save(tmp_path / "s", model=sharded, step=1)
    assert sorted(json.loads((tmp_path / "s" / "manifest.json").read_text())["tables"]) == \
        ["a", "b"]
    plain = dynemb.EmbeddingBagCollection(M.tables())
    assert checkpoint.load(tmp_path / "s", model=plain) == 1
    M.assert_same_tables(M.snapshot(plain), M.snapshot(sharded))
    checkpoint.save(tmp_path / "p", model=plain, step=1)
    again = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(M.tables()))
    checkpoint.load(tmp_path / "p", model=again)
    M.assert_same_tables(M.snapshot(again), M.snapshot(sharded))


@pytest.mark.parametrize("mode", ["hybrid", "caching"])
def test_storage_tiers_round_trip_and_change_mode(tmp_path, mode):
    """HYBRID and CACHING tables save every row (CACHING flushes first) and load into another
    storage mode: the mode changes where rows live, not what they are."""
    storage = dynemb.Storage(mode=dynemb.StorageMode(mode), cache_load_factor=0.2)
    tiered = [dynemb.TableConfig(**{**t.__dict__, "storage": storage}) for t in M.tables()]
    model = M.Tiny(dynemb.EmbeddingBagCollection(tiered))
    opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    M.train(model, opt, range(4), id_high=300, size=20)
    checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=4)
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert m["tables"]["sparse/a"]["storage_mode"] == mode
    plain, plain_opt = fresh()
    checkpoint.load(tmp_path / "ck", model=plain, dense_optimizer=plain_opt)
    M.assert_same_tables(M.snapshot(plain), M.snapshot(model))
    back = M.Tiny(dynemb.EmbeddingBagCollection(tiered))
    checkpoint.load(tmp_path / "ck", model=back)
    M.assert_same_tables(M.snapshot(back), M.snapshot(model))


OPTIMIZERS = [dynemb.SGD(lr=0.1), dynemb.Adagrad(lr=0.1), dynemb.RowWiseAdagrad(lr=0.1),
              dynemb.Adam(lr=0.1)]


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dim=st.integers(1, 9), opt=st.sampled_from(OPTIMIZERS),
       score=st.sampled_from([dynemb.ScorePolicy.LRU, dynemb.ScorePolicy.LFU,
                              dynemb.ScorePolicy.STEP]),
       keys=st.lists(st.integers(-(2**63) + 1, 2**63 - 1), max_size=60),
       part_bytes=st.sampled_from([1, 200, 64 << 20]), read_rows=st.sampled_from([1, 5, 1 << 17]))
def test_property_round_trip(tmp_path_factory, monkeypatch, dim, opt, score, keys, part_bytes,
                             read_rows):
    """Any keys (the reserved empty key aside), dims, optimizers, score policies, part sizes
    and read windows: load(save(table)) holds the same rows, state, scores and steps."""
    keys = [k for k in keys if k != dynemb.EMPTY_KEY]
    config = dynemb.TableConfig(name="t", dim=dim, features=["f"], capacity=256, optimizer=opt,
                                score=score)
    src = dynemb.EmbeddingBagCollection([config])
    table = src.tables["t"]
    if keys:
        k = torch.tensor(keys, dtype=torch.int64)
        table.find_or_insert(k)
        u = torch.unique(k)
        table.insert_or_assign(u, torch.randn(u.numel(), dim),
                               optimizer_state=torch.rand(u.numel(), table.optimizer.state_width))
    table.optimizer.step = len(keys)
    monkeypatch.setattr(writer, "PART_BYTES", part_bytes)
    monkeypatch.setattr(reader, "READ_ROWS", read_rows)
    path = tmp_path_factory.mktemp("prop") / "ck"
    checkpoint.save(path, model=src, step=len(keys))
    dst = dynemb.EmbeddingBagCollection([config])
    assert checkpoint.load(path, model=dst) == len(keys)
    M.assert_same_tables(M.snapshot(dst), M.snapshot(src))


def test_a_model_wrapped_whole_in_ddp_and_the_bare_model_load_each_other(tmp_path, group_of_one):
    """The table names drop DDP's ``module`` level as the dense names do: the manifest names
    the tables as the bare model does, and each model resumes from the other's checkpoint."""
    from torch.nn.parallel import DistributedDataParallel

    ref, ref_opt = fresh()
    ref_out = M.train(ref, ref_opt, range(STEPS))
    model, _ = fresh()
    wrapped = DistributedDataParallel(model)
    opt = torch.optim.Adam(wrapped.module.mlp.parameters(), lr=0.01)
    M.train(wrapped, opt, range(CUT))
    checkpoint.save(tmp_path / "ddp", model=wrapped, dense_optimizer=opt, step=CUT)
    names = sorted(json.loads((tmp_path / "ddp" / "manifest.json").read_text())["tables"])
    assert names == ["sparse/a", "sparse/b"]
    bare, bare_opt = fresh()
    assert checkpoint.load(tmp_path / "ddp", model=bare, dense_optimizer=bare_opt) == CUT
    out = M.train(bare, bare_opt, range(CUT, STEPS))
    assert [loss for loss, _ in out] == [loss for loss, _ in ref_out[CUT:]]
    M.assert_same_tables(M.snapshot(bare), M.snapshot(ref))
    checkpoint.save(tmp_path / "bare", model=bare, dense_optimizer=bare_opt, step=STEPS)
    again, _ = fresh()
    rewrapped = DistributedDataParallel(again)
    assert checkpoint.load(tmp_path / "bare", model=rewrapped) == STEPS
    M.assert_same_tables(M.snapshot(again), M.snapshot(ref))
