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




MAX_META_BYTES = 1 << 20
"""Largest meta entry read: a page of JSON (the counters, steps and geometry of one table)."""


def encode(obj: object) -> torch.Tensor:
    """A JSON-able object as a uint8 tensor."""
    return torch.tensor(list(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)


def decode(t: object, what: str) -> dict:
    """The object :func:`encode` made, or ConfigError naming ``what``."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 \
            or t.numel() > MAX_META_BYTES:
        found = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ConfigError(f"{what}: expected the 1-D uint8 tensor of JSON (at most "
                          f"{MAX_META_BYTES:,} bytes) a state_dict() wrote, found {found}.")
    try:
        out = json.loads(bytes(t.detach().cpu().numpy()).decode())
        if not isinstance(out, dict):
            raise ValueError("not a JSON object")
        return out
    except Exception as e:  # noqa: BLE001  (anything unreadable is the same error)
        raise ConfigError(f"{what}: expected the uint8 JSON tensor a state_dict() wrote, found "
                          f"{type(t).__name__} that does not decode ({e}).") from None


def differences(saved: dict, own: dict) -> list[str]:
    """``"<key> <saved> in the state but <own> here"`` for each key of ``own`` that differs."""
    return [f"{k} {saved.get(k)!r} in the state but {v!r} here" for k, v in own.items()
            if saved.get(k) != v]


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
        out["rows.ddr"] = table.store.settled_ddr()
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
    return {"name": c.name, "dim": c.dim, "capacity": c.capacity, "id_range": c.id_range,
            **lay,
            "optimizer": type(c.optimizer).__name__,
            "optimizer_state_width": table.optimizer.state_width, "score": c.score.value,
            "admission_counter_slots": (None if table.admission is None
                                        else table.admission.index.num_slots)}


def index_layout(table: DynamicTable) -> str:
    """Where the table's backend puts a new key in its bucket: ``"probe"`` (numba and triton:
    linear probing from the key's start slot, which a probe reads up to the first empty slot)
    or ``"bucket"`` (the torch reference: the bucket's first free slot, which its lookups find
    by comparing the whole bucket). A probe backend misses most keys of a "bucket" index."""
    return "bucket" if table.backend.name == "torch" else "probe"


def _busy(pins: torch.Tensor) -> int:
    """Slots whose pin is a lookup's or a hold (neither free nor a cached backing row), counted
    16 M slots at a time (a bounded temporary, whatever the table's size)."""
    return sum(int(((p != PIN_FREE) & (p != PIN_CACHED)).sum()) for p in pins.split(1 << 24))


def check_quiet(table: DynamicTable, what: str) -> None:
    """ConfigError unless the table is open, every call on it has completed and no lookup holds
    a row (its rows would be saved or replaced under it)."""
    if table.files is not None and table.files.closed:
        raise ConfigError(f"{what}: table {table.name!r} was closed (its ddr store is released); "
                          "expected an open table.")
    if table.interrupted:
        raise ConfigError(f"{what}: a call that changes table {table.name!r} is running or was "
                          "interrupted part way, so its rows may be half written; expected a "
                          "table whose calls all completed.")
    busy = sum(_busy(ix.pins) for ix in _indexes(table).values())
    if busy:
        raise ConfigError(f"{what}: {busy} row(s) of table {table.name!r} are held by lookups "
                          "in flight (a forward whose backward has not run, or a lookup with "
                          "hold=True not released); finish or release them first.")


def meta_of(table: DynamicTable) -> dict:
    """The table's geometry and scalars as they are now (``meta``)."""
    st = table.state
    score = table.lookup_score
    return {"geometry": geometry(table), "index_layout": index_layout(table), "step": st.step,
            "optimizer_step": table.optimizer.step, "counters": dict(st.settled()),
            "eviction_log_start": st.log.export()[0],
            "lookup_score": None if score is None else int(score),
            "forgotten_sightings": (None if table.admission is None
                                    else table.admission.forgotten_sightings),
            "unflushed": None if table.cache is None else table.cache.unflushed}


def state(table: DynamicTable, what: str) -> dict[str, torch.Tensor]:
    """Everything :func:`load` needs to make a table of the same geometry equal ``table``. The
    arrays are the table's own tensors: they change as it trains, while ``meta`` stays as it
    was; save or clone the state before the table is used again."""
    check_quiet(table, what)
    entries = table.state.log.export()[1]
    empty = torch.empty(0, dtype=torch.int64)
    return {**arrays(table), "meta": encode(meta_of(table)),
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
    check_quiet(table, what)
    meta = decode(entries["meta"], f"{what}: 'meta'")
    _check_meta(meta, table.admission is not None, table.cache is not None, what)
    diff = differences(meta.get("geometry", {}), geometry(table))
    if diff:
        raise ConfigError(f"{what}: the state was saved from a table of another geometry: "
                          f"{'; '.join(diff)}. load_state_dict needs the table it was saved "
                          "from; save with dynemb.checkpoint.save and load with "
                          "dynemb.checkpoint.load to change a table's geometry.")
    if meta.get("index_layout") == "bucket" and index_layout(table) == "probe":
        raise ConfigError(f"{what}: the state was saved from a table on the torch backend, "
                          "whose index puts keys anywhere in their bucket; this table's "
                          f"{table.backend.name} kernels probe from each key's start slot and "
                          "would miss most of its rows. Load it into a table built with "
                          "backend='torch', or save with dynemb.checkpoint.save and load with "
                          "dynemb.checkpoint.load (which inserts rows by key).")
    for name, live in arrays(table).items():
        t = entries[name]
        if not isinstance(t, torch.Tensor) or t.dtype != live.dtype or t.shape != live.shape:
            found = (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                     else type(t).__name__)
            raise ConfigError(f"{what}: {name!r} is {found}, expected {live.dtype} "
                              f"{tuple(live.shape)}.")
    for name in _indexes(table):
        if _busy(entries[f"{name}.pins"]):
            raise ConfigError(f"{what}: {name!r} has rows held by lookups in flight; a "
                              "state_dict() never holds such rows: expected one it wrote.")
    steps, lengths, keys = (entries[f"eviction_log.{n}"] for n in ("steps", "lengths", "keys"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == torch.int64
               for t in (steps, lengths, keys)) or steps.numel() != lengths.numel() \
            or bool((lengths < 0).any()) or int(lengths.sum()) != keys.numel() \
            or (meta["eviction_log_start"] is None and steps.numel() > 0):
        raise ConfigError(f"{what}: the eviction_log entries do not fit together (int64 steps, "
                          "lengths >= 0 and keys of one log that was started).")
    live = arrays(table)
    if any(t.numel() and entries[n].data_ptr() == t.data_ptr() for n, t in live.items()) \
            and meta != meta_of(table):
        raise ConfigError(f"{what}: the state's arrays are this table's own storage (a "
                          "state_dict() taken earlier and neither saved nor cloned), and the "
                          "table has changed since: they hold its rows as they are now, not as "
                          "they were. Reload from a state that was saved (torch.save) or cloned "
                          "when it was taken.")
    return meta


def _check_meta(meta: dict, admission: bool, cache: bool, what: str) -> None:
    """ConfigError unless ``meta`` has every scalar :func:`load` sets, of its type."""
    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    counters = meta.get("counters")
    keys = {"step", "optimizer_step", "counters", "eviction_log_start", "lookup_score",
            "forgotten_sightings", "unflushed"}
    ok = (keys <= set(meta) and is_int(meta.get("step")) and is_int(meta.get("optimizer_step"))
          and isinstance(counters, dict)
          and all(isinstance(k, str) and is_int(v) for k, v in counters.items())
          and (meta.get("eviction_log_start") is None or is_int(meta["eviction_log_start"]))
          and (meta.get("lookup_score") is None or isinstance(meta["lookup_score"], int))
          and (not admission or is_int(meta.get("forgotten_sightings")))
          and (not cache or isinstance(meta.get("unflushed"), bool)))
    if not ok:
        raise ConfigError(f"{what}: 'meta' lacks a value or has one of another type (expected "
                          "ints >= 0 for step, optimizer_step and the counters); expected the "
                          "meta a state_dict() wrote.")


def load(table: DynamicTable, entries: dict[str, torch.Tensor], meta: dict) -> None:
    """Makes ``table`` equal the table ``entries`` were saved from (already :func:`checked`,
    with nothing done to the table since)."""
    with torch.no_grad():
        for name, live in arrays(table).items():
            src = entries[name]
            if src.data_ptr() != live.data_ptr() or src.device != live.device:
                live.copy_(src)
    st = table.state
    st.step = meta["step"]
    st.epoch += 1  # a lookup made before finds its rows again by key
    st.settled().clear()
    st.counters.update(meta["counters"])
    lengths = entries["eviction_log.lengths"].tolist()
    keys = entries["eviction_log.keys"].split(lengths) if lengths else []
    st.log.restore(meta["eviction_log_start"],
                   list(zip(entries["eviction_log.steps"].tolist(), keys)))
    table.optimizer.step = meta["optimizer_step"]
    table.lookup_score = meta["lookup_score"]
    if table.admission is not None:
        table.admission.forgotten_sightings = meta["forgotten_sightings"]
    if table.cache is not None:  # a ddr store's pages were just written: flush() syncs them
        table.cache.unflushed = meta["unflushed"] or table.files is not None
    table.checkpoint_marks = None  # dynemb.checkpoint's record of saves: from another table
