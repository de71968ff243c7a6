"""Checkpoints of dynamic tables: a directory with a sealed ``manifest.json`` and per-rank,
per-table safetensors shard files, written atomically (saves to one path serialised by a lock
file), validated whole on load before anything changes, reshardable, incremental.

::

    dynemb.checkpoint.save(path, model=model, dense_optimizer=opt, step=step)  # every rank
    step = dynemb.checkpoint.load(path, model=model, dense_optimizer=opt)     # reshard=True to
                                                                              # change W/routing
    dropped = {}                                # rows that found their hash bucket full:
    dynemb.checkpoint.load(path, model=model, reshard=True, dropped=dropped)  # on_full=WARN
    dynemb.checkpoint.export_incremental(delta, model=model, since_step=step, step=now)

``model`` is any module holding dynemb collections (plain, or sharded over the ranks of a
torch.distributed job) and dense parameters. ``dynemb.checkpoint.inspect.describe(path)``
summarises a checkpoint. The format is documented in docs/checkpoint-format.md.
"""

from dynemb.checkpoint import inspect
from dynemb.errors import CheckpointError
from dynemb.checkpoint.manifest import FORMAT_VERSION
from dynemb.checkpoint.reader import load
from dynemb.checkpoint.writer import export_incremental, save

__all__ = ["FORMAT_VERSION", "CheckpointError", "export_incremental", "inspect", "load", "save"]
