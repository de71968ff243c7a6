"""``dynemb plan`` and ``dynemb calibrate``: the files they read, the profiles they measure, and
what they print.

It sits at the command line's layer (beside :mod:`dynemb.cli`): it reads YAML with the checks of
:mod:`dynemb.train.config_io` and builds data sources with :mod:`dynemb.train.setup`, which the
planner itself may not import. The file formats are documented in docs/planner.md.

A tables file holds a list of tables (at the top, or under ``tables:``); each entry takes the
fields of :class:`~dynemb.config.TableConfig` plus an optional ``profile:``::

    - name: item
      dim: 64
      capacity: 1000000                 # features: defaults to [name]
      optimizer: {name: adam, lr: 0.001}
      storage: auto                     # default; or hbm_only | hybrid | caching, or a mapping
      profile: {lookups_per_step: 65536, zipf_alpha: 1.05}

A topology file holds the fields of :class:`~dynemb.planner.Topology`; byte counts may carry a
unit (``80GiB``, ``512 MB``).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import os
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from dynemb import planner
from dynemb.config import (
    SGD, Adagrad, Adam, OptimizerConfig, RowWiseAdagrad, Storage, TableConfig,
)
from dynemb.errors import ConfigError, DynembError, PlanningError
from dynemb.planner.report import format_cost_model, format_plan
from dynemb.planner.sources import profiles_from_batches
from dynemb.train.config_io import from_dict, parse_yaml, read_file, read_text
from dynemb.train.planning import existing_ancestor

logger = logging.getLogger(__name__)

OPTIMIZERS: dict[str, type[OptimizerConfig]] = {
    "sgd": SGD, "adagrad": Adagrad, "rowwise_adagrad": RowWiseAdagrad, "adam": Adam}
"""``optimizer:`` names in a tables file."""
PROFILE_KEYS = ("lookups_per_step", "zipf_alpha", "num_ids", "unique_per_step")
BYTE_FIELDS = ("hbm_bytes_per_rank", "ddr_bytes_per_host")
_UNIT = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
         "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
         "tib": 1 << 40}


def read_yaml(path: str | os.PathLike, what: str) -> object:
    """The YAML (or JSON) value in ``path``, read and parsed with the config reader's checks
    (size, UTF-8, alias bombs). Errors name ``what`` and the file."""
    where = f"{what} {os.fspath(path)}"
    return parse_yaml(read_text(path, where), where)


def parse_bytes(value: object, where: str) -> int:
    """A byte count: an int >= 0, or a string with a unit (``80GiB``, ``1.5 TB``, ``512MiB``)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", value) \
        if isinstance(value, str) else None
    if m is None or m.group(2).lower() not in _UNIT:
        raise ConfigError(f"{where}: expected a byte count (an int >= 0, or a number with a "
                          f"unit such as 80GiB, 512MB), found {value!r}.")
    return int(float(m.group(1)) * _UNIT[m.group(2).lower()])


def _enum_of(hint: object) -> type[enum.Enum] | None:
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return candidate
    return None


def _convert(cls: type, data: object, where: str) -> object:
    """Dataclass ``cls`` from a mapping: enums from their values, nested dataclasses from
    mappings, lists as tuples; unknown keys and bad values are errors naming ``where``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, found "
                          f"{type(data).__name__} {data!r}.")
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(fields)}.")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        kind = _enum_of(hints[name])
        nested = next((h for h in (hints[name], *typing.get_args(hints[name]))
                       if dataclasses.is_dataclass(h) and isinstance(h, type)), None)
        if kind is not None and isinstance(value, str):
            try:
                value = kind(value)
            except ValueError:
                raise ConfigError(f"{where}.{name}: expected one of "
                                  f"{[k.value for k in kind]}, found {value!r}.") from None
        elif nested is not None and isinstance(value, dict):
            value = _convert(nested, value, f"{where}.{name}")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (DynembError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _optimizer(value: object, where: str) -> OptimizerConfig:
    data = {"name": value} if isinstance(value, str) else value
    if not isinstance(data, dict) or data.get("name") not in OPTIMIZERS:
        found = data.get("name") if isinstance(data, dict) else data
        raise ConfigError(f"{where}: expected an optimizer name ({', '.join(OPTIMIZERS)}) or "
                          f"a mapping with `name:` and its fields, found {found!r}.")
    fields = {k: v for k, v in data.items() if k != "name"}
    return _convert(OPTIMIZERS[data["name"]], fields, where)


def _storage(value: object, where: str) -> Storage:
    data = {"mode": value} if isinstance(value, str) else value
    if isinstance(data, dict):
        data = {"mode": "auto", **data}
    return _convert(Storage, data, where)


def _profile(value: object, where: str) -> planner.AccessProfile:
    if not isinstance(value, dict) or "lookups_per_step" not in value:
        raise ConfigError(f"{where}: expected a mapping with lookups_per_step (and optionally "
                          f"zipf_alpha, num_ids, unique_per_step), found {value!r}.")
    unknown = sorted(str(k) for k in value if k not in PROFILE_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are "
                          f"{list(PROFILE_KEYS)}.")
    try:
        return planner.AccessProfile(**value)
    except DynembError as e:
        raise ConfigError(f"{where}: {e}") from None


def read_tables(path: str | os.PathLike) -> tuple[list[TableConfig],
                                                  dict[str, planner.AccessProfile]]:
    """The tables of a tables file, and the profiles its ``profile:`` blocks give.

    Raises:
        ConfigError: the file cannot be read, or an entry is malformed (the message names the
            file, the entry and the field).
    """
    where = f"tables file {os.fspath(path)}"
    data = read_yaml(path, "tables file")
    under = isinstance(data, dict) and set(data) == {"tables"}
    if under:
        data = data["tables"]
    if not isinstance(data, list):
        found = type(data).__name__ if data is not None else \
            "nothing under `tables:`" if under else "an empty file"
        raise ConfigError(f"{where}: expected a list of tables (at the top, or under "
                          f"`tables:`), found {found}.")
    tables, profiles = [], {}
    for i, entry in enumerate(data):
        at = f"{where}: tables[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at}: expected a mapping of table fields, found {entry!r}.")
        entry = dict(entry)
        if isinstance(entry.get("name"), str):
            at += f" ({entry['name']})"
        profile = entry.pop("profile", None)
        entry.setdefault("features", [entry.get("name")])
        entry["storage"] = _storage(entry.get("storage", "auto"), f"{at}.storage")
        if "optimizer" in entry:
            entry["optimizer"] = _optimizer(entry["optimizer"], f"{at}.optimizer")
        config = _convert(TableConfig, entry, at)
        if any(t.name == config.name for t in tables):
            raise ConfigError(f"{at}: the name {config.name!r} is used twice; expected "
                              "distinct table names.")
        tables.append(config)
        if profile is not None:
            profiles[config.name] = _profile(profile, f"{at}.profile")
    return tables, profiles


def read_topology(path: str | os.PathLike) -> planner.Topology:
    """The topology in a YAML file (Topology's fields; byte counts may carry units)."""
    where = f"topology file {os.fspath(path)}"
    data = read_yaml(path, "topology file")
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of Topology fields, found "
                          f"{type(data).__name__}.")
    data = dict(data)
    for name in BYTE_FIELDS:
        if name in data:
            data[name] = parse_bytes(data[name], f"{where}: {name}")
    try:
        return planner.Topology.from_dict(data)
    except PlanningError as e:
        raise ConfigError(f"{where}: {e}") from None


def topology(args: argparse.Namespace, tables: list[TableConfig]) -> planner.Topology:
    """``--topology FILE``, else this machine's (``--from-machine``, the default); then the
    ``--world-size``, ``--ranks-per-host`` and ``--device`` overrides."""
    if args.topology:
        topo = read_topology(args.topology)
    else:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: this machine has no CUDA device to read the "
                              "topology from; give --topology FILE, or use --device cpu.")
        paths = [t.storage.ddr_path for t in tables if t.storage.ddr_path]
        topo = planner.Topology.from_machine(
            world_size=args.world_size, ranks_per_host=args.ranks_per_host, device=args.device,
            ddr_path=existing_ancestor(paths[0]) if paths else None)
    changes = {k: v for k, v in (("world_size", args.world_size),
                                 ("ranks_per_host", args.ranks_per_host),
                                 ("device", args.device)) if v is not None}
    if changes and args.topology:
        try:
            topo = dataclasses.replace(topo, **changes)
        except PlanningError as e:
            raise ConfigError(f"--world-size/--ranks-per-host/--device: {e}") from None
    return topo


def data_profiles(args: argparse.Namespace, tables: list[TableConfig]
                  ) -> tuple[dict[str, planner.AccessProfile], str]:
    """Profiles measured on the first ``--profile-steps`` batches of ``--data`` (with the data
    settings and batch size of ``--config``, if given), and a note saying so."""
    from dynemb.train import TrainConfig
    from dynemb.train.setup import make_source

    config = from_dict(TrainConfig, read_file(args.config)) if args.config else TrainConfig()
    data = config.data
    if args.data:
        data = dataclasses.replace(data, source=args.data)
    batch_size = args.batch_size or config.batch_size
    source = make_source(data)
    for t in tables:
        missing = [f for f in t.features if f not in source.feature_names]
        if missing:
            raise ConfigError(f"tables file {args.tables}: table {t.name!r} reads feature(s) "
                              f"{missing} that {data.source} does not have; its features are "
                              f"{list(source.feature_names)}. Name them in the table's "
                              "`features:`, or give the table a `profile:` block.")
    batches = source.train_batches(batch_size)
    try:
        profiles = profiles_from_batches(batches, tables, steps=args.profile_steps)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    return profiles, f"{args.profile_steps} batches of {batch_size} from {data.source}"


def _check_writable(path: str | None, flag: str) -> None:
    if path is None:
        return
    parent = Path(path).absolute().parent
    if Path(path).is_dir():
        raise ConfigError(f"{flag} {path}: expected a file path, found a directory.")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: expected a file in a writable directory, found no "
                          f"writable directory {parent}; create it or choose another path.")


def run_plan(args: argparse.Namespace) -> int:
    """``dynemb plan``: prints the plan, writes it to ``--out`` (and ``--plot``)."""
    _check_writable(args.out, "--out")
    _check_writable(args.plot, "--plot")
    factors = planner.FACTORS if args.x_step is None else x_grid(args.x_step)
    calibration = planner.CostModel.load(args.calibration) if args.calibration else None
    tables, profiles = read_tables(args.tables)
    topo = topology(args, tables)
    notes = {name: "profile from tables file" for name in profiles}
    unprofiled = [t for t in tables if t.name not in profiles]
    if unprofiled and (args.data or args.config):
        measured, note = data_profiles(args, unprofiled)
        profiles.update(measured)
        notes.update({t.name: "profile from data" for t in unprofiled})
        print(f"profiles measured on {note}")
    elif args.data or args.config:
        print("every table has a profile: block; the data was not read")
    for t in unprofiled:
        if t.name not in profiles:
            profiles[t.name] = planner.default_profile(t)
            notes[t.name] = "default profile (uniform)"
    result = planner.plan(tables, topo, profiles=profiles, calibration=calibration,
                          factors=factors)
    print(format_plan(result, notes))
    if args.calibration:
        print(f"cost constants read from {args.calibration}")
    if args.out:
        try:
            result.save(args.out)
        except OSError as e:
            raise ConfigError(f"--out {args.out}: cannot write it ({e.strerror or e}).") from None
        print(f"plan written to {args.out}")
    if args.plot:
        from dynemb.planner.plot import plot_plan

        plot_plan(result, tables, profiles, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def x_grid(step: float) -> tuple[float, ...]:
    """cache_load_factor values 0.1, 0.1 + step, ... below 1.0 (``--x-step``)."""
    if not isinstance(step, float) or not 0.001 <= step <= 0.9:
        raise ConfigError(f"--x-step: expected a number in [0.001, 0.9], found {step!r}.")
    count = int(round((0.9 / step), 9)) + 1
    return tuple(x for x in (round(0.1 + i * step, 6) for i in range(count)) if x < 1.0)


def progress_reporter(interactive: bool, file: typing.TextIO | None = None
                      ) -> tuple[Callable[[int, int, str], None], Callable[[], None]]:
    """A progress callback for ``calibrate`` (a tqdm bar on ``file``, default stderr, when
    ``interactive``; else a log line per run) and the function that completes and closes the
    bar."""
    from tqdm import tqdm

    state: dict = {}

    def step(i: int, n: int, name: str) -> None:
        if not interactive:
            logger.info("calibration run %d/%d: %s", i + 1, n, name)
            return
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = tqdm(total=n, desc="calibrate", unit="run", dynamic_ncols=True,
                                      file=file or sys.stderr)
        bar.update(i - bar.n)
        bar.set_postfix_str(name)

    def done() -> None:
        bar = state.pop("bar", None)
        if bar is not None:
            bar.update(bar.total - bar.n)
            bar.close()

    return step, done


def run_calibrate(args: argparse.Namespace) -> int:
    """``dynemb calibrate``: measures the cost constants, prints them, writes ``--out``."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: expected a CUDA device, found none; calibrate on a "
                          "GPU host, or use --device cpu.")
    _check_writable(args.out, "--out")
    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    step, done = progress_reporter(sys.stderr.isatty())
    try:
        model = planner.calibrate(device=device, quick=args.quick, progress=step)
    finally:
        done()
    print(format_cost_model(model))
    if args.out:
        try:
            model.save(args.out)
        except OSError as e:
            raise ConfigError(f"--out {args.out}: cannot write it ({e.strerror or e}).") from None
        print(f"calibration written to {args.out}; plan with it: dynemb plan --calibration "
              f"{args.out} ...")
    return 0
