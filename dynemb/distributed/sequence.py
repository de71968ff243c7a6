"""ShardedEmbeddingCollection: unpooled (one row per id) lookups over tables sharded row-wise.

One step: route and deduplicate ids per (table, owner); header and key all-to-alls; the owner
runs one lookup per table over every requester's keys and returns the rows of the keys each
requester asked for (an all-to-all of (U, dim) rows); the requester expands them to one row per
id. Backward exchanges a header ("backward of step n", checked like the forward one), then sends
the (U, dim) gradients back; the owner sums them per key across requesters and
applies the fused optimizer once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynemb.batch import SparseBatch
from dynemb.config import TableConfig
from dynemb.distributed import comm
from dynemb.distributed.base import FloatExchange, ShardedCollection
from dynemb.distributed.input_dist import InputDist
from dynemb.distributed.input_dist import TableRequest, counts_occurrences, plan_sequence
from dynemb.distributed.owner import OwnerTable, parse_sequence
from dynemb.errors import InputError
from dynemb.nn.modules import EmbeddingCollection, JaggedEmbeddings
from dynemb.nn.staging import Staged


@dataclass
class _RowsStep:
    """One step's autograd context: the module, the input distribution, the owner lookups."""

    module: ShardedEmbeddingCollection
    inp: InputDist
    owners: list[OwnerTable]

    error: Exception | None = None
    """This rank's owner-lookup failure (sent to every rank with the rows)."""
    exchange: FloatExchange | None = None
    rows: tuple[torch.Tensor, ...] = ()
    """Per table, the (U, dim) rows of this rank's unique keys, once :meth:`finish` ran."""

    def start(self) -> None:
        """Reads the rows other ranks asked for and starts the row all-to-all (zeros and a
        failure status when this rank's lookup failed)."""
        m, inp, w = self.module, self.inp, self.module.world_size
        parts = []
        for t, c in enumerate(m.configs):
            sizes = [inp.headers.counts[r][t][0] * c.dim for r in range(w)]
            rows = (self.owners[t].rows().reshape(-1) if self.error is None else
                    torch.zeros(sum(sizes), dtype=torch.float32, device=m.device))
            parts.append((rows, sizes))
        recv = [[req.unique_counts[r] * req.config.dim for req in inp.requests] for r in range(w)]
        self.exchange = m.start_floats(parts, recv, comm.PHASE_FORWARD, inp.step, "row",
                                       self.error)

    def finish(self) -> tuple[torch.Tensor, ...]:
        """Waits for the row all-to-all."""
        got = self.module.finish_floats(self.exchange)
        self.rows = tuple(got[t].view(-1, req.config.dim)
                          for t, req in enumerate(self.inp.requests))
        return self.rows

    def backward(self, grads: tuple[torch.Tensor, ...]) -> None:
        """Sends each table's (U, dim) gradient to the owners, which apply the optimizers."""
        self.module.check_backward(self.inp)
        parts = [(g.to(torch.float32), [n * req.config.dim for n in req.unique_counts])
                 for g, req in zip(grads, self.inp.requests)]
        recv = [[o.received.unique_splits[r] * o.table.dim for o in self.owners]
                for r in range(self.module.world_size)]
        got = comm.unpack_tables(self._exchange(parts, recv, comm.PHASE_BACKWARD, "gradient"),
                                 recv)
        summed = [o.row_grads(got[t].view(-1, o.table.dim)) for t, o in enumerate(self.owners)]
        point = comm.step_name(comm.PHASE_BACKWARD, self.inp.step)
        with self.module.transport(point, "optimizer all-reduce"):
            self.module.apply_optimizers(self.owners, summed)

    def _exchange(self, parts, recv: list[list[int]], phase: int, what: str) -> torch.Tensor:
        return self.module.exchange_floats(parts, recv, phase, self.inp.step, what)


class _ShardedRowsFn(torch.autograd.Function):
    """Per table (U, dim) rows from the owners; backward ships their gradients to the owners."""

    @staticmethod
    def forward(ctx, step: _RowsStep, anchor: torch.Tensor):
        ctx.step = step
        return step.rows

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        with ctx.step.module._timed("backward"):
            ctx.step.backward(grads)
        return None, None


class ShardedEmbeddingCollection(ShardedCollection):
    """An :class:`~dynemb.EmbeddingCollection` whose tables are split row-wise over the ranks of
    a process group: each rank passes its own batch (no weights) and gets
    ``{feature: JaggedEmbeddings}`` of its own samples. Collective, like
    :class:`~dynemb.distributed.ShardedEmbeddingBagCollection`."""

    pooled_kind = False
    local_class = EmbeddingCollection

    @torch.compiler.disable  # a graph break: torch.compile never traces the tables
    def forward(self, batch: SparseBatch) -> dict[str, JaggedEmbeddings]:
        staged = self._take(batch) if self._stages is not None else self._eager(batch)
        return self._output(staged)

    def _check_batch(self, batch: SparseBatch) -> SparseBatch:
        batch = super()._check_batch(batch)
        if batch.weights is not None:
            raise InputError(f"ShardedEmbeddingCollection (rank {self.rank}): the batch has "
                             "per-id weights, which an unpooled lookup cannot apply; pass the "
                             "batch without weights.")
        return batch

    def _plan(self, config: TableConfig, batch: SparseBatch) -> TableRequest:
        return plan_sequence(config, batch, self.world_size, self.device,
                             counts_occurrences(config, self.training))

    @torch.compiler.disable  # a graph break: torch.compile never traces the tables
    def sequence(self, inp: InputDist) -> dict[str, JaggedEmbeddings]:
        """Owner lookups and the row all-to-all of one distributed input (what forward does
        after :meth:`input_dist`)."""
        staged = Staged(batch=inp.batch, training=inp.training, grad=inp.grad, state=inp)
        self.stage_lookup(staged)
        return self._output(staged)

    def stage_lookup(self, staged: Staged) -> None:
        """Owner lookups (rows held until backward when a pipeline drives the collection) and
        the start of the row all-to-all."""
        inp, hold = staged.state, self._holds(staged)
        with self._timed("lookup"):
            owners, error = self.resolve_owners(inp, lambda t, config, counts, chunks: parse_sequence(
                chunks, counts, counts_occurrences(config, inp.training)), hold)
            staged.holds += [(o.table, o.lookup) for o in owners] if hold else []
            step = _RowsStep(module=self, inp=inp, owners=owners, error=error)
            step.start()
        staged.out = step

    def _output(self, staged: Staged) -> dict[str, JaggedEmbeddings]:
        step, inp = staged.out, staged.state
        with self._timed("output_dist"):
            rows = step.finish()
        if staged.updates:
            rows = _ShardedRowsFn.apply(step, self._anchor)
        out: dict[str, JaggedEmbeddings] = {}
        for req, table_rows in zip(inp.requests, rows):
            lo = 0
            for name in req.config.features:
                values, lengths, _ = inp.batch.feature(name)
                pos = req.position[lo:lo + values.numel()]
                lo += values.numel()
                out[name] = JaggedEmbeddings(values=F.embedding(pos, table_rows),
                                             lengths=lengths.to(self.device, torch.int64))
        return out
