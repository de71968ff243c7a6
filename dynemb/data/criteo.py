"""A streaming reader of the Criteo TSV format (the Kaggle Display Advertising Challenge and the
Terabyte click logs), for users' own files.

Each line: the label, 13 integer features and 26 categorical features, tab-separated; any
feature may be empty (missing). The accepted format, exactly (anything else raises
:class:`~dynemb.errors.InputError` naming the file, the line and the field):

- label: ``0`` or ``1``;
- integer feature: an optional ``-`` and 1 to 19 ASCII digits, within int64
  ([-2**63, 2**63 - 1]); no ``+``, spaces, underscores or decimal point. Fed to the model as
  ``log1p(max(x, 0))``, a missing value as 0;
- categorical feature: 1 to 16 hexadecimal digits (``0-9``, ``a-f``, either case), nothing
  else (no sign, ``0x`` prefix, underscore or whitespace). Criteo writes 8 lowercase digits.
  The id is the 64-bit value read as a two's-complement int64 (``ffffffffffffffff`` is -1), so
  distinct values are distinct ids; ``8000000000000000``, dynemb's reserved empty key, is
  rejected. A missing value is an empty bag.

``.gz`` files are read compressed (a file named ``.gz`` that is not gzip data, or a damaged
one, raises InputError). The file is read line by line, never whole, as ASCII.

Lines are split by position: with ``eval_fraction`` f, every round(1/f)-th line (the last of
each group of round(1/f)) is held out for evaluation; the training lines are dealt to the ranks
in turn (training line j to rank j mod W); blank lines (nothing but spaces before the line
end, ``\n`` or ``\r\n``) are skipped, and count in the line numbers. Training cycles over the
file (epochs) endlessly.
"""

from __future__ import annotations

import gzip
import io
import math
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from dynemb.batch import EMPTY_KEY, SparseBatch
from dynemb.data.base import Batch, DataSource, FeatureInfo
from dynemb.errors import ConfigError, InputError

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
DENSE_NAMES = tuple(f"i{j + 1}" for j in range(NUM_DENSE))
SPARSE_NAMES = tuple(f"c{f + 1}" for f in range(NUM_SPARSE))

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_DENSE = re.compile(r"-?[0-9]{1,19}", re.ASCII)
_HEX = re.compile(r"[0-9a-fA-F]{1,16}", re.ASCII)
_FAST_LINE = re.compile(r"[01]" + r"\t(?:-?[0-9]{1,18})?" * NUM_DENSE
                        + r"\t[0-9a-fA-F]{0,15}" * NUM_SPARSE, re.ASCII)
"""A line every field of which is certainly valid and needs no range check (dense values of at
most 18 digits, categories of at most 15 hex digits): parsed without per-field checks."""
_READ_ERRORS = (OSError, EOFError, zlib.error)
"""What reading a damaged (or fake) gzip file raises (``gzip.BadGzipFile`` is an OSError)."""
_GZIP_MAGIC = b"\x1f\x8b"


def _open(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="ascii", errors="replace", newline="\n")
    return open(path, encoding="ascii", errors="replace", newline="\n")


def _bad(where: str, expected: str, found: object) -> InputError:
    return InputError(f"{where}: expected {expected}, found {found!r}.")


def _dense_value(text: str, where: str, j: int) -> int:
    """Integer feature ``j`` (0-based) of a line: its value, 0 when missing."""
    if not text:
        return 0
    value = int(text) if _DENSE.fullmatch(text) else None
    if value is None or not _INT64_MIN <= value <= _INT64_MAX:
        raise _bad(f"{where}, field {2 + j} ({DENSE_NAMES[j]})", "an integer: an optional '-' "
                   "and decimal digits within int64 (or empty for missing)",
                   text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)")
    return value


def category_id(text: str, where: str = "<criteo>") -> int:
    """The int64 id of a non-empty Criteo categorical value (see the module docstring).

    Raises:
        InputError: ``text`` is not 1 to 16 hex digits, or is the reserved empty key.
    """
    if not _HEX.fullmatch(text):
        shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
        raise _bad(where, "a hex category: 1 to 16 hex digits, no sign, prefix, underscore or "
                   "space (or empty for missing)", shown)
    value = int(text, 16)
    if value > _INT64_MAX:
        value -= 1 << 64
    if value == EMPTY_KEY:
        raise _bad(where, "a hex category other than 8000000000000000 (dynemb's reserved empty "
                   "key, int64 minimum)", text)
    return value


def _parse_line(line: str, where: str) -> tuple[float, list[int], list[int | None]]:
    """(label, 13 ints with missing as 0, 26 ids with missing as None)."""
    text = line.rstrip("\r\n")
    parts = text.split("\t")
    if _FAST_LINE.fullmatch(text):
        return (float(parts[0]), [int(x) if x else 0 for x in parts[1:1 + NUM_DENSE]],
                [int(c, 16) if c else None for c in parts[1 + NUM_DENSE:]])
    if len(parts) != NUM_FIELDS:
        raise _bad(where, f"{NUM_FIELDS} tab-separated fields (label, {NUM_DENSE} integers, "
                   f"{NUM_SPARSE} hex categories)", f"{len(parts)} fields")
    if parts[0] not in ("0", "1"):
        raise _bad(where, "a label of 0 or 1 in the first field", parts[0][:40])
    ints = [_dense_value(x, where, j) for j, x in enumerate(parts[1:1 + NUM_DENSE])]
    ids = [category_id(c, f"{where}, field {2 + NUM_DENSE + f} ({SPARSE_NAMES[f]})") if c
           else None for f, c in enumerate(parts[1 + NUM_DENSE:])]
    return float(parts[0]), ints, ids


def parse_lines(lines: list[tuple[int, str]], path: str = "<criteo>") -> Batch:
    """One batch from ``(line number, text)`` pairs of Criteo TSV.

    Raises:
        InputError: a line with the wrong number of fields, a label other than 0/1, a dense
            value that is not a decimal int64 or a category that is not 1 to 16 hex digits
            (see the module docstring), naming ``path:line`` and the field.
    """
    labels, dense = [], []
    columns: list[list[int]] = [[] for _ in range(NUM_SPARSE)]
    lengths: list[list[int]] = [[] for _ in range(NUM_SPARSE)]
    for number, line in lines:
        label, ints, ids = _parse_line(line, f"{path}:{number}")
        labels.append(label)
        dense.append(ints)
        for f, value in enumerate(ids):
            if value is not None:
                columns[f].append(value)
            lengths[f].append(0 if value is None else 1)
    values = torch.tensor([v for col in columns for v in col], dtype=torch.int64)
    sparse = SparseBatch(features=SPARSE_NAMES, values=values,
                         lengths=torch.tensor([n for col in lengths for n in col],
                                              dtype=torch.int64))
    x = torch.tensor(dense, dtype=torch.float64).reshape(len(lines), NUM_DENSE)
    return Batch(dense=torch.log1p(x.clamp(min=0.0)).float(), sparse=sparse,
                 labels=torch.tensor(labels, dtype=torch.float32))


class CriteoTSV(DataSource):
    """Criteo-format click logs read from ``path`` (see the module docstring).

    Args:
        path: a TSV file (``.gz`` allowed).
        eval_fraction: share of the lines held out (every round(1 / eval_fraction)-th line).
    """

    def __init__(self, path: str | Path, *, eval_fraction: float = 0.1) -> None:
        self.path = Path(path)
        try:
            found = self.path.is_file()
        except OSError as error:  # a name too long, a directory that cannot be searched
            raise ConfigError(f"criteo:{path}: cannot read it ({error.strerror}).") from None
        if not found:
            raise ConfigError(f"criteo:{path}: expected a Criteo TSV file, found no such file.")
        if not 0.0 < eval_fraction < 1.0:
            raise ConfigError(f"criteo: eval_fraction expected in (0, 1), found {eval_fraction!r}.")
        if self.path.suffix == ".gz":
            self._check_gzip()
        self.period = max(2, round(1.0 / eval_fraction))
        super().__init__(name="criteo", dense_names=DENSE_NAMES,
                         features=[FeatureInfo(n) for n in SPARSE_NAMES])
        self.info = {"path": str(self.path), "eval_every_nth_line": self.period}

    def _check_gzip(self) -> None:
        """Raises InputError unless the ``.gz`` file starts like gzip data."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(_GZIP_MAGIC))
        except OSError as error:
            raise InputError(f"criteo:{self.path}: cannot read the file "
                             f"({error.strerror}).") from None
        if head != _GZIP_MAGIC:
            raise InputError(f"{self.path}:1: expected gzip data (the name ends in .gz), found a "
                             f"file starting with {head!r}; decompress it properly, or drop .gz "
                             "from the name if it is plain text.")

    def _read(self) -> Iterator[tuple[int, str]]:
        """``(line number, text)`` of every line of the file, one pass.

        Raises:
            InputError: the file cannot be read (damaged or truncated gzip data, an I/O
                error), naming the line reached.
        """
        n = 0
        try:
            with _open(self.path) as f:
                for n, line in enumerate(f, start=1):  # noqa: B007  (n is read below)
                    yield n, line
        except _READ_ERRORS as error:
            what = "gzip data" if self.path.suffix == ".gz" else "the file"
            raise InputError(f"{self.path}:{n + 1}: cannot read {what} after line {n} "
                             f"({error}); expected a complete, readable Criteo TSV file.") from None

    def _lines(self, want_eval: bool, rank: int,
               world_size: int) -> Iterator[tuple[int, str]]:
        """``(line number, text)`` of this rank's training (or eval) lines, in file order, one
        pass (blank lines are skipped: a line of tabs is a line of empty fields, not blank)."""
        k = 0
        for n, line in self._read():
            if not line.strip(" \r\n"):
                continue
            if ((n - 1) % self.period == self.period - 1) != want_eval:
                continue
            mine = k % world_size == rank
            k += 1
            if mine:
                yield n, line

    def _batches(self, lines: Iterator[tuple[int, str]], batch_size: int,
                 limit: float = math.inf) -> Iterator[Batch]:
        chunk: list[tuple[int, str]] = []
        taken = 0
        for item in lines:
            if taken >= limit:
                break
            chunk.append(item)
            taken += 1
            if len(chunk) == batch_size:
                yield parse_lines(chunk, str(self.path))
                chunk = []
        if chunk:
            yield parse_lines(chunk, str(self.path))

    def train_batches(self, batch_size: int, *, rank: int = 0, world_size: int = 1,
                      start: int = 0) -> Iterator[Batch]:
        """Endless: this rank's training lines in file order, over and over; batch i holds
        lines [i·batch_size, (i+1)·batch_size) of the repeated sequence."""
        to_skip = start * batch_size  # read past, not parsed
        chunk: list[tuple[int, str]] = []
        while True:
            got = 0
            for item in self._lines(False, rank, world_size):
                got += 1
                if to_skip:
                    to_skip -= 1
                    continue
                chunk.append(item)
                if len(chunk) == batch_size:
                    yield parse_lines(chunk, str(self.path))
                    chunk = []
            if got == 0:
                raise ConfigError(f"criteo:{self.path}: rank {rank} of {world_size} has no "
                                  "training lines; use a longer file or fewer ranks.")

    def eval_batches(self, batch_size: int, *, rank: int = 0,
                     world_size: int = 1) -> Iterator[Batch]:
        return self._batches(self._lines(True, rank, world_size), batch_size)

    def train_sample_batches(self, batch_size: int, max_samples: int, *, rank: int = 0,
                             world_size: int = 1) -> Iterator[Batch]:
        limit = max_samples // world_size + (rank < max_samples % world_size)
        return self._batches(self._lines(False, rank, world_size), batch_size, limit)
