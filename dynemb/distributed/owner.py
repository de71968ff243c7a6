"""The owning side: what one rank does with the ids the other ranks (and itself) sent it.

Per table and step, the owner concatenates the unique keys of every requester and runs ONE
lookup over them (train mode inserts, through admission; eval mode inserts nothing). Pooled: it
pools each requester's touched bags straight from the row store with the local pooling kernel
(SUM, its weights; MEAN is applied by the requester, which knows the whole bag), in one kernel
call over all requesters. Sequence: it gathers the rows of the requested keys. In backward it
receives the gradients, sums them per unique key across requesters (the pooling backward kernel,
or an index_add), and applies the table's fused optimizer once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dynemb.distributed.input_dist import counts_occurrences
from dynemb.optim.rules import grad_norm_sq
from dynemb.table.table import DynamicTable, Lookup


@dataclass
class Received:
    """One table's requests from every rank, as the owner received them (R requesters)."""

    keys: torch.Tensor
    """(ΣU_r,) int64 unique keys of each requester, requester after requester."""
    unique_splits: list[int]
    """(R,) U_r."""
    local: torch.Tensor
    """Pooled: (ΣN_r,) int64 index of each id into ``keys`` (offsets added); sequence: empty."""
    lengths: torch.Tensor
    """Pooled: (ΣT_r,) int64 lengths of the touched bags."""
    weights: torch.Tensor
    """Pooled: (ΣN_r,) float32 weights (ones for unweighted requesters), or empty if none is
    weighted."""
    touched_splits: list[int]
    """(R,) T_r."""
    occ_splits: list[int]
    """(R,) N_r (ids routed here by each requester)."""
    multiplicity: torch.Tensor | None
    """(ΣU_r,) occurrences of each key, when the lookup must count them; else None."""


def parse_pooled(chunks: Sequence[torch.Tensor], counts: Sequence[tuple[int, int, int]],
                 weighted: Sequence[bool], occurrences: bool) -> Received:
    """Splits each requester's int64 payload (see ``input_dist``) into its sections."""
    keys, local, lengths, weights = [], [], [], []
    offset = 0
    any_weighted = any(weighted)
    for chunk, (u, t, n), w in zip(chunks, counts, weighted):
        keys.append(chunk[:u])
        lengths.append(chunk[u:u + t])
        local.append(chunk[u + t:u + t + n] + offset)
        if w:
            weights.append(chunk[u + t + n:u + t + 2 * n].view(torch.float64).to(torch.float32))
        elif any_weighted:
            weights.append(torch.ones(n, dtype=torch.float32, device=chunk.device))
        offset += u
    device = chunks[0].device
    keys_all, local_all = torch.cat(keys), torch.cat(local)
    mult = None
    if occurrences:
        mult = torch.bincount(local_all, minlength=keys_all.numel())
    return Received(keys=keys_all, unique_splits=[c[0] for c in counts], local=local_all,
                    lengths=torch.cat(lengths),
                    weights=(torch.cat(weights) if any_weighted
                             else torch.empty(0, dtype=torch.float32, device=device)),
                    touched_splits=[c[1] for c in counts], occ_splits=[c[2] for c in counts],
                    multiplicity=mult)


def parse_sequence(chunks: Sequence[torch.Tensor], counts: Sequence[tuple[int, int, int]],
                   occurrences: bool) -> Received:
    """Splits each requester's payload: unique keys, then (with ``occurrences``) their counts."""
    keys = [c[:u] for c, (u, _, _) in zip(chunks, counts)]
    mult = [c[u:2 * u] for c, (u, _, _) in zip(chunks, counts)] if occurrences else None
    empty = torch.empty(0, dtype=torch.int64, device=chunks[0].device)
    return Received(keys=torch.cat(keys), unique_splits=[c[0] for c in counts], local=empty,
                    lengths=empty, weights=empty.float(), touched_splits=[0] * len(counts),
                    occ_splits=[c[2] for c in counts],
                    multiplicity=None if mult is None else torch.cat(mult))


@dataclass
class OwnerTable:
    """One table's lookup on its owner for one step, and what backward needs of it."""

    table: DynamicTable
    received: Received
    lookup: Lookup
    entry: torch.Tensor
    """(ΣU_r,) int64 lookup entry of each received key."""
    entries: torch.Tensor | None = None
    """(U_entries, dim) the entries' embeddings as forward saw them, kept only when some
    requester's weights need a gradient (an update landing between forward and backward must
    not reach it), as the single-process EmbeddingBagCollection does."""

    @classmethod
    def resolve(cls, table: DynamicTable, received: Received, training: bool,
                hold: bool = False) -> OwnerTable:
        """Runs the one lookup of this step over every requester's keys (``hold``: its rows
        are held until ``apply_gradients`` or ``release``)."""
        keys, mult = received.keys, received.multiplicity
        held = {"hold": True} if hold else {}
        if mult is not None and counts_occurrences(table.config, training):
            lk = table.lookup(torch.repeat_interleave(keys, mult), train=training, **held)
            entry = lk.inverse[torch.cumsum(mult, 0) - mult]
        else:
            lk = table.lookup(keys, train=training, **held)
            entry = lk.inverse
        return cls(table=table, received=received, lookup=lk, entry=entry)

    @property
    def num_touched(self) -> int:
        return self.received.lengths.numel()

    def pool(self, keep_entries: bool = False) -> torch.Tensor:
        """(ΣT_r, dim) float32 partial SUM of each received touched bag (weights applied);
        ``keep_entries`` keeps the entries' embeddings for the weights' gradient."""
        t, r = self.table, self.received
        out = torch.empty(self.num_touched, t.dim, dtype=torch.float32, device=t.device)
        if self.num_touched:
            src, extra = t.sources(self.lookup)
            t.backend.pool(t.rows, extra, src, self.entry[r.local], r.lengths, r.weights,
                           self.num_touched, t.dim, False, out)
            if keep_entries:
                self.entries = t.embeddings(self.lookup)
        return out

    def rows(self) -> torch.Tensor:
        """(ΣU_r, dim) float32 rows of the received keys (eval initializer where none)."""
        return self.table.embeddings(self.lookup)[self.entry]

    def pooled_grads(self, gout: torch.Tensor, want_wgrad: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Backward of :meth:`pool`: ((U_entries, dim) summed gradients, (ΣN_r,) weight
        gradients or empty) from ``gout`` (ΣT_r, dim), the gradient of each partial."""
        t, r, lk = self.table, self.received, self.lookup
        scratch = t.grad_scratch.empty if self.num_touched else t.grad_scratch.zeros
        grads = scratch(lk.unique_slots.numel(), t.dim, t.device)  # pool_backward overwrites
        wgrad = torch.zeros(r.local.numel() if want_wgrad else 0, dtype=torch.float32,
                            device=t.device)
        if self.num_touched:
            if want_wgrad:  # the embeddings as forward saw them
                rows, extra = self.entries, self.entries[:0]
                src = torch.arange(rows.shape[0], device=t.device)
            else:
                rows, (src, extra) = t.rows, t.sources(lk)
            t.backend.pool_backward(gout.to(torch.float32).contiguous(), rows, extra, src,
                                    self.entry[r.local], r.lengths, r.weights, self.num_touched,
                                    t.dim, False, grads, wgrad)
        return grads, wgrad

    def row_grads(self, grad_rows: torch.Tensor) -> torch.Tensor:
        """(U_entries, dim) gradients summed per entry from ``grad_rows`` (ΣU_r, dim)."""
        t, lk = self.table, self.lookup
        grads = t.grad_scratch.zeros(lk.unique_slots.numel(), t.dim, t.device)
        return grads.index_add_(0, self.entry, grad_rows.to(torch.float32))

    def grad_norm_sq(self, grads: torch.Tensor) -> torch.Tensor:
        """Squared L2 norm (float64 scalar) of the finite gradient rows that will update a row
        (rows with NaN or inf never count, whatever ``TableConfig.nonfinite`` does with them)."""
        rids, _ = self.table.gradient_rows(self.lookup, grads)
        return grad_norm_sq(grads, rids >= 0)
