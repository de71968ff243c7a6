"""Where a pipeline runs the stages of coming batches: in order on CPU, on a side stream on
CUDA (see :class:`Streams`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dynemb.nn.staging import Staged


class Streams:
    """Where a coming batch's stages run. CPU: in order on the calling thread (no CUDA call, no
    ``record_stream``; overlap comes from the asynchronous collectives). CUDA: on a side stream
    that first waits for everything queued on the main stream (a lookup reads rows the main
    stream's backward updated); before the main stream uses a staged batch it waits for the
    side stream, and every tensor the stages made is recorded on the main stream, so the
    allocator never hands out its memory while the main stream may still read it."""

    def __init__(self, device: torch.device) -> None:
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def ahead(self):
        """Runs the enclosed stage calls of a coming batch on the side stream."""
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        with torch.cuda.stream(self.side):
            yield

    def consume(self, staged: list[Staged]) -> None:
        """The main stream may now use what the stages of ``staged`` made."""
        if self.side is None:
            return
        main = torch.cuda.current_stream(self.side.device)
        main.wait_stream(self.side)
        for t in _tensors([(s.state, s.out) for s in staged]):
            if t.device.type == "cuda":
                t.record_stream(main)


def _tensors(obj, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``obj`` through dataclass fields, lists, tuples and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, seen)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name, None), seen)
