"""Load balance of a sharded collection: what each rank received and stores, per table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def max_over_mean(values: Sequence[int | float]) -> float:
    """max / mean of ``values`` (1.0 when all are zero: nothing to balance)."""
    if not values:
        return 1.0
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class TableRoutingStats:
    """One table's load per rank (tuples of length W, rank order) since the counters started.

    ``ids_received``: id occurrences routed to the rank (from every requester, itself included).
    ``unique_keys_received``: keys that arrived (deduplicated per requester, not across them).
    ``rows_stored``: rows in the rank's shard now.
    """

    ids_received: tuple[int, ...]
    unique_keys_received: tuple[int, ...]
    rows_stored: tuple[int, ...]

    @property
    def ids_max_over_mean(self) -> float:
        return max_over_mean(self.ids_received)

    @property
    def unique_keys_max_over_mean(self) -> float:
        return max_over_mean(self.unique_keys_received)

    @property
    def rows_max_over_mean(self) -> float:
        return max_over_mean(self.rows_stored)

    def as_dict(self) -> dict:
        """Plain values (JSON-friendly), ratios included."""
        return {"ids_received": list(self.ids_received),
                "unique_keys_received": list(self.unique_keys_received),
                "rows_stored": list(self.rows_stored),
                "ids_max_over_mean": self.ids_max_over_mean,
                "unique_keys_max_over_mean": self.unique_keys_max_over_mean,
                "rows_max_over_mean": self.rows_max_over_mean}


@dataclass(frozen=True)
class RoutingStats:
    """Per table load (see :class:`TableRoutingStats`), forward calls counted, and the bytes
    each rank sent to other ranks in all-to-alls (both directions of every stage)."""

    tables: dict[str, TableRoutingStats]
    steps: int
    bytes_sent: tuple[int, ...]

    def as_dict(self) -> dict:
        return {"steps": self.steps, "bytes_sent": list(self.bytes_sent),
                "tables": {name: t.as_dict() for name, t in self.tables.items()}}
