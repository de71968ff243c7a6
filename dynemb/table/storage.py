"""A table's row store over its two tiers.

Rows are ``[embedding (dim) | optimizer state]`` float32, addressed by global row ids: ids
``[0, hbm_rows)`` live in the hbm tensor (on the table's device), ids ``[hbm_rows, hbm_rows +
ddr_rows)`` in the ddr tensor (host memory: pinned for a CUDA table, or a memory-mapped file of
a :class:`~dynemb.table.ddr_files.DdrFiles` store).

Where the backend's kernels address both tiers by global row id (``in_place``: the triton
backend, with a ddr tier that is page-locked and mapped at its own address, or on CPU), every
method is one kernel over the ids and nothing waits for the device; a CUDA kernel then reads
and writes ddr rows in host memory directly. Otherwise the ids are split by tier with masks and
the kernels of each tier run where its tensor lives (host rows of a CUDA table are copied
through pinned staging buffers).
"""

from __future__ import annotations

import torch

from dynemb.kernels.backend import NUMBA
from dynemb.table.ddr_files import DdrFiles, ddr_file_bytes
from dynemb.table.hostmem import host_full
from dynemb.table.pinned import mapped_in_place, pinned_zeros, upload

__all__ = ["DdrFiles", "RowStore", "ddr_file_bytes"]


class RowStore:
    """Rows by global row id over the hbm and ddr tensors.

    Args:
        hbm_rows, ddr_rows: rows per tier (``ddr_rows`` 0: no ddr tier).
        dim: embedding width; ``width``: dim + optimizer state width.
        device: the table's device (hbm); ddr lives on the CPU.
        backend: the table's kernel backend (hbm; also ddr on a CPU table).
        files: memory-mapped files for the ddr rows, or None (RAM; for a CUDA table page-locked
            in chunks: ``dynemb.table.pinned``).
        name: the table's name (for errors).

    ``hbm`` is made once and never replaced (a restore copies into it): a collection's grouped
    kernels read it by address (``dynemb.nn.grouped``). ``in_place``: see the module docstring.
    """

    def __init__(self, hbm_rows: int, ddr_rows: int, dim: int, width: int, device: torch.device,
                 backend, files: DdrFiles | None, name: str = "") -> None:
        self.dim, self.width, self.split = dim, width, hbm_rows
        self.backend = backend
        self.hbm = (host_full((hbm_rows, width), 0, torch.float32) if device.type == "cpu"
                    else torch.zeros(hbm_rows, width, dtype=torch.float32, device=device))
        self.ddr: torch.Tensor | None = None
        # (host memory's kernels; a triton table's on CPU too, the model of its CUDA path)
        self.ddr_backend = backend if device.type == "cpu" and not backend.reads_wait else NUMBA
        self._side = None  # a CUDA table's side stream for copies to hbm (made on first use)
        if ddr_rows and files is not None:
            self.ddr = files.alloc("rows", ddr_rows * width, torch.float32, 0).view(ddr_rows, width)
        elif ddr_rows and device.type == "cuda":  # page-locked in chunks (table.pinned)
            self.ddr = pinned_zeros(ddr_rows, width, owner=self, name=name)
        elif ddr_rows:
            self.ddr = host_full((ddr_rows, width), 0, torch.float32)
        self.in_place = getattr(backend, "rows_in_place", False) and (
            self.ddr is None or device.type == "cpu"
            or (files is None and mapped_in_place(self.ddr)))

    def optimizer(self, name: str):
        """(``in_place``) The backend's update ``name`` over both tiers: ``parts`` hands this
        store to ``RowOptimizer.apply`` as the backend of its one part."""
        run = self.backend.optimizer(name)
        return lambda rows, slots, grads, *args: run(rows, slots, grads, *args, ddr=self.ddr)

    def settled_ddr(self) -> torch.Tensor | None:
        """The ddr rows, for the host to read or write, once the kernels queued on the device
        that read or write them in place have finished."""
        if self.in_place and self.ddr is not None and self.hbm.device.type == "cuda":
            torch.cuda.synchronize(self.hbm.device)
        return self.ddr

    def parts(self, ids: torch.Tensor) -> list[tuple]:
        """``(backend, rows, slots)`` per tier for ids (U,) (-1 allowed): each tier's slots
        hold its own row numbers, -1 for ids elsewhere."""
        if self.ddr is None:
            return [(self.backend, self.hbm, ids)]
        if self.in_place:  # one part: the update addresses both tiers
            return [(self, self.hbm, ids)]
        in_ddr = ids >= self.split
        hbm = torch.where(in_ddr, -1, ids)
        ddr = torch.where(in_ddr, ids - self.split, -1).to(self.ddr.device)
        return [(self.backend, self.hbm, hbm), (self.ddr_backend, self.ddr, ddr)]

    def gather(self, ids: torch.Tensor, ncols: int, out: torch.Tensor) -> None:
        """``out[u, :ncols] = row(ids[u])[:ncols]`` for ids >= 0 (others are left as they are)."""
        if self.in_place:
            self.backend.tier_gather(self.hbm, self.ddr, upload(ids, self.hbm.device), ncols, out)
            return
        for be, rows, slots in self.parts(ids):
            if rows.device == out.device:
                be.gather(rows, slots, ncols, out)
                continue
            ok = slots >= 0
            buf = torch.empty(int(ok.sum()), ncols, dtype=rows.dtype,
                              pin_memory=out.device.type == "cuda")
            be.gather(rows, slots[ok], ncols, buf)
            out[ok.to(out.device)] = self._upload(buf)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """(N, width) copies of the rows ``ids`` (all >= 0)."""
        out = torch.empty(ids.numel(), self.width, dtype=torch.float32, device=self.hbm.device)
        self.gather(ids, self.width, out)
        return out

    def write(self, ids: torch.Tensor, values: torch.Tensor, start: int = 0) -> None:
        """``row(ids[n])[start:start + values.shape[1]] = values[n]`` (ids all >= 0)."""
        if self.in_place:
            self.backend.tier_scatter(self.hbm, self.ddr, upload(ids, self.hbm.device),
                                      values.to(self.hbm), start)
            return
        stop = start + values.shape[1]
        for be, rows, slots in self.parts(ids):
            if not be.reads_wait and rows.device == values.device:  # (reads are free here)
                be.scatter(rows, slots, values.to(rows.dtype), start)
            elif self.ddr is None:
                rows[slots, start:stop] = values.to(rows)
            elif bool((ok := slots >= 0).any()):
                rows[slots[ok], start:stop] = values[ok.to(values.device)].to(rows)

    def fetch(self, ddr_rows: torch.Tensor, hbm_rows: torch.Tensor) -> None:
        """Copies ddr rows ``ddr_rows`` (K,) (ddr row numbers) to hbm rows ``hbm_rows`` (K,)."""
        if self.in_place:
            dev = self.hbm.device
            self.backend.tier_copy(self.hbm, self.ddr, upload(ddr_rows, dev) + self.split,
                                   upload(hbm_rows, dev))
            return
        if self.hbm.device == self.ddr.device:
            self.ddr_backend.copy_rows(self.ddr, ddr_rows, self.hbm, hbm_rows)
            return
        buf = torch.empty(ddr_rows.numel(), self.width, pin_memory=True)
        self.ddr_backend.copy_rows(self.ddr, ddr_rows, buf,
                                   torch.arange(ddr_rows.numel()))
        self.hbm[hbm_rows] = self._upload(buf)

    def _upload(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` (pinned host memory) copied to the hbm device asynchronously, on a side
        stream (a prefetch overlaps the step running on the current stream); the current stream
        waits for the copy before it reads the result. (Torch's pinned-memory allocator keeps
        ``buf`` until the copy is done.)"""
        dev = self.hbm.device
        if dev.type != "cuda":
            return buf.to(dev)
        if self._side is None:
            self._side = torch.cuda.Stream(dev)
        with torch.cuda.stream(self._side):
            out = upload(buf, dev)
        current = torch.cuda.current_stream(dev)
        current.wait_stream(self._side)
        out.record_stream(current)
        return out

    def store_back(self, hbm_rows: torch.Tensor, ddr_rows: torch.Tensor) -> None:
        """Copies hbm rows ``hbm_rows`` (K,) to ddr rows ``ddr_rows`` (K,) (ddr row numbers)."""
        if self.in_place:
            dev = self.hbm.device
            self.backend.tier_copy(self.hbm, self.ddr, upload(hbm_rows, dev),
                                   upload(ddr_rows, dev) + self.split)
            return
        if self.hbm.device == self.ddr.device:
            self.ddr_backend.copy_rows(self.hbm, hbm_rows, self.ddr, ddr_rows)
            return
        buf = self.hbm[hbm_rows].cpu()
        self.ddr_backend.copy_rows(buf, torch.arange(buf.shape[0]), self.ddr, ddr_rows.cpu())

    def init(self, ids: torch.Tensor, keys: torch.Tensor, state_value: float, init,
             table_mix: int) -> None:
        """Initial rows for ``keys`` (N,) at ``ids`` (N,) (all >= 0)."""
        if self.in_place and self.ddr is not None:  # made on the device, then put in place
            dev = self.hbm.device
            rows = torch.empty(keys.numel(), self.width, dtype=torch.float32, device=dev)
            self.backend.init_rows(rows, torch.arange(keys.numel(), device=dev), upload(keys, dev),
                                   self.dim, state_value, init, table_mix)
            self.write(ids, rows)
            return
        for be, rows, slots in self.parts(ids):
            ok = slots >= 0
            if self.ddr is None:
                be.init_rows(rows, slots, keys, self.dim, state_value, init, table_mix)
            elif bool(ok.any()):
                be.init_rows(rows, slots[ok], keys[ok.to(keys.device)].to(rows.device), self.dim,
                             state_value, init, table_mix)

    def tier_bytes(self) -> tuple[int, int]:
        """(hbm, ddr) bytes of rows."""
        ddr = 0 if self.ddr is None else self.ddr.numel() * self.ddr.element_size()
        return self.hbm.numel() * self.hbm.element_size(), ddr
