"""Every byte of a checkpoint goes through here: the :class:`Storage` protocol and its
implementations, chosen by location (:func:`storage_for`): local directories
(:class:`PosixStorage`), ``s3://bucket/prefix`` (:mod:`.s3`, obstore) and every other
scheme fsspec knows (``gs://``, ``az://``, ``file://``, ``memory://``, …: :mod:`.fsspec`),
each imported on first use; :func:`register_storage` adds or replaces a scheme.

Callers name files by plain strings relative to the checkpoint and never build paths,
open files or call ``os.write`` / ``os.pread`` themselves. A location becomes a ``Storage``
once per call, at the entry point (:func:`..core.checkpoint_location`): a local directory
stays a ``Path`` (Megatron-Core's strategies expect one), a URL becomes its scheme's
``Storage`` built with the call's ``storage_options``, and a ``Storage`` object may be passed
instead of a directory everywhere (the tests inject faults that way). A storage that is not
``fork_safe`` (S3, fsspec) is never written by a forked child: an async save of it copies
into host memory and writes from a thread. Storage errors are ``OSError`` s, so this
package imports nothing else of the library.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, Optional, Union

from .base import FileInfo, RangeReader, Storage, WriteStream
from .locations import normalized_location, object_key_problem
from .posix import PosixStorage

__all__ = ["FileInfo", "PosixStorage", "RangeReader", "Storage", "StorageOptions", "WriteStream",
           "normalized_location", "object_key_problem", "register_storage", "storage_for", "url_scheme"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_factories: Dict[str, Callable[..., Storage]] = {}
StorageOptions = Optional[Dict[str, Any]]


def url_scheme(location: Union[str, "os.PathLike[str]"]) -> str:
    """The URL scheme of ``location`` (``""`` for a local path)."""
    if not isinstance(location, str):
        return ""
    match = _SCHEME.match(location)
    return match.group(1).lower() if match else ""


def register_storage(scheme: str, factory: Callable[..., Storage]) -> None:
    """Serve locations ``{scheme}://…`` with ``factory(location)``, or
    ``factory(location, storage_options)`` when options are given."""
    _factories[scheme.lower()] = factory


def storage_for(location: Union[str, "os.PathLike[str]", Storage], storage_options: StorageOptions = None) -> Storage:
    """The storage of a checkpoint location: a :class:`Storage` as is, a local path as a
    :class:`PosixStorage`, a URL by its scheme's registered factory, else through fsspec
    when fsspec knows the scheme. ``storage_options`` configure a URL's client (they
    override the environment); a ``ValueError`` for an unknown scheme, and for options
    given with a local path or a :class:`Storage` (nothing would use them)."""
    scheme = "" if isinstance(location, Storage) else url_scheme(location)
    if storage_options and not scheme:
        raise ValueError(f"storage_options apply to URL locations only, not to {location!r}")
    if isinstance(location, Storage):
        return location
    if not scheme:
        return PosixStorage(location)
    factory = _factories.get(scheme)
    if factory is None:
        from .fsspec import fsspec_knows  # imports fsspec (if installed) only for such a URL

        if not fsspec_knows(scheme):
            raise ValueError(f"No storage is registered for {scheme}:// (location {location!r}); "
                             "other schemes need fsspec and its package for the scheme")
        factory = _fsspec_storage
    return factory(location) if storage_options is None else factory(location, storage_options)


def _s3_storage(location: str, storage_options: StorageOptions = None) -> Storage:
    from .s3 import S3Storage  # imports obstore: only when an s3:// location is used

    return S3Storage(location, storage_options)


def _fsspec_storage(location: str, storage_options: StorageOptions = None) -> Storage:
    from .fsspec import FsspecStorage

    return FsspecStorage(location, storage_options)


register_storage("s3", _s3_storage)
