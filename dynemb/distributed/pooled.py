"""ShardedEmbeddingBagCollection: pooled lookups over tables sharded row-wise across ranks.

One step (per forward, all tables together, so each stage is one collective):

1. ``input_dist``: route and deduplicate ids per (table, owner); header all-to-all (split sizes,
   flags, config digest, step and phase); id all-to-all (unique keys, touched-bag lengths,
   per-id indices and weights).
2. owners: one lookup per table over every requester's keys; one pooling kernel call over every
   requester's touched bags -> partial SUMs.
3. output all-to-all of the partials; the requester sums the partials of each bag (in owner
   order), divides MEAN bags by their original length, and lays out (B, Σ F·dim).

Backward: a header all-to-all ("backward of step n": every rank is at the same point before any
gradient moves); the requester scales (MEAN) and gathers the gradient of each touched bag and
sends it to its owner; the owner's pooling backward sums it per unique key across requesters
(and yields the per-id weight gradients, sent back to the requesters that asked for them); the
fused optimizer runs once per table (gradient clipping uses the norm over all shards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynemb.batch import SparseBatch
from dynemb.config import PoolingMode, TableConfig
from dynemb.distributed import comm
from dynemb.distributed.base import FloatExchange, ShardedCollection
from dynemb.distributed.input_dist import InputDist
from dynemb.distributed.input_dist import TableRequest, counts_occurrences, plan_pooled
from dynemb.distributed.owner import OwnerTable, parse_pooled
from dynemb.nn.modules import EmbeddingBagCollection, KeyedEmbeddings
from dynemb.nn.staging import Staged


def _bag_scale(lengths: torch.Tensor) -> torch.Tensor:
    """(F·B, 1) float32 MEAN factor per bag: 1/n for n > 1, else 1 (as the pooling kernels)."""
    scale = torch.where(lengths > 1, 1.0 / lengths.clamp(min=1).double(), 1.0)
    return scale.to(torch.float32)[:, None]


def _bags_to_out(pooled: torch.Tensor, num_features: int, batch: int) -> torch.Tensor:
    """(F·B, dim) per bag -> (B, F·dim)."""
    dim = pooled.shape[1]
    return pooled.view(num_features, batch, dim).transpose(0, 1).reshape(batch, num_features * dim)


def _out_to_bags(gout: torch.Tensor, num_features: int, dim: int) -> torch.Tensor:
    """(B, F·dim) -> (F·B, dim)."""
    batch = gout.shape[0]
    return gout.reshape(batch, num_features, dim).transpose(0, 1).reshape(num_features * batch, dim)


@dataclass
class _PooledStep:
    """Everything one step's autograd boundary needs: the module, the input distribution, and
    the owner-side lookup of every table."""

    module: ShardedEmbeddingBagCollection
    inp: InputDist
    owners: list[OwnerTable]

    error: Exception | None = None
    """This rank's owner-lookup failure (sent to every rank with the output)."""
    exchange: FloatExchange | None = None
    values: torch.Tensor | None = None
    """(B, Σ F·dim) pooled embeddings of this rank's samples, once :meth:`finish` ran."""

    def start(self) -> None:
        """Pools the partial SUMs of the bags other ranks asked for and starts the output
        all-to-all (zeros and a failure status when this rank's lookup failed)."""
        m, inp, w = self.module, self.inp, self.module.world_size
        keep = inp.training and inp.grad and inp.any_wants_wgrad
        parts = []
        for t, c in enumerate(m.configs):
            sizes = [inp.headers.counts[r][t][1] * c.dim for r in range(w)]
            values = (self.owners[t].pool(keep) if self.error is None else
                      torch.zeros(sum(sizes), dtype=torch.float32, device=m.device))
            parts.append((values, sizes))
        recv = [[req.touched_counts[r] * req.config.dim for req in inp.requests] for r in range(w)]
        self.exchange = m.start_floats(parts, recv, comm.PHASE_FORWARD, inp.step, "output",
                                       self.error)

    def finish(self) -> torch.Tensor:
        """Waits for the output all-to-all; sums each bag's partials (in owner order)."""
        got = self.module.finish_floats(self.exchange)
        outs = [self._assemble(req, got[t].view(-1, req.config.dim))
                for t, req in enumerate(self.inp.requests)]
        self.values = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return self.values

    def _assemble(self, req: TableRequest, partials: torch.Tensor) -> torch.Tensor:
        num_features, dim = len(req.config.features), req.config.dim
        pooled = torch.zeros(req.lengths.numel(), dim, dtype=torch.float32,
                             device=partials.device)
        pooled.index_add_(0, req.touched_bags, partials)
        if req.config.pooling == PoolingMode.MEAN:
            pooled *= _bag_scale(req.lengths)
        return _bags_to_out(pooled, num_features, req.batch)

    def backward(self, gout: torch.Tensor) -> torch.Tensor | None:
        """Sends bag gradients to owners, applies the optimizers, returns the (N,) gradient of
        the batch's weights (None unless this rank asked for it)."""
        m, inp, w = self.module, self.inp, self.module.world_size
        m.check_backward(inp)
        parts, col = [], 0
        for req in inp.requests:
            num_features, dim = len(req.config.features), req.config.dim
            g = _out_to_bags(gout[:, col:col + num_features * dim], num_features, dim)
            col += num_features * dim
            if req.config.pooling == PoolingMode.MEAN:
                g = g * _bag_scale(req.lengths)
            parts.append((g[req.touched_bags], [n * dim for n in req.touched_counts]))
        recv = [[o.received.touched_splits[r] * o.table.dim for o in self.owners]
                for r in range(w)]
        got = comm.unpack_tables(self._exchange(parts, recv, comm.PHASE_BACKWARD, "gradient"),
                                 recv)
        any_wgrad = inp.any_wants_wgrad
        results = [o.pooled_grads(got[t].view(-1, o.table.dim), any_wgrad)
                   for t, o in enumerate(self.owners)]
        point = comm.step_name(comm.PHASE_BACKWARD, inp.step)
        with m.transport(point, "optimizer all-reduce"):
            m.apply_optimizers(self.owners, [g for g, _ in results])
        if not any_wgrad:
            return None
        return self._weight_grads([wg for _, wg in results])

    def _weight_grads(self, wgrads: list[torch.Tensor]) -> torch.Tensor | None:
        """Returns each requester its weight gradients; assembles this rank's (N,) ones in batch
        order."""
        inp, w = self.inp, self.module.world_size
        wants = [inp.wants_wgrad(r) for r in range(w)]
        parts = []
        for wg, o in zip(wgrads, self.owners):
            chunks = torch.split(wg, o.received.occ_splits)
            parts.append((torch.cat([c for c, want in zip(chunks, wants) if want]),
                          [n if want else 0 for n, want in zip(o.received.occ_splits, wants)]))
        mine = wants[self.module.rank]
        recv = [[req.occ_counts[r] if mine else 0 for req in inp.requests] for r in range(w)]
        flat = self._exchange(parts, recv, comm.PHASE_BACKWARD, "weight-gradient")
        got = comm.unpack_tables(flat, recv)
        if not mine:
            return None
        batch = inp.batch
        out = torch.zeros(batch.values.numel(), dtype=torch.float32, device=self.module.device)
        starts = _feature_starts(batch)
        for t, req in enumerate(inp.requests):
            table_order = torch.empty(req.occ_order.numel(), dtype=torch.float32,
                                      device=out.device)
            table_order[req.occ_order] = got[t]
            lo = 0
            for f in req.config.features:
                n = batch.feature(f)[0].numel()
                out[starts[f]:starts[f] + n] = table_order[lo:lo + n]
                lo += n
        return out

    def _exchange(self, parts, recv: list[list[int]], phase: int, what: str) -> torch.Tensor:
        return self.module.exchange_floats(parts, recv, phase, self.inp.step, what)


def _feature_starts(batch: SparseBatch) -> dict[str, int]:
    """Offset of each feature's ids in ``batch.values``."""
    per_feature = batch.lengths.view(len(batch.features), batch.batch_size).sum(dim=1).tolist()
    starts, acc = {}, 0
    for name, n in zip(batch.features, per_feature):
        starts[name], acc = acc, acc + int(n)
    return starts


class _ShardedPooledFn(torch.autograd.Function):
    """(B, Σ F·dim) pooled embeddings from the owners; backward ships bag gradients to the
    owners (which apply the fused optimizers) and returns the gradient of the batch weights."""

    @staticmethod
    def forward(ctx, step: _PooledStep, anchor: torch.Tensor, weights: torch.Tensor):
        ctx.step = step
        values, step.values = step.values, None  # its grad_fn will be this node: no cycle
        return values

    @staticmethod
    def backward(ctx, gout: torch.Tensor):
        with ctx.step.module._timed("backward"):
            wgrad = ctx.step.backward(gout)
        if wgrad is None or not ctx.needs_input_grad[2]:
            return None, None, None
        weights = ctx.step.inp.batch.weights
        return None, None, wgrad.to(weights.device, weights.dtype)


class ShardedEmbeddingBagCollection(ShardedCollection):
    """An :class:`~dynemb.EmbeddingBagCollection` whose tables are split row-wise over the ranks
    of a process group; each rank passes its own batch and gets its own samples' pooled rows.

    Built by :func:`dynemb.distributed.shard` (or directly, with the same arguments as the base
    :class:`~dynemb.distributed.base.ShardedCollection`). Collective: every rank calls forward
    (and backward) the same number of times, in the same train/eval and grad mode; a rank with
    no data passes an empty batch (batch size 0). Batch sizes may differ between ranks.
    """

    pooled_kind = True
    local_class = EmbeddingBagCollection

    @torch.compiler.disable  # a graph break: torch.compile never traces the tables
    def forward(self, batch: SparseBatch) -> KeyedEmbeddings:
        staged = self._take(batch) if self._stages is not None else self._eager(batch)
        return self._output(staged)

    def _plan(self, config: TableConfig, batch: SparseBatch) -> TableRequest:
        return plan_pooled(config, batch, self.world_size, self.device)

    @torch.compiler.disable  # a graph break: torch.compile never traces the tables
    def pooled(self, inp: InputDist) -> KeyedEmbeddings:
        """Owner lookups, pooling and the output all-to-all of one distributed input (what
        forward does after :meth:`input_dist`)."""
        staged = Staged(batch=inp.batch, training=inp.training, grad=inp.grad, state=inp)
        self.stage_lookup(staged)
        return self._output(staged)

    def stage_lookup(self, staged: Staged) -> None:
        """Owner lookups (rows held until backward when a pipeline drives the collection),
        pooling, and the start of the output all-to-all."""
        inp, hold = staged.state, self._holds(staged)
        with self._timed("lookup"):
            weighted = [inp.weighted(r) for r in range(self.world_size)]
            owners, error = self.resolve_owners(inp, lambda t, config, counts, chunks: parse_pooled(
                chunks, counts, weighted, counts_occurrences(config, inp.training)), hold)
            staged.holds += [(o.table, o.lookup) for o in owners] if hold else []
            step = _PooledStep(module=self, inp=inp, owners=owners, error=error)
            step.start()
        staged.out = step

    def _output(self, staged: Staged) -> KeyedEmbeddings:
        step = staged.out
        with self._timed("output_dist"):
            values = step.finish()
        if staged.updates:
            weights = step.inp.batch.weights
            weights = self._anchor if weights is None else weights
            values = _ShardedPooledFn.apply(step, self._anchor, weights)
        keys = [f for c in self.configs for f in c.features]
        dims = [c.dim for c in self.configs for _ in c.features]
        return KeyedEmbeddings(keys, dims, values)
