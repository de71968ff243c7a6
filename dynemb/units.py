"""Formatting shared by the reports: bytes in binary units."""

from __future__ import annotations

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, e.g. ``1.50 GiB``, ``512 B``."""
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
