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
import queue
import threading
from pathlib import Path
from typing import Callable, Dict, Hashable, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch.serialization import get_crc32_options, set_crc32_options

from ..bytes_view import as_bytes
from ..integrity import new_hasher

STAGING_BUFFER_BYTES = 16 << 20
BUFFERS_PER_FILE = 3
_HASH_BATCH = 64 << 10  # small writes (torch.save's zip framing) are hashed together, up to this
_ALIGN = 4096

Payload = Union[torch.Tensor, bytes]


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+


class _BufferPool:
    """Page-aligned staging buffers, kept for reuse (bounded by writer threads x
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
        return taken + [mmap.mmap(-1, STAGING_BUFFER_BYTES) for _ in range(n - len(taken))]

    def release_buffers(self, buffers: List[mmap.mmap]) -> None:
        with self._lock:
            self._free.extend(buffers)

    def release(self) -> None:
        with self._lock:
            for buf in self._free:
                buf.close()
            self._free.clear()


_POOL = _BufferPool()


def _forget_buffers_after_fork() -> None:
    # The buffers are shared (anonymous MAP_SHARED) mappings: a forked child (an async
    # save's writer) writing into inherited ones would write into the parent's and its
    # siblings' buffers. Children start with an empty pool of their own.
    _POOL._free = []
    _POOL._lock = threading.Lock()
    _POOL._unmapped = set()


os.register_at_fork(after_in_child=_forget_buffers_after_fork)


def release_staging_buffers() -> None:
    """Free the staging buffers kept for reuse."""
    _POOL.release()


def reserve_staging_buffers(n: int) -> List[mmap.mmap]:
    """Take ``n`` staging buffers out of the pool for a forked writer (see
    :func:`adopt_staging_buffers`); give them back with :func:`return_staging_buffers`
    once the writer is done."""
    return _POOL.acquire(n)


def return_staging_buffers(buffers: List[mmap.mmap]) -> None:
    """Put buffers taken by :func:`reserve_staging_buffers` back into the pool."""
    _POOL.release_buffers(buffers)


def adopt_staging_buffers(buffers: List[mmap.mmap]) -> None:
    """In a forked writer: use ``buffers`` (reserved by the parent, so nobody else writes
    them meanwhile) as this process's pool. Their pages exist already, which is cheaper
    than zero-filling new buffers, but a fork does not copy the page tables of shared
    mappings: each buffer is mapped back in just before its first use
    (:meth:`_BufferPool.map_in`), while the previous one is being written."""
    _POOL._free = list(buffers)
    _POOL._unmapped = {id(buf) for buf in buffers}


_crc_lock = threading.Lock()
_crc_depth = 0
_crc_saved = True
_crc_switch_per_thread: Optional[bool] = None


def _crc_switch_is_per_thread() -> bool:
    """Whether torch keeps the zip-CRC switch per thread (a context variable, as recent
    torch does) rather than process-wide. Probed once, by the caller that has just turned
    the switch off: a fresh thread still sees it on only if the switch is per thread."""
    global _crc_switch_per_thread
    if _crc_switch_per_thread is None:
        seen: List[bool] = []
        probe = threading.Thread(target=lambda: seen.append(get_crc32_options()), name="dist-ckpt-crc-probe")
        probe.start()
        probe.join()
        _crc_switch_per_thread = seen[0]
    return _crc_switch_per_thread


@contextlib.contextmanager
def zip_crc_disabled() -> Iterator[None]:
    """Skip ``torch.save``'s zip CRC32 (a slow byte-by-byte pass) in ``torch.save`` calls
    made by this thread meanwhile.

    Neither ``torch.load`` nor DCP verifies it (stdlib ``zipfile.read`` would: read our blobs
    with ``torch.load``). Enter it on the thread that saves: recent torch keeps the switch
    per thread, and then only this thread's setting changes; where torch keeps it
    process-wide, it is off while any such block runs. Re-entrant and thread-safe; the
    previous setting is restored on exit.
    """
    global _crc_depth, _crc_saved
    with _crc_lock:
        previous = get_crc32_options()
        set_crc32_options(False)
        per_thread = _crc_switch_is_per_thread()
        if not per_thread:
            if _crc_depth == 0:
                _crc_saved = previous
            _crc_depth += 1
    try:
        yield
    finally:
        if per_thread:
            set_crc32_options(previous)
        else:
            with _crc_lock:
                _crc_depth -= 1
                if _crc_depth == 0:
                    set_crc32_options(_crc_saved)


class StagedFileWriter(io.RawIOBase):
    """A write-only file object that stages bytes in reused page-aligned buffers and
    writes them in large aligned blocks (``O_DIRECT`` when possible) from a background
    I/O thread, so copying into one buffer overlaps writing the previous one."""

    def __init__(self, path: Union[str, Path]):
        super().__init__()
        self._path = str(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self._direct = hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(self._path, flags | (os.O_DIRECT if self._direct else 0), 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False
            self._fd = os.open(self._path, flags, 0o644)
        self._buffers = _POOL.acquire(BUFFERS_PER_FILE)
        self._free: "queue.Queue[mmap.mmap]" = queue.Queue()
        for buf in self._buffers[1:]:
            self._free.put(buf)
        self._full: "queue.Queue[Optional[Tuple[mmap.mmap, int]]]" = queue.Queue()
        self._io_error: Optional[BaseException] = None
        self._io_thread = threading.Thread(target=self._io_loop, name="dist-ckpt-writer", daemon=True)
        self._io_thread.start()
        self._buf = self._buffers[0]
        _POOL.map_in(self._buf)
        self._view = memoryview(self._buf)
        self._fill = 0
        self._flushed = 0
        self._hasher = None  # an xxh3-64 hasher while a record is being checksummed
        self._hashed = 0  # end of the current buffer's bytes already hashed (or not hashed at all)

    def start_checksum(self) -> None:
        """Checksum every byte written from now on, right after it is copied into the
        staging buffer (hot in the CPU cache); see :meth:`take_checksum`."""
        self._hasher, self._hashed = new_hasher(), self._fill

    def take_checksum(self) -> int:
        """The checksum of the bytes written since :meth:`start_checksum`; stops hashing."""
        self._hash_staged()
        digest = self._hasher.intdigest()
        self._hasher = None
        return digest

    def _hash_staged(self) -> None:
        """Hash the bytes copied into the current buffer since the last call."""
        self._hasher.update(self._view[self._hashed:self._fill])
        self._hashed = self._fill

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
            if self._hasher is not None and (self._fill - self._hashed >= _HASH_BATCH or self._fill == size):
                self._hash_staged()
            if self._fill == size:
                self._hand_over(size)
        return n

    def _hand_over(self, nbytes: int) -> None:
        """Queue the current buffer for writing and continue in a free one."""
        if self._io_error is not None:
            raise self._io_error
        self._view.release()
        self._full.put((self._buf, nbytes))
        self._flushed += self._fill
        self._fill = self._hashed = 0
        self._buf = self._free.get()
        _POOL.map_in(self._buf)
        self._view = memoryview(self._buf)

    def _io_loop(self) -> None:
        while True:
            item = self._full.get()
            if item is None:
                return
            buf, nbytes = item
            try:
                if self._io_error is None:
                    self._write_out(memoryview(buf)[:nbytes])
            except BaseException as e:  # noqa: BLE001 - re-raised in the writing thread
                self._io_error = e
            self._free.put(buf)

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

    def _stop_io(self) -> None:
        self._full.put(None)
        self._io_thread.join()
        self._view.release()
        _POOL.release_buffers(self._buffers)

    def close(self) -> None:
        if self.closed:
            return
        try:
            total = self.tell()
            if self._fill:
                fill = self._fill
                padded = -(-fill // _ALIGN) * _ALIGN if self._direct else fill
                self._hand_over(padded)
            self._stop_io()
            if self._io_error is not None:
                raise self._io_error
            if total % _ALIGN:
                os.ftruncate(self._fd, total)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            super().close()

    def abort(self) -> None:
        """Close without finishing (after an error)."""
        if not self.closed:
            self._stop_io()
            os.close(self._fd)
            super().close()


class HostStaging:
    """Host (CPU) copies of tensors for async saves, kept for the next save of the same
    structure: a slot whose tensor keeps its shape and dtype reuses its buffer (already
    touched, so the copy runs at memory speed) unless that buffer is still in use by a
    write in flight (see :meth:`hold`), which gets a new one."""

    def __init__(self) -> None:
        self._buffers: Dict[Hashable, torch.Tensor] = {}
        self._held: Dict[int, int] = {}  # id(buffer) -> number of writes using it
        self._lock = threading.Lock()

    def stage(self, tensors: Sequence[Tuple[Hashable, torch.Tensor]], pin: bool = False) -> List[torch.Tensor]:
        """Copy each ``(slot, tensor)`` into its slot's buffer; buffers of slots not in this
        call are dropped. ``pin``: new buffers for non-CPU tensors in pinned memory."""
        buffers: Dict[Hashable, torch.Tensor] = {}
        out = []
        for slot, t in tensors:
            buf = self._buffers.get(slot)
            with self._lock:
                busy = buf is not None and id(buf) in self._held
            if buf is None or busy or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.device.type != "cpu" and _can_pin())
            buf.copy_(t.detach())
            buffers[slot] = buf
            out.append(buf)
        self._buffers = buffers
        return out

    def hold(self, buffers: Sequence[torch.Tensor]) -> Callable[[], None]:
        """Mark ``buffers`` in use by a write in flight; returns the call that ends it."""
        ids = [id(b) for b in buffers]
        with self._lock:
            for i in ids:
                self._held[i] = self._held.get(i, 0) + 1

        def done() -> None:
            with self._lock:
                for i in ids:
                    self._held[i] -= 1
                    if not self._held[i]:
                        del self._held[i]
        return done

    def release(self) -> None:
        """Free every buffer (those of writes in flight once the writes are done)."""
        self._buffers = {}


def _can_pin() -> bool:
    """Whether pinned host memory can be had (it needs an accelerator runtime)."""
    try:
        accelerator = getattr(torch, "accelerator", None)
        return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken accelerator runtime: pageable memory
        return False


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(as_bytes(t).numpy()).cast("B")


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
    if nbytes == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    # A new storage over the same memory, exactly the elements' bytes (no copy).
    return torch.from_numpy(as_bytes(t).numpy()).view(t.dtype).view(t.shape)


def write_file(path: Union[str, Path], payloads: Sequence[Payload],
               compute_checksums: bool = True) -> List[Tuple[int, int, Optional[int]]]:
    """Write ``payloads`` (tensors as ``torch.save`` blobs, bytes as is) into a new file.

    Returns ``(offset, length, checksum)`` of each payload in the file; the checksum
    (``None`` unless ``compute_checksums``) covers the payload's whole record, the
    ``length`` bytes at ``offset``. It is computed piece by piece right after each piece
    is copied into the staging buffer (still in the CPU cache), while the I/O thread
    writes the previous buffer, so it mostly hides behind the disk. The blobs' zip CRC32
    is not computed (see :func:`zip_crc_disabled`).
    """
    writer = StagedFileWriter(path)
    try:
        with zip_crc_disabled():
            spans = _write_payloads(writer, payloads, compute_checksums)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return spans


def _write_payloads(writer: StagedFileWriter, payloads: Sequence[Payload],
                    compute_checksums: bool) -> List[Tuple[int, int, Optional[int]]]:
    spans: List[Tuple[int, int, Optional[int]]] = []
    for payload in payloads:
        start = writer.tell()
        if compute_checksums:
            writer.start_checksum()
        if isinstance(payload, torch.Tensor):
            torch.save(_exact_cpu_tensor(payload), writer)
        else:
            writer.write(payload)
        spans.append((start, writer.tell() - start, writer.take_checksum() if compute_checksums else None))
    return spans
