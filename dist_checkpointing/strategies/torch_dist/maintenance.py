"""Changing a finished ``torch_dist`` checkpoint in place: ``remove_sharded_tensors``."""

from __future__ import annotations

from ...pickling.dcp_types import TensorStorageMetadata

from ...core import CheckpointingException, Location, open_storage
from .format import checked_data_file_name
from .metadata import as_plain_metadata, read_metadata, write_metadata


def remove_sharded_tensors(checkpoint_dir: Location, key_prefix: str) -> None:
    """Remove tensors whose key starts with ``key_prefix``; data files that hold
    nothing else are deleted."""
    storage = open_storage(checkpoint_dir)
    metadata = as_plain_metadata(read_metadata(storage))
    removed = {k for k, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata) and k.startswith(key_prefix)}
    if not removed:
        return
    files_before = {si.relative_path for si in metadata.storage_data.values()}
    for fname in files_before:
        checked_data_file_name(storage.describe(), fname)  # refuse a crafted .metadata before changing anything
    metadata.state_dict_metadata = {k: v for k, v in metadata.state_dict_metadata.items() if k not in removed}
    metadata.storage_data = {i: si for i, si in metadata.storage_data.items() if i.fqn not in removed}
    metadata.mcore_data = {k: v for k, v in metadata.mcore_data.items() if k not in removed}
    write_metadata(metadata, storage)
    for fname in files_before - {si.relative_path for si in metadata.storage_data.values()}:
        try:
            storage.delete(fname)
        except OSError as e:
            raise CheckpointingException(f"Cannot remove {storage.describe(fname)}: {e}") from e
