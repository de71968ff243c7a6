"""What a table checks and reports about its callers' input (a mixin of ``DynamicTable``)."""

from __future__ import annotations

import functools

import torch

from dynemb.batch import all_finite, check_keys
from dynemb.config import ScorePolicy
from dynemb.errors import ConfigError, DynembError, InputError


def writes(verb):
    """Marks a table verb that may change the table: while it runs, and for good if anything
    but a :class:`DynembError` escapes it (a KeyboardInterrupt or an out-of-memory error part
    way through; dynemb's own errors are raised before a change or after a complete one),
    ``interrupted`` is true and ``close()`` does not mark the table's ddr store clean."""

    @functools.wraps(verb)
    def run(self, *args, **kwargs):
        self._writing += 1
        try:
            out = verb(self, *args, **kwargs)
        except DynembError:
            self._writing -= 1
            raise
        self._writing -= 1
        return out

    return run


class TableChecks:
    """Input validation of a :class:`~dynemb.DynamicTable` (the ``on_full`` policy is the row
    life cycle's: ``dynemb.table.lifecycle``)."""

    _writing = 0  # verbs that may change the table running now, or interrupted (see ``writes``)

    @property
    def interrupted(self) -> bool:
        """Whether a call that changes the table is running or was interrupted part way (its
        rows may be half written: ``close()`` then leaves the ddr store unmarked, torn)."""
        return self._writing > 0

    def _keys(self, keys: torch.Tensor, verb: str, checked: bool = False) -> torch.Tensor:
        if self.files is not None and self.files.closed:
            raise ConfigError(f"table {self.name!r}: {verb} after close(): its ddr store is "
                              "closed; build a new table (Storage(reopen=True) opens it again).")
        if not checked:
            check_keys(keys, f"table {self.name!r}: {verb}")
        return keys.to(self.device)

    def _check_rows(self, keys, values, optimizer_state, verb, what: str = "values") -> None:
        """Distinct keys; ``values`` (named ``what``) and ``optimizer_state`` (or None) of the
        right shapes and finite as float32."""
        repeat = self.backend.first_repeat(keys)
        if repeat is not None:
            i, j = repeat
            raise InputError(f"table {self.name!r}: {verb} expects distinct keys; key "
                             f"{int(keys[i])} is at positions {i} and {j}. Nothing was written.")
        self._check_shape(what, values, (keys.numel(), self.dim))
        self._check_finite(what, values, verb)
        if optimizer_state is not None:
            self._check_shape("optimizer_state", optimizer_state,
                              (keys.numel(), self.optimizer.state_width))
            self._check_finite("optimizer_state", optimizer_state, verb)

    def _check_finite(self, what: str, t: torch.Tensor, verb: str) -> None:
        """Raises InputError unless ``t`` (2-D) is finite as float32, the dtype rows are stored
        in (a float64 1e300 would become inf)."""
        as_stored = t.detach().to(torch.float32)
        if not all_finite(as_stored):
            bad = ~torch.isfinite(as_stored)
            row, col = (int(i) for i in torch.nonzero(bad)[0])
            rows = int(bad.any(dim=1).sum())
            raise InputError(f"table {self.name!r}: {verb}: {what} hold {rows} row(s) that are "
                             f"not finite as float32 (first: row {row}, column {col}, value "
                             f"{float(t[row, col])}); expected finite values. Nothing was "
                             "written.")

    def _scores(self, scores, keys, verb) -> torch.Tensor | None:
        if scores is None:
            return None
        if self.config.score != ScorePolicy.CUSTOM:
            raise InputError(f"table {self.name!r}: {verb} got scores but the table's score "
                             f"policy is {self.config.score.name}; scores need ScorePolicy.CUSTOM.")
        self._check_shape("scores", scores, (keys.numel(),))
        if scores.dtype.is_floating_point or scores.dtype == torch.bool:
            raise InputError(f"table {self.name!r}: {verb} expects integer scores, found "
                             f"{scores.dtype}.")
        scores = scores.to(device=self.device, dtype=torch.int64)
        uk, inv = torch.unique(keys, return_inverse=True)
        if uk.numel() < keys.numel():  # one score per key: duplicates must agree
            low = torch.full_like(uk, torch.iinfo(torch.int64).max).scatter_reduce(0, inv, scores, "amin")
            if not bool((low[inv] == scores).all()):
                raise InputError(f"table {self.name!r}: {verb} got one key twice with different "
                                 "scores; give each key one score.")
        return scores

    def _check_shape(self, what: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise InputError(f"table {self.name!r}: {what} must have shape {shape}, found "
                             f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}.")
