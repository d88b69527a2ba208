"""Which CPU tensors live in memory that a fork does not isolate.

A forked writer sees the parent's private anonymous memory (the CPU allocator's heap) as
it was at the fork: the kernel copies a page on the first write by either process. Other
memory is not isolated that way:

- every ``MAP_SHARED`` mapping (``rw-s`` in ``/proc/self/maps``): files mapped shared
  (``np.memmap`` modes ``r``/``r+``/``w+``, ``torch.from_file(shared=True)``, ``mmap.mmap`` of a
  file), ``/dev/shm`` and ``memfd`` files (``share_memory_()``), SysV shm, anonymous shared
  memory: a write by the parent (or any other process) after the fork is seen by the child;
- every file-backed ``MAP_PRIVATE`` mapping (``np.memmap`` mode ``c``, ``torch.load(mmap=True)``):
  a page not yet copied on write is the file's page cache, so rewriting the file in place
  after the fork changes what the child reads.

Both are read from ``/proc/self/maps`` once per batch of tensors; where it cannot be read
(not Linux), every CPU tensor counts as not isolated.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import List, Optional, Sequence, Tuple

import torch

MAPS_PATH = "/proc/self/maps"


class UnisolatedMemory:
    """The address ranges ``[start, end)`` of a process whose contents a fork does not
    isolate, sorted and disjoint (as ``/proc/<pid>/maps`` lists them)."""

    def __init__(self, ranges: Sequence[Tuple[int, int]]) -> None:
        self._starts = [start for start, _ in ranges]
        self._ends = [end for _, end in ranges]

    @classmethod
    def parse(cls, maps: str) -> "UnisolatedMemory":
        """The shared and the file-backed mappings of a ``/proc/<pid>/maps`` text (lines
        ``start-end perms offset dev inode [path]``; shared: perms end in ``s``;
        file-backed: a non-zero inode)."""
        ranges = []
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and (fields[1].endswith("s") or fields[4] != "0"):
                start, _, end = fields[0].partition("-")
                ranges.append((int(start, 16), int(end, 16)))
        return cls(ranges)

    @classmethod
    def of_this_process(cls, maps_path: str = MAPS_PATH) -> Optional["UnisolatedMemory"]:
        """The ranges of the calling process, or ``None`` where ``maps_path`` cannot be read."""
        try:
            with open(maps_path, encoding="ascii", errors="replace") as f:
                return cls.parse(f.read())
        except OSError:
            return None

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any byte of ``[start, end)`` lies in one of the ranges."""
        if start >= end:
            return False
        i = bisect_right(self._starts, start) - 1  # the last range starting at or before start
        if i >= 0 and self._ends[i] > start:
            return True
        return i + 1 < len(self._starts) and self._starts[i + 1] < end


def byte_extent(t: torch.Tensor) -> Tuple[int, int]:
    """The addresses ``[start, end)`` spanned by the elements of a strided tensor (a
    non-contiguous view spans more than ``nbytes``; an empty tensor spans nothing)."""
    if t.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def not_isolated_by_fork(tensors: Sequence[torch.Tensor], maps_path: str = MAPS_PATH) -> List[bool]:
    """For each CPU tensor, whether any of its bytes lie in memory a fork does not isolate
    (module docstring); all ``True`` where ``maps_path`` cannot be read. One read of
    ``maps_path`` and a binary search per tensor."""
    memory = UnisolatedMemory.of_this_process(maps_path) if tensors else None
    if memory is None:
        return [True] * len(tensors)
    return [memory.overlaps(*byte_extent(t)) for t in tensors]


def needs_host_copy(tensors: List[torch.Tensor]) -> List[bool]:
    """For each tensor, whether a forked writer would not see it as it is now: memory on
    another device, pinned memory (not inherited reliably), or CPU memory a fork does not
    isolate (shared or file-backed mappings; every CPU tensor where the process's mappings
    cannot be read: :func:`not_isolated_by_fork`)."""
    needed = [True] * len(tensors)
    cpu = [i for i, t in enumerate(tensors) if t.device.type == "cpu" and not _is_pinned(t)]
    for i, unisolated in zip(cpu, not_isolated_by_fork([tensors[i] for i in cpu])):
        needed[i] = unisolated
    return needed


def _is_pinned(t: torch.Tensor) -> bool:
    try:
        return t.is_pinned()
    except RuntimeError:  # no accelerator to ask
        return False
