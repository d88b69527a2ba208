"""Changing a finished ``torch_dist`` checkpoint in place: ``remove_sharded_tensors``."""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .format import data_file_path
from .metadata import as_plain_metadata, read_metadata, write_metadata


def remove_sharded_tensors(checkpoint_dir: Path, key_prefix: str) -> None:
    """Remove tensors whose key starts with ``key_prefix``; data files that hold
    nothing else are deleted."""
    metadata = as_plain_metadata(read_metadata(checkpoint_dir))
    removed = {k for k, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata) and k.startswith(key_prefix)}
    if not removed:
        return
    files_before = {si.relative_path for si in metadata.storage_data.values()}
    for fname in files_before:
        data_file_path(checkpoint_dir, fname)  # refuse a crafted .metadata before changing anything
    metadata.state_dict_metadata = {k: v for k, v in metadata.state_dict_metadata.items() if k not in removed}
    metadata.storage_data = {i: si for i, si in metadata.storage_data.items() if i.fqn not in removed}
    metadata.mcore_data = {k: v for k, v in metadata.mcore_data.items() if k not in removed}
    write_metadata(metadata, checkpoint_dir)
    for fname in files_before - {si.relative_path for si in metadata.storage_data.values()}:
        try:
            os.remove(data_file_path(checkpoint_dir, fname))
        except FileNotFoundError:
            pass
