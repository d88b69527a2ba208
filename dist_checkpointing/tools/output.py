"""Writing a tool's output safely (for export, import and :mod:`dist_checkpointing.tools.convert`):
refuse to replace an existing output unless asked; a local output is written next to it
and moved into place durably; a URL output (an object store cannot rename) is written in
place, its marker of completeness last, after the old output (with ``force``) was deleted
marker first — so nothing half-written or half-deleted looks complete.

Owns: writing an output safely (``OutputExistsError``, ``refuse_existing``, ``temp_output_dir``
(``staging_dir``, its earlier name), ``move_into_place``), for the tools and ``tools/convert.py``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, List, Tuple, Union

from ..core import CONFIG_FNAME, CheckpointingException, open_storage
from ..integrity.overlap import output_location
from ..strategies.safetensors.format import INDEX_FNAME
from ..storage import Storage, StorageOptions
from ..storage.posix import fsync_dir

PathLike = Union[str, os.PathLike]
# progress(done_bytes, total_bytes, what)
Progress = Callable[[int, int, str], None]


class OutputExistsError(CheckpointingException):
    """The output of an export or import exists and replacing it was not asked for
    (``force=True``; on the command line ``--force``)."""

    def __init__(self, out: Union[Path, str]):
        super().__init__(f"{out} already exists (pass force=True to replace it)")
        self.out = out

    def __reduce__(self) -> Tuple[type, Tuple[Union[Path, str]]]:
        return type(self), (self.out,)  # (rebuilt from the path, not the message)


def _umask() -> int:
    """The process's file mode creation mask, read from ``/proc/self/status`` where it is
    listed; elsewhere set and restored at once (briefly visible to other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def refuse_existing(out: Path, force: bool) -> None:
    """Raise :class:`OutputExistsError` if ``out`` exists and ``force`` is not set."""
    if out.exists() and not force:
        raise OutputExistsError(out)


@contextmanager
def temp_output_dir(out: Path) -> Iterator[Tuple[Path, Path]]:
    """``(tmp, location)``: a new directory to write an output in, next to ``location``
    (where ``out`` goes: :func:`~dist_checkpointing.integrity.overlap.output_location`, never
    inside a source), with the usual mode (``0777`` less the umask, not ``mkdtemp``'s
    ``0700``). The block moves what it wrote into place (:func:`move_into_place`);
    whatever is left of ``tmp`` afterwards is removed, also when the block fails."""
    location = output_location(out)
    location.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{location.name}.", dir=location.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp, location
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


staging_dir = temp_output_dir  # its earlier name (public: dist_checkpointing.tools.staging_dir)


def move_into_place(src: Path, out: Path) -> None:
    """Replace ``out`` (a symlink itself, not its target) by the finished ``src`` (a file
    or directory) and make it durable."""
    if src.is_dir():
        for child in src.iterdir():  # the index and the files (already fsynced) and the entries
            if child.suffix == ".json":
                with open(child, "rb+") as f:
                    os.fsync(f.fileno())
        fsync_dir(src)
    remove_path(out)
    os.replace(src, out)
    fsync_dir(out.parent)


def remove_path(path: Path) -> None:
    """Delete ``path`` if there: a directory tree, a file, or a symlink itself (never its target)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


# the files whose presence marks an output complete: a checkpoint's, a sharded export's
_COMPLETION_MARKERS = (CONFIG_FNAME, INDEX_FNAME)


def url_output(out: str, storage_options: StorageOptions, force: bool) -> Tuple[Storage, List[str]]:
    """The storage of the URL output ``out`` and the names stored there; raises
    :class:`OutputExistsError` if it holds anything and ``force`` is not set."""
    storage = open_storage(out, storage_options)
    try:
        names = storage.list()
    except OSError as e:
        raise CheckpointingException(f"Cannot list the output {storage.describe()}: {e}") from e
    if names and not force:
        raise OutputExistsError(out)
    return storage, names


def clear_url_output(storage: Storage, names: List[str]) -> None:
    """Delete the files ``names`` of an output being replaced: the markers of completeness
    first, so that an interrupted deletion leaves nothing that looks complete. One level
    only (an output is flat): a sub-prefix there is refused before anything is deleted."""
    for name in names:
        if storage.kind(name) != "file":
            raise CheckpointingException(f"{storage.describe(name)} is not a file: not replacing {storage.describe()}")
    for name in sorted(names, key=lambda n: n not in _COMPLETION_MARKERS):
        storage.delete(name)


def delete_quietly(storage: Storage, names: List[str]) -> None:
    """Best-effort removal of what a failed output wrote (the error being raised matters more)."""
    for name in names:
        try:
            storage.delete(name)
        except OSError:
            pass
