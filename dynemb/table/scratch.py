"""A table's reusable gradient buffer."""

from __future__ import annotations

import torch


class Scratch:
    """A reusable float32 buffer: fresh large tensors page-fault on first touch (see
    docs/architecture.md), so the per-step gradient accumulator of a table is kept (the pooling
    backward kernels overwrite it; what else accumulates into it takes it zeroed)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held between steps."""
        return 0 if self._buf is None else self._buf.nbytes

    def empty(self, rows: int, dim: int, device: torch.device) -> torch.Tensor:
        """A (rows, dim) float32 tensor of any contents, valid until the next call."""
        buf = self._buf
        if buf is None or buf.shape[0] < rows or buf.shape[1] != dim or buf.device != device:
            grown = 0 if buf is None else buf.shape[0] + buf.shape[0] // 4
            self._buf = buf = torch.empty(max(rows, grown, 1024), dim, dtype=torch.float32,
                                          device=device)
        return buf[:rows]

    def zeros(self, rows: int, dim: int, device: torch.device) -> torch.Tensor:
        """A zero-filled (rows, dim) float32 tensor, valid until the next call."""
        return self.empty(rows, dim, device).zero_()
