"""The exception tree of dynemb.

::

    DynembError                     base of everything dynemb raises on purpose
    ├── InputError (ValueError)     a batch, key tensor or argument that cannot be used
    ├── ConfigError (ValueError)    a configuration that cannot be built
    ├── CapacityError (RuntimeError) a table has no room for a key and may not evict
    ├── CheckpointError             a checkpoint that cannot be written or loaded
    └── PlanningError               no placement of the tables fits the memory budgets

Messages say what was expected, what was found, and how to fix it.
"""

from __future__ import annotations


class DynembError(Exception):
    """Base class of every error dynemb raises on purpose."""


class InputError(DynembError, ValueError):
    """Bad input: a malformed batch, wrong dtype, a reserved key, an unknown feature."""


class ConfigError(DynembError, ValueError):
    """A configuration value is out of range or inconsistent with another."""


class CapacityError(DynembError, RuntimeError):
    """A key could not get a row: the table (or its bucket) is full and eviction is not allowed."""


class CheckpointError(DynembError):
    """A checkpoint cannot be written or loaded: a missing, truncated or corrupted file, a
    manifest from another configuration (table names, dims, optimizer type, routing mode or
    world size without ``reshard=True``), or a failed collective save.

    A load that raises it before its mutation phase leaves the model untouched.
    """


class PlanningError(DynembError):
    """The planner cannot place the tables: no plan fits the memory budgets (the message names the
    tier, what the smallest plan needs and the budget that would fit), or its inputs are invalid."""
