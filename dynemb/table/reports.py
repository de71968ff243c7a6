"""What a table reports about itself: its counters (``stats``) and bytes per tier
(``memory_usage``); a mixin of ``DynamicTable``."""

from __future__ import annotations

from dynemb.kernels.index_numba import C_EVICTED, C_INSERTED
from dynemb.table.memory import MemoryUsage, TierMemory
from dynemb.table.stats import TableStats


class TableReports:
    """``stats()`` and ``memory_usage()`` of a :class:`~dynemb.DynamicTable` (the per-tier
    hit counting is its resolver's)."""

    def memory_usage(self) -> MemoryUsage:
        """Bytes per tier of the live tensors (the same formula as ``dynemb.table_memory``)."""
        hbm_rows, ddr_rows = self.store.tier_bytes()
        width = self.dim + self.optimizer.state_width

        def split(nbytes: int) -> dict[str, int]:
            return {"values_bytes": nbytes * self.dim // width,
                    "optimizer_state_bytes": nbytes * self.optimizer.state_width // width}

        admission = 0 if self.admission is None else self.admission.index.nbytes()
        hbm_index, ddr_index = self.resolver.index_bytes()
        return MemoryUsage(
            hbm=TierMemory(**split(hbm_rows), index_bytes=hbm_index, admission_bytes=admission),
            ddr=TierMemory(**split(ddr_rows), index_bytes=ddr_index))

    def stats(self) -> TableStats:
        c, adm = self.state.settled(), self.admission
        hbm_rows, ddr_rows = self.resolver.tier_rows()
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
            backing_evictions=self.resolver.backing_evictions(),
            prefetched=c["prefetched"], held_rows=self.held_rows())
