"""Geometry of chunks in a global tensor: which stored chunks overlap a requested one, and
how flattened (N-D reformulated) chunks map back to the original tensor."""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Optional, Sequence, Tuple

Region = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)


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


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """Row-major strides (in elements) of a tensor of ``shape``."""
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def linear_index(coords: Sequence[int], strides: Sequence[int]) -> int:
    """Position of ``coords`` in a row-major layout with ``strides``."""
    return sum(c * s for c, s in zip(coords, strides))


def grid_chunks_overlapping(region: Region, chunk_shape: Sequence[int]) -> Iterator[Tuple[int, ...]]:
    """Indices of the chunks of a regular grid (chunks of ``chunk_shape``) that ``region`` touches."""
    ranges = [range(off // c, (off + size - 1) // c + 1) for off, size, c in zip(region[0], region[1], chunk_shape)]
    return itertools.product(*ranges)


def flat_slice_bounding_region(chunk_offsets: Sequence[int], chunk_sizes: Sequence[int], prepend: int,
                               flat_range: slice) -> Tuple[Region, int]:
    """The smallest block of whole rows of a chunk that holds the flat slice ``flat_range``
    of it (flat indices count over the non-prepended axes), and the flat index of the
    block's first element. Reading this block is all a flattened request needs."""
    local = tuple(chunk_sizes[prepend:])
    if not local:
        return (tuple(chunk_offsets), tuple(chunk_sizes)), 0
    row = math.prod(local[1:])
    first_row, last_row = flat_range.start // row, (flat_range.stop - 1) // row
    offsets = list(chunk_offsets)
    sizes = list(chunk_sizes)
    offsets[prepend] += first_row
    sizes[prepend] = last_row - first_row + 1
    return (tuple(offsets), tuple(sizes)), first_row * row


def contiguous_start(box_sizes: Sequence[int], rel_offsets: Sequence[int], sizes: Sequence[int]) -> Optional[int]:
    """If the sub-box (``rel_offsets``, ``sizes``) of a box is one contiguous run of the
    box's row-major layout, the flat index where it starts; else ``None``. That is the case
    when, past the first axis longer than 1, the sub-box spans whole axes of the box."""
    n = len(box_sizes)
    first_long = next((j for j in range(n) if sizes[j] > 1), n)
    if any(sizes[j] != box_sizes[j] for j in range(first_long + 1, n)):
        return None
    return linear_index(rel_offsets, contiguous_strides(box_sizes))
