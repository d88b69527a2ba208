"""The storage protocol over an fsspec file system: every URL scheme fsspec knows except
``s3`` (which is :mod:`.s3`): ``gs://``, ``az://``, ``file://``, ``memory://``, …

Correct, not tuned (``pip install dist_checkpointing[fsspec]`` plus the scheme's own
package, e.g. ``gcsfs``; imported when the first such location is used). A streamed file
is written through the file system's own file object (its buffering and uploads); reads
are ``cat_file`` ranges. Small files are written whole (``pipe_file``; on the local file
system to a temporary name renamed over the target); an exclusive create opens with
mode ``"xb"`` where the file system supports it, else checks and writes (not atomic:
the checkpoint's directory claim is). ``storage_options`` are the file system's own
keyword arguments (``fsspec.core.url_to_fs``). Durability is the file system's: fsspec's
local file system does not fsync (a plain path gets :class:`.PosixStorage`, which does).

Not ``fork_safe``: a forked child's writes to ``memory://`` would stay in the child, and
fsspec's async file systems run an event loop thread; async saves write from a thread.
"""

from __future__ import annotations

import errno
import uuid
from typing import Any, Dict, List, Optional

from .base import FileInfo, RangeReader, Storage, WriteStream, byte_view
from .locations import object_key_problem

_VERSION_FIELDS = ("size", "mtime", "created", "ETag", "etag", "generation", "ino", "LastModified", "last_modified")


def fsspec_knows(scheme: str) -> bool:
    """Whether fsspec is installed and has an implementation for ``scheme``."""
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return False
    return scheme in known_implementations or scheme in registry


class FsspecWriteStream(WriteStream):
    """A new file written through an fsspec file object."""

    def __init__(self, fs: Any, path: str):
        super().__init__()
        self._fs, self._path = fs, path
        self._file = fs.open(path, "wb")
        self._written = 0

    def write(self, data) -> int:  # type: ignore[override]
        view = byte_view(data)
        if self._hasher is not None:
            self._hasher.update(view)
        try:
            self._file.write(view)
        except BaseException as e:
            self.error = e
            raise
        self._written += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._written

    def flush(self) -> None:
        """The file object buffers and uploads on its own; :meth:`close` finishes the file."""

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._file.close()
        except BaseException:
            self._drop()
            raise
        finally:
            super().close()

    def _drop(self) -> None:
        try:
            self._fs.rm_file(self._path)
        except (OSError, NotImplementedError):
            pass

    def abort(self) -> None:
        """Drop the file: discard what is buffered (or close it) and delete what was written."""
        if self.closed:
            return
        try:
            discard = getattr(self._file, "discard", None)
            if discard is not None:
                discard()
            else:
                self._file.close()
        except Exception:  # noqa: BLE001 - the file is being dropped anyway
            pass
        self._drop()
        super().close()


class FsspecReader(RangeReader):
    """Ranged reads of one file through ``cat_file`` (stateless: safe from several threads)."""

    def __init__(self, fs: Any, path: str, size: int):
        self._fs, self._path, self.size = fs, path, size

    def read(self, offset: int, n: int) -> bytes:
        n = min(n, self.size - offset)
        if n <= 0:
            return b""
        return self._fs.cat_file(self._path, start=offset, end=offset + n)

    def readinto(self, buf, offset: int) -> int:
        dst = byte_view(buf)
        data = self.read(offset, dst.nbytes)
        dst[:len(data)] = data
        return len(data)

    def close(self) -> None:
        """Nothing is held between reads."""


class FsspecStorage(Storage):
    """The files under one fsspec URL; names are the paths below it."""

    fork_safe = False

    def __init__(self, location: str, storage_options: Optional[Dict[str, Any]] = None):
        try:
            from fsspec.core import url_to_fs
        except ImportError as e:
            raise ImportError(f"{location.split('://', 1)[0]}:// checkpoint locations need fsspec: "
                              "pip install dist_checkpointing[fsspec]") from e
        self._url = location.rstrip("/")
        self._options = storage_options
        self.fs, root = url_to_fs(location, **(storage_options or {}))
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self._local = "file" in protocols

    def __repr__(self) -> str:
        return f"FsspecStorage({self._url!r})"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def describe(self, name: str = "") -> str:
        return f"{self._url}/{name}" if name else self._url

    def subdirectory(self, name: str) -> "FsspecStorage":
        return FsspecStorage(self.describe(name), self._options)

    def local_root(self) -> Optional[str]:
        return self.root if self._local else None

    def name_problem(self, name: str = "") -> Optional[str]:
        """An object store's rules (:func:`.locations.object_key_problem`) for every URL
        not on the local file system."""
        if self._local:
            return None
        return object_key_problem("/".join(p for p in (self.root.lstrip("/"), name) if p))

    def _refuse_unkept(self, name: str) -> None:
        problem = self.name_problem(name)
        if problem is not None:
            raise OSError(errno.EINVAL, f"{self.describe(name)}: not an object key the store keeps: {problem}")

    def create_stream(self, name: str) -> WriteStream:
        self._refuse_unkept(name)
        if self.info(name) is not None:
            raise FileExistsError(errno.EEXIST, f"{self.describe(name)} exists")
        return FsspecWriteStream(self.fs, self._path(name))

    def write_atomic(self, name: str, data) -> None:
        self._refuse_unkept(name)
        if not self._local:
            self.fs.pipe_file(self._path(name), bytes(byte_view(data)))
            return
        tmp = self._path(f".{name}.{uuid.uuid4().hex}.tmp")
        self.fs.pipe_file(tmp, bytes(byte_view(data)))
        try:
            self.fs.mv(tmp, self._path(name))
        except BaseException:
            self._remove(tmp)
            raise

    def create_exclusive(self, name: str, data) -> None:
        self._refuse_unkept(name)
        path = self._path(name)
        try:
            with self.fs.open(path, "xb") as f:
                f.write(bytes(byte_view(data)))
            return
        except (ValueError, NotImplementedError, TypeError):  # no "xb" mode: check, then write
            pass
        if self.fs.exists(path):
            raise FileExistsError(errno.EEXIST, f"{self.describe(name)} exists")
        self.fs.pipe_file(path, bytes(byte_view(data)))

    def _remove(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def delete(self, name: str) -> None:
        self._remove(self._path(name))

    def remove_dir(self, name: str) -> None:
        if self.kind(name) != "dir":
            return
        if self.fs.ls(self._path(name), detail=False):
            raise OSError(errno.ENOTEMPTY, f"{self.describe(name)} is not empty")
        try:
            self.fs.rmdir(self._path(name))
        except (FileNotFoundError, NotImplementedError):
            pass

    def make_root(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)

    def read_bytes(self, name: str, max_bytes: Optional[int] = None) -> bytes:
        if max_bytes is None:
            return self.fs.cat_file(self._path(name))
        return self.fs.cat_file(self._path(name), start=0, end=max_bytes + 1)

    def open_reader(self, name: str) -> RangeReader:
        info = self.info(name)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.describe(name)} does not exist")
        return FsspecReader(self.fs, self._path(name), info.size)

    def _info(self, name: str) -> Optional[Dict[str, Any]]:
        try:
            return self.fs.info(self._path(name))
        except FileNotFoundError:
            return None

    def info(self, name: str) -> Optional[FileInfo]:
        found = self._info(name) if name else None
        if found is None or found.get("type") != "file":
            return None
        return FileInfo(int(found["size"]), tuple(str(found.get(k)) for k in _VERSION_FIELDS))

    def kind(self, name: str = "") -> Optional[str]:
        found = self._info(name)
        if found is None:
            return None
        return "file" if found.get("type") == "file" else "dir"

    def entry_kind(self, name: str) -> Optional[str]:
        found = self._info(name)
        if found is None:
            return None
        if found.get("islink"):
            return "link"
        return {"file": "file", "directory": "dir"}.get(found.get("type"), "other")

    def _ls(self) -> List[Any]:
        try:
            return self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []

    def list(self) -> List[str]:
        return sorted({str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in self._ls()})

    def listed_sizes(self) -> Optional[Dict[str, int]]:
        if self._local:
            return None
        return {str(e["name"]).rsplit("/", 1)[-1]: int(e["size"]) for e in self._ls() if e.get("type") == "file"}
