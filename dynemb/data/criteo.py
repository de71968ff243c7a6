"""A streaming reader of the Criteo TSV format (the Kaggle Display Advertising Challenge and the
Terabyte click logs), for users' own files.

Each line: the label (0 or 1), 13 integer features and 26 categorical features written as hex
strings (32-bit hashes), tab-separated; any feature may be empty (missing). Dense features are
fed as ``log1p(max(x, 0))`` with a missing value as 0; a categorical feature is one id (the hex
value as an int) or, when missing, an empty bag. ``.gz`` files are read compressed.

The file is read line by line, never whole. Lines are split by position: with ``eval_fraction``
f, every round(1/f)-th line (the last of each group of round(1/f)) is held out for evaluation;
the training lines are dealt to the ranks in turn (training line j to rank j mod W). Training
cycles over the file (epochs) endlessly.
"""

from __future__ import annotations

import gzip
import io
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from dynemb.batch import SparseBatch
from dynemb.data.base import ID_MASK, Batch, DataSource, FeatureInfo
from dynemb.errors import ConfigError, InputError

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
DENSE_NAMES = tuple(f"i{j + 1}" for j in range(NUM_DENSE))
SPARSE_NAMES = tuple(f"c{f + 1}" for f in range(NUM_SPARSE))


def _open(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="ascii", errors="replace", newline="\n")
    return open(path, encoding="ascii", errors="replace", newline="\n")


def _bad(where: str, expected: str, found: object) -> InputError:
    return InputError(f"{where}: expected {expected}, found {found!r}.")


def _parse_line(line: str, where: str) -> tuple[float, list[int], list[str]]:
    """(label, 13 ints with missing as 0, 26 hex strings with missing as '')."""
    parts = line.rstrip("\r\n").split("\t")
    if len(parts) != NUM_FIELDS:
        raise _bad(where, f"{NUM_FIELDS} tab-separated fields (label, {NUM_DENSE} integers, "
                   f"{NUM_SPARSE} hex categories)", f"{len(parts)} fields")
    if parts[0] not in ("0", "1"):
        raise _bad(where, "a label of 0 or 1 in the first field", parts[0])
    try:
        ints = [int(x) if x else 0 for x in parts[1:1 + NUM_DENSE]]
    except ValueError:
        bad = next(x for x in parts[1:1 + NUM_DENSE] if x and not x.lstrip("-").isdigit())
        raise _bad(where, f"integers (or empty) in fields 2-{1 + NUM_DENSE}", bad) from None
    return float(parts[0]), ints, parts[1 + NUM_DENSE:]


def parse_lines(lines: list[tuple[int, str]], path: str = "<criteo>") -> Batch:
    """One batch from ``(line number, text)`` pairs of Criteo TSV.

    Raises:
        InputError: a line with the wrong number of fields, a label other than 0/1, a
            non-integer dense value or a non-hex category, naming ``path:line``.
    """
    labels, dense = [], []
    columns: list[list[int]] = [[] for _ in range(NUM_SPARSE)]
    lengths: list[list[int]] = [[] for _ in range(NUM_SPARSE)]
    for number, line in lines:
        where = f"{path}:{number}"
        label, ints, cats = _parse_line(line, where)
        labels.append(label)
        dense.append(ints)
        for f, text in enumerate(cats):
            if text:
                try:
                    columns[f].append(int(text, 16) & ID_MASK)
                except ValueError:
                    raise _bad(f"{where}, field {2 + NUM_DENSE + f} ({SPARSE_NAMES[f]})",
                               "a hex category (or empty)", text) from None
            lengths[f].append(1 if text else 0)
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
        if not self.path.is_file():
            raise ConfigError(f"criteo:{path}: expected a Criteo TSV file, found no such file.")
        if not 0.0 < eval_fraction < 1.0:
            raise ConfigError(f"criteo: eval_fraction expected in (0, 1), found {eval_fraction!r}.")
        self.period = max(2, round(1.0 / eval_fraction))
        super().__init__(name="criteo", dense_names=DENSE_NAMES,
                         features=[FeatureInfo(n) for n in SPARSE_NAMES])
        self.info = {"path": str(self.path), "eval_every_nth_line": self.period}

    def _lines(self, want_eval: bool, rank: int,
               world_size: int) -> Iterator[tuple[int, str]]:
        """``(line number, text)`` of this rank's training (or eval) lines, in file order, one
        pass (blank lines are skipped)."""
        k = 0
        with _open(self.path) as f:
            for n, line in enumerate(f):
                if not line.strip():
                    continue
                if (n % self.period == self.period - 1) != want_eval:
                    continue
                mine = k % world_size == rank
                k += 1
                if mine:
                    yield n + 1, line

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
