"""Geometry of chunks in a global tensor: which stored chunks overlap a requested one."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

Region = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)


def region_volume(sizes: Sequence[int]) -> int:
    """Number of elements in a region of the given sizes."""
    n = 1
    for s in sizes:
        n *= s
    return n


def intersect(a: Region, b: Region) -> Optional[Region]:
    """The overlap of two regions, or ``None`` if they do not overlap."""
    offsets, sizes = [], []
    for a_off, a_size, b_off, b_size in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(a_off, b_off), min(a_off + a_size, b_off + b_size)
        if lo >= hi:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def relative_slices(region: Region, origin: Sequence[int]) -> Tuple[slice, ...]:
    """Index of ``region`` within a tensor whose first element sits at ``origin``."""
    return tuple(slice(off - o, off - o + size) for off, size, o in zip(region[0], region[1], origin))
