"""Exact coverage of a region of a global tensor by its stored chunks: the parts of it that
no chunk stores (a gap) and the parts that several chunks store (an overlap, whose values
would depend on the order of the reads). Counting elements cannot tell a gap hidden by an
overlap of the same size from a full cover; this is box arithmetic, in any number of
dimensions.

A sweep along the first axis cuts the region into slabs at the chunks' boundaries; each
slab's cross-section is checked the same way against the chunks spanning the slab, down
to the last axis. For chunks on a grid (what every save writes) this costs about
``n log n`` for ``n`` chunks overlapping the region. A few chunks (a load in the layout of
the save, or resharded from a similar one) are confirmed pair by pair, and the sweep runs
only to describe what is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..resharding import Region, intersect

_Fault = Tuple[Tuple[int, ...], Tuple[int, ...], int]  # (offsets, sizes, chunk count) over trailing axes


@dataclass(frozen=True)
class CoverageFault:
    """A box of the region stored by ``count`` chunks: ``0`` (a gap) or more than one (an overlap)."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    count: int

    def describe(self) -> str:
        """E.g. ``elements [6:8] are stored in no chunk`` (``[a:b, c:d]`` for each axis)."""
        box = "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"
        what = f"elements {box} are" if self.offsets else "the element (a 0-d tensor) is"
        return f"{what} stored in {'no chunk' if self.count == 0 else f'{self.count} chunks'}"


def coverage_faults(region: Region, chunks: Sequence[Region], limit: int = 8) -> List[CoverageFault]:
    """The boxes of ``region`` (``(offsets, sizes)``) that ``chunks`` do not store exactly once
    (at most ``limit`` of them, in order along the axes; empty when every element of the
    region is stored exactly once). Chunks, or parts of them, outside the region are ignored."""
    region = (tuple(region[0]), tuple(region[1]))
    if any(s <= 0 for s in region[1]):
        return []
    boxes = [box for box in (intersect(region, (tuple(c[0]), tuple(c[1]))) for c in chunks) if box is not None]
    if tiles(region, boxes):
        return []
    return [CoverageFault(*fault) for fault in _faults(region, boxes, 0, max(1, limit))]


_PAIRWISE = 16  # up to this many chunks, a cover is confirmed pair by pair (cheaper than the sweep)


def tiles(region: Region, boxes: Sequence[Region]) -> bool:
    """Whether ``boxes`` (each inside ``region``) store every element of it exactly once,
    when that is quick to confirm: they hold as many elements and no two of them overlap
    (``False`` for more than a few boxes: :func:`coverage_faults` decides then)."""
    if len(boxes) > _PAIRWISE or sum(math.prod(b[1]) for b in boxes) != math.prod(region[1]):
        return False
    return len(boxes) == 1 or not any(intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:])


def describe_faults(faults: Sequence[CoverageFault]) -> str:
    """The faults for a message: ``elements [2:4] are stored in 2 chunks, elements …``."""
    return ", ".join(f.describe() for f in faults)


def _spans_tail(box: Region, region: Region, axis: int) -> bool:
    return box[1][axis:] == region[1][axis:]


def _faults(region: Region, boxes: List[Region], axis: int, limit: int) -> List[_Fault]:
    """The faults of ``region`` over the axes from ``axis`` on, for ``boxes`` (inside
    ``region``, each spanning the slab of the axes before ``axis`` being checked)."""
    if axis == len(region[0]):
        return [] if len(boxes) == 1 else [((), (), len(boxes))]
    lo = region[0][axis]
    cuts = sorted({lo, lo + region[1][axis], *(b[0][axis] for b in boxes), *(b[0][axis] + b[1][axis] for b in boxes)})
    by_start = sorted(boxes, key=lambda b: b[0][axis])
    found: List[_Fault] = []
    open_faults: Dict[_Fault, int] = {}  # a fault of the last slab's cross-section -> where it began
    active: List[Region] = []
    taken, end = 0, lo
    for start, end in zip(cuts, cuts[1:]):
        while taken < len(by_start) and by_start[taken][0][axis] <= start:
            active.append(by_start[taken])
            taken += 1
        active = [b for b in active if b[0][axis] + b[1][axis] > start]
        if len(active) == 1 and _spans_tail(active[0], region, axis + 1):
            tail: List[_Fault] = []
        else:
            tail = _faults(region, active, axis + 1, limit)
        continued = {fault: open_faults.pop(fault, start) for fault in tail}
        found += [((begin,) + f[0], (start - begin,) + f[1], f[2]) for f, begin in open_faults.items()]
        open_faults = continued
        if len(found) >= limit:
            break
    found += [((begin,) + f[0], (end - begin,) + f[1], f[2]) for f, begin in open_faults.items()]
    return sorted(found)[:limit]
