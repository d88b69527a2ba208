"""Byte progress of the write and the read of one ``save`` / ``load``.

The entry points install a sink with :func:`reporting_bytes` around the sharded
strategy's call; the lowest layers that know the bytes (the writer of data files, the
reader's tasks) take a :class:`ByteMeter` from :func:`byte_meter` in the calling thread
and count each item as it is done. The sink is called at most every
:data:`REPORT_INTERVAL` seconds and once at the end, never per byte. Without a sink
(offline tools) :func:`byte_meter` returns ``None`` and nothing is counted.

An async save's writer runs later, in another thread or process: the strategy captures
the caller's sink (:func:`current_sink`) and reports to it from the thread that waits for
the writer (a forked writer counts into a :class:`SharedCount`; the persistent writer sends
its counts with its result).

Owns: byte progress of one save / load: ``reporting_bytes`` (the entry points' sink, a
context variable set around the sharded strategy's call), ``byte_meter`` / ``ByteMeter``
(taken by ``_write_files`` and the reader's ``_execute`` in the calling thread, counted per
item, reported at most every 0.5 s and at the end); for async saves ``current_sink``
(captured by ``async_save``), ``SharedCount`` (16 bytes of shared memory a forked writer's
meter sets) and ``poll_count`` (the waiting thread reads it every 0.5 s); the persistent
writer's meter sends ``(phase, done, total)`` on its results pipe
(``persistent_worker.report_progress`` → the job's ``on_progress``).
"""

from __future__ import annotations

import mmap
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Optional, Tuple

#: ``sink(phase, bytes_done, bytes_total)``
ByteSink = Callable[[str, int, int], None]

REPORT_INTERVAL = 0.5  # seconds between two reports of one meter (the last one is always sent)

_sink: ContextVar[Optional[ByteSink]] = ContextVar("dist_checkpointing_byte_sink", default=None)


@contextmanager
def reporting_bytes(sink: Optional[ByteSink]) -> Iterator[None]:
    """Within the block, meters taken in this thread (:func:`byte_meter`) report to ``sink``."""
    token = _sink.set(sink)
    try:
        yield
    finally:
        _sink.reset(token)


class ByteMeter:
    """Bytes done out of ``total`` for one phase; thread safe. Reports go to the sink in
    order (under a lock), so ``bytes_done`` never decreases."""

    def __init__(self, sink: ByteSink, phase: str, total: int, interval: Optional[float] = None):
        self._sink, self.phase, self.total = sink, phase, total
        self._interval = REPORT_INTERVAL if interval is None else interval
        self.done = 0
        self._last = time.monotonic()
        self._reported = -1
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more; report if the interval has passed."""
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if now - self._last >= self._interval:
                self._last = now
                self._report()

    def finish(self) -> None:
        """Report the final count (once; not again if it was the last one reported)."""
        with self._lock:
            if self._reported != self.done:
                self._report()

    def _report(self) -> None:
        self._reported = self.done
        self._sink(self.phase, self.done, max(self.total, self.done))


def byte_meter(phase: str, total: int) -> Optional[ByteMeter]:
    """A meter for ``total`` bytes reporting to this thread's sink, or ``None`` without one."""
    sink = _sink.get()
    return None if sink is None else ByteMeter(sink, phase, total)


def current_sink() -> Optional[ByteSink]:
    """This thread's sink (``None`` without one), for a writer that runs later elsewhere."""
    return _sink.get()


class SharedCount:
    """The latest ``(bytes_done, bytes_total)`` of a forked writer: 16 bytes of anonymous
    shared memory, set by the child (:meth:`sink`), read by the parent (:meth:`get`)."""

    def __init__(self) -> None:
        self._map = mmap.mmap(-1, 16)  # MAP_SHARED: a forked child's writes are seen here
        self._fields = memoryview(self._map).cast("q")  # each field written as one 8-byte store

    def sink(self, phase: str, done: int, total: int) -> None:
        """A :data:`ByteSink` for the child."""
        self._fields[1] = total
        self._fields[0] = done

    def get(self) -> Tuple[int, int]:
        return self._fields[0], self._fields[1]


def poll_count(sink: ByteSink, count: SharedCount, finished: Callable[[float], bool]) -> None:
    """Report ``count`` to ``sink`` every :data:`REPORT_INTERVAL` seconds until
    ``finished(timeout)`` says the writer is done, then once more if it moved. Only
    counts past the last one reported are passed on (the child's two fields are not
    written at once: a read may catch them mid-update), so ``bytes_done`` never decreases."""
    last = 0
    while True:
        over = finished(REPORT_INTERVAL)
        done, total = count.get()
        if done > last and total >= done:
            last = done
            sink("write", done, total)
        if over:
            return
