"""Training steps → table steps, per table, for incremental exports (in memory, kept on each
table object as ``table.checkpoint_marks``: no process-global state).

A table counts its own steps (score-touching calls), not training steps. Every save, load and
incremental export records here which table step each table was at for the training step it was
given, so ``export_incremental(since_step=s)`` can ask the table for the rows written and the
keys evicted after the table step of training step ``s``.

The table's eviction log starts at the first save (or restarts at a load) and is trimmed so it
covers what a later delta may still ask for: after a save, the evictions since the full save
before it; after a delta since step ``s``, the evictions since ``s``. A ``since_step`` must
therefore be the step of a save, load or delta of this process, not older than the since_step
of the latest delta nor the full save before the latest one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dynemb.errors import CheckpointError
from dynemb.table.table import DynamicTable

logger = logging.getLogger(__name__)


@dataclass
class TableSteps:
    """One table's marks: training step → table step, and the full saves kept in its log."""

    marks: dict[int, int] = field(default_factory=dict)
    full: list[int] = field(default_factory=list)
    """Table steps of the latest two full saves (or the load the log restarted at)."""
    tracking: bool = False


def steps_of(table: DynamicTable) -> TableSteps:
    """The table's marks (``table.checkpoint_marks``, created on first use)."""
    marks = table.checkpoint_marks
    if not isinstance(marks, TableSteps):
        marks = table.checkpoint_marks = TableSteps()
    return marks


def start_tracking(table: DynamicTable) -> None:
    """Starts the table's eviction log if this process has not yet (before a full save)."""
    s = steps_of(table)
    if not s.tracking:
        table.track_evictions()
        s.tracking = True


def _trim(table: DynamicTable, table_step: int) -> None:
    s = steps_of(table)
    if s.tracking:
        table.trim_eviction_log(table_step)
    s.marks = {k: v for k, v in s.marks.items() if v >= table_step}


def after_save(table: DynamicTable, step: int) -> None:
    """Records a full save at training ``step``; trims the log to the previous full save."""
    s = steps_of(table)
    s.marks[step] = table.step
    s.full = (s.full + [table.step])[-2:]
    if len(s.full) == 2:
        _trim(table, s.full[0])


def after_delta(table: DynamicTable, step: int, since_table_step: int) -> None:
    """Records an incremental export at training ``step``; trims the log to its since step."""
    steps_of(table).marks[step] = table.step
    _trim(table, since_table_step)


def after_load(table: DynamicTable, step: int, table_step_before: int) -> None:
    """Records that the table now holds the state of training ``step`` (full or delta load):
    older marks are forgotten, and the eviction log keeps nothing from before or during the
    load (the keys a load erased are not evictions of the state it loaded).

    The log is trimmed to the later of the table steps before and after the load; after a load
    that moved the table step back (an older checkpoint into a table that went further) a delta
    since the loaded step raises instead of listing stale keys.
    """
    s = steps_of(table)
    table.track_evictions()
    table.trim_eviction_log(max(table_step_before, table.step))
    s.tracking = True
    s.marks = {step: table.step}
    s.full = [table.step]


def table_step_at(table: DynamicTable, key: str, step: int) -> int:
    """The table step recorded for training ``step``.

    Raises:
        CheckpointError: no save, load or export of this process recorded ``step`` (or it is
            older than the eviction log reaches), or the table cannot log evictions.
    """
    s = steps_of(table)
    if step not in s.marks:
        raise CheckpointError(f"table {key!r}: no checkpoint of training step {step} is known to "
                              f"this process (known: {sorted(s.marks)}); since_step must be the "
                              "step of a save, load or export_incremental made since this process "
                              "started, and not older than the latest delta's since_step or the "
                              "full save before the latest one. Save a full checkpoint instead.")
    return s.marks[step]
