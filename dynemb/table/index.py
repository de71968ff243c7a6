"""The hash index of one table: its tensors, geometry and the backend that runs its kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dynemb.kernels.index_numba import C_SIZE_DELTA, EMPTY_KEY, NUM_COUNTS, PIN_FREE, PIN_LOCKED
from dynemb.table.hostmem import host_full

# (name, numel, dtype, fill) -> tensor: where an index keeps its persistent arrays
Alloc = Callable[[str, int, torch.dtype, int], torch.Tensor]


def device_alloc(device: torch.device) -> Alloc:
    """Allocates filled tensors on ``device`` (host memory: in huge pages, ``table.hostmem``)."""
    if device.type == "cpu":
        return lambda name, n, dtype, fill: host_full((n,), fill, dtype)
    return lambda name, n, dtype, fill: torch.full((n,), fill, dtype=dtype, device=device)


class HashIndex:
    """Buckets of ``width`` slots: keys, scores, digests, pins and write steps (see
    ``kernels.index_numba``).

    Args:
        num_buckets, width: the geometry (``dynemb.table.memory.index_geometry``).
        device: where the tensors live.
        backend: a kernel backend from ``dynemb.kernels.backend``.
        split: buckets ``[0, split)`` are a HYBRID table's hbm tier (default: all, one tier).
        alloc: where keys, scores, digests and write steps live (default: ``device``; a
            memory-mapped backing store passes its files). Pins (and hold counts) live on
            ``device``.

    Holds: lookups in flight (``lookup(hold=True)`` until ``release``) hold their slots. A held
    slot's pin counts its holds: ``PIN_LOCKED - (count - 1)`` (-4 for one hold, -5 for two,
    ...), a value no insert takes as a victim, so holds cost no memory. Only :meth:`hold` and
    :meth:`release` (or, without reading a GPU, :meth:`hold_where` and :meth:`release_where`)
    change a count, by one per slot given; a lookup's ``finish``/``unpin`` (which
    free the pins it used) put the counts of held slots back (``kernels.backend``). A held slot
    whose key is erased keeps its count (a key that reuses the slot is protected until those
    lookups end), and a release never lowers another lookup's count.

    The tensors are made once and never replaced (a restore copies into them): a collection's
    grouped kernels read them by address (``dynemb.nn.grouped``).
    """

    def __init__(self, num_buckets: int, width: int, device: torch.device, backend, *,
                 split: int | None = None, alloc: Alloc | None = None) -> None:
        self.num_buckets, self.width = num_buckets, width
        self.split = num_buckets if split is None else split
        n = num_buckets * width
        alloc = alloc or device_alloc(device)
        self.backend = backend
        self.keys = alloc("keys", n, torch.int64, EMPTY_KEY)
        self.scores = alloc("scores", n, torch.int64, 0)
        self.digests = alloc("digests", n, torch.uint8, 0)
        self.written = alloc("written", n, torch.int64, 0)
        """Table step of each slot's last write (insert, optimizer update, assign, load)."""
        self.pins = device_alloc(device)("pins", n, torch.int32, PIN_FREE)
        self.counts = torch.zeros(NUM_COUNTS, dtype=torch.int64, device=device)
        self.counts[C_SIZE_DELTA] = int((self.digests >= 2).sum())  # a reopened store has rows
        self._held = 0
        self._held_on_device: torch.Tensor | None = None  # changes not read yet (hold_where)

    @property
    def held(self) -> int:
        """Slots held by lookups in flight (0: nothing to keep, the common case); reads the
        changes :meth:`hold_where` and :meth:`release_where` kept on the device."""
        if self._held_on_device is not None:
            self._held += int(self._held_on_device)
            self._held_on_device = None
        return self._held

    @property
    def num_slots(self) -> int:
        return self.keys.numel()

    def size(self) -> int:
        """Occupied slots."""
        return int(self.counts[C_SIZE_DELTA])

    def count(self, which: int) -> int:
        return int(self.counts[which])

    def occupied(self, start: int, stop: int) -> torch.Tensor:
        """Slots in [start, stop) that hold a key (int64)."""
        return torch.nonzero(self.digests[start:stop] >= 2).flatten() + start

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key or -1, touching nothing."""
        return self.backend.find(self, keys, _NO_SCORES.to(keys.device), 0, 0, False, False)

    def hold(self, slots: torch.Tensor) -> None:
        """Adds one hold to each of ``slots`` (distinct, all >= 0, free or held)."""
        if slots.numel() == 0:
            return
        slots = slots.to(self.pins.device)
        p = self.pins[slots]
        held = p <= PIN_LOCKED
        if not bool((held | (p == PIN_FREE)).all()):  # a lookup pin or a cached row: a bug
            raise AssertionError("hold of slots that are pinned")
        self._held += slots.numel() - int(held.sum())
        self.pins[slots] = torch.where(held, p - 1, PIN_LOCKED)

    def release(self, slots: torch.Tensor) -> None:
        """Removes one hold from each of ``slots`` (distinct, each given to :meth:`hold` before
        and not released since); slots left without holds are free again."""
        if slots.numel() == 0:
            return
        slots = slots.to(self.pins.device)
        p = self.pins[slots]
        if not bool((p <= PIN_LOCKED).all()):  # the caller's record and this index disagree
            raise AssertionError("release of slots that are not held")
        last = p == PIN_LOCKED
        self._held -= int(last.sum())
        self.pins[slots] = torch.where(last, PIN_FREE, p + 1)

    # Without reading the device (a GPU keeps running): ``slots`` may hold -1 (no slot), the
    # others distinct; the pins change through an accumulating indexed write (``put_where``'s
    # rule) and the count of held slots on the device. Unchecked: the callers' records are
    # the checked methods' own (``table.holds``).

    def hold_where(self, slots: torch.Tensor) -> None:
        """:meth:`hold` of the slots >= 0 among ``slots``."""
        p, ok, at = self._pins_at(slots)
        held = p <= PIN_LOCKED
        self._pin_delta(at, torch.where(ok, torch.where(held, -1, PIN_LOCKED - p), 0),
                        (ok & ~held).sum())

    def release_where(self, slots: torch.Tensor) -> None:
        """:meth:`release` of the slots >= 0 among ``slots``."""
        p, ok, at = self._pins_at(slots)
        last = p == PIN_LOCKED
        self._pin_delta(at, torch.where(ok, torch.where(last, PIN_FREE - p, 1), 0),
                        -(ok & last).sum())

    def _pins_at(self, slots: torch.Tensor):
        ok = slots >= 0
        at = torch.where(ok, slots, 0)
        return self.pins[at], ok, at

    def _pin_delta(self, at: torch.Tensor, delta: torch.Tensor, count: torch.Tensor) -> None:
        self.pins.index_put_((at,), delta.to(self.pins.dtype), accumulate=True)
        pending = self._held_on_device
        self._held_on_device = count if pending is None else pending + count

    def held_pins(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(slots, pins) of the held ones among ``slots`` (-1 allowed), for a lookup's
        ``finish``/``unpin`` to put back after freeing its pins; None when nothing is held."""
        if not self.held:
            return None
        s = slots[slots >= 0]
        p = self.pins[s]
        keep = p <= PIN_LOCKED
        return s[keep], p[keep]

    def is_held(self, slots: torch.Tensor) -> torch.Tensor:
        """(N,) bool: whether each of ``slots`` (N,) (all >= 0) is held."""
        if not self.held:
            return torch.zeros(slots.shape, dtype=torch.bool, device=slots.device)
        return (self.pins[slots.to(self.pins.device)] <= PIN_LOCKED).to(slots.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.keys, self.scores, self.digests, self.pins, self.written))


_NO_SCORES = torch.empty(0, dtype=torch.int64)
