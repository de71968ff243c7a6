"""The process environment of a training run: one process, or one rank of a torchrun job.

Under torchrun (``WORLD_SIZE`` > 1) :func:`environment` initialises the default process group
(gloo on CPU, nccl on CUDA) unless the caller already did, and tears it down if it made it.
The collectives here are synchronous and used between steps only, so they never interleave
with the sharded embeddings' all-to-alls. A collective that fails because a rank vanished or the
group's timeout (``TrainConfig.timeout_s``) ran out raises DynembError saying which rank, as the
sharded embeddings do.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynemb.distributed import comm
from dynemb.errors import ConfigError, DynembError


@dataclass(frozen=True)
class Env:
    """Where this process stands in the job.

    Attributes:
        rank: this process's rank (0 alone).
        world_size: the number of ranks.
        device: where the model and batches live.
    """

    rank: int
    world_size: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files and prints."""
        return self.rank == 0


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("TrainConfig.device: expected a CUDA device for device=cuda, found "
                              "none; use device: cpu.")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@contextlib.contextmanager
def environment(device: str = "cpu", timeout_s: float = 600.0) -> Iterator[Env]:
    """The run's :class:`Env`; initialises (and later destroys) the process group under
    torchrun when no group exists yet.

    Args:
        device: ``cpu`` or ``cuda`` (each rank takes ``cuda:<LOCAL_RANK>``).
        timeout_s: collective timeout of a group made here.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    made = False
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    elif world > 1:
        dev = _device(device, local_rank)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
        made = True
    rank = dist.get_rank() if world > 1 else 0
    env = Env(rank=rank, world_size=world, device=_device(device, local_rank))
    try:
        yield env
    except BaseException:
        if made and dist.is_initialized():
            dist.destroy_process_group()  # no barrier: the other ranks may be stuck elsewhere
        raise
    if made and dist.is_initialized():
        # Every rank is done before any tears its group down: a rank exiting while a peer's
        # gloo connection is still open made the peer abort at exit now and then.
        try:
            with _collective(env, "the barrier that ends the run"):
                dist.barrier()
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def _collective(env: Env, what: str) -> Iterator[None]:
    """Turns a transport failure (a rank gone, the timeout) into a DynembError naming the rank."""
    try:
        yield
    except RuntimeError as e:
        if not comm.is_transport_error(e):
            raise
        raise DynembError(comm.peer_loss_message(f"dynemb train (rank {env.rank})", what, e,
                                                 None)) from e


def all_sum(env: Env, values: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of ``values`` over the ranks (a copy; the input alone if one)."""
    out = values.clone()
    if env.distributed:
        with _collective(env, "a sum over the ranks"):
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_max(env: Env, values: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of ``values`` over the ranks."""
    out = values.clone()
    if env.distributed:
        with _collective(env, "a maximum over the ranks"):
            dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def any_rank(env: Env, flag: bool) -> bool:
    """True if ``flag`` is true on any rank."""
    if not env.distributed:
        return flag
    return bool(all_max(env, torch.tensor([int(flag)], device=env.device)).item())


def all_gather_cat(env: Env, values: torch.Tensor) -> torch.Tensor:
    """Every rank's (n_r, ...) ``values`` concatenated in rank order, on every rank."""
    if not env.distributed:
        return values
    sizes = [torch.zeros(1, dtype=torch.int64, device=values.device)
             for _ in range(env.world_size)]
    with _collective(env, "a gather over the ranks"):
        dist.all_gather(sizes, torch.tensor([values.shape[0]], device=values.device))
    longest = int(max(int(s) for s in sizes))
    padded = torch.zeros(longest, *values.shape[1:], dtype=values.dtype, device=values.device)
    padded[:values.shape[0]] = values
    parts = [torch.empty_like(padded) for _ in range(env.world_size)]
    with _collective(env, "a gather over the ranks"):
        dist.all_gather(parts, padded)
    return torch.cat([p[:int(n)] for p, n in zip(parts, sizes)])


def sum_gradients(env: Env, params: list[torch.nn.Parameter]) -> None:
    """Sums the dense gradients over the ranks, in place, with one all-reduce."""
    if not env.distributed:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    with _collective(env, "the dense gradients' all-reduce"):
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def broadcast_parameters(env: Env, module: torch.nn.Module) -> None:
    """Copies rank 0's dense parameters to every rank."""
    if env.distributed:
        with _collective(env, "the broadcast of the dense parameters"):
            for p in module.parameters():
                dist.broadcast(p.data, src=0)
