"""Spawned jobs of the robustness tests: ranks that skip a backward, call forward twice, die,
exit or hang mid-run, collections built on a subgroup before one on the whole world, and a rank
that cannot build its shards.

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

# table a's max_grad_norm puts the optimizers' all-reduce into every backward (a victim dies there)
TABLES = [dynemb.TableConfig(name="a", dim=4, features=["fa"], capacity=256,
                             optimizer=dynemb.Adam(lr=0.05, max_grad_norm=10.0)),
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
    save()
    results["grad_mismatch"] = outcome(lambda: _grad_on_all_but_one(m, rank))
    results["twice_per_step"] = outcome(lambda: _twice_per_step(m, rank))
    save()
    _stats_after_skip(rank, world_size, results)
    save()
    _build_fails(rank, world_size, results)


def _grad_on_all_but_one(m, rank: int) -> None:
    """Rank 0 calls forward under torch.no_grad(), the others with grad (and backward)."""
    if rank == 0:
        with torch.no_grad():
            m(batch(7, rank))
    else:
        loss(m(batch(7, rank))).backward()


def _twice_per_step(m, rank: int) -> None:
    """Two forward calls per step, one loss over both: two backwards, in the same order on
    every rank (autograd's), so every rank is at the same point each time."""
    for step in range(8, 10):
        first, second = m(batch(step, rank)), m(batch(step + 50, rank))
        (loss(first) + 2 * loss(second)).backward()


def _stats_after_skip(rank: int, world_size: int, results: dict) -> None:
    """The last rank skips the last backward and goes on to ``routing_stats`` (another
    collective) while the others wait in that backward; on a group with a short timeout, so
    that a rank left waiting fails this scenario, not the job."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=20))
    m = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(TABLES), group=group)
    last = world_size - 1
    results["stats_after_skip"] = outcome(lambda: (
        train(m, range(1, 3), rank, skip_backward=lambda s: s == 2 and rank == last),
        m.routing_stats()))
    results["stats_again"] = outcome(m.routing_stats)


def _build_fails(rank: int, world_size: int, results: dict) -> None:
    """The last rank cannot allocate its shards (a RuntimeError, as torch's allocators raise):
    every rank must raise, none wait for it. Last in the job: before the fix the others waited
    until the failed rank left."""
    import dynemb.nn.modules as modules  # noqa: PLC0415

    class NoMemory(modules.DynamicTable):
        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 805306368 bytes")

    real = modules.DynamicTable
    if rank == world_size - 1:
        modules.DynamicTable = NoMemory
    try:
        results["build_fails"] = outcome(
            lambda: dynemb.distributed.shard(dynemb.EmbeddingBagCollection(TABLES)))
    finally:
        modules.DynamicTable = real


def _subgroup(rank: int, world_size: int, results: dict) -> None:
    """Ranks 0 and 1 build a collection on their own group, ranks 1 and 2 one on theirs (rank 1
    builds both: the groups overlap), and each pair trains its own; then every rank builds the
    equivalence case's collection on the whole world and trains it."""
    pairs = [dist.new_group([0, 1]), dist.new_group([1, 2])]  # collective over the world
    subs = [dynemb.distributed.shard(dynemb.EmbeddingBagCollection(TABLES), group=pair)
            for i, pair in enumerate(pairs) if rank in (i, i + 1)]
    for sub in subs:
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
    rank dies (``how``: kill, exit, hang) before the others build the collection
    (``when`` = build; they wait in its first collective), at the start of forward (``forward``),
    after
    its forward header in place of its id all-to-all (``ids``), between forward and backward
    (``backward``), or after its gradient all-to-all in place of the optimizers' all-reduce
    (``optimizer``).

    A first collection on the default group (long timeout) compiles the kernels, so no rank is
    late by more than a short timeout before the victim's step.
    """
    train(dynemb.distributed.shard(dynemb.EmbeddingBagCollection(TABLES)), range(1, 3), rank)
    dist.barrier()
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    if when == "build":
        if rank == victim:
            _die(how)
        results["lost"] = outcome(lambda: dynemb.distributed.shard(
            dynemb.EmbeddingBagCollection(TABLES), group=group))
        return
    m = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(TABLES), group=group)
    train(m, range(1, 3), rank)
    if rank == victim and when in ("ids", "optimizer"):  # the first such call of step 3
        setattr(m, "all_to_all" if when == "ids" else "apply_optimizers",
                lambda *args, **kwargs: _die(how))

    def fail() -> None:
        if rank == victim and when == "forward":
            _die(how)
        out = m(batch(3, rank))
        if rank == victim and when == "backward":
            _die(how)
        loss(out).backward()
        train(m, range(4, 6), rank)

    results["lost"] = outcome(fail)
    save()
    results["again"] = outcome(lambda: m(batch(9, rank)))


def _dense_victim(rank: int, world_size: int, results: dict, save, victim: int, at: str,
                  port: int) -> None:
    """``dynemb train``'s own collectives, in a group that ``environment`` makes as under
    torchrun: the victim is killed before the dense gradients' all-reduce of the second step
    (``at`` = step) or at the end of the run, before the barrier that ends it (``end``)."""
    from dynemb.train.parallel import environment, sum_gradients  # noqa: PLC0415

    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_PORT=str(port))
    params = [torch.nn.Parameter(torch.ones(3))]

    def run() -> None:
        with environment("cpu", timeout_s=60) as env:
            for step in range(2):
                if rank == victim and (step, at) == (1, "step"):
                    _die("kill")
                params[0].grad = torch.full((3,), float(rank))
                sum_gradients(env, params)
            if rank == victim and at == "end":
                _die("kill")

    results["lost"] = outcome(run)


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
