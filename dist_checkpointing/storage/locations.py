"""What a location names, whatever its spelling, and which object keys a store keeps.

:func:`normalized_location` is the one normalisation every overlap check uses: a local
path (or a ``file://`` URL of one, as fsspec reads it) stays a path, to be resolved on
disk by the caller; any other URL becomes its scheme (lower case) and its segments, with
empty and ``.`` segments dropped, ``..`` applied, backslashes read as ``/`` (SeaweedFS
stores ``a\\b`` as ``a/b``) and the first segment (the bucket) in lower case.

:func:`object_key_problem` says why an object store would not keep a key as written,
found against S3 and SeaweedFS: obstore refuses control characters and empty, ``.`` or
``..`` segments; SeaweedFS stores a backslash as ``/`` (the object then answers under
another name); a segment over 255 bytes or a key over 1024 bytes (UTF-8) is refused by the
server, halfway through a save.

Owns: ``normalized_location`` (the one normalisation of a location every overlap check uses:
a local path or ``file://`` URL as a path, any other URL as its scheme and normalised
segments) and ``object_key_problem`` (the object keys a store would rewrite or refuse:
backslash, control characters, empty/``.``/``..`` segments, over 255 bytes a segment or 1024
a key), behind ``Storage.name_problem`` of ``S3Storage`` and non-local ``FsspecStorage``
(their writes refuse such names too); ``Storage.listed_sizes`` gives the files' sizes from
one listing (``None`` on a file system).
"""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple, Union

from .base import Storage

MAX_KEY_BYTES = 1024  # S3's limit on an object key
MAX_SEGMENT_BYTES = 255  # SeaweedFS's limit on one name between slashes
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_LOCAL_SCHEMES = ("file", "local")


def _local_url_path(url: str) -> str:
    """The path of a ``file://`` URL as fsspec opens it."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        return url.split("://", 1)[1]
    return url_to_fs(url)[1]


def normalized_location(location: Union[str, "os.PathLike[str]", Storage]) -> Tuple[str, str]:
    """``("", path)`` for a local location (a path, a ``file://`` URL, a local storage:
    the path as given, for the caller to resolve), else ``(scheme, "seg/seg/...")``: the
    URL's scheme in lower case and its normalised segments (see the module doc)."""
    if isinstance(location, Storage):
        local_root = location.local_root()
        if local_root is not None:
            return "", local_root
        location = location.describe()
    text = os.fspath(location)
    match = _SCHEME.match(text)
    if match is None:
        return "", text
    scheme = match.group(1).lower()
    if scheme in _LOCAL_SCHEMES:
        return "", _local_url_path(text)
    segments: list = []
    for segment in text[match.end():].replace("\\", "/").split("/"):
        if segment == "..":
            if segments:
                segments.pop()
        elif segment not in ("", "."):
            segments.append(segment)
    if segments:
        segments[0] = segments[0].lower()
    return scheme, "/".join(segments)


def object_key_problem(key: str) -> Optional[str]:
    """Why an object store would not keep the object key ``key`` as written (``None`` if
    it would); ``""`` (a bucket's root) has no problem."""
    if not key:
        return None
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError:
        return "it is not valid Unicode text"
    bad = _CONTROL.search(key)
    if bad is not None:
        return f"it holds the control character {bad.group()!r}"
    if "\\" in key:
        return "it holds a backslash (stored as '/' by some object stores)"
    if len(encoded) > MAX_KEY_BYTES:
        return f"it is {len(encoded)} bytes long (object keys hold at most {MAX_KEY_BYTES})"
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            return f"it has an empty, '.' or '..' segment ({segment!r})"
        if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
            return f"its part {segment[:40]!r}... is over {MAX_SEGMENT_BYTES} bytes long"
    return None
