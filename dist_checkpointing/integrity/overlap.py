"""Refusing an output that overlaps the input of a tool that writes (convert, export,
import, convert-local, the manager's ``persist_local``).

With ``force`` a tool deletes its existing output: an output that is the input, holds it,
or lies inside it would destroy the input (and its siblings). Locations are compared by
what they name, not by how they are spelled (:func:`~.storage.normalized_location`): a
URL by its scheme and normalised segments, a local path (or ``file://`` URL) on disk:
symlinks and ``..`` are resolved, and the ``(st_dev, st_ino)`` identities of the existing
directories are compared, so aliases that no string comparison sees (a bind mount, the
same directory reached by two routes) are caught too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Tuple, Union

from ..core import CheckpointingException, Location
from ..storage import Storage, normalized_location

_Identity = Tuple[int, int]


def output_location(out: Union[str, os.PathLike]) -> Path:
    """Where ``out``'s own directory entry is: its parent with symlinks and ``..``
    resolved, joined with its name (``out`` itself, when a symlink, is not followed)."""
    out = Path(out)
    if out.name in ("", ".", ".."):
        return Path(os.path.realpath(out))
    return Path(os.path.realpath(out.parent)) / out.name


def _identities(path: Path) -> List[_Identity]:
    """The identities of ``path`` (symlink followed) and of every ancestor of it, from
    the nearest existing one up to the root (``path`` must be absolute and resolved)."""
    found = []
    for p in (path, *path.parents):
        try:
            st = os.stat(p)
        except OSError:
            continue  # not there (yet), or not reachable
        found.append((st.st_dev, st.st_ino))
    return found


def _local_relation(source: str, out: str) -> Optional[str]:
    """How the local path ``out`` relates to the local path ``source`` (by identity on disk)."""
    try:
        st = os.stat(source)
    except OSError:
        return None
    source_id = (st.st_dev, st.st_ino)
    # Every directory the source is reached through, by its resolved path and by its own entry.
    source_chain = _identities(Path(os.path.realpath(source))) + _identities(output_location(source))
    # Every directory the output is reached through, and where its entry lies.
    out_chain = _identities(Path(os.path.realpath(out))) + _identities(output_location(out))
    if os.path.exists(out):
        out_st = os.stat(out)
        if (out_st.st_dev, out_st.st_ino) == source_id:
            return "is the same as"
        if (out_st.st_dev, out_st.st_ino) in source_chain:
            return "contains"
    return "lies inside" if source_id in out_chain else None


def _url_relation(source: str, out: str) -> Optional[str]:
    """How the normalised URL path ``out`` relates to ``source`` (same scheme)."""
    if out == source:
        return "is the same as"
    if not out or source.startswith(out + "/"):
        return "contains"
    return "lies inside" if not source or out.startswith(source + "/") else None


def refuse_overlap(source: Location, out: Location, action: str) -> None:
    """Raise :class:`CheckpointingException` when ``out`` is ``source``, an ancestor of
    it, or inside it (``out`` need not exist). Each is a local path, a URL or a storage,
    compared as :func:`~.storage.normalized_location` normalises them (a ``file://`` URL
    as the local path it names); local paths by what they are on disk (see the module
    doc). ``action`` names the operation in the message. A local ``source`` that does not
    exist is left to the caller to report."""
    source_scheme, source_path = normalized_location(source)
    out_scheme, out_path = normalized_location(out)
    if source_scheme != out_scheme:
        return  # a local path and a URL of a store, or two stores: apart
    relation = (_local_relation(source_path, out_path) if not source_scheme
                else _url_relation(source_path, out_path))
    if relation is not None:
        source, out = _named(source), _named(out)
        raise CheckpointingException(
            f"Cannot {action} {source} to {out}: the output {out} {relation} the source {source} "
            "(writing it would destroy the source): choose an output outside the source"
        )


def _named(location: Location) -> str:
    return location.describe() if isinstance(location, Storage) else os.fspath(location)
