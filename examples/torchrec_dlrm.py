"""torchrec's own DLRM, unmodified, with dynemb tables as its sparse arch, on MovieLens 100K.

    .venv/bin/python examples/torchrec_dlrm.py [--steps 400]
    .venv/bin/torchrun --nproc-per-node 2 examples/torchrec_dlrm.py    # tables over 2 ranks

The batches come from dynemb's MovieLens reader (the real ratings shipped with dynemb, as a
click task: rating >= 4); their ids reach the model as a torchrec KeyedJaggedTensor, as in any
torchrec training loop. torchrec's DLRM reads the tables from the collection's
``embedding_bag_configs()`` and its pooled output's ``to_dict()``; the dynemb tables hold raw
ids (no vocabulary) and update their rows in backward with their fused Adagrad. Under torchrun
the collection is sharded row-wise (``dynemb.distributed.shard``, in a process group of its own:
both it and DDP run collectives during backward, and on one group they could be issued in
different orders on different ranks) and the dense layers are data-parallel
(DistributedDataParallel). Prints the loss, then the eval AUC.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchrec.models.dlrm import DLRM

import dynemb
from dynemb.data.base import empty_batch
from dynemb.data.movielens import MovieLens100K
from dynemb.train.metrics import roc_auc


def tables(source: MovieLens100K, dim: int) -> list[dynemb.TableConfig]:
    """One table per sparse field (torchrec's DLRM needs one dim for all)."""
    return [dynemb.TableConfig(name=f"t_{name}", dim=dim, features=[name], capacity=1 << 14,
                               optimizer=dynemb.Adagrad(lr=0.05),
                               initializer=dynemb.Initializer(std=0.05))
            for name in source.feature_names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=256, help="samples per rank per step")
    parser.add_argument("--dim", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per process (torchrun starts one per core)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)  # the same dense layers on every rank

    source = MovieLens100K()
    ebc = dynemb.EmbeddingBagCollection(tables(source, args.dim))
    if distributed:  # its own group: its all-to-alls never interleave with DDP's all-reduces
        ebc = dynemb.distributed.shard(ebc, group=dist.new_group(backend="gloo"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=len(source.dense_names),
                 dense_arch_layer_sizes=[32, args.dim], over_arch_layer_sizes=[32, 1])
    trained = DistributedDataParallel(model) if distributed else model
    opt = torch.optim.Adam(trained.parameters(), lr=0.003)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    start, window, first = time.perf_counter(), [], None
    batches = source.train_batches(args.batch_size, rank=rank, world_size=world_size)
    for step in range(1, args.steps + 1):
        batch = next(batches)
        logits = trained(batch.dense, batch.sparse.to_kjt()).squeeze(1)
        loss = loss_fn(logits, batch.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        window.append(loss.item())
        if step % 100 == 0 or step == args.steps:
            mean = sum(window) / len(window)
            first = mean if first is None else first
            window.clear()
            if rank == 0:
                rate = step * args.batch_size * world_size / (time.perf_counter() - start)
                print(f"step {step:5d}  loss {mean:.4f}  {rate:,.0f} samples/s "
                      f"({world_size} rank(s))", flush=True)
    last = mean

    model.eval()  # every rank evaluates its part of the held-out samples
    scores, labels = [], []
    mine = list(source.eval_batches(1024, rank=rank, world_size=world_size))
    calls = torch.tensor(len(mine))
    if distributed:  # a sharded collection is called as often on every rank: pad with empties
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    empty = empty_batch(len(source.dense_names), source.feature_names)
    with torch.no_grad():
        for batch in mine + [empty] * (int(calls) - len(mine)):
            scores.append(model(batch.dense, batch.sparse.to_kjt()).squeeze(1))
            labels.append(batch.labels)
    scores, labels = torch.cat(scores), torch.cat(labels)
    if distributed:  # the ranks' parts together (sizes may differ by one batch)
        parts = [None] * world_size
        dist.all_gather_object(parts, (scores, labels))
        scores, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        dist.barrier()  # see examples/torchrun_sharded.py: every rank is done before teardown
        dist.destroy_process_group()
    if rank == 0:
        print(f"loss {first:.4f} -> {last:.4f}; eval AUC {roc_auc(scores, labels):.4f} "
              f"({labels.numel():,} samples)")


if __name__ == "__main__":
    main()
