"""A :class:`~dist_checkpointing.storage.Storage` that injects faults into another one: the
way tests make writes, reads and commits fail (instead of patching module functions)."""

from __future__ import annotations

import errno
import fnmatch
import threading
from typing import List, Optional

from dist_checkpointing.storage import FileInfo, PosixStorage, RangeReader, Storage, WriteStream

#: the operations a fault can hit
OPS = ("create", "stream_write", "stream_close", "write_atomic", "create_exclusive", "read", "short_read")


def _fault(op: str) -> OSError:
    # No file name in the error: the library must name the file itself.
    return OSError(errno.EIO, f"injected {op} fault")


class FaultyStorage(Storage):
    """Delegates to ``inner`` (a local directory by default) and fails the ``nth`` operation
    ``op`` (one of :data:`OPS`) on a file whose name matches ``pattern`` (fnmatch), and
    every later one. ``short_read``: from the ``nth`` ranged read on, reads end half way
    through the file (a file truncated under the reader). Counts are per instance, thread-safe."""

    def __init__(self, inner, op: Optional[str] = None, pattern: str = "*", nth: int = 1):
        assert op is None or op in OPS, op
        self.inner = inner if isinstance(inner, Storage) else PosixStorage(inner)
        self.op, self.pattern, self.nth = op, pattern, nth
        self.calls = {name: 0 for name in OPS}
        self.bytes_read = 0  # bytes returned by ranged reads of its files
        self._lock = threading.Lock()

    def count_read(self, n: int) -> int:
        with self._lock:
            self.bytes_read += n
        return n

    def hit(self, op: str, name: str) -> bool:
        """Count one ``op`` on ``name``; whether it must fail."""
        if op != self.op or not fnmatch.fnmatch(name, self.pattern):
            return False
        with self._lock:
            self.calls[op] += 1
            return self.calls[op] >= self.nth

    def describe(self, name: str = "") -> str:
        return self.inner.describe(name)

    def create_stream(self, name: str) -> WriteStream:
        if self.hit("create", name):
            raise _fault("create")
        return _FaultyStream(self, name, self.inner.create_stream(name))

    def write_atomic(self, name: str, data) -> None:
        if self.hit("write_atomic", name):
            raise _fault("write_atomic")
        self.inner.write_atomic(name, data)

    def create_exclusive(self, name: str, data) -> None:
        if self.hit("create_exclusive", name):
            raise _fault("create_exclusive")
        self.inner.create_exclusive(name, data)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def make_root(self) -> None:
        self.inner.make_root()

    def read_bytes(self, name: str, max_bytes: Optional[int] = None) -> bytes:
        if self.hit("read", name):
            raise _fault("read")
        return self.inner.read_bytes(name, max_bytes)

    def open_reader(self, name: str) -> RangeReader:
        return _FaultyReader(self, name, self.inner.open_reader(name))

    def info(self, name: str) -> Optional[FileInfo]:
        return self.inner.info(name)

    def kind(self, name: str = "") -> Optional[str]:
        return self.inner.kind(name)

    def list(self) -> List[str]:
        return self.inner.list()


class _FaultyStream(WriteStream):
    def __init__(self, storage: FaultyStorage, name: str, inner: WriteStream):
        super().__init__()
        self._storage, self._name, self._inner = storage, name, inner

    def write(self, data) -> int:  # type: ignore[override]
        if self._storage.hit("stream_write", self._name):
            self.error = _fault("stream_write")
            raise self.error
        return self._inner.write(data)

    def tell(self) -> int:
        return self._inner.tell()

    def start_checksum(self, hasher) -> None:
        self._inner.start_checksum(hasher)

    def take_checksum(self) -> int:
        return self._inner.take_checksum()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._storage.hit("stream_close", self._name):  # e.g. the fsync fails
                self._inner.abort()
                raise _fault("stream_close")
            self._inner.close()
        finally:
            super().close()

    def abort(self) -> None:
        self._inner.abort()
        super().close()


class _FaultyReader(RangeReader):
    def __init__(self, storage: FaultyStorage, name: str, inner: RangeReader):
        self._storage, self._name, self._inner = storage, name, inner
        self.size = inner.size

    def _limit(self, offset: int, n: int) -> int:
        """How many of the ``n`` bytes at ``offset`` a read returns (raises for a failing read)."""
        if self._storage.hit("read", self._name):
            raise _fault("read")
        if self._storage.op == "short_read" and self._storage.hit("short_read", self._name):
            return max(0, min(n, self.size // 2 - offset))  # the file ends half way
        return n

    def read(self, offset: int, n: int) -> bytes:
        n = self._limit(offset, n)
        data = self._inner.read(offset, n) if n else b""
        self._storage.count_read(len(data))
        return data

    def readinto(self, buf, offset: int) -> int:
        view = memoryview(buf).cast("B")
        n = self._limit(offset, view.nbytes)
        return self._storage.count_read(self._inner.readinto(view[:n], offset) if n else 0)

    def close(self) -> None:
        self._inner.close()
