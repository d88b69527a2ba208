"""The file writer used by saves.

Each data file is a sequence of ``torch.save`` blobs (the DCP item format). Blobs are
streamed through a page-aligned staging buffer that is reused across files and saves
(freshly allocated memory is slow to touch), and written with ``O_DIRECT`` where the
file system allows it: this bypasses the page cache, whose write-back throughput
collapses after a few GB of dirty pages. Where ``O_DIRECT`` is refused (e.g. tmpfs) the
same code writes through the page cache. Every file is fsynced before it counts as
written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import threading
from pathlib import Path
from typing import Iterator, List, Sequence, Tuple, Union

import torch
from torch.serialization import get_crc32_options, set_crc32_options

STAGING_BUFFER_BYTES = 32 << 20
_ALIGN = 4096

Payload = Union[torch.Tensor, bytes]


class _BufferPool:
    """Page-aligned staging buffers, kept for reuse (bounded by the writer thread count)."""

    def __init__(self) -> None:
        self._free: List[mmap.mmap] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def buffer(self) -> Iterator[mmap.mmap]:
        with self._lock:
            buf = self._free.pop() if self._free else mmap.mmap(-1, STAGING_BUFFER_BYTES)
        try:
            yield buf
        finally:
            with self._lock:
                self._free.append(buf)

    def release(self) -> None:
        with self._lock:
            for buf in self._free:
                buf.close()
            self._free.clear()


_POOL = _BufferPool()


def release_staging_buffers() -> None:
    """Free the staging buffers kept for reuse."""
    _POOL.release()


_crc_lock = threading.Lock()
_crc_depth = 0
_crc_saved = True


@contextlib.contextmanager
def zip_crc_disabled() -> Iterator[None]:
    """Skip ``torch.save``'s zip CRC32 (a slow byte-by-byte pass) while saving.

    Neither ``torch.load`` nor DCP verifies it (stdlib ``zipfile.read`` would: read our blobs
    with ``torch.load``). Re-entrant and thread-safe; the previous setting is restored on exit.
    """
    global _crc_depth, _crc_saved
    with _crc_lock:
        if _crc_depth == 0:
            _crc_saved = get_crc32_options()
            set_crc32_options(False)
        _crc_depth += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_depth -= 1
            if _crc_depth == 0:
                set_crc32_options(_crc_saved)


class StagedFileWriter(io.RawIOBase):
    """A write-only file object that stages bytes in ``buf`` and writes them in large,
    aligned blocks (``O_DIRECT`` when possible)."""

    def __init__(self, path: Union[str, Path], buf: mmap.mmap):
        super().__init__()
        self._path = str(path)
        self._buf = buf
        self._view = memoryview(buf)
        self._fill = 0
        self._flushed = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self._direct = hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(self._path, flags | (os.O_DIRECT if self._direct else 0), 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False
            self._fd = os.open(self._path, flags, 0o644)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._flushed + self._fill

    def write(self, data) -> int:  # type: ignore[override]
        src = memoryview(data)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        n = src.nbytes
        pos = 0
        size = len(self._view)
        while pos < n:
            k = min(size - self._fill, n - pos)
            self._view[self._fill : self._fill + k] = src[pos : pos + k]
            self._fill += k
            pos += k
            if self._fill == size:
                self._write_out(self._view)
                self._flushed += size
                self._fill = 0
        return n

    def _write_out(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.write(self._fd, view[done:])
            except OSError as e:
                if e.errno != errno.EINVAL or not self._direct:
                    raise
                # The file system accepted O_DIRECT at open but refuses the write.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self._direct = False

    def flush(self) -> None:
        """Data is written in blocks; :meth:`close` writes the rest."""

    def close(self) -> None:
        if self.closed:
            return
        try:
            total = self.tell()
            if self._fill:
                if self._direct:
                    padded = -(-self._fill // _ALIGN) * _ALIGN
                    self._write_out(self._view[:padded])
                    os.ftruncate(self._fd, total)
                else:
                    self._write_out(self._view[: self._fill])
            os.fsync(self._fd)
        finally:
            self._view.release()
            os.close(self._fd)
            super().close()

    def abort(self) -> None:
        """Close without finishing (after an error)."""
        if not self.closed:
            self._view.release()
            os.close(self._fd)
            super().close()


def _exact_cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with exactly ``t``'s elements as its storage (``torch.save`` writes the
    whole storage, so a view of a large buffer must not drag the buffer along)."""
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes:
        return t
    flat_bytes = t.reshape(-1).view(torch.uint8).numpy()
    return torch.from_numpy(flat_bytes).view(t.dtype).view(t.shape)


def write_file(path: Union[str, Path], payloads: Sequence[Payload]) -> List[Tuple[int, int]]:
    """Write ``payloads`` (tensors as ``torch.save`` blobs, bytes as is) into a new file.

    Returns the ``(offset, length)`` of each payload in the file. Call inside
    :func:`zip_crc_disabled` for full speed.
    """
    spans: List[Tuple[int, int]] = []
    with _POOL.buffer() as buf:
        writer = StagedFileWriter(path, buf)
        try:
            for payload in payloads:
                start = writer.tell()
                if isinstance(payload, torch.Tensor):
                    torch.save(_exact_cpu_tensor(payload), writer)
                else:
                    writer.write(payload)
                spans.append((start, writer.tell() - start))
        except BaseException:
            writer.abort()
            raise
        writer.close()
    return spans
