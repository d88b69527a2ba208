"""The write buffers that streams write through: page-aligned, 16 MiB, kept in a
process-wide pool for reuse across files and saves (freshly allocated memory is slow to
touch); a forked writer gets its own set reserved by the parent.

Owns: the process-wide pool of 16 MiB write buffers; reserving / adopting / returning them
for a forked writer (``MADV_POPULATE_READ``).
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import List, Set

WRITE_BUFFER_BYTES = 16 << 20
STAGING_BUFFER_BYTES = WRITE_BUFFER_BYTES  # its earlier name
BUFFERS_PER_FILE = 3

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+


class _BufferPool:
    """Page-aligned write buffers, kept for reuse (bounded by writer threads x
    ``BUFFERS_PER_FILE``)."""

    def __init__(self) -> None:
        self._free: List[mmap.mmap] = []
        self._lock = threading.Lock()
        self._unmapped: Set[int] = set()  # ids of adopted buffers not mapped in yet

    def map_in(self, buf: mmap.mmap) -> None:
        """Before a buffer's first use in a forked writer: map its pages in with one
        ``MADV_POPULATE_READ`` (read-populating maps the pages of shared memory writable,
        several per fault). Left to fault one page at a time on its first write, the
        96 MiB of a two-file writer cost ~0.04 s; populated, ~0.01 s."""
        try:
            self._unmapped.remove(id(buf))
        except KeyError:
            return
        try:
            buf.madvise(_MADV_POPULATE_READ)
        except (OSError, ValueError):  # an older kernel: the pages fault in on first use
            pass

    def acquire(self, n: int) -> List[mmap.mmap]:
        with self._lock:
            taken, self._free = self._free[:n], self._free[n:]
        return taken + [mmap.mmap(-1, WRITE_BUFFER_BYTES) for _ in range(n - len(taken))]

    def release_buffers(self, buffers: List[mmap.mmap]) -> None:
        with self._lock:
            self._free.extend(buffers)

    def release(self) -> None:
        with self._lock:
            for buf in self._free:
                buf.close()
            self._free.clear()


POOL = _BufferPool()


def _forget_buffers_after_fork() -> None:
    # The buffers are shared (anonymous MAP_SHARED) mappings: a forked child (an async
    # save's writer) writing into inherited ones would write into the parent's and its
    # siblings' buffers. Children start with an empty pool of their own.
    POOL._free = []
    POOL._lock = threading.Lock()
    POOL._unmapped = set()


os.register_at_fork(after_in_child=_forget_buffers_after_fork)


def release_write_buffers() -> None:
    """Free the write buffers kept for reuse."""
    POOL.release()


def reserve_write_buffers(n: int) -> List[mmap.mmap]:
    """Take ``n`` write buffers out of the pool for a forked writer (see
    :func:`adopt_write_buffers`); give them back with :func:`return_write_buffers`
    once the writer is done."""
    return POOL.acquire(n)


def return_write_buffers(buffers: List[mmap.mmap]) -> None:
    """Put buffers taken by :func:`reserve_write_buffers` back into the pool."""
    POOL.release_buffers(buffers)


def adopt_write_buffers(buffers: List[mmap.mmap]) -> None:
    """In a forked writer: use ``buffers`` (reserved by the parent, so nobody else writes
    them meanwhile) as this process's pool. Their pages exist already, which is cheaper
    than zero-filling new buffers, but a fork does not copy the page tables of shared
    mappings: each buffer is mapped back in just before its first use
    (:meth:`_BufferPool.map_in`), while the previous one is being written."""
    POOL._free = list(buffers)
    POOL._unmapped = {id(buf) for buf in buffers}
