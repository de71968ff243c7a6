"""The training loop of ``dynemb train``: build, (resume), train, evaluate, report.

Before the first step the tables are placed (:mod:`dynemb.train.planning`: the planner on rank
0, a saved plan, or the resumed run's plan; shared with every rank) and built.

One step: the next batch (prefetched by a background thread), the DLRM's forward, binary
cross-entropy, backward (the tables' fused optimizers update their rows in place), the dense
gradients summed over the ranks, the dense optimizer's step. Under torchrun each rank trains on
its own batch_size / W samples; its loss is scaled by 1 / W so that the summed gradients are
those of the mean loss over the global batch, as in one process.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from dynemb.data.base import Batch, DataSource
from dynemb.data.prefetch import Prefetcher, worker_batches
from dynemb.errors import ConfigError, DynembError
from dynemb.models.dlrm import DLRM
from dynemb.train import checkpoints, planning
from dynemb.train.config import TrainConfig
from dynemb.train.config_io import dump_yaml
from dynemb.train.evaluate import evaluate, evaluate_train
from dynemb.train.parallel import Env, all_max, all_sum, environment, sum_gradients
from dynemb.train.pipelines import SPLIT, TrainPipeline, pipeline
from dynemb.train.progress import Progress
from dynemb.train.report import memory_report, plan_report, table_report, tier_counts, write_json
from dynemb.train.setup import build_model, dense_optimizer, make_source, table_configs

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Run:
    """Everything a running job holds."""

    config: TrainConfig
    env: Env
    out: Path
    source: DataSource
    model: DLRM
    optimizer: torch.optim.Optimizer
    progress: Progress
    settled: planning.RunPlan
    """How the tables were placed (the same on every rank)."""
    first_batches: list[Batch] = field(default_factory=list)
    """Rank 0: the batches the planner profiled, trained on first."""
    history: list[dict] = field(default_factory=list)
    train_s: float = 0.0
    """Seconds spent in training steps (data wait included; evaluation and saving not)."""
    last_loss: float = float("nan")
    """Mean training loss over the last log window (all ranks)."""
    data_wait_s: float = 0.0
    """Of ``train_s``, seconds spent waiting for the next batch."""
    saved_step: int = -1
    step_s: list[float] = field(default_factory=list)
    """Seconds of each training step of this process (as ``train_s`` counts them)."""
    tier_counts: torch.Tensor | None = None
    """(T, 2) this rank's (lookups, hbm hits) per table during the training steps."""
    split: dict[str, float] = field(default_factory=dict)
    """This rank's training seconds by part (the pipeline's step time split)."""


def train(config: TrainConfig, *, resume: bool = False, overwrite: bool = False,
          interactive: bool | None = None) -> dict:
    """Runs one training job (one process, or one rank of a torchrun job).

    Args:
        config: the run's configuration.
        resume: continue from the newest checkpoint in ``<out>/checkpoints`` up to
            ``config.steps`` (resharded when it was saved over another number of ranks).
        overwrite: let a fresh run replace an earlier run in ``<out>`` (its checkpoints and
            metrics are deleted); without it a fresh run refuses such a directory.
        interactive: show a progress bar (True) or log lines (False); default: whether stderr
            is a terminal.
    Returns:
        The metrics written to ``<out>/metrics.json`` (the same dict on every rank); or, when
        the newest checkpoint of a resumed run is already at ``config.steps``,
        ``{"nothing_to_do": True, "out", "steps", "resumed_from"}`` (nothing is written).
    Raises:
        ConfigError: on every rank, before anything is written: ``<out>`` holds an earlier run
            and neither ``resume`` nor ``overwrite`` is set, ``<out>`` cannot be written, or
            the newest checkpoint is past ``config.steps``.
    """
    wall = time.perf_counter()
    torch.set_num_threads(config.threads)
    with environment(config.device, config.timeout_s) as env:
        if config.batch_size % env.world_size:
            raise ConfigError(f"TrainConfig.batch_size: expected a multiple of the world size "
                              f"{env.world_size} (samples per step over all ranks), found "
                              f"{config.batch_size}.")
        config = dataclasses.replace(config, out=str(Path(config.run_dir)))
        point = _on_main(env, lambda: _claim(config, resume, overwrite))
        if point is not None and point.step == config.steps:
            logger.debug("nothing to do: the newest checkpoint, %s, is already at step %d",
                        point.path, point.step)
            return {"nothing_to_do": True, "out": config.out, "steps": config.steps,
                    "resumed_from": point.step}
        run = _prepare(config, env, interactive, point)
        try:
            start = 0
            if point is not None:
                start = checkpoints.restore(point, run.model, run.optimizer, env.world_size)
                run.history = [h for h in checkpoints.previous_history(run.out)
                               if h["step"] <= start]
            _fit(run, start)
            metrics = _finish(run, start, wall)
        finally:
            run.progress.close()
            run.model.embeddings.close(delete_files=True)  # ddr files: the rows are saved
    return metrics


def _on_main(env: Env, task: Callable[[], T]) -> T:
    """Runs ``task`` on rank 0 and gives every rank its result; an error it raises is raised
    on every rank (rank 0's own; elsewhere the DynembError, or a DynembError naming rank 0's
    error), so that no rank goes on alone into a collective."""
    result, error = None, None
    if env.is_main:
        try:
            result = task()
        except Exception as e:  # noqa: BLE001  (raised on every rank below)
            if not env.distributed:
                raise
            error = e
    if env.distributed:
        note = error if error is None or isinstance(error, DynembError) else DynembError(
            f"rank 0 failed before training: {type(error).__name__}: {error}")
        box = [(result, note)]
        dist.broadcast_object_list(box, src=0)
        result, note = box[0]
        if error is not None:
            raise error
        if note is not None:
            raise note
    return result  # type: ignore[return-value]


def _claim(config: TrainConfig, resume: bool, overwrite: bool) -> checkpoints.ResumePoint | None:
    """Rank 0: checks that the run may start in ``config.out`` (see
    :mod:`dynemb.train.checkpoints`), then creates it and writes ``config.yaml``; returns the
    checkpoint to resume from. Writes nothing when there is nothing to do."""
    out = Path(config.out)
    try:  # every OSError (unreadable, unwritable, a name too long): a ConfigError
        point = checkpoints.find_resume(out, config.steps) if resume else None
        if point is not None and point.step == config.steps:
            return point
        if not resume:
            checkpoints.check_fresh(out, overwrite)
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_yaml(config), encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot use the run directory ({error.strerror}: "
                          f"{error.filename}); expected a directory dynemb train can create, "
                          "read and write: choose another --out.") from None
    return point


def _prepare(config: TrainConfig, env: Env, interactive: bool | None,
             point: checkpoints.ResumePoint | None) -> Run:
    source = make_source(config.data)
    tables = table_configs(config, source)
    start = 0 if point is None else point.step
    profiled: list[Batch] = []

    def settle() -> planning.RunPlan:  # rank 0; the batches stay there
        settled, batches = planning.settle(config, tables, source, world_size=env.world_size,
                                           out=Path(config.out), resume=point is not None,
                                           start=start)
        profiled.extend(batches)
        return settled

    settled = _on_main(env, settle)
    if env.is_main:
        for line in planning.describe(settled):
            logger.info("%s", line)
    model = build_model(config, source, env, settled.plan)
    progress = Progress(config.steps, enabled=env.is_main, interactive=interactive)
    logger.debug("rank %d: %s, %d dense and %d sparse features", env.rank, source.name,
                 len(source.dense_names), len(source.features))
    return Run(config=config, env=env, out=Path(config.out), source=source, model=model,
               optimizer=dense_optimizer(config, model), progress=progress, settled=settled,
               first_batches=profiled)


def _pipeline(run: Run, params: list[torch.nn.Parameter]) -> TrainPipeline:
    """The run's training pipeline (``config.pipeline``) over its DLRM: forward on the batch's
    dense and sparse parts, binary cross-entropy scaled by 1 / W (so the summed gradients are
    those of the mean loss over the global batch), the dense gradients summed over the ranks
    after backward."""
    w, pc = run.env.world_size, run.config.pipeline

    def loss_fn(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels) / w

    return pipeline(pc.kind, model=run.model, optimizer=run.optimizer, loss_fn=loss_fn,
                    forward=lambda model, batch: model(batch.dense, batch.sparse),
                    after_backward=lambda: sum_gradients(run.env, params),
                    start_batch=pc.start_batch, stash_gradients=pc.stash_gradients)


def _segments(cfg: TrainConfig, start: int) -> list[int]:
    """The steps after which the pipeline stops with nothing in flight: evaluations,
    checkpoints and the last step."""
    ends = {cfg.steps}
    for every in (cfg.eval_every, cfg.checkpoint_every):
        if every:
            ends.update(range(every, cfg.steps, every))
    return sorted(e for e in ends if e > start)


def _fit(run: Run, start: int) -> None:
    """Trains from step ``start`` + 1 to ``config.steps``, logging, evaluating and saving on
    the way. Each stretch between evaluations and checkpoints runs one pipeline over exactly
    its batches, so none is in flight when the model is evaluated or saved."""
    cfg, env = run.config, run.env
    run.progress.advance_to(start)
    per_rank = cfg.batch_size // env.world_size
    first, run.first_batches = run.first_batches, []
    after = start + len(first)  # the batches the planner profiled come first
    if cfg.data.workers:
        stream = worker_batches(run.source, per_rank, rank=env.rank,
                                world_size=env.world_size, start=after)
    else:
        stream = run.source.train_batches(per_rank, rank=env.rank, world_size=env.world_size,
                                          start=after)
    params = run.model.dense_parameters()
    window = [torch.zeros((), dtype=torch.float64, device=env.device), 0]
    run.model.train()
    before = tier_counts(run.model)
    step = start
    with Prefetcher(itertools.chain(first, stream), cfg.data.prefetch) as batches:
        on_device = (b.to(env.device) for b in batches)
        for end in _segments(cfg, start):
            with _pipeline(run, params) as pipe:
                it = itertools.islice(on_device, end - step)
                while True:
                    t0 = time.perf_counter()
                    done = pipe.progress(it)
                    took = time.perf_counter() - t0
                    window[0] += done.loss * env.world_size
                    window[1] += 1
                    run.train_s += took
                    run.step_s.append(took)
                    for key, s in done.seconds.items():
                        run.split[key] = run.split.get(key, 0.0) + s
                    step += 1
                    run.progress.step()
                    if step == end:
                        break
                    _after_step(run, step, start, window)  # logs (segments end at the rest)
            _after_step(run, step, start, window)  # evaluate or save: no batch in flight
        run.data_wait_s = batches.wait_s
    run.tier_counts = tier_counts(run.model) - before


def _after_step(run: Run, step: int, start: int, window: list) -> None:
    cfg = run.config
    if step % cfg.log_every == 0 or step == cfg.steps:
        total = all_sum(run.env, torch.stack([window[0], torch.tensor(
            float(window[1]), dtype=torch.float64, device=run.env.device)])).tolist()
        run.last_loss = total[0] / max(total[1], 1.0)
        window[0].zero_()
        window[1] = 0
        run.progress.report(step, run.last_loss, _rate(run, step - start))
    if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
        _record_eval(run, step, start)
    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
        _save(run, step)


def _rate(run: Run, steps: int) -> float:
    return steps * run.config.batch_size / run.train_s if run.train_s > 0 else float("nan")


def _record_eval(run: Run, step: int, start: int) -> dict:
    cfg = run.config
    result = evaluate(run.model, run.source, run.env, batch_size=cfg.data.eval_batch_size,
                      max_samples=cfg.data.max_eval_samples)
    entry = {"step": step, "eval_auc": result["auc"], "eval_log_loss": result["log_loss"],
             "train_loss": run.last_loss, "samples_per_s": _rate(run, step - start)}
    run.history = [h for h in run.history if h["step"] != step] + [entry]
    run.progress.note(f"step {step}: eval AUC {result['auc']:.4f}, log loss "
                      f"{result['log_loss']:.4f}")
    return result


def _save(run: Run, step: int) -> None:
    checkpoints.save(run.out, step, run.model, run.optimizer, keep=run.config.keep_checkpoints,
                     prune=run.env.is_main)
    run.saved_step = step
    run.progress.note(f"step {step}: checkpoint saved in {run.out / 'checkpoints'}")


def _finish(run: Run, start: int, wall: float) -> dict:
    """Final evaluation, checkpoint and report; writes metrics.json on rank 0."""
    cfg, env = run.config, run.env
    run.progress.close()
    final = _record_eval(run, cfg.steps, start)
    train_metrics = {}
    if cfg.data.train_eval_samples:
        train_metrics = evaluate_train(run.model, run.source, env,
                                       batch_size=cfg.data.eval_batch_size,
                                       samples=cfg.data.train_eval_samples)
    train_metrics["loss_last_window"] = run.last_loss
    if cfg.checkpoint_at_end and run.saved_step != cfg.steps:
        _save(run, cfg.steps)
    step_ms = 1e3 * statistics.median(run.step_s) if run.step_s else 0.0
    times = all_max(env, torch.tensor([run.train_s, run.data_wait_s, step_ms],
                                      dtype=torch.float64, device=env.device)).tolist()
    split = all_max(env, torch.tensor([run.split.get(k, 0.0) for k in SPLIT],
                                      dtype=torch.float64, device=env.device)).tolist()
    steps_run = cfg.steps - start
    metrics = {
        "out": str(run.out), "data": {"source": cfg.data.source, **run.source.info},
        "world_size": env.world_size, "steps": cfg.steps, "batch_size": cfg.batch_size,
        "resumed_from": start or None, "eval": final, "train": train_metrics,
        "throughput": {"samples_per_s": steps_run * cfg.batch_size / times[0] if times[0] else 0.0,
                       "train_s": times[0], "data_wait_s": times[1],
                       "data_wait_share": times[1] / times[0] if times[0] else 0.0,
                       "step_ms_median": times[2], "wall_s": time.perf_counter() - wall},
        "tables": table_report(run.model, env), "memory": memory_report(env),
        "plan": plan_report(run.settled, run.model, env, run.tier_counts, times[2]),
        "pipeline": {"kind": cfg.pipeline.kind, "start_batch": cfg.pipeline.start_batch,
                     "stash_gradients": cfg.pipeline.stash_gradients,
                     "split_s": dict(zip(SPLIT, split)),
                     "split_share": {k: v / times[0] if times[0] else 0.0
                                     for k, v in zip(SPLIT, split)},
                     "per_rank": "each part's seconds are the slowest rank's"},
        "history": run.history,
    }
    if env.is_main:
        write_json(run.out / "metrics.json", metrics)
    return metrics
