"""The storage protocol: everything that touches the bytes of a checkpoint.

A :class:`Storage` is one checkpoint location (a directory, later an object-store
prefix). Its files are named by plain strings relative to that root (``"common.pt"``,
``"__0_0.distcp"``); nothing above this layer builds paths. The protocol is what an
object store can do too: stream a new file from write buffers (:meth:`Storage.create_stream`),
write a small file whole (:meth:`Storage.write_atomic`, :meth:`Storage.create_exclusive`),
read ranges into the caller's buffers (:meth:`Storage.open_reader`), read a small file,
list, stat, delete. Durability: a stream's bytes are durable once it is closed, a small
file once written; no rename is needed anywhere (the commit of a checkpoint is writing
``metadata.json`` last).

Errors are ``OSError`` (``FileNotFoundError``, ``FileExistsError``, …); the callers turn
them into ``CheckpointingException`` naming :meth:`Storage.describe` of the file. This
package imports nothing else of the library.

Owns: the storage protocol, every byte of a checkpoint goes through it: ``Storage`` (one
checkpoint location; files named by plain strings relative to it: ``create_stream``,
``write_atomic``, ``create_exclusive``, ``read_bytes``, ``open_reader``, ``info``, ``kind``,
``list``, ``subdirectory`` (a directory under it, opened with the same client options),
``delete``, ``make_root``), ``WriteStream`` (a new file written front to back from write
buffers, durable on ``close``, with the checksum hooks), ``RangeReader`` (ranged reads into
the caller's buffers), ``FileInfo``; storage errors are ``OSError``s, which the callers turn
into ``CheckpointingException``s naming the file.
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple


def byte_view(data) -> memoryview:
    """``data`` (any bytes-like object) as a flat view of unsigned bytes, without a copy."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class WriteStream(io.RawIOBase):
    """A new file written front to back (``torch.save`` writes into it).

    Bytes go into write buffers and out to storage in large blocks in the background;
    :meth:`close` writes the rest and makes the file durable (raising if any part of it
    failed); :meth:`abort` drops it after an error. ``start_checksum(hasher)`` /
    ``take_checksum()`` hash the bytes written in between, while they are hot in the CPU
    cache. ``error`` keeps the storage error a :meth:`write` raised: ``torch.save``
    replaces an error of the stream it writes into by its own, which does not say why."""

    error: Optional[BaseException] = None

    def writable(self) -> bool:
        return True

    @abstractmethod
    def write(self, data) -> int:  # type: ignore[override]
        """Append ``data`` (any bytes-like object); returns its length. ``data`` is read
        only until the call returns (a stream may upload straight from it, returning once
        sent): the caller may change or free it afterwards."""

    @abstractmethod
    def tell(self) -> int:
        """Bytes written so far."""

    _hasher = None  # fed by write() (in the subclass) while a checksum is taken

    def start_checksum(self, hasher) -> None:
        """Feed every byte written from now on to ``hasher`` (``update(bytes)``, ``intdigest()``)."""
        self._hasher = hasher

    def take_checksum(self) -> int:
        """The digest of the bytes written since :meth:`start_checksum`; stops hashing."""
        digest = self._hasher.intdigest()
        self._hasher = None
        return digest

    @abstractmethod
    def abort(self) -> None:
        """Close without finishing (after an error); what was written is not a file to trust."""


class RangeReader(ABC):
    """Ranged reads of one stored file (``size`` bytes), safe to call from several threads."""

    size: int

    @abstractmethod
    def read(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file)."""

    @abstractmethod
    def readinto(self, buf, offset: int) -> int:
        """Fill as much of the writable buffer ``buf`` as one request gives from ``offset``;
        returns the byte count (0 at the end of the file)."""

    def readinto_runs(self, buf, starts: Sequence[int], length: int) -> None:
        """Fill ``buf`` with the ``length`` bytes at each offset of ``starts``, one run after
        another (a request's rows, scattered in the file); raises ``EOFError`` where the
        file ends first."""
        mv = memoryview(buf).cast("B")
        for i, start in enumerate(starts):
            piece, done = mv[i * length:(i + 1) * length], 0
            while done < length:
                n = self.readinto(piece[done:], start + done)
                if n <= 0:
                    raise EOFError(f"the file ends before byte {start + length}")
                done += n

    def will_read(self, offset: int, n: int) -> None:
        """A hint: the calling thread reads the ``n`` bytes at ``offset`` next, front to back
        (in pieces, e.g. to hash each while it is in the CPU cache). Ignored by default."""

    def map(self) -> Optional[memoryview]:
        """The whole file as a writable private memory map (pages read on first touch,
        copied on first write, the file never changed), for a reader that would otherwise
        copy all of it into a new buffer; ``None`` where the storage cannot map files. It
        stays valid after :meth:`close`."""
        return None

    def will_read_ranges(self, ranges: Sequence[Tuple[int, int]], then: Optional[Callable[[], None]] = None) -> None:
        """A hint: the byte ranges ``(offset, n)`` (sorted, disjoint) will be read soon,
        roughly front to back, by any threads (e.g. the records of a load, each read by one
        of several threads). A reader that fetches ahead calls ``then`` (once, from a
        reading thread, holding no lock) when it has started fetching the last of them, so
        that the caller can announce its next file in time. Ignored by default (``then``
        is never called)."""

    @abstractmethod
    def close(self) -> None:
        """Release the file."""


@dataclass(frozen=True)
class FileInfo:
    """A stored file's size and a version stamp that changes whenever the file does."""

    size: int
    version: Hashable


class Storage(ABC):
    """The bytes of one checkpoint location; ``name`` arguments are relative to its root
    (``""`` is the root itself).

    ``fork_safe``: whether a process forked from one that used this storage can use it
    too. An async save writes a fork-safe storage from a forked copy-on-write child, any
    other from a thread of this process (after copying the tensors to host buffers)."""

    fork_safe: bool = True

    def process_spec(self) -> Optional[Tuple[Callable[..., "Storage"], Tuple[Any, ...]]]:
        """How another process opens this same storage: a picklable factory and its
        arguments (async saves' persistent writer uses it), or ``None`` when it cannot (an
        async save then writes from a thread of this process)."""
        return None

    def __str__(self) -> str:
        return self.describe()

    @abstractmethod
    def describe(self, name: str = "") -> str:
        """The full name of ``name`` (a path or URL) for messages."""

    # -- writing ------------------------------------------------------------------------
    @abstractmethod
    def create_stream(self, name: str) -> WriteStream:
        """A new file ``name`` (it must not exist), written through a :class:`WriteStream`."""

    @abstractmethod
    def write_atomic(self, name: str, data) -> None:
        """Write the small file ``name`` whole: readers see the old content (or nothing) or
        all of ``data``, never a part; durable on return."""

    @abstractmethod
    def create_exclusive(self, name: str, data) -> None:
        """Create the small file ``name`` holding ``data``, durable on return; raises
        ``FileExistsError`` if it exists (of several racing creators exactly one wins)."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove the file ``name`` (nothing if it is missing)."""

    def delete_many(self, names: Sequence[str], pause: Optional[Callable[[], None]] = None) -> None:
        """Remove the files ``names`` (each entry itself: a link is removed, never what it
        points to; missing ones are skipped), in the order given. ``pause``, if given, is
        called between pieces of the work and may block (to let other I/O go first)."""
        for name in names:
            if pause is not None:
                pause()
            self.delete(name)

    def remove_dir(self, name: str) -> None:
        """Remove the directory ``name`` once it is empty (nothing if it is missing; an
        ``OSError`` if it is not empty). Object stores have nothing to do: a prefix exists
        only through its objects."""

    @abstractmethod
    def make_root(self) -> None:
        """Create the root location if it is missing (and its parents)."""

    # -- reading ------------------------------------------------------------------------
    @abstractmethod
    def read_bytes(self, name: str, max_bytes: Optional[int] = None) -> bytes:
        """The content of ``name`` (at most ``max_bytes + 1`` bytes of it when given, so
        the caller can tell a file that is too large)."""

    @abstractmethod
    def open_reader(self, name: str) -> RangeReader:
        """Ranged reads of ``name``."""

    @abstractmethod
    def info(self, name: str) -> Optional[FileInfo]:
        """Size and version of the file ``name``; ``None`` if it is not a file."""

    @abstractmethod
    def kind(self, name: str = "") -> Optional[str]:
        """``"file"``, ``"dir"`` or ``None`` (missing) for ``name``."""

    @abstractmethod
    def list(self) -> List[str]:
        """The names of the entries directly under the root, sorted (``[]`` if it is missing)."""

    def entries(self) -> Dict[str, Optional[str]]:
        """Each entry directly under the root with its :meth:`entry_kind`."""
        return {name: self.entry_kind(name) for name in self.list()}

    def subdirectory(self, name: str) -> "Storage":
        """The storage of the directory ``name`` under the root, opened as this one was
        (the same client options), to list or read what lies in it."""
        raise NotImplementedError(f"{type(self).__name__} cannot open the directory {self.describe(name)}")

    def entry_kind(self, name: str) -> Optional[str]:
        """What the entry ``name`` itself is, links not followed: ``"file"`` (a regular
        file), ``"dir"``, ``"link"`` (a symbolic link), ``"other"`` (a FIFO, socket or
        device) or ``None`` (missing). Object stores have files and prefixes only."""
        return self.kind(name)

    def listed_sizes(self) -> Optional[Dict[str, int]]:
        """The size of every file directly under the root, from one listing, or ``None``
        where a listing does not give sizes (a file system: a stat per file)."""
        return None

    # -- names ----------------------------------------------------------------------------
    def local_root(self) -> Optional[str]:
        """The local directory this storage is, or ``None`` (not on the local file system)."""
        return None

    def name_problem(self, name: str = "") -> Optional[str]:
        """Why the file ``name`` (``""``: the root) would not be stored under the name it
        is written with (an object store rewriting or refusing its key), or ``None``."""
        return None
