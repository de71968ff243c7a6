"""Checkpoint integrity: the manifest is sealed by a checksum and validated whole (types, ranges,
consistency, file names), every file's own metadata is cross-checked, paths stay inside the
checkpoint, colliding table names are refused at save, a save replaces only a checkpoint, step
marks live on the tables. Every failure is a CheckpointError raised before the model changed.

Tampering tests re-seal the manifest (``manifest.write_json`` recomputes the checksum), so they
show the checks behind the checksum, as a bug or a deliberate edit would meet them."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import signal

import pytest
import torch

import dynemb
from dynemb import checkpoint
from dynemb.checkpoint import CheckpointError, files, inspect, manifest, steps
from dynemb.cli import main as cli_main

import _models as M
from _models import expect_untouched, fresh, trained_other


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a model trained 3 steps (a: Adam dim 4; b: Adagrad dim 3, admission)."""
    path = tmp_path_factory.mktemp("ck") / "ck"
    model, opt = fresh()
    M.train(model, opt, range(3))
    checkpoint.save(path, model=model, dense_optimizer=opt, step=3)
    return path


def copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def read(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def reseal(path, data: dict) -> None:
    (path / "manifest.json").write_bytes(manifest.write_json(data))


def expect_refused(path, model=None, opt=None, match: str = "", files_ok: bool = False,
                   **load_kw) -> str:
    """load raises CheckpointError matching ``match`` with the model untouched; inspect's
    verify_all raises CheckpointError too (never KeyError and the like), unless ``files_ok``
    (the files hold what was saved, and the load refuses the values)."""
    if model is None:
        model, opt = trained_other()
    message = expect_untouched(path, model, opt, match, **load_kw)
    if files_ok:
        inspect.verify_all(path)
    else:
        with pytest.raises(CheckpointError):
            inspect.verify_all(path)
    return message


def _flip_digit(path, needle: str) -> None:
    raw = bytearray((path / "manifest.json").read_bytes())
    at = raw.index(needle.encode()) + len(needle) - 1
    raw[at] ^= 0x01  # "3" -> "2": one bit
    (path / "manifest.json").write_bytes(bytes(raw))


def test_one_bit_flip_of_a_step_counter_fails_the_checksum(saved, tmp_path):
    """Before: the flipped optimizer step loaded silently (wrong Adam bias correction) and
    inspect --verify said OK."""
    path = copy(saved, tmp_path)
    _flip_digit(path, '"optimizer_step": 3')
    msg = expect_refused(path, match="fails its checksum")
    assert "manifest_sha256" in msg
    assert cli_main(["inspect", str(path), "--verify"]) == 1


@pytest.mark.parametrize("field,value", [
    ("table_step", "3"), ("table_step", -1), ("table_step", 2**64), ("table_step", True),
    ("optimizer_step", None), ("rows", 10**20), ("parts", "x"),
])
def test_bad_numbers_are_refused_before_any_change(saved, tmp_path, field, value):
    """Before: a string table_step left the model half-loaded (table a loaded, b failed)."""
    path = copy(saved, tmp_path)
    m = read(path)
    m["tables"]["sparse/b"]["ranks"][0][field] = value
    reseal(path, m)
    expect_refused(path, match=f"field tables\\['sparse/b'\\].ranks\\[0\\].{field}: expected")


def _drop(m: dict, where: list) -> None:
    obj = m
    for k in where[:-1]:
        obj = obj[k]
    del obj[where[-1]]


@pytest.mark.parametrize("where", [
    ["step"], ["world_size"], ["dense"], ["dense", "files"], ["files"], ["kind"],
    ["tables", "sparse/a", "dim"], ["tables", "sparse/b", "ranks"],
    ["tables", "sparse/a", "ranks", 0, "parts", 0, "file"],
    ["tables", "sparse/b", "ranks", 0, "admission"],
])
def test_missing_fields_are_checkpoint_errors_for_load_and_inspect(saved, tmp_path, capsys,
                                                                   where):
    """Before: KeyError / IndexError / TypeError, some after the model changed, and tracebacks
    from ``dynemb inspect``."""
    path = copy(saved, tmp_path)
    m = read(path)
    _drop(m, where)
    reseal(path, m)
    expect_refused(path, match="manifest.json field")
    with pytest.raises(CheckpointError):
        inspect.describe(path)
    for flags in ([], ["--verify"], ["--json"]):
        assert cli_main(["inspect", str(path), *flags]) == 1
    assert "manifest.json field" in capsys.readouterr().err


def test_inspect_prints_any_manifest_string_without_a_traceback(saved, tmp_path, capsys):
    """A re-sealed manifest whose strings hold a lone surrogate and a terminal escape: inspect
    used to die of UnicodeEncodeError printing them (and passed escapes to the terminal)."""
    path = copy(saved, tmp_path)
    m = read(path)
    m["library_version"] = "0.1\ud800\x1b[2J"
    m["dense"]["optimizer"] = "torch.optim.\x07Bell"
    reseal(path, m)
    capsys.readouterr()
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "dynemb 0.1\\ud800\\x1b[2J," in out and "optimizer torch.optim.\\x07Bell" in out
    assert all(c.isprintable() for c in out.replace("\n", ""))


def test_a_manifest_that_is_a_fifo_or_huge_is_refused_without_reading_it(saved, tmp_path):
    """A FIFO in place of manifest.json used to block load, save and inspect forever; a huge
    (sparse) manifest was read 256 MiB into memory before being refused."""
    fifo = copy(saved, tmp_path, "fifo")
    (fifo / "manifest.json").unlink()
    os.mkfifo(fifo / "manifest.json")

    def blocked(*_):
        raise AssertionError("blocked opening the FIFO")
    previous = signal.signal(signal.SIGALRM, blocked)
    signal.setitimer(signal.ITIMER_REAL, 30)  # fail, rather than hang, if it blocks
    try:
        expect_refused(fifo, match="has no manifest.json")
        assert cli_main(["inspect", str(fifo)]) == 1
        with pytest.raises(CheckpointError, match="is not a dynemb checkpoint"):
            checkpoint.save(fifo, model=fresh()[0], step=1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    huge = copy(saved, tmp_path, "huge")
    with open(huge / "manifest.json", "r+b") as f:
        f.truncate(manifest.MAX_MANIFEST_BYTES + 1)
    read_bytes = []
    real_fdopen = os.fdopen
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fdopen", lambda *a, **k: read_bytes.append(1) or real_fdopen(*a, **k))
        expect_refused(huge, match="is larger than")
    assert read_bytes == []


def test_a_dense_file_holding_no_tensor_is_a_checkpoint_error(saved, tmp_path):
    """A re-sealed checkpoint whose dense state maps a name to an int: it used to raise
    AttributeError (no ``.shape``)."""
    path = copy(saved, tmp_path)
    dense = torch.load(path / "dense/rank00000.pt", weights_only=True)
    dense["model"]["mlp.0.weight"] = 5
    (path / "dense/rank00000.pt").unlink()
    entry = files.write_bytes(path / "dense/rank00000.pt", _pickled(dense))
    m = read(path)
    m["files"]["dense/rank00000.pt"] = entry.as_json()
    reseal(path, m)
    expect_refused(path, match="dense state 'mlp.0.weight' is a int in the checkpoint, "
                               "expected a tensor", files_ok=True)


def _pickled(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()

def _seal(raw: bytes) -> bytes:
    """``raw`` manifest bytes with their checksum recomputed (as ``write_json`` seals)."""
    at = raw.index(b'"manifest_sha256": "') + len(b'"manifest_sha256": "')
    zeroed = raw[:at] + b"0" * 64 + raw[at + 64:]
    return raw[:at] + hashlib.sha256(zeroed).hexdigest().encode() + raw[at + 64:]


def test_a_duplicate_key_is_refused_even_when_resealed(saved, tmp_path):
    """JSON keeps the last of two equal keys: a manifest saying ``"step"`` twice is refused,
    not read one way here and another way by another reader (no test guarded this)."""
    path = copy(saved, tmp_path)
    raw = (path / "manifest.json").read_bytes()
    assert b'\n "step": 3,' in raw
    (path / "manifest.json").write_bytes(_seal(raw.replace(b'\n "step": 3,',
                                                           b'\n "step": 9,\n "step": 3,')))
    expect_refused(path, match="not readable JSON .*key 'step' appears twice")

def test_empty_part_list_is_refused(saved, tmp_path):
    """Before: ``parts: []`` loaded an empty table."""
    path = copy(saved, tmp_path)
    m = read(path)
    m["tables"]["sparse/a"]["ranks"][0]["parts"] = []
    reseal(path, m)
    expect_refused(path, match="the sum of its parts' rows")


def _twins():
    """Two tables of the same shape (dim 3, Adagrad), so their files fit each other."""
    return dynemb.EmbeddingBagCollection([dynemb.TableConfig(
        name=n, dim=3, features=[f"f{n}"], capacity=64, optimizer=dynemb.Adagrad(lr=0.1))
        for n in ("a", "b")])


def test_swapped_part_lists_are_refused(tmp_path):
    """Before: table a's rows loaded into table b and back. Swapping the lists is refused by the
    file names; swapping the files themselves (manifest consistent by name) by their metadata."""
    src = _twins()
    src.tables["a"].find_or_insert(torch.arange(10))
    src.tables["b"].find_or_insert(torch.arange(100, 107))
    checkpoint.save(tmp_path / "ck", model=src, step=1)

    path = copy(tmp_path / "ck", tmp_path)
    m = read(path)
    ra, rb = m["tables"]["a"]["ranks"][0], m["tables"]["b"]["ranks"][0]
    ra["parts"], rb["parts"] = rb["parts"], ra["parts"]
    ra["rows"], rb["rows"] = rb["rows"], ra["rows"]
    reseal(path, m)
    target = _twins()
    expect_refused(path, target, match="expected a file under tables/<NNN>-a/")

    path = copy(tmp_path / "ck", tmp_path, "files")
    m = read(path)
    fa = m["tables"]["a"]["ranks"][0]["parts"][0]["file"]
    fb = m["tables"]["b"]["ranks"][0]["parts"][0]["file"]
    (path / fa).rename(path / "x")
    (path / fb).rename(path / fa)
    (path / "x").rename(path / fb)
    m["files"][fa], m["files"][fb] = m["files"][fb], m["files"][fa]
    ra, rb = m["tables"]["a"]["ranks"][0], m["tables"]["b"]["ranks"][0]
    ra["parts"][0]["rows"], rb["parts"][0]["rows"] = 7, 10
    ra["rows"], rb["rows"] = 7, 10
    reseal(path, m)
    msg = expect_refused(path, target, match="its metadata has table='b', the manifest says 'a'")
    assert fa in msg


def test_delta_relabelled_full_is_refused_before_it_wipes_the_base(tmp_path):
    model, opt = fresh()
    M.train(model, opt, range(2))
    checkpoint.save(tmp_path / "base", model=model, step=2)
    M.train(model, opt, range(2, 4))
    checkpoint.export_incremental(tmp_path / "delta", model=model, since_step=2, step=4)
    m = read(tmp_path / "delta")
    m["kind"], m["since_step"] = "full", None
    for t in m["tables"].values():
        for r in t["ranks"]:
            del m["files"][r["evicted"]["file"]]
            r["evicted"] = r["since_table_step"] = None
    reseal(tmp_path / "delta", m)
    target, _ = fresh()
    checkpoint.load(tmp_path / "base", model=target)
    msg = expect_refused(tmp_path / "delta", target, match="its metadata has kind='delta', the "
                                                           "manifest says 'full'")
    assert "part00000" in msg


@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside.safetensors",
                                 "tables/000-sparse_a/../../outside.safetensors"])
def test_paths_outside_the_checkpoint_are_refused(saved, tmp_path, bad):
    """Before: load and inspect --verify read any file the manifest named (a copy of the real
    part outside the checkpoint loaded fine)."""
    path = copy(saved, tmp_path)
    m = read(path)
    rel = m["tables"]["sparse/a"]["ranks"][0]["parts"][0]["file"]
    shutil.copy(path / rel, tmp_path / "outside.safetensors")
    m["tables"]["sparse/a"]["ranks"][0]["parts"][0]["file"] = bad
    m["files"][bad] = m["files"].pop(rel)
    reseal(path, m)
    expect_refused(path, match="expected a file under tables/<NNN>-sparse_a/, found "
                               f"'{bad}'")


def test_symbolic_link_out_of_the_checkpoint_is_refused(saved, tmp_path):
    path = copy(saved, tmp_path)
    rel = read(path)["tables"]["sparse/a"]["ranks"][0]["parts"][0]["file"]
    shutil.move(path / rel, tmp_path / "outside.safetensors")
    (path / rel).symlink_to(tmp_path / "outside.safetensors")
    expect_refused(path, match="outside the checkpoint directory")


def test_colliding_table_names_are_refused_at_save(tmp_path):
    """Before: the save kept one of the two tables and the checkpoint could never load."""
    def ebc(name):
        return dynemb.EmbeddingBagCollection([dynemb.TableConfig(
            name=name, dim=2, features=[f"f_{name}"], capacity=16)])

    model = torch.nn.Module()
    model.add_module("sparse", ebc("more/x"))
    model.add_module("sparse/more", ebc("x"))
    with pytest.raises(CheckpointError, match="table 'more/x' of the collection at 'sparse' and "
                                              "table 'x' of the collection at 'sparse/more' would "
                                              "both be saved as 'sparse/more/x'"):
        checkpoint.save(tmp_path / "ck", model=model, step=0)
    assert not list(tmp_path.iterdir())


def test_save_replaces_only_a_checkpoint(saved, tmp_path):
    """Before: any directory holding a file named manifest.json was replaced, with everything
    else in it."""
    model, _ = fresh()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"my": "notes"}')
    (mine / "data.csv").write_text("keep me")
    with pytest.raises(CheckpointError, match="is not a dynemb checkpoint"):
        checkpoint.save(mine, model=model, step=1)
    assert (mine / "data.csv").read_text() == "keep me"

    ck = copy(saved, tmp_path)  # a real checkpoint with a file of the user's added
    (ck / "tables" / "notes.txt").write_text("keep me too")
    with pytest.raises(CheckpointError, match=r"entries its manifest does not name "
                                              r"\(\[.tables/notes.txt.\], 1 in all\)"):
        checkpoint.save(ck, model=model, step=1)
    assert (ck / "tables" / "notes.txt").exists()
    (ck / "tables" / "notes.txt").unlink()
    checkpoint.save(ck, model=model, step=1)  # a checkpoint (and an empty dir) is replaced
    (tmp_path / "empty").mkdir()
    checkpoint.save(tmp_path / "empty", model=model, step=1)
    assert checkpoint.load(ck, model=fresh()[0]) == checkpoint.load(tmp_path / "empty",
                                                                      model=fresh()[0]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "empty", "mine"]


def test_step_marks_live_on_the_table(tmp_path):
    """Before: a process-global map held them; now each table carries its own."""
    model, opt = fresh()
    M.train(model, opt, range(2))
    checkpoint.save(tmp_path / "ck", model=model, step=2)
    for t in model.sparse.tables.values():
        assert isinstance(t.checkpoint_marks, steps.TableSteps)
        assert t.checkpoint_marks.marks == {2: t.step}
    assert not hasattr(steps, "_STEPS")
    other, _ = fresh()
    assert all(t.checkpoint_marks is None for t in other.sparse.tables.values())
    checkpoint.load(tmp_path / "ck", model=other)
    assert other.sparse.tables["a"].checkpoint_marks.marks == {2: other.sparse.tables["a"].step}


def test_format_1_checkpoints_load_with_a_warning(saved, tmp_path, caplog):
    """Format 1 (before the checksum): read, validated by the schema and its files checked, with
    a warning that an edit cannot be detected."""
    path = copy(saved, tmp_path)
    m = read(path)
    del m["manifest_sha256"]
    m["format_version"] = 1
    (path / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))
    model, opt = fresh()
    with caplog.at_level(logging.WARNING, logger="dynemb.checkpoint.manifest"):
        assert checkpoint.load(path, model=model, dense_optimizer=opt) == 3
    assert "format version 1 has no manifest checksum" in caplog.text
    want, _ = fresh()
    checkpoint.load(saved, model=want)
    M.assert_same_tables(M.snapshot(model), M.snapshot(want))
    assert inspect.verify_all(path) == len(m["files"])
    m["tables"]["sparse/a"]["ranks"][0]["parts"] = []
    (path / "manifest.json").write_text(json.dumps(m))
    expect_refused(path, match="the sum of its parts' rows")  # the schema still applies


def test_rows_that_are_not_finite_are_refused_before_any_change(tmp_path):
    """A table trained with nonfinite='apply' may save NaN rows, which ``load_rows`` refuses:
    the load refuses them during validation, not half-way through the tables."""
    model, opt = fresh()
    M.train(model, opt, range(2))
    table = model.sparse.tables["b"]  # the second table: "a" would load first
    table.store.hbm[table.index.occupied(0, table.capacity())[0]] = float("nan")
    checkpoint.save(tmp_path / "ck", model=model, dense_optimizer=opt, step=2)
    expect_refused(tmp_path / "ck", match="table 'sparse/b' holds rows whose embedding or "
                                          "optimizer state is NaN or infinite", files_ok=True)
