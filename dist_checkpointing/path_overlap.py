"""Refusing an output path that overlaps the input of an offline tool.

An export or import with ``force`` deletes its existing output: an output that is the
input, holds it, or lies inside it would destroy the input (and its siblings). Paths are
compared by what they are on disk, not by how they are spelled: symlinks and ``..`` are
resolved, and the ``(st_dev, st_ino)`` identities of the existing directories are
compared, so aliases that no string comparison sees (a bind mount, the same directory
reached by two routes) are caught too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Tuple, Union

from .core import CheckpointingException

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


def refuse_overlap(source: Union[str, os.PathLike], out: Union[str, os.PathLike], action: str) -> None:
    """Raise :class:`CheckpointingException` when ``out`` is ``source``, an ancestor of
    it, or inside it (``out`` need not exist). ``action`` names the operation in the
    message. A ``source`` that does not exist is left to the caller to report."""
    try:
        st = os.stat(source)
    except OSError:
        return
    source_id = (st.st_dev, st.st_ino)
    # Every directory the source is reached through, by its resolved path and by its own entry.
    source_chain = _identities(Path(os.path.realpath(source))) + _identities(output_location(source))
    # Every directory the output is reached through, and where its entry lies.
    out_chain = _identities(Path(os.path.realpath(out))) + _identities(output_location(out))
    relation = None
    if os.path.exists(out):
        out_st = os.stat(out)
        if (out_st.st_dev, out_st.st_ino) == source_id:
            relation = "is the same as"
        elif (out_st.st_dev, out_st.st_ino) in source_chain:
            relation = "contains"
    if relation is None and source_id in out_chain:
        relation = "lies inside"
    if relation is not None:
        raise CheckpointingException(
            f"Cannot {action} {source} to {out}: the output {out} {relation} the source {source} "
            "(writing it would destroy the source): choose an output outside the source"
        )
