"""Train a small click model on generated data with a dynamic EmbeddingBagCollection.

The plain-API version of what ``dynemb train`` does (``make train``). The data: users and items
with hidden preference vectors; a click is more likely when they agree. The model learns user and
item embeddings (created on first sight, no vocabulary) plus a small MLP; the loss falls.

    python examples/quickstart.py [--steps 300] [--batch-size 512]
"""

from __future__ import annotations

import argparse
import time

import torch

import dynemb


def make_world(g: torch.Generator, num_users: int = 2_000, num_items: int = 1_000, rank: int = 8):
    """Users and items with raw, sparse-looking ids (no vocabulary, no contiguous range) and a
    hidden taste vector plus bias (the last column) each, drawn from ``g``."""
    user_ids = torch.randint(0, 2**62, (num_users,), generator=g)
    item_ids = torch.randint(0, 2**62, (num_items,), generator=g)
    return user_ids, item_ids, torch.randn(num_users, rank + 1, generator=g), \
        torch.randn(num_items, rank + 1, generator=g)


def sample(world, g: torch.Generator, batch_size: int):
    """One batch drawn from ``g``: user, item, 3 recently clicked items, and the click label."""
    user_ids, item_ids, u_vec, i_vec = world
    u = torch.randint(0, user_ids.numel(), (batch_size,), generator=g)
    i = torch.randint(0, item_ids.numel(), (batch_size,), generator=g)
    hist = torch.randint(0, item_ids.numel(), (batch_size, 3), generator=g)
    uv, iv = u_vec[u], i_vec[i]
    logit = (uv[:, :-1] * iv[:, :-1]).sum(1) / 2 + uv[:, -1] + iv[:, -1]
    label = (torch.rand(batch_size, generator=g) < torch.sigmoid(logit)).float()
    batch = dynemb.SparseBatch(
        features=["user_id", "item_id", "clicked_items"],
        values=torch.cat([user_ids[u], item_ids[i], item_ids[hist].flatten()]),
        lengths=torch.cat([torch.ones(2 * batch_size, dtype=torch.int64),
                           torch.full((batch_size,), 3, dtype=torch.int64)]))
    return batch, label


class ClickModel(torch.nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embeddings = dynemb.EmbeddingBagCollection([
            dynemb.TableConfig(name="user", dim=dim, features=["user_id"], capacity=1 << 16,
                               optimizer=dynemb.Adam(lr=0.01),
                               initializer=dynemb.Initializer(std=0.1)),
            dynemb.TableConfig(name="item", dim=dim, features=["item_id", "clicked_items"],
                               capacity=1 << 14, optimizer=dynemb.Adam(lr=0.01),
                               initializer=dynemb.Initializer(std=0.1),
                               pooling=dynemb.PoolingMode.MEAN),
        ])
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3 * dim + 1, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def forward(self, batch: dynemb.SparseBatch) -> torch.Tensor:
        e = self.embeddings(batch)
        dot = (e["user_id"] * e["item_id"]).sum(1, keepdim=True)
        return self.mlp(torch.cat([e.values(), dot], dim=1)).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    world = make_world(g)
    model = ClickModel()
    dense_opt = torch.optim.Adam(model.mlp.parameters(), lr=0.01)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    start, window = time.perf_counter(), []
    first = last = None
    for step in range(1, args.steps + 1):
        batch, label = sample(world, g, args.batch_size)
        loss = loss_fn(model(batch), label)
        dense_opt.zero_grad()
        loss.backward()  # embedding rows are updated here, by their fused Adam
        dense_opt.step()
        window.append(loss.item())
        if step % 50 == 0 or step == args.steps:
            mean = sum(window) / len(window)
            first = mean if first is None else first
            last = mean
            rate = step * args.batch_size / (time.perf_counter() - start)
            print(f"step {step:5d}  loss {mean:.4f}  {rate:,.0f} samples/s", flush=True)
            window.clear()
    for name, table in model.embeddings.tables.items():
        s = table.stats()
        print(f"table {name}: {s.size:,} rows of {s.capacity:,}, {s.evicted:,} evicted")
    print(f"loss {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
    main()
