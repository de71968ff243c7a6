"""Train the quickstart's click model with its embedding tables sharded row-wise over the ranks.

    .venv/bin/torchrun --nproc-per-node 2 examples/torchrun_sharded.py [--steps 300]

Every rank draws its own samples; the embedding tables are split over the ranks (each id has one
owner rank, chosen by the table's routing mode) and the small MLP is data-parallel
(DistributedDataParallel). The embeddings use their own process group so their all-to-alls never
interleave with DDP's all-reduces. Runs on CPU with gloo; rank 0 prints the mean loss of all ranks
and, at the end, how evenly the ids were spread.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dynemb
from quickstart import make_world, sample  # the same toy click data (examples/ is on sys.path)


def tables(dim: int) -> list[dynemb.TableConfig]:
    """capacity is global: each of W ranks holds ceil(capacity / W) rows of each table."""
    return [
        dynemb.TableConfig(name="user", dim=dim, features=["user_id"], capacity=1 << 16,
                           optimizer=dynemb.Adam(lr=0.01), initializer=dynemb.Initializer(std=0.1),
                           routing=dynemb.Routing.HASH_ROUNDROBIN),
        dynemb.TableConfig(name="item", dim=dim, features=["item_id", "clicked_items"],
                           capacity=1 << 14, optimizer=dynemb.Adam(lr=0.01),
                           initializer=dynemb.Initializer(std=0.1),
                           pooling=dynemb.PoolingMode.MEAN),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256, help="samples per rank per step")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per rank: torchrun starts one process per core
    dist.init_process_group("gloo")  # reads RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    rank, world_size = dist.get_rank(), dist.get_world_size()
    emb_group = dist.new_group(backend="gloo")  # the embeddings' own collectives
    torch.manual_seed(args.seed)  # the same initial MLP on every rank

    sharded = dynemb.distributed.shard(dynemb.EmbeddingBagCollection(tables(args.dim)),
                                       group=emb_group)
    mlp = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(3 * args.dim + 1, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    dense_opt = torch.optim.Adam(mlp.parameters(), lr=0.01)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    world = make_world(torch.Generator().manual_seed(args.seed))  # the same world on every rank
    g = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # each rank its own samples
    start, window, first, last = time.perf_counter(), [], None, None
    for step in range(1, args.steps + 1):
        batch, label = sample(world, g, args.batch_size)
        e = sharded(batch)  # this rank's samples: (batch_size, 3 * dim)
        dot = (e["user_id"] * e["item_id"]).sum(1, keepdim=True)
        loss = loss_fn(mlp(torch.cat([e.values(), dot], dim=1)).squeeze(1), label)
        dense_opt.zero_grad()
        loss.backward()  # rows updated on their owners by the fused Adam; MLP grads all-reduced
        dense_opt.step()
        window.append(loss.detach())
        if step % 50 == 0 or step == args.steps:
            mean = torch.stack(window).mean()
            dist.all_reduce(mean)
            mean = float(mean) / world_size
            first = mean if first is None else first
            last = mean
            rate = step * args.batch_size * world_size / (time.perf_counter() - start)
            if rank == 0:
                print(f"step {step:5d}  loss {mean:.4f}  {rate:,.0f} samples/s "
                      f"({world_size} ranks)", flush=True)
            window.clear()
    stats = sharded.routing_stats()  # collective: every rank calls it
    if rank == 0:
        for name, t in stats.tables.items():
            print(f"table {name}: rows per rank {list(t.rows_stored)}, ids received per rank "
                  f"{list(t.ids_received)} (max/mean {t.ids_max_over_mean:.3f})")
        print(f"loss {first:.4f} -> {last:.4f}")
    # Every rank is done before any tears its groups down. Without this barrier a rank that
    # leaves first makes a peer still finishing the last gather abort ("connection closed"),
    # or deadlock in gloo's teardown (its worker thread waits for the GIL that the thread
    # joining it holds), now and then.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
