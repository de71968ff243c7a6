"""What a checkpoint sees of a model: its dynamic tables (plain or sharded collections, found
anywhere in the module tree), the ranks they are sharded over, and its dense state.

Tables are named ``"<module path>/<table name>"`` (just the table name for a collection at the
root), so a sharded collection and the plain collection it was built from, at the same place in
the model, have the same table names. Table module paths and dense state names drop the
``module`` level that ``DistributedDataParallel`` inserts, so a checkpoint of a model wrapped in
DDP (whole, or a part of it) loads into the bare one and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dynemb.errors import CheckpointError, DynembError
from dynemb.config import TableConfig
from dynemb.distributed.base import ShardedCollection
from dynemb.nn.modules import EmbeddingBagCollection, EmbeddingCollection, dense_only
from dynemb.table.table import DynamicTable


@dataclass
class TableSlot:
    """One table of the model, on this rank: its shard (or the whole table at W = 1)."""

    key: str
    """The table's name in the checkpoint: ``"<module path>/<name>"`` or ``"<name>"``."""
    table: DynamicTable
    config: TableConfig
    """The global config (a sharded table's ``capacity`` is the whole table's)."""
    module: str = ""
    """The collection's path in the model (``""`` at the root)."""


@dataclass
class World:
    """The ranks the model's tables are sharded over (size 1: a plain collection)."""

    size: int
    rank: int
    group: object = None

    def all_gather(self, obj: object) -> list:
        """Every rank's ``obj`` (collective when size > 1)."""
        if self.size == 1:
            return [obj]
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def raise_together(self, error: BaseException | None, action: str) -> None:
        """Collective: if any rank failed, every rank raises (its own error where it failed, a
        CheckpointError naming the failed rank elsewhere), so no rank waits in a later
        collective or goes on with a model the others did not load. An error that is not a
        DynembError (an I/O error: a full disk, a read-only directory) is raised as a
        CheckpointError naming ``action`` and its cause."""
        note = None if error is None else f"{type(error).__name__}: {error}"
        failed = [(r, m) for r, m in enumerate(self.all_gather(note)) if m is not None]
        if isinstance(error, DynembError):
            raise error
        if error is not None:
            raise CheckpointError(f"{action} failed on rank {self.rank}: {note} (for an I/O "
                                  "error: check the file system's free space and "
                                  "permissions).") from error
        if failed:
            r, msg = failed[0]
            raise CheckpointError(f"{action} failed on rank {r} (this is rank {self.rank}; "
                                  f"nothing was changed here unless that rank said so): {msg}")


@dataclass
class ModelView:
    """The tables of a model and the world they are sharded over."""

    tables: list[TableSlot]
    world: World

    def by_key(self) -> dict[str, TableSlot]:
        return {t.key: t for t in self.tables}


def _qualified(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _who(slot: TableSlot) -> str:
    return f"table {slot.config.name!r} of the collection at {slot.module or '<root>'!r}"


def _check_distinct(tables: list[TableSlot]) -> None:
    """Two tables may not share a checkpoint name (``"<module path>/<name>"`` can be spelled
    two ways when module or table names hold a ``/``)."""
    seen: dict[str, TableSlot] = {}
    for slot in tables:
        other = seen.setdefault(slot.key, slot)
        if other is not slot:
            raise CheckpointError(f"checkpoint: {_who(other)} and {_who(slot)} would both be "
                                  f"saved as {slot.key!r}; rename one of them (or the module "
                                  "that holds it).")


def view_model(model: torch.nn.Module) -> ModelView:
    """Finds every dynemb collection in ``model`` (itself included).

    Raises:
        CheckpointError: ``model`` is not a module, two tables have the same checkpoint name,
            sharded collections disagree on their world, or plain and sharded collections are
            mixed in a job of several ranks.
    """
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"checkpoint: expected model= a torch.nn.Module, found "
                              f"{type(model).__name__}.")
    tables: list[TableSlot] = []
    worlds: dict[str, tuple[int, int, object]] = {}
    plain: list[str] = []
    skip: list[str] = []
    prefixes = _ddp_prefixes(model)
    for path, m in model.named_modules():
        if any(s == "" or path == s or path.startswith(s + ".") for s in skip):
            continue  # inside a sharded collection: its shards are listed already
        if isinstance(m, ShardedCollection):
            skip.append(path)
            worlds[path or "<root>"] = (m.world_size, m.rank, m.group)
            for config in m.configs:
                tables.append(TableSlot(key=_qualified(_unwrapped(path, prefixes), config.name),
                                        table=m.tables[config.name], config=config, module=path))
        elif isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)):
            plain.append(path or "<root>")
            for name, table in m.tables.items():
                tables.append(TableSlot(key=_qualified(_unwrapped(path, prefixes), name),
                                        table=table,
                                        config=table.config, module=path))
    _check_distinct(tables)
    sizes = {(w, r) for w, r, _ in worlds.values()}
    if len(sizes) > 1:
        by_module = {k: v[:2] for k, v in worlds.items()}
        raise CheckpointError(f"checkpoint: the model's sharded collections disagree on their "
                              f"world: (world size, rank) by module {by_module}; shard every "
                              "collection of one model over the same ranks.")
    if not worlds:
        return ModelView(tables=tables, world=World(size=1, rank=0))
    size, rank, group = next(iter(worlds.values()))
    if plain and size > 1:
        raise CheckpointError(f"checkpoint: the model mixes sharded collections "
                              f"{sorted(worlds)} with plain ones {plain} over {size} ranks; every "
                              "rank would save its plain tables as its own. Shard them all.")
    return ModelView(tables=tables, world=World(size=size, rank=rank, group=group))


# ---------------------------------------------------------------- dense state


def _ddp_prefixes(model: torch.nn.Module) -> list[str]:
    """State-dict prefixes that DistributedDataParallel adds (``"<path>.module."``), longest
    first."""
    found = [f"{p}.module." if p else "module." for p, m in model.named_modules()
             if isinstance(m, DistributedDataParallel)]
    return sorted(found, key=len, reverse=True)


def _normalise(name: str, prefixes: list[str]) -> str:
    for p in prefixes:
        if name.startswith(p):
            return name[:len(p) - len("module.")] + name[len(p):]
    return name


def _unwrapped(path: str, prefixes: list[str]) -> str:
    """A module path without the ``module`` levels DistributedDataParallel adds: the path the
    same module has in the bare model."""
    return _normalise(path + ".", prefixes)[:-1] if path else path


def dense_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict (parameters and buffers; dynamic tables hold none) on CPU, with
    DDP's ``module.`` dropped from the names."""
    prefixes = _ddp_prefixes(model)
    with dense_only():
        state = model.state_dict()
    return {_normalise(k, prefixes): v.detach().to("cpu") for k, v in state.items()}


def check_dense_state(model: torch.nn.Module, state: dict[str, torch.Tensor],
                      where: str) -> dict[str, torch.Tensor]:
    """Matches a saved dense state to ``model`` without changing it.

    Returns:
        The state under the model's own names, ready for ``load_state_dict``.

    Raises:
        CheckpointError: names missing on either side, or a shape that differs.
    """
    prefixes = _ddp_prefixes(model)
    with dense_only():
        own = {_normalise(k, prefixes): (k, v) for k, v in model.state_dict().items()}
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise CheckpointError(f"{where}: the dense state does not match the model: in the model "
                              f"but not the checkpoint {missing[:10]}, in the checkpoint but not "
                              f"the model {extra[:10]}; load into the model that was saved.")
    out = {}
    for name, (actual, tensor) in own.items():
        saved = state[name]
        if not isinstance(saved, torch.Tensor):
            raise CheckpointError(f"{where}: dense state {name!r} is a {type(saved).__name__} in "
                                  "the checkpoint, expected a tensor.")
        if tuple(saved.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{where}: dense tensor {name!r} has shape "
                                  f"{tuple(saved.shape)} in the checkpoint but "
                                  f"{tuple(tensor.shape)} in the model.")
        out[actual] = saved
    return out


def optimizer_type(optimizer: torch.optim.Optimizer | None) -> str | None:
    """``"module.Class"`` of a dense optimizer, or None."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"checkpoint: expected dense_optimizer= a torch.optim.Optimizer or "
                              f"None, found {type(optimizer).__name__}.")
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"
