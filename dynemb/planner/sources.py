"""Access profiles measured on training batches (the first batches of a run, or of a data
source): the ids each table looks up, per step, in order."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from dynemb.batch import SparseBatch
from dynemb.config import TableConfig
from dynemb.errors import PlanningError
from dynemb.planner.profile import AccessProfile


def _sparse(batch: object) -> SparseBatch:
    sparse = batch if isinstance(batch, SparseBatch) else getattr(batch, "sparse", None)
    if not isinstance(sparse, SparseBatch):
        raise PlanningError(f"profiles_from_batches: expected SparseBatch objects (or objects "
                            f"with a .sparse SparseBatch), found {type(batch).__name__}.")
    return sparse


def profiles_from_batches(batches: Iterable[object], tables: Sequence[TableConfig], *,
                          steps: int, world_size: int = 1) -> dict[str, AccessProfile]:
    """Each table's profile from the ids of up to ``steps`` batches (in order).

    Args:
        batches: SparseBatch objects, or objects with a ``.sparse`` SparseBatch; the features
            of every table must be in them.
        tables: the table configs (a table looks up the ids of all its features).
        steps: how many batches to read at most.
        world_size: the batches are one of W ranks' shares of each step (see
            ``AccessProfile.from_ids``).
    """
    if not isinstance(steps, int) or steps < 1:
        raise PlanningError(f"profiles_from_batches: steps must be an int >= 1, found {steps!r}.")
    ids: dict[str, list[torch.Tensor]] = {t.name: [] for t in tables}
    seen = 0
    for batch in batches:
        sparse = _sparse(batch)
        for t in tables:
            missing = [f for f in t.features if f not in sparse.features]
            if missing:
                raise PlanningError(f"profiles_from_batches: table {t.name!r} reads feature(s) "
                                    f"{missing} that the batches do not have (they have "
                                    f"{list(sparse.features)}).")
            ids[t.name].append(torch.cat([sparse.feature(f)[0] for f in t.features]).cpu())
        seen += 1
        if seen >= steps:
            break
    if seen == 0:
        raise PlanningError("profiles_from_batches: the data gave no batch to profile.")
    return {name: AccessProfile.from_ids(torch.cat(parts), steps=seen, world_size=world_size)
            for name, parts in ids.items()}
