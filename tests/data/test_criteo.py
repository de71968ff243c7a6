"""The streaming Criteo TSV reader on small files the tests write (missing values, .gz, the
eval split, ranks, restarts, the exact field formats, and errors naming the file and line)."""

from __future__ import annotations

import gzip
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynemb.data import CriteoTSV, parse_lines
from dynemb.errors import ConfigError, InputError


def _line(rng: random.Random, label: int | None = None) -> str:
    label = rng.randint(0, 1) if label is None else label
    ints = [str(rng.randint(-2, 500)) if rng.random() > 0.2 else "" for _ in range(13)]
    cats = [f"{rng.getrandbits(32):08x}" if rng.random() > 0.2 else "" for _ in range(26)]
    return "\t".join([str(label), *ints, *cats]) + "\n"


@pytest.fixture
def tsv(tmp_path: Path) -> Path:
    rng = random.Random(0)
    path = tmp_path / "day_0.tsv"
    path.write_text("".join(_line(rng) for _ in range(100)))
    return path


def test_parse_values_missing_and_negative():
    ints = ["5", "", "-3"] + ["0"] * 10
    cats = ["68fd1e64", ""] + ["0a"] * 24
    batch = parse_lines([(1, "\t".join(["1", *ints, *cats]) + "\n")])
    assert batch.labels.tolist() == [1.0]
    assert batch.dense[0, :3].tolist() == pytest.approx([math.log1p(5), 0.0, 0.0])
    values, lengths, _ = batch.sparse.feature("c1")
    assert values.tolist() == [0x68FD1E64] and lengths.tolist() == [1]
    assert batch.sparse.feature("c2")[1].tolist() == [0]  # missing: an empty bag
    assert batch.sparse.feature("c26")[0].tolist() == [10]


def test_eval_split_ranks_and_train_sample(tsv):
    data = CriteoTSV(tsv, eval_fraction=0.1)
    held = torch.cat([b.labels for b in data.eval_batches(7)])
    assert held.numel() == 10  # every 10th line
    lines = tsv.read_text().splitlines()
    assert held.tolist() == [float(lines[i].split("\t")[0]) for i in range(9, 100, 10)]
    per_rank = [torch.cat([b.labels for b in data.eval_batches(4, rank=r, world_size=2)])
                for r in range(2)]
    assert sorted(x.numel() for x in per_rank) == [5, 5]
    sample = torch.cat([b.labels for b in data.train_sample_batches(16, 30)])
    train_lines = [ln for i, ln in enumerate(lines) if i % 10 != 9]
    assert sample.tolist() == [float(ln.split("\t")[0]) for ln in train_lines[:30]]


def test_training_cycles_endlessly_and_restarts_at_a_batch(tsv):
    data = CriteoTSV(tsv, eval_fraction=0.1)  # 90 training lines
    it = data.train_batches(40)
    batches = [next(it) for _ in range(5)]  # 200 lines: more than two passes
    assert all(b.size == 40 for b in batches)
    again = next(data.train_batches(40, start=3))
    assert torch.equal(again.sparse.values, batches[3].sparse.values)
    r1 = next(data.train_batches(10, rank=1, world_size=2))
    whole = next(data.train_batches(20))
    assert torch.equal(r1.labels, whole.labels[1::2])


def test_gzip_files(tsv, tmp_path):
    gz = tmp_path / "day_0.tsv.gz"
    with gzip.open(gz, "wt") as f:
        f.write(tsv.read_text())
    a = next(CriteoTSV(gz).train_batches(32))
    b = next(CriteoTSV(tsv).train_batches(32))
    assert torch.equal(a.sparse.values, b.sparse.values) and torch.equal(a.dense, b.dense)


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p[:-1], "expected 40 tab-separated fields"),
    (lambda p: ["2", *p[1:]], "a label of 0 or 1"),
    (lambda p: [p[0], "x1", *p[2:]], "an integer"),
    (lambda p: [*p[:20], "zz", *p[21:]], "hex category"),
    (lambda p: [""] * 40, "a label of 0 or 1"),  # 39 tabs: was skipped as blank, silently
])
def test_bad_lines_name_the_file_and_line(tmp_path, mutate, match):
    rng = random.Random(1)
    good = [_line(rng, 0) for _ in range(3)]
    parts = good[1].rstrip("\n").split("\t")
    good[1] = "\t".join(mutate(parts)) + "\n"
    path = tmp_path / "bad.tsv"
    path.write_text("".join(good))
    with pytest.raises(InputError, match=match) as info:
        next(CriteoTSV(path, eval_fraction=0.25).train_batches(3))
    assert f"{path}:2" in str(info.value)


def test_crlf_line_ends_and_blank_lines(tmp_path, tsv):
    """Windows line ends read as the same file; blank lines (nothing but spaces before the
    line end) are skipped."""
    crlf = tmp_path / "crlf.tsv"
    crlf.write_bytes(tsv.read_bytes().replace(b"\n", b"\r\n") + b"  \r\n\r\n\n")
    want, got = CriteoTSV(tsv).eval_batches(7), CriteoTSV(crlf).eval_batches(7)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.labels, b.labels) and torch.equal(a.dense, b.dense)
        assert torch.equal(a.sparse.values, b.sparse.values)


def test_missing_file_and_too_few_lines(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        CriteoTSV(tmp_path / "none.tsv")
    path = tmp_path / "one.tsv"
    path.write_text(_line(random.Random(2)))
    with pytest.raises(ConfigError, match="no training lines"):
        next(CriteoTSV(path, eval_fraction=0.5).train_batches(4, rank=1, world_size=2))


def _with_field(index: int, text: str) -> str:
    """A valid line whose field ``index`` (0-based: 0 label, 1-13 integers, 14-39 categories)
    is ``text``."""
    parts = ["1", *["7"] * 13, *["68fd1e64"] * 26]
    parts[index] = text
    return "\t".join(parts) + "\n"


@pytest.mark.parametrize("index,text", [
    (1, "--5"), (1, "9" * 400), (1, "9223372036854775808"), (1, "-9223372036854775809"),
    (1, "+5"), (1, " 5"), (1, "5 "), (1, "1_000"), (1, "5.0"), (1, "0x10"), (1, "\u0665"),
    (1, "-"),
    (14, "-1f"), (14, "0x1f"), (14, "de_ad"), (14, " ff "), (14, "ff "), (14, "a" * 40),
    (14, "1" * 17), (14, "+ff"), (14, "g1"), (39, "8000000000000000"), (39, "\u0661"),
])
def test_malformed_fields_raise_input_error_naming_file_line_and_field(tmp_path, index, text):
    """Integers: an optional '-' and decimal digits within int64; categories: 1-16 hex digits,
    nothing else. What int() would quietly accept (signs, prefixes, underscores, spaces,
    400 digits) is an InputError naming the file, the line and the field."""
    path = tmp_path / "bad.tsv"
    path.write_text(_with_field(1, "3") + _with_field(index, text), encoding="utf-8")
    with pytest.raises(InputError) as info:
        next(CriteoTSV(path, eval_fraction=0.25).train_batches(2))
    message = str(info.value)
    assert f"{path}:2, field {index + 1} " in message, message
    assert len(message) < 400  # a 400-digit value is shortened, not echoed whole


def test_the_accepted_field_formats_and_their_values():
    line = "\t".join(["0", "-9223372036854775808", "9223372036854775807", "", "00012",
                      *["0"] * 9, "ffffffffffffffff", "7FFFFFFFFFFFFFFF", "68FD1E64", "68fd1e64",
                      "0", "a", "", *["1"] * 19])
    batch = parse_lines([(1, line)])
    assert batch.dense[0, :4].tolist() == pytest.approx([0.0, math.log1p(2.0**63 - 1), 0.0,
                                                         math.log1p(12)])
    ids = [batch.sparse.feature(f"c{f}")[0].tolist() for f in range(1, 8)]
    assert ids == [[-1], [(1 << 63) - 1], [0x68FD1E64], [0x68FD1E64], [0], [10], []]


def test_a_fake_gz_raises_input_error(tmp_path):
    fake = tmp_path / "day_0.tsv.gz"
    fake.write_text(_with_field(1, "3"))
    with pytest.raises(InputError, match=r"day_0\.tsv\.gz:1: expected gzip data"):
        CriteoTSV(fake)


def test_a_damaged_gz_raises_input_error_naming_the_line(tmp_path, tsv):
    data = gzip.compress(tsv.read_bytes())
    cut = tmp_path / "cut.tsv.gz"
    cut.write_bytes(data[:len(data) // 2])  # truncated
    with pytest.raises(InputError, match=r"cut\.tsv\.gz:\d+: cannot read gzip data after line"):
        for _ in CriteoTSV(cut).eval_batches(8):
            pass
    flipped = bytearray(data)
    flipped[-8] ^= 0xFF  # the CRC-32 of the trailer: detected at the end of the stream
    bad = tmp_path / "crc.tsv.gz"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(InputError, match=r"crc\.tsv\.gz:101: cannot read gzip data after "
                                         r"line 100 \(CRC check failed"):
        for _ in CriteoTSV(bad).eval_batches(8):
            pass
    for at in range(20, len(data) - 8, 97):  # damage anywhere: an InputError naming the file
        flipped = bytearray(data)
        flipped[at] ^= 0x5A
        bad.write_bytes(bytes(flipped))
        with pytest.raises(InputError, match=r"crc\.tsv\.gz:\d+"):
            for _ in CriteoTSV(bad).eval_batches(8):
                pass
