"""What a table and its resolver share: the step clock, the eviction epoch, the counters, the
eviction log and the score policy.

One :class:`TableState` per :class:`~dynemb.DynamicTable`. The table's verbs and its resolver
(``dynemb.table.resolver``, ``dynemb.table.caching``) and row life cycle
(``dynemb.table.lifecycle``) read and advance it; nothing else of the table is shared.
"""

from __future__ import annotations

from collections import Counter

import torch

from dynemb.config import ScorePolicy
from dynemb.kernels.index_numba import P_CUSTOM, P_LFU, P_LRU, P_NO_EVICTION, P_STEP
from dynemb.table.stats import EvictionLog

POLICY_CODES = {ScorePolicy.LRU: P_LRU, ScorePolicy.LFU: P_LFU, ScorePolicy.STEP: P_STEP,
                ScorePolicy.CUSTOM: P_CUSTOM, ScorePolicy.NO_EVICTION: P_NO_EVICTION}

Saved = tuple[int, Counter]
"""A snapshot of the step and the counters (:meth:`TableState.snapshot`)."""


class TableState:
    """The shared, mutable state of one table.

    Attributes:
        score: the table's score policy (``TableConfig.score``).
        policy: its kernel code (``kernels.index_numba.P_*``).
        step: the table step: score-touching calls and erases so far (the clock of LRU/STEP
            scores and write steps).
        epoch: the eviction epoch, advanced whenever a row may have left its slot (evicted,
            erased, dropped from or moved out of a cache): a lookup made at another epoch finds
            its rows again by key.
        counters: the counters behind ``TableStats`` (lookups, hits and misses per tier,
            failed_inserts, admission_rejected, erased, stale_updates, nonfinite_grads,
            cache_evictions, write_backs, prefetched).
        log: the eviction log (keys evicted or erased, by table step).
        no_scores: an empty (0,) int64 tensor on the table's device (no custom scores).

    Args:
        score: the table's score policy.
        device: the table's device.
    """

    def __init__(self, score: ScorePolicy, device: torch.device) -> None:
        self.score = score
        self.policy = POLICY_CODES[score]
        self.step = 0
        self.epoch = 0
        self.counters: Counter[str] = Counter()
        self.no_scores = torch.empty(0, dtype=torch.int64, device=device)
        self.log = EvictionLog(self.no_scores)
        self._on_device: dict[str, torch.Tensor] = {}

    def count_on_device(self, name: str, n: torch.Tensor) -> None:
        """Adds the count ``n`` (a 0-d int tensor on the table's device) to ``counters[name]``
        without reading it: a GPU keeps running. :meth:`settled` reads such counts."""
        held = self._on_device.get(name)
        self._on_device[name] = n if held is None else held + n

    def settled(self) -> Counter:
        """``counters`` with the counts :meth:`count_on_device` kept on the device added in (one
        read of them all); for reports and saves, never the hot path."""
        if self._on_device:
            names = list(self._on_device)
            for name, n in zip(names, torch.stack([self._on_device[k] for k in names]).tolist()):
                self.counters[name] += n
            self._on_device.clear()
        return self.counters

    def snapshot(self) -> Saved:
        """The step and a copy of the counters, for :meth:`restore` (an atomic call)."""
        return self.step, self.counters.copy()

    def restore(self, saved: Saved) -> None:
        """Puts the step and counters of a :meth:`snapshot` back (counts on the device are
        from backward passes, which no snapshot spans: they stay)."""
        self.step = saved[0]
        self.counters.clear()
        self.counters.update(saved[1])

    def touch(self, occurrences: int) -> None:
        """A score-touching call of ``occurrences`` keys begins: the step advances."""
        self.step += 1
        self.counters["lookups"] += occurrences

    def evicted(self, keys: torch.Tensor) -> None:
        """``keys`` (int64) left the table at the current step: logged, the epoch advances."""
        self.epoch += 1
        self.log.add(self.step, keys)
