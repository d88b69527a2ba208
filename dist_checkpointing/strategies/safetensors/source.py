"""A directory (or object-store prefix) of safetensors files seen as a checkpoint.

A safetensors checkpoint is ``model.safetensors.index.json`` with the files its
``weight_map`` names (Hugging Face's sharded layout), or a lone ``model.safetensors``.
Shard files (``model-00001-of-00002.safetensors``) without their index are an incomplete
checkpoint (the index is written last). :class:`SafetensorsSource` reads the headers it
needs (with an index, only those of the files holding the requested keys) and describes
the tensors as the torch_dist planner's :class:`~..torch_dist.dcp_types.Metadata`: each
tensor one chunk, whole, at its byte range; so requests are planned, resharded, cast and
checked exactly as for torch_dist checkpoints.
"""

from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ...core import CheckpointingConfig, CheckpointingException
from ...storage import Storage
from ...pickling.dcp_types import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageInfo, TensorProperties,
                                    TensorStorageMetadata)
from .format import INDEX_FNAME, SUFFIX, Entry, read_header, read_index, shard_names

SINGLE_FNAME = shard_names(1)[0]
#: the ``sharded_backend`` of a safetensors checkpoint (a directory without ``metadata.json`` reads as one)
BACKEND = "safetensors"


def implicit_config(names: Iterable[str]) -> Optional[CheckpointingConfig]:
    """The config of a directory without ``metadata.json`` whose files are ``names``: a
    safetensors checkpoint (no common state) if it has an index or ``model.safetensors``;
    ``None`` if it holds no safetensors file; shard files alone are refused as incomplete."""
    names = set(names)
    if INDEX_FNAME in names or SINGLE_FNAME in names:
        return CheckpointingConfig(BACKEND, 1, None, None)
    shards = sorted(n for n in names if n.endswith(SUFFIX))
    if shards:
        raise CheckpointingException(
            f"safetensors files ({', '.join(shards[:3])}{', …' if len(shards) > 3 else ''}) without "
            f"{INDEX_FNAME} or {SINGLE_FNAME}: an incomplete safetensors checkpoint (its index is written last)")
    return None


class SafetensorsSource:
    """The safetensors files of ``storage`` and their headers (each read once, when first needed)."""

    def __init__(self, storage: Storage):
        self.storage = storage
        try:
            names = set(storage.list())
        except OSError as e:
            raise CheckpointingException(f"Cannot list {storage.describe()}: {e}") from e
        self.weight_map: Optional[Dict[str, str]] = read_index(storage) if INDEX_FNAME in names else None
        if self.weight_map is not None:
            self.files = sorted(set(self.weight_map.values()))
            absent = [f for f in self.files if f not in names]
            if absent:
                raise CheckpointingException(
                    f"{storage.describe(INDEX_FNAME)} names {storage.describe(absent[0])}, which does not exist"
                    f"{f' (nor {len(absent) - 1} other files)' if len(absent) > 1 else ''}")
        elif SINGLE_FNAME in names:
            self.files = [SINGLE_FNAME]
        else:
            raise CheckpointingException(f"{storage.describe()} holds neither {INDEX_FNAME} nor {SINGLE_FNAME}")
        self._headers: Dict[str, Dict[str, Entry]] = {}
        self._lock = threading.Lock()

    def header(self, name: str) -> Dict[str, Entry]:
        """The tensor entries of the file ``name`` (offsets within the file), read once."""
        with self._lock:
            if name in self._headers:
                return self._headers[name]
        where = self.storage.describe(name)
        try:
            reader = self.storage.open_reader(name)
        except OSError as e:
            raise CheckpointingException(f"Cannot open {where}: {e}") from e
        try:
            _, entries = read_header(reader, where)
        finally:
            reader.close()
        with self._lock:
            self._headers[name] = entries
        return entries

    def located(self, keys: Optional[Iterable[str]] = None) -> Dict[str, Tuple[str, Entry]]:
        """``{key: (file, entry)}`` of ``keys`` (absent keys left out), or of every tensor.
        With an index only the files holding the keys are read, and each must hold what
        the index says it holds."""
        out: Dict[str, Tuple[str, Entry]] = {}
        if self.weight_map is None:
            entries = self.header(SINGLE_FNAME)
            wanted = entries if keys is None else [k for k in keys if k in entries]
            return {k: (SINGLE_FNAME, entries[k]) for k in wanted}
        wanted = self.weight_map if keys is None else [k for k in keys if k in self.weight_map]
        for key in wanted:
            name = self.weight_map[key]
            entry = self.header(name).get(key)
            if entry is None:
                raise CheckpointingException(
                    f"{self.storage.describe(INDEX_FNAME)} says {self.storage.describe(name)} holds {key!r}, "
                    "but that file's header has no such tensor")
            out[key] = (name, entry)
        return out

    def keys(self) -> List[str]:
        """Every tensor key of the checkpoint (from the index, else from the single file's header)."""
        return sorted(self.weight_map) if self.weight_map is not None else sorted(self.header(SINGLE_FNAME))

    def metadata(self, keys: Optional[Iterable[str]] = None) -> Metadata:
        """The tensors of ``keys`` (or all) as torch_dist's planner reads a checkpoint."""
        state, storage_data = {}, {}
        for key, (name, entry) in self.located(keys).items():
            origin = torch.Size([0] * len(entry.shape))
            state[key] = TensorStorageMetadata(TensorProperties(dtype=entry.dtype), torch.Size(entry.shape),
                                               [ChunkStorageMetadata(origin, torch.Size(entry.shape))])
            storage_data[MetadataIndex(key, origin)] = StorageInfo(name, entry.begin, entry.end - entry.begin)
        return Metadata(state_dict_metadata=state, storage_data=storage_data)
