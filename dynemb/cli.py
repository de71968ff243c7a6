"""The ``dynemb`` command line.

::

    dynemb train [--config run.yaml] [--data movielens-100k|synthetic|criteo:PATH] [--steps N]
                 [--batch-size B] [--out runs/NAME] [--resume | --overwrite]
                 [--plan plan.json] [--set KEY=VALUE ...]
    dynemb inspect PATH [--verify] [--json]
    dynemb plan --tables tables.yaml [--data SOURCE] [--topology topo.yaml | --from-machine]
                [--calibration cal.json] [--out plan.json] [--plot plan.png]
    dynemb calibrate [--device cpu|cuda] [--out cal.json] [--quick]

Errors the user can fix (a bad config, data file or run directory: every
:class:`~dynemb.errors.DynembError`) are printed as one message, without a traceback, and exit
with status 2. The behaviour is documented in docs/cli.md.

Each subcommand is a function that adds its parser (``_add_train``) and a handler it sets as
``handler``; :data:`SUBCOMMANDS` lists the adders, so a new subcommand is one function and one
entry there.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from dynemb.checkpoint.inspect import describe, verify_all
from dynemb.checkpoint.manifest import read_manifest
from dynemb.errors import CheckpointError, ConfigError, DynembError
from dynemb.train import TrainConfig, format_summary, from_dict, train
from dynemb.train.config import PIPELINE_KINDS
from dynemb.train.config_io import apply_overrides, describe_yaml, read_file


def _set(data: dict, dotted: str, value: object, flag: str) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{flag}: sets {dotted}, but {part!r} is {repr(node)[:40]} in "
                              "the config, expected a mapping of settings.")
    node[leaf] = value


def _setup_logging(verbose: bool) -> None:
    """INFO (DEBUG with -v) to stderr on rank 0; warnings only on the other ranks."""
    rank = int(os.environ.get("RANK", "0"))
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level if rank == 0 else logging.WARNING,
                        format="%(message)s" if rank == 0 else f"[rank {rank}] %(message)s",
                        stream=sys.stderr)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a DLRM click model",
                       description="Train a DLRM click model with dynamic embedding tables; "
                                   "writes metrics.json, config.yaml and checkpoints/ under "
                                   "--out. Under torchrun the tables are sharded over the ranks. "
                                   "Tables left to the planner (embeddings.storage: auto, the "
                                   "default) are placed at start-up, within this machine's "
                                   "memory (or the embeddings.*_bytes_* budgets).")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON config (see "
                   "dynemb.train.TrainConfig); flags below override it")
    p.add_argument("--data", metavar="SOURCE",
                   help="movielens-100k (default), synthetic, or criteo:PATH")
    p.add_argument("--steps", type=int, metavar="N", help="training steps (total)")
    p.add_argument("--batch-size", type=int, metavar="B", help="samples per step, all ranks")
    p.add_argument("--out", metavar="DIR", help="run directory (default runs/<data source>)")
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in DIR/checkpoints up to "
                            "--steps (resharded if saved over another number of ranks)")
    start.add_argument("--overwrite", action="store_true",
                       help="start afresh in a DIR that holds an earlier run, deleting its "
                            "checkpoints and metrics (without it, such a DIR is refused)")
    p.add_argument("--pipeline", metavar="KIND", choices=PIPELINE_KINDS,
                   help="how steps overlap: " + ", ".join(PIPELINE_KINDS) + " (pipeline.kind; "
                        "see docs/pipelines.md)")
    p.add_argument("--plan", metavar="FILE",
                   help="build the tables from this saved plan (dynemb plan --out FILE) "
                        "instead of planning them at start-up (embeddings.plan)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set data.split=time (repeatable); "
                        "the sections are data, model, embeddings (per-table settings in "
                        "embeddings.tables), dense_optimizer and pipeline, the rest are "
                        "top-level fields (--print-config lists them all)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (every field, with its meaning) as YAML "
                        "that --config reads back, and exit without training")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(handler=_run_train)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The config of ``dynemb train``: the file, then ``--set`` overrides, then the flags."""
    data = read_file(args.config) if args.config else {}
    data = apply_overrides(data, args.set)
    for flag, key in (("data", "data.source"), ("steps", "steps"),
                      ("batch_size", "batch_size"), ("out", "out"),
                      ("plan", "embeddings.plan"), ("pipeline", "pipeline.kind")):
        value = getattr(args, flag)
        if value is not None:
            _set(data, key, value, flag.replace("_", "-"))
    return from_dict(TrainConfig, data)


def _run_train(args: argparse.Namespace) -> int:
    _setup_logging(args.verbose)
    config = train_config(args)
    if args.print_config:
        print(describe_yaml(config), end="", flush=True)
        return 0
    metrics = train(config, resume=args.resume, overwrite=args.overwrite)
    if int(os.environ.get("RANK", "0")) == 0:
        if metrics.get("nothing_to_do"):
            print(f"dynemb train: nothing to do: the run in {metrics['out']} is already at step "
                  f"{metrics['resumed_from']} (--steps {metrics['steps']}); pass a larger "
                  "--steps to train further.", flush=True)
        else:
            print(format_summary(metrics), flush=True)
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show what a checkpoint holds",
                       description="Show a checkpoint's manifest, per-table and per-rank rows "
                                   "and sizes.")
    p.add_argument("path", type=Path, help="a checkpoint directory")
    p.add_argument("--verify", action="store_true", help="also check every file's sha256")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(handler=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    """Prints what the checkpoint holds; 1 on a bad checkpoint, with the reason on stderr."""
    try:
        if args.json:
            print(json.dumps(read_manifest(args.path), indent=1, sort_keys=True))
        else:
            print(describe(args.path))
        if args.verify:
            print(f"verified {verify_all(args.path)} files: sizes and sha256 match")
    except CheckpointError as e:
        print(f"dynemb inspect: {e}", file=sys.stderr)
        return 1
    return 0


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose each table's storage mode and cache_load_factor",
                       description="Choose per table HBM_ONLY, HYBRID or CACHING and its "
                                   "cache_load_factor, minimising the predicted step time within "
                                   "the hbm and ddr budgets; prints the plan and writes it as "
                                   "JSON (see docs/planner.md).")
    p.add_argument("--tables", required=True, metavar="FILE",
                   help="YAML list of tables (TableConfig fields, optional profile:)")
    p.add_argument("--data", metavar="SOURCE", help="profile the tables on the first batches of "
                   "movielens-100k, synthetic or criteo:PATH (default: the tables file's "
                   "profile: blocks, else a uniform default)")
    p.add_argument("--config", metavar="FILE", help="a `dynemb train` config whose data settings "
                   "and batch size the profiling uses")
    p.add_argument("--batch-size", type=int, metavar="B", help="samples per profiled batch "
                   "(default: the train config's, 256)")
    p.add_argument("--profile-steps", type=int, default=32, metavar="N",
                   help="batches profiled (default 32, as `dynemb train`)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--topology", metavar="FILE", help="YAML topology: world_size, "
                       "ranks_per_host, hbm_bytes_per_rank, ddr_bytes_per_host, device, reserves")
    where.add_argument("--from-machine", action="store_true",
                       help="this machine's topology (the default)")
    p.add_argument("--world-size", type=int, metavar="W", help="ranks in all (overrides)")
    p.add_argument("--ranks-per-host", type=int, metavar="R", help="ranks per host (overrides)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="device kind (overrides)")
    p.add_argument("--calibration", metavar="FILE",
                   help="cost constants from `dynemb calibrate` (default: the device's defaults)")
    p.add_argument("--x-step", type=float, metavar="S", help="try cache_load_factor 0.1, "
                   "0.1+S, ... (default 0.1)")
    p.add_argument("--out", default="plan.json", metavar="FILE",
                   help="where the plan is written (default plan.json)")
    p.add_argument("--plot", metavar="PNG", help="also draw the plan into this PNG")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(handler=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from dynemb.cli_plan import run_plan

    _setup_logging(args.verbose)
    for flag in ("profile_steps", "batch_size", "world_size", "ranks_per_host"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: expected an int >= 1, found "
                              f"{value}.")
    return run_plan(args)


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's cost constants for the planner",
                       description="Measure the planner's cost constants on this machine with "
                                   "short runs of every storage mode, fit them, print them and "
                                   "write them as JSON for `dynemb plan --calibration`.")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="where the tables run (default: cuda if available, else cpu)")
    p.add_argument("--out", default="calibration.json", metavar="FILE",
                   help="where the constants are written (default calibration.json)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch threads, as the training runs use (default 1)")
    p.add_argument("--quick", action="store_true",
                   help="tiny runs (seconds): checks the command, not the machine")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(handler=_run_calibrate)


def _run_calibrate(args: argparse.Namespace) -> int:
    from dynemb.cli_plan import run_calibrate

    _setup_logging(args.verbose)
    if args.threads < 1:
        raise ConfigError(f"--threads: expected an int >= 1, found {args.threads}.")
    return run_calibrate(args)


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_train, _add_inspect, _add_plan, _add_calibrate)
"""The functions that add each subcommand's parser (and its ``handler``)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``dynemb`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="dynemb", description="Dynamic embedding tables for "
                                     "recommendation models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``dynemb`` with ``argv`` (default: the process's arguments); returns the exit code
    (2 for a bad config or input, with the error on stderr; 141 when stdout's reader closed the
    pipe early, as a shell reports SIGPIPE)."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except DynembError as error:
        print(f"dynemb {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dynemb {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader left early (``dynemb inspect PATH | head``)
        try:  # no second error when the interpreter flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141


if __name__ == "__main__":
    sys.exit(main())
