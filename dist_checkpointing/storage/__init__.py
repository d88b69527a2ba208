"""Every byte of a checkpoint goes through here: the :class:`Storage` protocol and its
implementations, chosen by location (:func:`storage_for`): local directories
(:class:`PosixStorage`) and ``s3://bucket/prefix`` (:mod:`.s3`, imported on first use);
other schemes are registered with :func:`register_storage`."""

from __future__ import annotations

import os
import re
from typing import Callable, Dict, Union

from .base import FileInfo, RangeReader, Storage, WriteStream
from .posix import PosixStorage

__all__ = ["FileInfo", "PosixStorage", "RangeReader", "Storage", "WriteStream", "register_storage",
           "storage_for", "url_scheme"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_factories: Dict[str, Callable[[str], Storage]] = {}


def url_scheme(location: Union[str, "os.PathLike[str]"]) -> str:
    """The URL scheme of ``location`` (``""`` for a local path)."""
    if not isinstance(location, str):
        return ""
    match = _SCHEME.match(location)
    return match.group(1).lower() if match else ""


def register_storage(scheme: str, factory: Callable[[str], Storage]) -> None:
    """Serve locations ``{scheme}://…`` with ``factory(location)``."""
    _factories[scheme.lower()] = factory


def storage_for(location: Union[str, "os.PathLike[str]", Storage]) -> Storage:
    """The storage of a checkpoint location: a :class:`Storage` as is, a local path as a
    :class:`PosixStorage`, a URL by its scheme's registered factory (``ValueError`` for
    an unknown scheme)."""
    if isinstance(location, Storage):
        return location
    scheme = url_scheme(location)
    if not scheme:
        return PosixStorage(location)
    factory = _factories.get(scheme)
    if factory is None:
        raise ValueError(f"No storage is registered for {scheme}:// (location {location!r})")
    return factory(location)


def _s3_storage(location: str) -> Storage:
    from .s3 import S3Storage  # imports obstore: only when an s3:// location is used

    return S3Storage(location)


register_storage("s3", _s3_storage)
