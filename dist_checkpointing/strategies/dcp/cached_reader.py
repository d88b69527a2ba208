"""Megatron-Core's ``CachedMetadataFileSystemReader``: a PyTorch DCP ``FileSystemReader``
whose metadata is read once per checkpoint and shared by every reader of it.

Here ``read_metadata`` is this library's (:func:`..torch_dist.metadata.read_metadata`):
``.metadata`` is unpickled through the safe allow-list and checked field by field (PyTorch's
reader unpickles it unrestricted), and the cache is checked against the file's version on
every read, so a rewritten checkpoint is never served stale (Megatron-Core's keeps an entry
until :meth:`clear_metadata_cache`). Megatron-Core's own ``torch_dist`` strategy reads
through it; Megatron-LM clears its cache on an in-process restart (this library's loads
share the cache, so that clears theirs too).
"""

from __future__ import annotations

import os
from typing import Any, Union

from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.metadata import StorageMeta

from ..torch_dist import metadata as _metadata


class CachedMetadataFileSystemReader(FileSystemReader):
    """A DCP ``FileSystemReader`` of ``path``; ``cache_metadata=False`` reads ``.metadata``
    again on every :meth:`read_metadata`."""

    def __init__(self, path: Union[str, os.PathLike], cache_metadata: bool = True) -> None:
        super().__init__(path=path)
        self._location = os.fspath(path)
        self.cache_metadata = cache_metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (checked; shared while the file is unchanged)."""
        metadata = _metadata.read_metadata(self._location, cached=self.cache_metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @classmethod
    def clear_metadata_cache(cls) -> None:
        """Forget every cached ``.metadata`` (this library's loads read them again)."""
        _metadata.clear_metadata_cache()
