"""The DCP ``.metadata`` of a ``torch_dist`` checkpoint: built on rank 0 from every rank's
item locations (with consistency checks and the item checksum table), written with its
checksum sidecar, and read back (checked field by field, cached while the file is
unchanged).

Owns: ``.metadata``: assembled on rank 0 from every rank's item locations
(``assemble_table``, ``write_table``; ``build_metadata``, the object-by-object form, for the
tools and to name a refused location), written with its sidecar, read back checked and
cached; ``stored_items`` (the catalog of ``.metadata``, every chunk and object located, file
sizes read through the storage).
"""

from __future__ import annotations

import math
import pickle
import threading
import uuid
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import torch
from ...pickling.trusted import loads_trusted
from ...pickling.dcp_types import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo as _StorageInfo,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...tensors.bytes_view import nbytes
from ...core import CheckpointingException, gc_paused, malformed, open_storage
from ...core import Location as CheckpointLocation
from ...integrity.checksums import checksum, item_checksum_table, write_file_with_checksum
from ...integrity.save_claim import current_save_id
from ...storage import Storage
from ..base import StoredChunk, StoredItems, StoredRange, StoredTensor
from .metadata_checks import check_dcp_metadata
from ...pickling.safe_load import load_dcp_metadata
from .key_index import encode_index, encode_table_index
from .location_table import ChecksumColumns, ItemLocation, LocationTable
from .format import DCP_VERSION, INDEX_FNAME, METADATA_FNAME, checked_data_file_name, original_global_shape


def checksum_table(per_rank_checksums: List[List[Tuple[str, int, Optional[int]]]]) -> Dict[str, Any]:
    return item_checksum_table(
        {(fname, offset): cs for entries in per_rank_checksums for fname, offset, cs in entries if cs is not None})


def storage_meta(storage: Storage) -> StorageMeta:
    """DCP's record of this save: the directory and the id of the save that holds it
    (:mod:`~dist_checkpointing.integrity.save_claim`; a fresh id when none does)."""
    return StorageMeta(checkpoint_id=storage.describe(), save_id=current_save_id(storage) or uuid.uuid4().hex)


def build_metadata(per_rank: List[List[ItemLocation]], storage: Storage) -> Metadata:
    """Global DCP metadata from every rank's item locations, with consistency checks (the
    object-by-object form of what a save streams from columns: :func:`write_table`)."""
    state_dict_metadata: Dict[str, Any] = {}
    orig_shapes: Dict[str, Optional[Tuple[int, ...]]] = {}
    storage_data: Dict[MetadataIndex, _StorageInfo] = {}
    owner: Dict[MetadataIndex, int] = {}
    shape_owner: Dict[str, int] = {}
    for rank, locations in enumerate(per_rank):
        for key, tensor_meta, fname, offset, length, cs in locations:
            if tensor_meta is None:
                index = MetadataIndex(key)
                if key in state_dict_metadata and not isinstance(state_dict_metadata[key], BytesStorageMetadata):
                    raise CheckpointingException(f"Key {key!r} is saved both as a tensor and as an object")
                state_dict_metadata[key] = BytesStorageMetadata()
            else:
                global_shape, dtype, offsets, sizes, orig_shape = tensor_meta
                index = MetadataIndex(key, torch.Size(offsets))
                md = state_dict_metadata.get(key)
                if md is not None and not isinstance(md, TensorStorageMetadata):
                    raise CheckpointingException(f"Key {key!r} is saved both as a tensor and as an object")
                if md is None:
                    md = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(global_shape), [])
                    state_dict_metadata[key] = md
                    orig_shapes[key] = orig_shape
                    shape_owner[key] = rank
                elif orig_shapes.get(key) != orig_shape:
                    raise CheckpointingException(
                        f"ShardedTensor {key!r}: rank {shape_owner[key]} and rank {rank} save it with different "
                        f"flattening (original global shapes {orig_shapes.get(key)} and {orig_shape})"
                    )
                elif tuple(md.size) != tuple(global_shape) or md.properties.dtype != dtype:
                    raise CheckpointingException(
                        f"ShardedTensor {key!r}: rank {shape_owner[key]} saves global shape "
                        f"{tuple(md.size)} dtype {md.properties.dtype}, rank {rank} saves "
                        f"{tuple(global_shape)} dtype {dtype}"
                    )
                if index in storage_data and math.prod(sizes) == 0 and math.prod(global_shape) == 0:
                    continue  # ranks' empty chunks of an empty tensor at one offset: one is recorded
                md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            if index in storage_data:
                raise CheckpointingException(
                    f"Item {key!r} (offset {tuple(index.offset) if index.offset is not None else None}) "
                    f"is saved as main replica by both rank {owner[index]} and rank {rank}"
                )
            storage_data[index] = _StorageInfo(fname, offset, length)
            owner[index] = rank
    for md in state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            md.chunks.sort(key=lambda c: tuple(c.offsets))
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        storage_data=storage_data,
        storage_meta=storage_meta(storage),
        version=DCP_VERSION,
    )
    # Megatron-Core's loader looks up per-key extras here: the original global shape of
    # flattened (N-D reformulated) tensors, nothing for the others.
    metadata.mcore_data = {
        k: ({"nd_reformulated_orig_global_shape": orig_shapes[k]} if orig_shapes.get(k) is not None else {})
        for k, md in state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
    }
    metadata.checksums = checksum_table([[(loc[2], loc[3], loc[5]) for loc in locs] for locs in per_rank])
    return metadata


def as_plain_metadata(metadata: Metadata) -> Metadata:
    """A plain DCP ``Metadata`` copy (drops Megatron's pickled plans, keeps ``mcore_data``)."""
    plain = Metadata(
        state_dict_metadata=dict(metadata.state_dict_metadata),
        planner_data=metadata.planner_data,
        storage_data=dict(metadata.storage_data),
        storage_meta=metadata.storage_meta,
        version=metadata.version,
    )
    plain.mcore_data = dict(getattr(metadata, "mcore_data", None) or {})
    if getattr(metadata, "checksums", None) is not None:
        plain.checksums = metadata.checksums
    return plain


def data_file_sizes(metadata: Metadata) -> Dict[str, int]:
    """The size of each data file ``metadata`` names: where its last item ends (a data file
    is its items written back to back)."""
    sizes: Dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        if end > sizes.get(info.relative_path, -1):  # a file named only by empty items: 0 bytes
            sizes[info.relative_path] = end
    return sizes


def write_metadata(metadata: Metadata, storage: Storage) -> None:
    """Write ``.metadata`` and its checksum sidecar, then the per-key index of it
    (:mod:`.key_index`) and the index's sidecar. (An old index is removed first: a crash in
    between leaves none, never one of another ``.metadata``.)"""
    _write_both(storage, pickle.dumps(metadata), lambda metadata_checksum: encode_index(metadata, metadata_checksum))


def assemble_table(per_rank: List[tuple], storage: Storage) -> LocationTable:
    """Rank 0's table of every rank's :func:`.location_table.encode_locations`; locations that
    :func:`build_metadata` refuses are refused with its error, naming key and rank."""
    table = LocationTable(per_rank)
    if table.problem:
        build_metadata(table.per_rank_locations(), storage)  # raises the error naming key and rank
        raise CheckpointingException("The item locations are inconsistent, but no check names the problem")
    return table


def write_table(table: LocationTable, checks: ChecksumColumns, storage: Storage) -> None:
    """:func:`write_metadata` of the ``Metadata`` that :func:`build_metadata` would build from
    ``table``'s locations with this save's item checksums ``checks``, streamed from the
    columns (:mod:`.metadata_writer`, :func:`.key_index.encode_table_index`)."""
    from .metadata_writer import metadata_bytes  # writers only: it imports DCP's classes

    table.storage_meta = storage_meta(storage)
    _write_both(storage, metadata_bytes(table, checks, table.storage_meta),
                lambda metadata_checksum: encode_table_index(table, checks, metadata_checksum))


def table_metadata(table: LocationTable) -> Metadata:
    """The ``Metadata`` last written from ``table`` (by :func:`write_table`), as objects."""
    from .metadata_writer import metadata_bytes

    return loads_trusted(metadata_bytes(table, table.checksums, table.storage_meta))  # built here


def _write_both(storage: Storage, data: bytes, index: Callable[[int], bytes]) -> None:
    """Write ``.metadata`` (``data``), then the index that ``index(checksum of data)`` encodes."""
    try:
        storage.delete(INDEX_FNAME)
    except OSError as e:
        raise CheckpointingException(f"Cannot remove {storage.describe(INDEX_FNAME)}: {e}") from e
    write_file_with_checksum(storage, METADATA_FNAME, data)
    metadata_checksum = checksum(data)
    del data
    write_file_with_checksum(storage, INDEX_FNAME, index(metadata_checksum))


_metadata_cache: Dict[str, Tuple[Hashable, Metadata]] = {}
_metadata_cache_lock = threading.Lock()


def read_metadata(checkpoint_dir: CheckpointLocation, cached: bool = True) -> Metadata:
    """The DCP metadata of a checkpoint (cached while the file is unchanged; ``cached=False``
    reads the file again)."""
    storage = open_storage(checkpoint_dir)
    path = storage.describe(METADATA_FNAME)
    info = storage.info(METADATA_FNAME)
    if info is None:
        raise CheckpointingException(f"Checkpoint metadata file {path} is missing")
    with _metadata_cache_lock:
        entry = _metadata_cache.get(path)
        if cached and entry is not None and entry[0] == info.version:
            return entry[1]
    with gc_paused():  # millions of small objects in a large checkpoint's metadata
        metadata = load_dcp_metadata(storage, METADATA_FNAME)
        check_dcp_metadata(metadata, path)
    with _metadata_cache_lock:
        _metadata_cache.clear()
        _metadata_cache[path] = (info.version, metadata)
    return metadata


def clear_metadata_cache() -> None:
    """Forget the cached metadata (the next :func:`read_metadata` reads the file)."""
    with _metadata_cache_lock:
        _metadata_cache.clear()


def stored_items(checkpoint_dir: CheckpointLocation) -> StoredItems:
    """The catalog of ``.metadata``: every tensor (flattened keys in their original shape)
    with each chunk's data file, byte range and recorded checksum, every object's, and the
    size of each data file named; a malformed entry is an error naming it."""
    storage = open_storage(checkpoint_dir)
    metadata = read_metadata(storage)
    where = storage.describe(METADATA_FNAME)
    with malformed(f"{where} is malformed"):
        table = getattr(metadata, "checksums", None)
        checksums = table["items"] if table is not None else {}
        entries = sorted(metadata.state_dict_metadata.items())
    items = StoredItems(located=True, checksums_recorded=table is not None)

    def located(index: MetadataIndex) -> Optional[StoredRange]:
        info = metadata.storage_data.get(index)
        if info is None:
            return None
        name = checked_data_file_name(storage.describe(), info.relative_path)
        if name not in items.files:
            file_info = storage.info(name)
            items.files[name] = file_info.size if file_info is not None else None
        return StoredRange(name, info.offset, info.length, checksums.get((name, info.offset)))

    for key, md in entries:
        with malformed(f"{where}: the entry of {key!r} is malformed"):
            if hasattr(md, "chunks"):
                orig = original_global_shape(metadata, key)
                shape = tuple(orig if orig is not None else md.size)
                chunks = [StoredChunk(tuple(c.offsets), tuple(c.sizes), located(MetadataIndex(key, c.offsets)))
                          for c in md.chunks]
                items.tensors.append(StoredTensor(key, shape, md.properties.dtype, chunks,
                                                  nbytes(shape, md.properties.dtype), orig is not None,
                                                  tuple(md.size)))
            else:
                location = located(MetadataIndex(key))
                items.objects[key] = location.length if location is not None else 0
                if location is not None:
                    items.object_locations[key] = location
    return items
