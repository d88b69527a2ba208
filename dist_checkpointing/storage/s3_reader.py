"""Ranged reads of one S3 object (:class:`S3Reader`, made by ``S3Storage.open_reader``)."""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .base import RangeReader
from .s3_client import PART_BYTES, PARTS_IN_FLIGHT, _obstore, _os_errors

SMALL_BLOCK_BYTES = 256 << 10
SMALL_BLOCKS_KEPT = 16
SPAN_BLOCKS_KEPT = 2 * PARTS_IN_FLIGHT  # blocks of planned ranges held per object (fetched or in flight)
AHEAD_PIECES_KEPT = 2 * PARTS_IN_FLIGHT  # pieces fetched ahead for will_read, all threads together


class _Block:
    """A cached range ``[start, end)`` of an object: filled by the thread that fetches it,
    awaited by the others (``ready``); ``touched`` once a read asked for it; ``read`` the merged
    ``[a, b)`` ranges read from it so far (a block of an announced range is dropped once
    every byte of it was read)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.ready = threading.Event()
        self.data: Optional[memoryview] = None
        self.error: Optional[BaseException] = None
        self.touched = False
        self.read: List[List[int]] = []

    def mark_read(self, a: int, b: int) -> bool:
        """Record that ``[a, b)`` was read; whether every byte of the block has been."""
        merged: List[List[int]] = []
        for lo, hi in sorted(self.read + [[a, b]]):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.read = merged
        return merged == [[self.start, self.end]]


class _Span:
    """A range planned by :meth:`S3Reader.will_read_ranges`; ``ahead``: where its read-ahead stands."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.ahead = start, end, start


class _ReadAhead:
    """The pieces of a range announced by :meth:`S3Reader.will_read`: ``pieces[k]`` (a future
    of the bytes at ``start + k * PART_BYTES``), ``fetched`` of them started."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.fetched = start, end, 0
        self.pieces: Dict[int, "Future[memoryview]"] = {}


class S3Reader(RangeReader):
    """Ranged GETs of one object, each copied once from obstore's buffer.

    Ranges planned with :meth:`will_read_ranges` (a load plans each data file's runs of
    small records) are read through blocks of :data:`PART_BYTES` laid from each range's
    start (the last taking in a rest below a quarter part), shared by all threads and fetched once: up to :data:`PARTS_IN_FLIGHT` blocks that
    no read has asked for yet are fetched ahead, in parallel, on into the next planned
    ranges (at most :data:`SPAN_BLOCKS_KEPT` held: the least recently used go first, a block
    every byte of which was read at once), so that records and the small headers that
    locate them arrive in large parallel GETs. A range a thread announces with
    :meth:`will_read` (a large checksummed record, read 1 MiB at a time) is fetched for it in
    :data:`PART_BYTES` pieces, :data:`PARTS_IN_FLIGHT` ahead (:data:`AHEAD_PIECES_KEPT` held
    for all threads). Otherwise a read of :data:`PART_BYTES` or more is fetched as such
    parts, up to :data:`PARTS_IN_FLIGHT` at once, and a smaller read is served from an
    aligned block that holds it, shared and fetched once, the most recent kept: blocks of
    :data:`SMALL_BLOCK_BYTES` for reads up to that size, of :data:`PART_BYTES`
    (:data:`PARTS_IN_FLIGHT` kept) for larger ones."""

    def __init__(self, store: Any, key: str, size: int, url: str):
        self._store, self._key, self.size, self._url = store, key, size, url
        self._lock = threading.Lock()
        # per block size: the aligned blocks by index, least recently used first, and how many are kept
        self._blocks: Dict[int, "OrderedDict[int, _Block]"] = {SMALL_BLOCK_BYTES: OrderedDict(),
                                                               PART_BYTES: OrderedDict()}
        self._keep = {SMALL_BLOCK_BYTES: SMALL_BLOCKS_KEPT, PART_BYTES: PARTS_IN_FLIGHT}
        self._spans: List[_Span] = []  # planned, sorted by start, disjoint
        self._span_starts: List[int] = []
        self._span_blocks: "OrderedDict[int, _Block]" = OrderedDict()  # by start, least recently used first
        self._then: Optional[Callable[[], None]] = None  # see will_read_ranges
        self._local = threading.local()  # .ahead: the calling thread's _ReadAhead, if any
        self._ahead_pieces = 0  # pieces of every thread's read-ahead held (fetched or in flight)
        self._fetchers: Optional[ThreadPoolExecutor] = None

    # -- fetching ---------------------------------------------------------------------------
    def _fill(self, block: _Block, cache: "OrderedDict[int, _Block]", key: int) -> None:
        """GET ``block``'s bytes; on failure it leaves ``cache`` (a later read fetches it again)."""
        try:
            with _os_errors(f"read of {self._url}"):
                block.data = memoryview(_obstore().get_range(self._store, self._key, start=block.start,
                                                             length=block.end - block.start))
        except BaseException as e:  # noqa: BLE001 - raised by every read waiting for the block
            block.error = e
            with self._lock:
                if cache.get(key) is block:
                    del cache[key]
        finally:
            block.ready.set()

    @staticmethod
    def _wait(block: _Block) -> memoryview:
        block.ready.wait()
        if block.error is not None:
            raise block.error
        return block.data  # type: ignore[return-value]

    def _block(self, block_bytes: int, index: int) -> memoryview:
        """Aligned block ``index`` of ``block_bytes`` bytes (shorter at the end of the object)."""
        cache = self._blocks[block_bytes]
        with self._lock:
            block = cache.get(index)
            fetch = block is None
            if fetch:
                start = index * block_bytes
                block = cache[index] = _Block(start, min(start + block_bytes, self.size))
                while len(cache) > self._keep[block_bytes]:
                    cache.popitem(last=False)
            else:
                cache.move_to_end(index)
        if fetch:
            self._fill(block, cache, index)
        return self._wait(block)

    def _copy_from_blocks(self, block_bytes: int, dst: memoryview, offset: int) -> None:
        """Fill ``dst`` (inside the object) from the aligned blocks of ``block_bytes``."""
        done = 0
        while done < dst.nbytes:
            index, rel = divmod(offset + done, block_bytes)
            piece = self._block(block_bytes, index)[rel:rel + dst.nbytes - done]
            dst[done:done + len(piece)] = piece
            done += len(piece)

    # -- planned ranges, read by any threads -----------------------------------------------------
    def will_read_ranges(self, ranges: Sequence[Tuple[int, int]], then: Optional[Callable[[], None]] = None) -> None:
        """Plan ``ranges`` (``(offset, n)``, sorted and disjoint) to be read soon, roughly
        front to back, by any threads, and start fetching them ahead; ``then()`` is called
        once the read-ahead has started fetching the last planned block and the reads have
        reached the blocks fetched ahead (see :meth:`_span_read_ahead`). A range that
        overlaps one planned before is ignored."""
        with self._lock:
            self._then = then
            first = None
            for offset, n in ranges:
                end = min(offset + n, self.size)
                at = bisect.bisect_right(self._span_starts, offset)
                if end <= offset or (at and self._spans[at - 1].end > offset) or (
                        at < len(self._spans) and self._spans[at].start < end):
                    continue
                self._spans.insert(at, _Span(offset, end))
                self._span_starts.insert(at, offset)
                first = at if first is None else min(first, at)
            done = self._span_read_ahead(first if first is not None else len(self._spans))
        if done is not None:
            done()

    def _span_index(self, offset: int) -> Optional[int]:
        """The index of the planned span holding ``offset`` (called holding the lock)."""
        at = bisect.bisect_right(self._span_starts, offset) - 1
        return at if at >= 0 and offset < self._spans[at].end else None

    def _span_at(self, offset: int) -> Optional[_Span]:
        with self._lock:
            at = self._span_index(offset)
        return None if at is None else self._spans[at]

    def _span_read_ahead(self, at: int) -> Optional[Callable[[], None]]:
        """Start fetching the next blocks of span ``at`` and the spans after it while fewer
        than :data:`PARTS_IN_FLIGHT` blocks are in flight or wait for their first read (called
        holding the lock); returns the ``then`` of :meth:`will_read_ranges` to call (without
        the lock) once the last planned block was started and at most half of
        :data:`PARTS_IN_FLIGHT` blocks are in flight or unread (the next file's read-ahead
        then takes over as this one's blocks arrive, rather than all at once)."""
        waiting = sum(1 for b in self._span_blocks.values() if not (b.touched and b.ready.is_set()))
        while waiting < PARTS_IN_FLIGHT and at < len(self._spans):
            span = self._spans[at]
            if span.ahead >= span.end:
                at += 1
                continue
            start, span.ahead = self._block_bounds(span, span.ahead)
            if start in self._span_blocks:
                continue
            block = self._span_blocks[start] = _Block(start, span.ahead)
            self._evict_span_blocks()
            self._pool().submit(self._fill, block, self._span_blocks, start)
            waiting += 1
        if (self._then is None or waiting > PARTS_IN_FLIGHT // 2
                or any(span.ahead < span.end for span in self._spans)):
            return None
        then, self._then = self._then, None
        return then

    def _pool(self) -> ThreadPoolExecutor:
        """The threads that fetch ahead (called holding the lock)."""
        if self._fetchers is None:
            self._fetchers = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="dist-ckpt-s3-reader")
        return self._fetchers

    def _evict_span_blocks(self) -> None:
        while len(self._span_blocks) > SPAN_BLOCKS_KEPT:
            self._span_blocks.popitem(last=False)

    @staticmethod
    def _block_bounds(span: _Span, offset: int) -> Tuple[int, int]:
        """``[start, end)`` of the block of ``span`` that holds ``offset``: blocks of
        :data:`PART_BYTES` from the span's start, the last one taking in a rest below a
        quarter of that (one GET fewer)."""
        full, rest = divmod(span.end - span.start, PART_BYTES)
        last = full if rest >= PART_BYTES // 4 or not full else full - 1
        k = min((offset - span.start) // PART_BYTES, last)
        start = span.start + k * PART_BYTES
        return start, span.end if k == last else start + PART_BYTES

    def _span_block(self, span: _Span, offset: int) -> _Block:
        """The block of ``span`` that holds ``offset``, fetched (and the read-ahead moved on)."""
        start, end = self._block_bounds(span, offset)
        with self._lock:
            block = self._span_blocks.get(start)
            fetch = block is None
            if fetch:
                block = self._span_blocks[start] = _Block(start, end)
                self._evict_span_blocks()
                span.ahead = max(span.ahead, block.end)
            else:
                self._span_blocks.move_to_end(start)
            block.touched = True
            done = self._span_read_ahead(self._span_index(offset))  # type: ignore[arg-type] - the span holds it
        if done is not None:
            done()
        if fetch:
            self._fill(block, self._span_blocks, start)
        self._wait(block)
        return block

    def _copy_from_span(self, span: _Span, dst: memoryview, offset: int) -> int:
        """Fill ``dst`` from ``span``'s blocks, up to the span's end; returns the byte count."""
        n, done = min(dst.nbytes, span.end - offset), 0
        while done < n:
            pos = offset + done
            block = self._span_block(span, pos)
            k = min(n - done, block.end - pos)
            dst[done:done + k] = block.data[pos - block.start:pos - block.start + k]  # type: ignore[index]
            with self._lock:
                if block.mark_read(pos, pos + k) and self._span_blocks.get(block.start) is block:
                    del self._span_blocks[block.start]  # read to the last byte: not needed again
            done += k
        return n

    # -- a range one thread reads -------------------------------------------------------------
    def will_read(self, offset: int, n: int) -> None:
        """Start fetching the range (if it spans 2 parts or more and was not planned) for
        the calling thread: pieces of :data:`PART_BYTES`, :data:`PARTS_IN_FLIGHT` ahead of its
        reads, at most :data:`PARTS_IN_FLIGHT` GETs at once and :data:`AHEAD_PIECES_KEPT`
        pieces held for all threads (beyond that, a thread fetches its next piece when it
        needs it)."""
        n = min(n, self.size - offset)
        previous = getattr(self._local, "ahead", None)
        if previous is not None:
            self._end_read_ahead(previous)
        if n < 2 * PART_BYTES or self._span_at(offset) is not None:
            return
        ahead = self._local.ahead = _ReadAhead(offset, offset + n)
        for _ in range(PARTS_IN_FLIGHT):
            self._fetch_next(ahead, needed=not ahead.pieces)

    def _fetch_next(self, ahead: _ReadAhead, needed: bool) -> None:
        """Start fetching ``ahead``'s next piece: when it is ``needed`` next, or while fewer
        than :data:`AHEAD_PIECES_KEPT` pieces are held."""
        start = ahead.start + ahead.fetched * PART_BYTES
        with self._lock:
            if start >= ahead.end or (not needed and self._ahead_pieces >= AHEAD_PIECES_KEPT):
                return
            self._ahead_pieces += 1
            piece = self._pool().submit(self._fetch, start, min(PART_BYTES, ahead.end - start))
        ahead.pieces[ahead.fetched] = piece
        ahead.fetched += 1

    def _fetch(self, start: int, length: int) -> memoryview:
        with _os_errors(f"read of {self._url}"):
            return memoryview(_obstore().get_range(self._store, self._key, start=start, length=length))

    def _drop_piece(self, ahead: _ReadAhead, k: int) -> None:
        del ahead.pieces[k]
        with self._lock:
            self._ahead_pieces -= 1

    def _read_ahead(self, dst: memoryview, offset: int) -> Optional[int]:
        """Fill ``dst`` from the calling thread's read-ahead piece holding ``offset`` (up to
        the piece's end), dropping the pieces before it and fetching on; ``None`` (and the
        read-ahead dropped) if its range does not hold ``offset``."""
        ahead = getattr(self._local, "ahead", None)
        if ahead is None:
            return None
        k, rel = divmod(offset - ahead.start, PART_BYTES)
        if not ahead.start <= offset < ahead.end or k < min(ahead.pieces, default=ahead.fetched):
            self._end_read_ahead(ahead)
            return None
        for j in [j for j in ahead.pieces if j < k]:
            self._drop_piece(ahead, j)
        if k >= ahead.fetched:  # not fetched ahead (the budget was spent, or pieces skipped): fetched now
            ahead.fetched = k
            self._fetch_next(ahead, needed=True)
        data = ahead.pieces[k].result()
        n = min(dst.nbytes, data.nbytes - rel)
        dst[:n] = data[rel:rel + n]
        if rel + n == data.nbytes:
            self._drop_piece(ahead, k)
            for _ in range(PARTS_IN_FLIGHT - len(ahead.pieces)):
                self._fetch_next(ahead, needed=not ahead.pieces)
            if not ahead.pieces and ahead.fetched * PART_BYTES >= ahead.end - ahead.start:
                self._local.ahead = None
        return n

    def _end_read_ahead(self, ahead: _ReadAhead) -> None:
        for k in list(ahead.pieces):
            ahead.pieces[k].cancel()
            self._drop_piece(ahead, k)
        self._local.ahead = None

    # -- the protocol ---------------------------------------------------------------------------
    def read(self, offset: int, n: int) -> bytes:
        n = min(n, self.size - offset)
        if n <= 0:
            return b""
        span = self._span_at(offset)
        in_span = span is not None and offset + n <= span.end
        if n <= SMALL_BLOCK_BYTES or in_span:
            out = bytearray(n)
            if in_span:
                self._copy_from_span(span, memoryview(out), offset)  # type: ignore[arg-type]
            else:
                self._copy_from_blocks(SMALL_BLOCK_BYTES, memoryview(out), offset)
            return bytes(out)
        with _os_errors(f"read of {self._url}"):
            return bytes(_obstore().get_range(self._store, self._key, start=offset, length=n))

    def readinto(self, buf, offset: int) -> int:
        dst = memoryview(buf)
        if dst.format != "B" or dst.ndim != 1:
            dst = dst.cast("B")
        want = min(dst.nbytes, self.size - offset)
        if want <= 0:
            return 0
        span = self._span_at(offset)
        if span is not None:
            return self._copy_from_span(span, dst[:want], offset)
        got = self._read_ahead(dst[:want], offset)
        if got is not None:
            return got
        if want < PART_BYTES:  # up to the end of the block that holds ``offset``
            block_bytes = SMALL_BLOCK_BYTES if want <= SMALL_BLOCK_BYTES else PART_BYTES
            if block_bytes == PART_BYTES:
                want = min(want, PART_BYTES - offset % PART_BYTES)
            self._copy_from_blocks(block_bytes, dst[:want], offset)
            return want
        want = min(want, PARTS_IN_FLIGHT * PART_BYTES)
        starts = list(range(offset, offset + want, PART_BYTES))
        lengths = [min(PART_BYTES, offset + want - start) for start in starts]
        with _os_errors(f"read of {self._url}"):
            pieces = _obstore().get_ranges(self._store, self._key, starts=starts, lengths=lengths, coalesce=0)
        for start, piece in zip(starts, pieces):
            dst[start - offset:start - offset + len(piece)] = memoryview(piece)
        return want

    def close(self) -> None:
        """Drops the cached blocks and stops the read-ahead."""
        with self._lock:
            for cache in self._blocks.values():
                cache.clear()
            for block in self._span_blocks.values():
                if not block.ready.is_set():  # (its fetch may be cancelled: no read waits forever)
                    block.error = OSError(f"read of {self._url}: the reader was closed")
                    block.ready.set()
            self._span_blocks.clear()
            self._spans.clear()
            self._span_starts.clear()
            if self._fetchers is not None:
                self._fetchers.shutdown(wait=False, cancel_futures=True)
                self._fetchers = None
