"""Spawned jobs of the robustness tests: ranks that skip a backward, call forward twice, die,
exit or hang mid-run, and collections built on a subgroup before one on the whole world.

Unlike ``_harness.spawn`` a rank here may be killed (or kill itself): every rank saves its results
after each scenario (``<out>/rank<r>.pt``), the parent waits for the job with a deadline, kills
what is left of it, and reads whichever result files exist.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dynemb
import _harness as H

TABLES = [dynemb.TableConfig(name="a", dim=4, features=["fa"], capacity=256,
                             optimizer=dynemb.Adam(lr=0.05)),
          dynemb.TableConfig(name="b", dim=3, features=["fb"], capacity=256,
                             pooling=dynemb.PoolingMode.MEAN)]


def batch(step: int, rank: int) -> dynemb.SparseBatch:
    """Rank ``rank``'s batch of ``step``: 3 samples, 1 to 2 ids per bag."""
    g = torch.Generator().manual_seed(step * 101 + rank)
    lengths = torch.randint(1, 3, (6,), generator=g)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
    return dynemb.SparseBatch(features=["fa", "fb"], values=values, lengths=lengths)


def outcome(fn) -> tuple[str, str, float]:
    """(exception class name or "ok", message, seconds taken)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001  (the test inspects type and message)
        return type(e).__name__, str(e), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def loss(out) -> torch.Tensor:
    if isinstance(out, dict):  # EmbeddingCollection: {feature: JaggedEmbeddings}
        return sum(v.values.sum() for v in out.values())
    return out.values().sum()


def train(module, steps: range, rank: int, skip_backward=None, extra_forward=None) -> None:
    """Forward and backward per step; ``skip_backward(step)`` / ``extra_forward(step)`` say
    whether this rank leaves out the step's backward or calls forward once more before it."""
    for step in steps:
        out = module(batch(step, rank))
        if extra_forward is not None and extra_forward(step):
            module(batch(step, rank))
        if skip_backward is None or not skip_backward(step):
            loss(out).backward()


# ---------------------------------------------------------------- the jobs


def _steps_job(rank: int, world_size: int, results: dict, save) -> None:
    """Step and phase mismatches (every rank must raise DynembError), then a subgroup."""
    if world_size >= 3:
        results["subgroup"] = outcome(lambda: _subgroup(rank, world_size, results))
        save()
    last = world_size - 1
    m = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(TABLES))
    results["skip_backward"] = outcome(
        lambda: train(m, range(1, 5), rank, skip_backward=lambda s: s == 3 and rank == last))
    save()
    ec = dynemb.distributed.shard(dynemb.EmbeddingCollection(TABLES))
    results["extra_forward"] = outcome(
        lambda: train(ec, range(1, 5), rank, extra_forward=lambda s: s == 2 and rank == 0))
    save()
    # a call refused on every rank is not a step: both collections go on from where they were
    results["usable_after"] = outcome(lambda: (train(m, range(5, 7), rank),
                                               train(ec, range(5, 7), rank)))


def _subgroup(rank: int, world_size: int, results: dict) -> None:
    """Ranks 0 and 1 build (and train) a collection on their own group first; then every rank
    builds the equivalence case's collection on the whole world and trains it."""
    pair = dist.new_group([0, 1])  # collective over the world, even for the ranks outside it
    if rank < 2:
        sub = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(TABLES), group=pair)
        train(sub, range(1, 3), rank)
    case = SUBGROUP_CASE
    steps = [H.local_slices(case, s, world_size) for s in range(case.steps)]
    world = dynemb.distributed.shard(H.collection(case))
    results["subgroup_rec"] = H.run_case(case, world, [b[rank] for _, _, b in steps],
                                         [(g, off[rank]) for g, off, _ in steps], rank)


SUBGROUP_CASE = next(c for c in H.cases() if c.name == "hash_roundrobin-adam")


def _victim_step(rank: int, world_size: int, results: dict, save, when: str, victim: int,
                 how: str, timeout_s: float) -> None:
    """Trains 4 steps on a group with collective timeout ``timeout_s``; at step 3 the victim
    rank dies (``how``: kill, exit, hang) at the start of forward (``when`` = forward) or
    between forward and backward (``when`` = backward).

    A first collection on the default group (long timeout) compiles the kernels, so no rank is
    late by more than a short timeout before the victim's step.
    """
    train(dynemb.distributed.shard(dynemb.EmbeddingBagCollection(TABLES)), range(1, 3), rank)
    dist.barrier()
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    m = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(TABLES), group=group)
    train(m, range(1, 3), rank)

    def fail() -> None:
        if rank == victim and when == "forward":
            _die(how)
        out = m(batch(3, rank))
        if rank == victim:
            _die(how)
        loss(out).backward()
        train(m, range(4, 6), rank)

    results["lost"] = outcome(fail)
    save()
    results["again"] = outcome(lambda: m(batch(9, rank)))


def _dense_victim(rank: int, world_size: int, results: dict, save, victim: int) -> None:
    """``dynemb train``'s own collectives: the victim is killed before the dense gradients'
    all-reduce of the second step."""
    from dynemb.train.parallel import Env, sum_gradients  # noqa: PLC0415

    env = Env(rank=rank, world_size=world_size, device=torch.device("cpu"))
    params = [torch.nn.Parameter(torch.ones(3))]

    def steps() -> None:
        for step in range(2):
            if rank == victim and step == 1:
                _die("kill")
            params[0].grad = torch.full((3,), float(rank))
            sum_gradients(env, params)

    results["lost"] = outcome(steps)


def _die(how: str) -> None:
    time.sleep(1.0)  # the others have read all this rank sent, and wait in its next collective
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(0)
    time.sleep(60)  # hang: the parent kills this process when the others are done


JOBS = {"steps": _steps_job, "victim": _victim_step, "dense_victim": _dense_victim}


# ---------------------------------------------------------------- spawning


def _worker(rank: int, world_size: int, port: int, out_dir: str, job: str,
            kwargs: dict) -> None:
    torch.set_num_threads(1)
    H.init_group(rank, world_size, port)  # 60 s: ranks start and compile at different speeds
    results: dict = {}

    def save() -> None:
        path = Path(out_dir) / f"rank{rank}.pt"
        torch.save(results, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)

    try:
        JOBS[job](rank, world_size, results, save, **kwargs)
    except Exception:  # noqa: BLE001  (recorded: the parent reports it)
        results["__error__"] = traceback.format_exc()
    save()
    if "victim" in job:  # the group lost a rank: leave without tearing it down
        os._exit(0)
    dist.destroy_process_group()


def spawn(job: str, world_size: int, out_dir: Path, deadline_s: float = 120.0,
          **kwargs) -> dict[int, dict]:
    """Runs ``JOBS[job](rank, world_size, results, save, **kwargs)`` on ``world_size`` gloo
    ranks; returns {rank: results} of the ranks that saved some. Processes still alive after
    ``deadline_s`` (a hung victim) are killed."""
    ctx = mp.get_context("spawn")
    port = H.free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, str(out_dir), job, kwargs),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    victim = kwargs.get("victim")  # a hung victim never ends by itself: wait for the others
    for r, p in enumerate(procs):
        if r != victim:
            p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return {r: torch.load(out_dir / f"rank{r}.pt", weights_only=False)
            for r in range(world_size) if (out_dir / f"rank{r}.pt").exists()}
