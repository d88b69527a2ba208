"""File names and fixed values of the ``torch_dist`` format (see ``docs/format.md``).

A checkpoint directory holds the DCP metadata ``.metadata`` and the data files
``{prefix}__{rank}_{n}.distcp`` named in it (``prefix``: the save's ``separation_hint``
with ``/`` replaced by ``_``, or empty); the common state is ``common.pt``
(:mod:`..common`) or the ShardedObject :data:`COMMON_STATE_OBJECT_KEY`.

Owns: the ``torch_dist`` file names and fixed values: ``.metadata``,
``{prefix}__{rank}_{n}.distcp`` (``data_file_name``), the data-file path rule
(``data_file_path``), ``is_checkpoint_file``, the ``common_state`` object key,
``original_global_shape``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Tuple

from ...pickling.dcp_types import Metadata

from ...core import CheckpointingException

METADATA_FNAME = ".metadata"
INDEX_FNAME = ".metadata.index"  # the per-key index of .metadata (key_index.py)
DATA_FILE_SUFFIX = ".distcp"
DCP_VERSION = "1.0.0"
COMMON_STATE_OBJECT_KEY = "common_state/shard_0_1"


def data_file_name(rank: int, n: int, prefix: str = "") -> str:
    """The name of rank ``rank``'s ``n``-th data file (``prefix``: see the module docstring)."""
    return f"{prefix}__{rank}_{n}{DATA_FILE_SUFFIX}"


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is a file this format writes into a checkpoint directory (a
    directory holding one but no ``metadata.json`` is an incomplete checkpoint)."""
    return name in (METADATA_FNAME, INDEX_FNAME) or name.endswith(DATA_FILE_SUFFIX)


def checked_data_file_name(checkpoint_dir: str, relative_path: str) -> str:
    """A data file name read from ``.metadata``, once known to be a plain name inside the
    checkpoint (a crafted ``.metadata`` cannot reach other files)."""
    if not relative_path or os.path.basename(relative_path) != relative_path or relative_path in (".", ".."):
        raise CheckpointingException(
            f"Checkpoint metadata in {checkpoint_dir} names data file {relative_path!r}, which is "
            "not a file inside the checkpoint directory"
        )
    return relative_path


def data_file_path(checkpoint_dir: Path, relative_path: str) -> Path:
    """The local path of a data file named in ``.metadata`` (:func:`checked_data_file_name`)."""
    return Path(checkpoint_dir) / checked_data_file_name(str(checkpoint_dir), relative_path)


def original_global_shape(metadata: Metadata, key: str) -> Optional[Tuple[int, ...]]:
    """The original global shape of a key stored N-D reformulated (flattened), else ``None``."""
    extras = (getattr(metadata, "mcore_data", None) or {}).get(key) or {}
    shape = extras.get("nd_reformulated_orig_global_shape")
    return tuple(shape) if shape is not None else None
