"""Fitting a full checkpoint's rows into a table of another geometry (a reshard, or another
capacity): each key has one home bucket of ``table.index.width`` slots (``table.home_buckets``:
the HYBRID split index's tier included, a CACHING table's backing index), and ``load_rows``
never evicts. When more rows belong to a bucket than it holds, the load either raises or keeps
the bucket's highest-scored rows and drops the rest, chosen here before anything is loaded.

Order within a bucket: score descending (LRU/STEP: most recent table step, LFU: most counted,
CUSTOM: the caller's), ties broken by key ascending, so the choice does not depend on the world
size or file order the rows come from.
"""

from __future__ import annotations

import torch

from dynemb.config import OnFull
from dynemb.errors import CheckpointError


def resolve_on_full(on_full: OnFull | str | None, reshard: bool) -> OnFull:
    """The load's policy: ``None`` gives WARN with ``reshard`` (drop and warn), else RAISE.

    Raises:
        CheckpointError: an unknown value.
    """
    if on_full is None:
        return OnFull.WARN if reshard else OnFull.RAISE
    try:
        return OnFull(on_full)
    except ValueError:
        raise CheckpointError(f"checkpoint load: on_full must be one of "
                              f"{[m.value for m in OnFull]} (dynemb.OnFull) or None, found "
                              f"{on_full!r}.") from None


def lowest_scored(keys: torch.Tensor, scores: torch.Tensor, buckets: torch.Tensor,
                  width: int) -> torch.Tensor:
    """The rows that do not fit: per bucket, all but the ``width`` highest-scored.

    Args:
        keys: (N,) int64, distinct: every row that belongs to an over-full bucket.
        scores: (N,) int64, their scores.
        buckets: (N,) int64, their home buckets.
        width: slots per bucket.

    Returns:
        (D,) int64, the dropped keys, sorted.
    """
    order = torch.argsort(keys, stable=True)
    order = order[torch.argsort(scores[order], descending=True, stable=True)]
    order = order[torch.argsort(buckets[order], stable=True)]
    b = buckets[order]
    first = torch.ones_like(b, dtype=torch.bool)
    first[1:] = b[1:] != b[:-1]
    starts = torch.nonzero(first).flatten()
    run = torch.cumsum(first.long(), 0) - 1  # which bucket run each sorted row is in
    rank_in_bucket = torch.arange(b.numel()) - starts[run]
    return torch.sort(keys[order][rank_in_bucket >= width]).values
