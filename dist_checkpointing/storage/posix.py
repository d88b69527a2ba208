"""The POSIX implementation of the storage protocol: a local directory.

Data files are streamed through page-aligned write buffers (:mod:`.buffers`) and
written with ``O_DIRECT`` where the file system allows it: this bypasses the page cache,
whose write-back throughput collapses after a few GB of dirty pages. Where ``O_DIRECT``
is refused (e.g. tmpfs) the same code writes through the page cache. Reads are
``preadv`` straight into the caller's buffers.

The fsync rules: a streamed file is fsynced when it is closed; a small file is written to
a temporary name of its own, fsynced, renamed over the target, and the directory fsynced
(readers see the old file or the whole new one); an exclusively created file and a
deletion are followed by a directory fsync.

Owns: the POSIX implementation: ``BufferedFileWriter`` (reused page-aligned write buffers,
per-file I/O thread, ``O_DIRECT`` where allowed, ``fsync`` on close), ``PlainFileWriter``
(``PosixStorage(root, buffered=False)``: plain writes straight from the caller's memory, no
buffers — ``export`` into its temporary output directory, which writes from the reader's one
reused buffer), ``PosixReader`` (``pread``/``preadv``), ``open_regular`` (every read opens
``O_NONBLOCK`` and checks ``fstat``: only a regular file, a FIFO or device is an error,
never a hang), the fsync rules (``atomic_write_file``: exclusive temporary, ``fsync``,
rename, directory ``fsync``; ``fsync_dir``).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import queue
import stat
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .base import FileInfo, RangeReader, Storage, WriteStream, byte_view
from .buffers import BUFFERS_PER_FILE, POOL

_HASH_BATCH = 64 << 10  # small writes (torch.save's zip framing) are hashed together, up to this
_ALIGN = 4096


class BufferedFileWriter(WriteStream):
    """A write-only file object that collects bytes in reused page-aligned buffers and
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
        self._buffers = POOL.acquire(BUFFERS_PER_FILE)
        self._free: "queue.Queue[mmap.mmap]" = queue.Queue()
        for buf in self._buffers[1:]:
            self._free.put(buf)
        self._full: "queue.Queue[Optional[Tuple[mmap.mmap, int]]]" = queue.Queue()
        self._io_error: Optional[BaseException] = None
        self._io_thread = threading.Thread(target=self._io_loop, name="dist-ckpt-writer", daemon=True)
        self._io_thread.start()
        self._buf = self._buffers[0]
        POOL.map_in(self._buf)
        self._view = memoryview(self._buf)
        self._fill = 0
        self._flushed = 0
        self._hasher = None  # an xxh3-64 hasher while a record is being checksummed
        self._hashed = 0  # end of the current buffer's bytes already hashed (or not hashed at all)

    def start_checksum(self, hasher) -> None:
        """Feed every byte written from now on to ``hasher``, right after it is copied into
        the write buffer (hot in the CPU cache); see :meth:`take_checksum`."""
        self._hasher, self._hashed = hasher, self._fill

    def take_checksum(self) -> int:
        """The checksum of the bytes written since :meth:`start_checksum`; stops hashing."""
        self._hash_pending()
        digest = self._hasher.intdigest()
        self._hasher = None
        return digest

    def _hash_pending(self) -> None:
        """Hash the bytes copied into the current buffer since the last call."""
        self._hasher.update(self._view[self._hashed:self._fill])
        self._hashed = self._fill

    def tell(self) -> int:
        return self._flushed + self._fill

    def write(self, data) -> int:  # type: ignore[override]
        src = byte_view(data)
        n = src.nbytes
        pos = 0
        size = len(self._view)
        while pos < n:
            k = min(size - self._fill, n - pos)
            self._view[self._fill : self._fill + k] = src[pos : pos + k]
            self._fill += k
            pos += k
            if self._hasher is not None and (self._fill - self._hashed >= _HASH_BATCH or self._fill == size):
                self._hash_pending()
            if self._fill == size:
                self._hand_over(size)
        return n

    def _hand_over(self, nbytes: int) -> None:
        """Queue the current buffer for writing and continue in a free one."""
        if self._io_error is not None:
            self.error = self._io_error
            raise self._io_error
        self._view.release()
        self._full.put((self._buf, nbytes))
        self._flushed += self._fill
        self._fill = self._hashed = 0
        self._buf = self._free.get()
        POOL.map_in(self._buf)
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
        POOL.release_buffers(self._buffers)

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


StagedFileWriter = BufferedFileWriter  # its earlier name


class PlainFileWriter(WriteStream):
    """A new file written with plain ``write`` calls straight from the caller's memory (no
    write buffers, no background thread): for a writer that hands over large pieces from
    a buffer it reuses, where a copy would only add memory. Durable once closed."""

    def __init__(self, path: Union[str, Path]):
        super().__init__()
        self._path = str(path)
        self._file = open(self._path, "xb", buffering=0)
        self._written = 0

    def write(self, data) -> int:  # type: ignore[override]
        view = byte_view(data)
        if self._hasher is not None:
            self._hasher.update(view)
        done = 0
        while done < view.nbytes:
            done += self._file.write(view[done:])
        self._written += done
        return done

    def tell(self) -> int:
        return self._written

    def close(self) -> None:
        if self.closed:
            return
        try:
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
            super().close()

    def abort(self) -> None:
        """Close without fsync (the partial file stays, as a buffered stream's does)."""
        if not self.closed:
            self._file.close()
            super().close()


def open_regular(path: str, follow_links: bool = True) -> int:
    """A read-only descriptor of the regular file ``path``. Opened without blocking (a FIFO
    would block ``open`` until a writer comes) and checked with ``fstat``: anything but a
    regular file (a FIFO, device, socket, directory; a link with ``follow_links=False``)
    is an ``OSError`` naming the path, raised before a byte is read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links:
            raise OSError(errno.ELOOP, f"{path} is a symbolic link, not a regular file") from e
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL,
                          f"{path} is not a regular file ({_kind_of_mode(mode)})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind_of_mode(mode: int) -> str:
    """``"file"``, ``"dir"``, ``"link"`` or ``"other"`` for a ``st_mode``."""
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "link" if stat.S_ISLNK(mode) else "other"


class PosixReader(RangeReader):
    """``pread``/``preadv`` on one open file descriptor."""

    def __init__(self, path: str):
        self._fd = open_regular(path)
        self.size = os.fstat(self._fd).st_size

    def read(self, offset: int, n: int) -> bytes:
        return os.pread(self._fd, n, offset)

    def readinto(self, buf, offset: int) -> int:
        return os.preadv(self._fd, [buf], offset)

    def readinto_runs(self, buf, starts: Sequence[int], length: int) -> None:
        mv, fd = memoryview(buf).cast("B"), self._fd
        for i, start in enumerate(starts):  # one pread per run; a short one: the general loop
            if os.preadv(fd, [mv[i * length:(i + 1) * length]], start) != length:
                return super().readinto_runs(mv[i * length:], starts[i:], length)

    def map(self) -> Optional[memoryview]:
        return memoryview(mmap.mmap(self._fd, self.size, access=mmap.ACCESS_COPY)) if self.size else None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def fsync_dir(path: Union[str, Path]) -> None:
    """Make a directory entry (a rename, a new or removed file) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_file(path: Union[str, Path], data, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file (or nothing) or
    the whole new one; durable on return (``durable=False``: left to the page cache, no
    ``fsync``)."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    # A name of its own: two writers of one path never write into each other's file.
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(directory or ".")


#: a large file is deleted in pieces of this size, truncated from its end: freeing a file's
#: blocks and cached pages is work the file system does at once, which a concurrent save
#: would otherwise wait behind (``delete_many``'s ``pause`` runs between pieces)
DELETE_PIECE_BYTES = 64 << 20


def _delete_in_pieces(path: str, pause: Optional[Callable[[], None]]) -> None:
    """Unlink the entry ``path`` (a link itself, never its target); a large regular file is
    first truncated piece by piece through a descriptor opened without following links,
    ``pause`` called before each piece."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size > DELETE_PIECE_BYTES:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size if stat.S_ISREG(os.fstat(fd).st_mode) else 0
                while size > DELETE_PIECE_BYTES:
                    if pause is not None:
                        pause()
                    size -= DELETE_PIECE_BYTES
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)
        if pause is not None:
            pause()
        os.unlink(path)
    except FileNotFoundError:
        pass


class PosixStorage(Storage):
    """A local directory ``root``; names are file names inside it. Streams collect their
    bytes in reused buffers written from a background thread (:class:`BufferedFileWriter`),
    or with ``buffered=False`` are written straight from the caller's memory
    (:class:`PlainFileWriter`: no buffers; what a tool writing from its own reused buffer
    wants). ``durable=False``: :meth:`write_atomic` leaves its files to the page cache (no
    ``fsync``: they survive a crash of the process, not of the machine). ``staged`` is
    ``buffered``'s earlier name (still accepted)."""

    def __init__(self, root: Union[str, Path], buffered: bool = True, durable: bool = True, *,
                 staged: Optional[bool] = None):
        # absolute once, here: a working directory changed later (or another process's, the
        # persistent writer's) never moves where the files go
        self.root = os.path.abspath(os.fspath(root))
        self._buffered = buffered if staged is None else staged
        self.durable = durable

    def __repr__(self) -> str:
        return f"PosixStorage({self.root!r})"

    def process_spec(self) -> Tuple[Callable[..., Storage], Tuple[Any, ...]]:
        return PosixStorage, (self.root, self._buffered, self.durable)

    def subdirectory(self, name: str) -> "PosixStorage":
        return PosixStorage(self._path(name), self._buffered, self.durable)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name) if name else self.root

    def describe(self, name: str = "") -> str:
        return self._path(name)

    def local_root(self) -> Optional[str]:
        return self.root

    def listed_sizes(self) -> Optional[Dict[str, int]]:
        """The size of every regular file directly under the root (one directory scan; the
        commit checks every file it expects against it)."""
        sizes: Dict[str, int] = {}
        try:
            with os.scandir(self.root) as entries:
                for entry in entries:
                    if entry.is_file(follow_symlinks=False):
                        sizes[entry.name] = entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            return {}
        return sizes

    def create_stream(self, name: str) -> WriteStream:
        return (BufferedFileWriter if self._buffered else PlainFileWriter)(self._path(name))

    def write_atomic(self, name: str, data) -> None:
        atomic_write_file(self._path(name), data, self.durable)

    def create_exclusive(self, name: str, data) -> None:
        path = self._path(name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.root)
        except BaseException:
            self.delete(name)
            raise

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            return
        fsync_dir(self.root)

    def delete_many(self, names, pause: Optional[Callable[[], None]] = None) -> None:
        """Unlink each entry (a link itself, never its target); a large file is truncated
        from its end piece by piece first, ``pause`` called before each piece."""
        for name in names:
            _delete_in_pieces(self._path(name), pause)
        if names:
            fsync_dir(self.root)

    def remove_dir(self, name: str) -> None:
        path = self._path(name)
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return
        fsync_dir(os.path.dirname(path) or ".")

    def make_root(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def read_bytes(self, name: str, max_bytes: Optional[int] = None) -> bytes:
        with open(open_regular(self._path(name)), "rb") as f:
            return f.read() if max_bytes is None else f.read(max_bytes + 1)

    def open_reader(self, name: str) -> RangeReader:
        return PosixReader(self._path(name))

    def info(self, name: str) -> Optional[FileInfo]:
        try:
            st = os.stat(self._path(name))
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return FileInfo(st.st_size, (st.st_mtime_ns, st.st_size, st.st_ino))

    def kind(self, name: str = "") -> Optional[str]:
        try:  # one stat: a directory created meanwhile by another save is not taken for a file
            mode = os.stat(self._path(name)).st_mode
        except OSError:  # missing (or unreachable, as os.path.exists has it)
            return None
        return "dir" if stat.S_ISDIR(mode) else "file"

    def list(self) -> List[str]:
        try:
            return sorted(os.listdir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def entry_kind(self, name: str) -> Optional[str]:
        try:
            return _kind_of_mode(os.lstat(self._path(name)).st_mode)
        except OSError:
            return None

    def entries(self) -> Dict[str, Optional[str]]:
        try:
            with os.scandir(self.root) as scan:
                found = sorted(scan, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        kinds: Dict[str, Optional[str]] = {}
        for entry in found:
            try:
                kinds[entry.name] = _kind_of_mode(entry.stat(follow_symlinks=False).st_mode)
            except FileNotFoundError:  # removed meanwhile
                pass
        return kinds
