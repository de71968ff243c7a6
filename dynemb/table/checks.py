"""What a table checks and reports about its callers' input (a mixin of ``DynamicTable``)."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import NoReturn

import torch

from dynemb.batch import all_finite, check_keys
from dynemb.config import OnFull, ScorePolicy
from dynemb.errors import CapacityError, ConfigError, DynembError, InputError

logger = logging.getLogger("dynemb.table.table")


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
    """Input validation and the ``on_full`` policy of a :class:`~dynemb.DynamicTable`."""

    _writing = 0  # verbs that may change the table running now, or interrupted (see ``writes``)

    @property
    def interrupted(self) -> bool:
        """Whether a call that changes the table is running or was interrupted part way (its
        rows may be half written: ``close()`` then leaves the ddr store unmarked, torn)."""
        return self._writing > 0

    def _refuse(self, failed: int, saved: tuple[int, Counter]) -> NoReturn:
        """Raises for an atomic call (``on_full`` RAISE) whose insert kernel could not place
        ``failed`` occurrences and changed nothing: the caller has undone its touches and pins;
        this restores the step and counters ``saved`` before the call, then counts the failure."""
        self.step, self._counters = saved
        self._on_full(failed)
        raise AssertionError("unreachable: on_full RAISE raises")  # pragma: no cover

    def _on_full(self, failed: int) -> None:
        """Counts ``failed`` occurrences that got no row; raises (RAISE: the call was atomic and
        changed nothing), warns (WARN) or stays silent (COUNT)."""
        self._counters["failed_inserts"] += failed
        if self.config.on_full == OnFull.COUNT:
            return
        if self.config.score == ScorePolicy.NO_EVICTION:
            why = "its bucket is full and score=NO_EVICTION forbids eviction"
        elif self.config.score == ScorePolicy.CUSTOM:
            why = "its bucket is full of rows used by this call or with higher custom scores"
        else:
            why = "its bucket is full of rows used by this same call (the table is too small for the batch)"
        held = self.held_rows()
        if held and self.config.score != ScorePolicy.NO_EVICTION:
            why += (f", or held by lookups in flight ({held} rows are held from lookup(hold=True) "
                    "until apply_gradients or release: fewer batches in flight need fewer rows)")
        msg = (f"table {self.name!r}: {failed} key occurrence(s) could not get a row: {why} "
               f"(size {self.size()} of capacity {self.capacity()}). Raise capacity, choose an "
               "evicting ScorePolicy, or set on_full=WARN/COUNT to give such keys the eval "
               "initializer and count them in stats().failed_inserts.")
        if self.config.on_full == OnFull.RAISE:
            raise CapacityError(msg + " The call changed nothing in the table.")
        logger.warning(msg)

    def _keys(self, keys: torch.Tensor, verb: str) -> torch.Tensor:
        if self.files is not None and self.files.closed:
            raise ConfigError(f"table {self.name!r}: {verb} after close(): its ddr store is "
                              "closed; build a new table (Storage(reopen=True) opens it again).")
        check_keys(keys, f"table {self.name!r}: {verb}")
        return keys.to(self.device)

    def _check_rows(self, keys, values, optimizer_state, verb, what: str = "values") -> None:
        """Distinct keys; ``values`` (named ``what``) and ``optimizer_state`` (or None) of the
        right shapes and finite as float32."""
        if keys.numel() != torch.unique(keys).numel():
            raise InputError(f"table {self.name!r}: {verb} expects distinct keys.")
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
