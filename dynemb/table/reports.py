"""What a table reports about itself: its counters (``stats``) and bytes per tier
(``memory_usage``); a mixin of ``DynamicTable``."""

from __future__ import annotations

import torch

from dynemb.config import StorageMode
from dynemb.kernels.hashing import home_bucket, index_hash
from dynemb.kernels.index_numba import C_EVICTED, C_INSERTED
from dynemb.table.memory import MemoryUsage, TierMemory
from dynemb.table.stats import TableStats


class TableReports:
    """``stats()``, ``memory_usage()`` and the per-tier hit counting of a
    :class:`~dynemb.DynamicTable`."""

    def memory_usage(self) -> MemoryUsage:
        """Bytes per tier of the live tensors (the same formula as ``dynemb.table_memory``)."""
        hbm_rows, ddr_rows = self.store.tier_bytes()
        width = self.dim + self.optimizer.state_width

        def split(nbytes: int) -> dict[str, int]:
            return {"values_bytes": nbytes * self.dim // width,
                    "optimizer_state_bytes": nbytes * self.optimizer.state_width // width}

        admission = 0 if self.admission is None else self.admission.index.nbytes()
        if self.cache is None:
            hbm_index, ddr_index = self.index.nbytes(), 0
        else:
            hbm_index, ddr_index = self.cache.nbytes(), self.index.nbytes()
        return MemoryUsage(
            hbm=TierMemory(**split(hbm_rows), index_bytes=hbm_index, admission_bytes=admission),
            ddr=TierMemory(**split(ddr_rows), index_bytes=ddr_index))

    def stats(self) -> TableStats:
        c, adm = self._counters, self.admission
        if self.cache is not None:
            hbm_rows, ddr_rows = self.cache.index.size(), self.size()
        elif self.mode == StorageMode.HBM_ONLY:
            hbm_rows, ddr_rows = self.size(), 0
        else:
            hbm_rows = int((self.index.digests[:self.layout.hbm_rows] >= 2).sum())
            ddr_rows = self.size() - hbm_rows
        return TableStats(
            size=self.size(), capacity=self.capacity(), step=self.step,
            optimizer_step=self.optimizer.step, lookups=c["lookups"],
            hits=c["hbm_hits"] + c["ddr_hits"], hbm_hits=c["hbm_hits"],
            hbm_misses=c["hbm_misses"], ddr_hits=c["ddr_hits"], ddr_misses=c["ddr_misses"],
            inserted=self.index.count(C_INSERTED), evicted=self.index.count(C_EVICTED),
            failed_inserts=c["failed_inserts"], admission_rejected=c["admission_rejected"],
            counter_evictions=0 if adm is None else adm.counter_evictions,
            counter_overflows=0 if adm is None else adm.counter_overflows,
            forgotten_sightings=0 if adm is None else adm.forgotten_sightings,
            nonfinite_grads=c["nonfinite_grads"],
            erased=c["erased"], stale_updates=c["stale_updates"], hbm_rows=hbm_rows,
            ddr_rows=ddr_rows, cache_evictions=c["cache_evictions"],
            write_backs=c["write_backs"],
            backing_evictions=self.index.count(C_EVICTED) if self.cache is not None else 0,
            prefetched=c["prefetched"], held_rows=self.held_rows())

    def _count_tiers(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Per-tier hits and misses of a single-index (HBM_ONLY or HYBRID) lookup."""
        c, split = self._counters, self.layout.hbm_rows
        hit = slots >= 0
        n_hit = int(hit.sum())
        if self.mode == StorageMode.HBM_ONLY:
            c["hbm_hits"] += n_hit
            c["hbm_misses"] += keys.numel() - n_hit
            return
        in_hbm = slots < split
        c["hbm_hits"] += int((hit & in_hbm).sum())
        c["ddr_hits"] += int((hit & ~in_hbm).sum())
        if n_hit < keys.numel():
            mk = keys[~hit]
            ix = self.index
            hbm_tier = home_bucket(mk, index_hash(mk), ix.num_buckets, ix.split) < ix.split
            c["hbm_misses"] += int(hbm_tier.sum())
            c["ddr_misses"] += int((~hbm_tier).sum())
