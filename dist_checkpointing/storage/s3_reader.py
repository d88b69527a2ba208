"""Ranged reads of one S3 object (:class:`S3Reader`, made by ``S3Storage.open_reader``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Optional

from .base import RangeReader
from .s3_client import PART_BYTES, PARTS_IN_FLIGHT, _obstore, _os_errors

SMALL_BLOCK_BYTES = 256 << 10
SMALL_BLOCKS_KEPT = 16


class _Block:
    """A cached block of an object: filled by the thread that fetches it, awaited by the others."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.data: Optional[memoryview] = None
        self.error: Optional[BaseException] = None


class _ReadAhead:
    """The pieces of a range announced by :meth:`S3Reader.will_read`: ``pieces[k]`` (a future
    of the bytes at ``start + k * PART_BYTES``), ``fetched`` of them started."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.fetched = start, end, 0
        self.pieces: Dict[int, "Future[memoryview]"] = {}


class S3Reader(RangeReader):
    """Ranged GETs of one object, each copied once from obstore's buffer. A range that a
    thread announced with :meth:`will_read` (a checksummed record, read 1 MiB at a time) is
    fetched for it in :data:`PART_BYTES` pieces, :data:`PARTS_IN_FLIGHT` ahead, in parallel.
    Otherwise a read of :data:`PART_BYTES` or more is fetched as such parts, up to
    :data:`PARTS_IN_FLIGHT` at once, and a smaller read is served from an aligned block that
    holds it, shared by all threads and fetched once, the most recent kept: blocks of
    :data:`SMALL_BLOCK_BYTES` for reads up to that size (the ~9 small reads that locate a
    record, and its neighbours', share one GET), blocks of :data:`PART_BYTES` for larger ones,
    :data:`PARTS_IN_FLIGHT` of them kept."""

    def __init__(self, store: Any, key: str, size: int, url: str):
        self._store, self._key, self.size, self._url = store, key, size, url
        self._lock = threading.Lock()
        # per block size: the blocks by index, least recently used first, and how many are kept
        self._blocks: Dict[int, "OrderedDict[int, _Block]"] = {SMALL_BLOCK_BYTES: OrderedDict(),
                                                               PART_BYTES: OrderedDict()}
        self._keep = {SMALL_BLOCK_BYTES: SMALL_BLOCKS_KEPT, PART_BYTES: PARTS_IN_FLIGHT}
        self._local = threading.local()  # .ahead: the calling thread's _ReadAhead, if any
        self._fetchers: Optional[ThreadPoolExecutor] = None

    def _block(self, block_bytes: int, index: int) -> memoryview:
        """Block ``index`` of ``block_bytes`` bytes (shorter at the end of the object)."""
        cache = self._blocks[block_bytes]
        with self._lock:
            block = cache.get(index)
            fetch = block is None
            if fetch:
                block = cache[index] = _Block()
                while len(cache) > self._keep[block_bytes]:
                    cache.popitem(last=False)
            else:
                cache.move_to_end(index)
        if fetch:
            start = index * block_bytes
            try:
                with _os_errors(f"read of {self._url}"):
                    block.data = memoryview(_obstore().get_range(self._store, self._key, start=start,
                                                                 length=min(block_bytes, self.size - start)))
            except BaseException as e:
                block.error = e
                with self._lock:
                    if cache.get(index) is block:
                        del cache[index]
            finally:
                block.ready.set()
        block.ready.wait()
        if block.error is not None:
            raise block.error
        return block.data  # type: ignore[return-value]

    def _copy_from_blocks(self, block_bytes: int, dst: memoryview, offset: int) -> None:
        """Fill ``dst`` (inside the object) from the blocks of ``block_bytes``."""
        done = 0
        while done < dst.nbytes:
            index, rel = divmod(offset + done, block_bytes)
            piece = self._block(block_bytes, index)[rel:rel + dst.nbytes - done]
            dst[done:done + len(piece)] = piece
            done += len(piece)

    def _fetch(self, start: int, length: int) -> memoryview:
        with _os_errors(f"read of {self._url}"):
            return memoryview(_obstore().get_range(self._store, self._key, start=start, length=length))

    def will_read(self, offset: int, n: int) -> None:
        """Start fetching the range (if it spans 2 parts or more) for the calling thread:
        pieces of :data:`PART_BYTES`, :data:`PARTS_IN_FLIGHT` ahead of its reads, at most
        :data:`PARTS_IN_FLIGHT` GETs at once for all threads."""
        n = min(n, self.size - offset)
        self._local.ahead = None
        if n < 2 * PART_BYTES:
            return
        with self._lock:
            if self._fetchers is None:
                self._fetchers = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="dist-ckpt-s3-reader")
        ahead = self._local.ahead = _ReadAhead(offset, offset + n)
        for _ in range(PARTS_IN_FLIGHT):
            self._fetch_next(ahead)

    def _fetch_next(self, ahead: "_ReadAhead") -> None:
        start = ahead.start + ahead.fetched * PART_BYTES
        if start < ahead.end:
            ahead.pieces[ahead.fetched] = self._fetchers.submit(self._fetch, start, min(PART_BYTES, ahead.end - start))
            ahead.fetched += 1

    def _read_ahead(self, dst: memoryview, offset: int) -> Optional[int]:
        """Fill ``dst`` from the calling thread's read-ahead piece holding ``offset`` (up to
        the piece's end), dropping the piece once read to its end and fetching the next;
        ``None`` (and the read-ahead dropped) if it does not hold ``offset``."""
        ahead = getattr(self._local, "ahead", None)
        if ahead is None:
            return None
        k, rel = divmod(offset - ahead.start, PART_BYTES)
        if not ahead.start <= offset < ahead.end or k not in ahead.pieces:
            self._local.ahead = None
            return None
        data = ahead.pieces[k].result()
        n = min(dst.nbytes, data.nbytes - rel)
        dst[:n] = data[rel:rel + n]
        if rel + n == data.nbytes:
            for j in [j for j in ahead.pieces if j <= k]:
                del ahead.pieces[j]
            self._fetch_next(ahead)
            if not ahead.pieces:
                self._local.ahead = None
        return n

    def read(self, offset: int, n: int) -> bytes:
        n = min(n, self.size - offset)
        if n <= 0:
            return b""
        if n <= SMALL_BLOCK_BYTES:
            out = bytearray(n)
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
            if self._fetchers is not None:
                self._fetchers.shutdown(wait=False, cancel_futures=True)
                self._fetchers = None
