"""A table's whole state as named tensors that view its live storage, and the exact reload of
such a state into a table of the same geometry (what a collection's ``state_dict`` and
``load_state_dict`` hold and do; ``dynemb.checkpoint`` is the format for anything else).

The arrays are the table's own: every index (the table's, a CACHING table's cache, an admission
filter's counters) slot by slot, the rows of both tiers with their optimizer state, and a
cache's home slots and dirty flags. Reloading copies them back slot for slot, so a reloaded
table is the saved one: the same rows in the same slots, the same scores and write steps, hence
the same victims, results and statistics from then on. ``meta`` is a uint8 tensor of JSON: the
geometry (checked on reload) and the scalars (steps, counters, eviction-log bounds). Every value
is a tensor, so the state survives ``torch.save``/``torch.load(weights_only=True)``,
safetensors and ``.to(device)``.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from dynemb.errors import ConfigError
from dynemb.kernels.index_numba import PIN_CACHED, PIN_FREE
from dynemb.table.index import HashIndex
from dynemb.table.table import DynamicTable

INDEX_ARRAYS = ("keys", "scores", "digests", "written", "pins", "counts")
"""What of a :class:`HashIndex` a state holds. Its pins are state only as far as they mark a
backing row that is cached (``PIN_CACHED``); a lookup's pin or hold refuses the state."""




def encode(obj: object) -> torch.Tensor:
    """A JSON-able object as a uint8 tensor."""
    return torch.tensor(list(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)


def decode(t: object, what: str) -> dict:
    """The object :func:`encode` made, or ConfigError naming ``what``."""
    try:
        out = json.loads(bytes(t.detach().cpu().to(torch.uint8).tolist()).decode())
        if not isinstance(out, dict):
            raise ValueError("not a JSON object")
        return out
    except Exception as e:  # noqa: BLE001  (anything unreadable is the same error)
        raise ConfigError(f"{what}: expected the uint8 JSON tensor a state_dict() wrote, found "
                          f"{type(t).__name__} that does not decode ({e}).") from None


def _indexes(table: DynamicTable) -> dict[str, HashIndex]:
    out = {"index": table.index}
    if table.cache is not None:
        out["cache"] = table.cache.index
    if table.admission is not None:
        out["admission"] = table.admission.index
    return out


def arrays(table: DynamicTable) -> dict[str, torch.Tensor]:
    """The table's arrays by name: the live tensors themselves, no copies."""
    out = {f"{name}.{a}": getattr(ix, a) for name, ix in _indexes(table).items()
           for a in INDEX_ARRAYS}
    out["rows.hbm"] = table.store.hbm
    if table.store.ddr is not None:
        out["rows.ddr"] = table.store.ddr
    if table.cache is not None:
        out["cache.home"], out["cache.dirty"] = table.cache.home, table.cache.dirty
    return out


def names(table: DynamicTable) -> list[str]:
    """The entries :func:`state` gives ``table``."""
    return [*arrays(table), "meta", "eviction_log.steps", "eviction_log.lengths",
            "eviction_log.keys"]


def geometry(table: DynamicTable) -> dict[str, object]:
    """What must be equal for a state to reload into ``table``."""
    lay = dataclasses.asdict(table.layout)
    lay["mode"] = table.mode.value
    c = table.config
    return {"name": c.name, "dim": c.dim, "capacity": c.capacity, **lay,
            "optimizer": type(c.optimizer).__name__,
            "optimizer_state_width": table.optimizer.state_width, "score": c.score.value,
            "admission_counter_slots": (None if table.admission is None
                                        else table.admission.index.num_slots)}


def check_quiet(table: DynamicTable, what: str) -> None:
    """ConfigError unless every call on ``table`` has completed and no lookup holds a row (its
    rows would be saved or replaced under it)."""
    if table.interrupted:
        raise ConfigError(f"{what}: a call that changes table {table.name!r} is running or was "
                          "interrupted part way, so its rows may be half written; expected a "
                          "table whose calls all completed.")
    busy = sum(int(((ix.pins != PIN_FREE) & (ix.pins != PIN_CACHED)).sum())
               for ix in _indexes(table).values())
    if busy:
        raise ConfigError(f"{what}: {busy} row(s) of table {table.name!r} are held by lookups "
                          "in flight (a forward whose backward has not run, or a lookup with "
                          "hold=True not released); finish or release them first.")


def state(table: DynamicTable, what: str) -> dict[str, torch.Tensor]:
    """Everything :func:`load` needs to make a table of the same geometry equal ``table``."""
    check_quiet(table, what)
    st = table.state
    log_start, entries = st.log.export()
    meta = {"geometry": geometry(table), "step": st.step,
            "optimizer_step": table.optimizer.step, "counters": dict(st.counters),
            "eviction_log_start": log_start, "lookup_score": table.lookup_score,
            "forgotten_sightings": (None if table.admission is None
                                    else table.admission.forgotten_sightings),
            "unflushed": None if table.cache is None else table.cache.unflushed}
    empty = torch.empty(0, dtype=torch.int64)
    return {**arrays(table), "meta": encode(meta),
            "eviction_log.steps": torch.tensor([s for s, _ in entries], dtype=torch.int64),
            "eviction_log.lengths": torch.tensor([k.numel() for _, k in entries],
                                                 dtype=torch.int64),
            "eviction_log.keys": torch.cat([k.cpu() for _, k in entries]) if entries else empty}


def checked(table: DynamicTable, entries: dict[str, object], what: str) -> dict:
    """The decoded meta of ``entries`` (one table's state) once everything in it fits
    ``table``: the same geometry, every array of the right shape and dtype. Changes nothing.

    Raises:
        ConfigError: naming each difference.
    """
    meta = decode(entries["meta"], f"{what}: 'meta'")
    saved, own = meta.get("geometry", {}), geometry(table)
    diff = [f"{k} {saved.get(k)!r} in the state but {v!r} here" for k, v in own.items()
            if saved.get(k) != v]
    if diff:
        raise ConfigError(f"{what}: the state was saved from a table of another geometry: "
                          f"{'; '.join(diff)}. load_state_dict needs the table it was saved "
                          "from; save with dynemb.checkpoint.save and load with "
                          "dynemb.checkpoint.load to change a table's geometry.")
    for name, live in arrays(table).items():
        t = entries[name]
        if not isinstance(t, torch.Tensor) or t.dtype != live.dtype or t.shape != live.shape:
            found = (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                     else type(t).__name__)
            raise ConfigError(f"{what}: {name!r} is {found}, expected {live.dtype} "
                              f"{tuple(live.shape)}.")
    for name in _indexes(table):
        pins = entries[f"{name}.pins"]
        if bool(((pins != PIN_FREE) & (pins != PIN_CACHED)).any()):
            raise ConfigError(f"{what}: {name!r} has rows held by lookups in flight; a "
                              "state_dict() never holds such rows: expected one it wrote.")
    steps, lengths, keys = (entries[f"eviction_log.{n}"] for n in ("steps", "lengths", "keys"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in (steps, lengths, keys)) \
            or steps.numel() != lengths.numel() or int(lengths.sum()) != keys.numel():
        raise ConfigError(f"{what}: the eviction_log entries do not fit together (steps, "
                          "lengths and keys of one log).")
    return meta


def load(table: DynamicTable, entries: dict[str, torch.Tensor], meta: dict, what: str) -> None:
    """Makes ``table`` equal the table ``entries`` were saved from (already :func:`checked`)."""
    check_quiet(table, what)
    with torch.no_grad():
        for name, live in arrays(table).items():
            src = entries[name]
            if src.data_ptr() != live.data_ptr() or src.device != live.device:
                live.copy_(src)
    st = table.state
    st.step = meta["step"]
    st.epoch += 1  # a lookup made before finds its rows again by key
    st.counters.clear()
    st.counters.update(meta["counters"])
    lengths = entries["eviction_log.lengths"].tolist()
    keys = entries["eviction_log.keys"].split(lengths) if lengths else []
    st.log.restore(meta["eviction_log_start"],
                   list(zip(entries["eviction_log.steps"].tolist(), keys)))
    table.optimizer.step = meta["optimizer_step"]
    table.lookup_score = meta["lookup_score"]
    if table.admission is not None:
        table.admission.forgotten_sightings = meta["forgotten_sightings"]
    if table.cache is not None:
        table.cache.unflushed = meta["unflushed"]
    table.checkpoint_marks = None  # dynemb.checkpoint's record of saves: from another table
