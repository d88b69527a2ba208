"""Checks of a DCP ``.metadata`` before anything trusts it.

A ``.metadata`` file is unpickled with an allow-list of classes (:mod:`..pickling.safe_load`), but the
values inside can still be anything: a string where a mapping belongs, a negative offset,
a chunk larger than the bytes it is stored in, a global shape of a petabyte. Readers index
and allocate by these values, so :func:`check_dcp_metadata` checks the types and the
internal consistency of every field once, when the file is read, and names the file and
field at fault. :func:`check_stored_sizes` then checks the claimed byte ranges against the
data files' real sizes, for readers that allocate whole tensors from the metadata.

What is checked: mapping types, string keys and file names, non-negative integer offsets,
lengths and shapes, chunks inside their tensor and no larger than the bytes storing them, a
well-formed checksum table and ``mcore_data`` -- once per file (the metadata cache). Readers
that allocate whole tensors (``load_local``, hence ``load_plain_tensors``; the tools' tensor
reader) first check coverage and that byte ranges lie within the data files. (Elsewhere:
``metadata.json`` is a JSON object of at most 64 KiB, :func:`...core.maybe_load_config`; a
reader checks each item's range against its file's size before reading or allocating.)
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Iterable, Optional

import torch

from ...pickling.dcp_types import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo as _StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
)

from ...core import CheckpointingException, key_problem
from ...storage import Storage

_MAX_NDIM = 64
_MAX_INT = 1 << 62  # no file, offset or dimension is larger; Python ints could be


def _fail(path: Any, field: str, problem: str) -> CheckpointingException:
    return CheckpointingException(f"Checkpoint metadata {path} is malformed: {field} {problem}")


def _is_int(value: Any) -> bool:
    return type(value) is int and 0 <= value < _MAX_INT or (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_INT)


def _dims_ok(value: Any, ndim: Optional[int] = None) -> bool:
    """Whether ``value`` is a sequence of at most 64 non-negative integers (``ndim`` of them)."""
    if type(value) is torch.Size:  # holds ints only: their range is what is left to check
        valid = not value or (min(value) >= 0 and max(value) < _MAX_INT)
    else:
        valid = isinstance(value, (tuple, list)) and all(_is_int(v) for v in value)
    return valid and len(value) <= _MAX_NDIM and (ndim is None or len(value) == ndim)


def _int_tuple(value: Any, path: Any, field: str, ndim: Optional[int] = None) -> tuple:
    if not _dims_ok(value, ndim):
        if isinstance(value, (tuple, list)) and all(_is_int(v) for v in value):
            raise _fail(path, field, f"has {len(value)} dimensions" + (f", expected {ndim}" if ndim is not None else ""))
        raise _fail(path, field, f"must be a sequence of non-negative integers, not {value!r:.200}")
    return tuple(value)


def _check_tensor(key: str, md: TensorStorageMetadata, path: Any, chunk_bytes: Dict[tuple, int]) -> None:
    field = f"state_dict_metadata[{key!r}]"
    if not isinstance(md.properties, TensorProperties) or not isinstance(md.properties.dtype, torch.dtype):
        raise _fail(path, f"{field}.properties", "must hold a torch dtype")
    shape = _int_tuple(md.size, path, f"{field}.size")
    if not isinstance(md.chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in md.chunks):
        raise _fail(path, f"{field}.chunks", "must be a list of ChunkStorageMetadata")
    ndim, itemsize = len(shape), md.properties.dtype.itemsize
    for n, chunk in enumerate(md.chunks):  # field names are built only for a message
        offsets, sizes = chunk.offsets, chunk.sizes
        if not (_dims_ok(offsets, ndim) and _dims_ok(sizes, ndim)):
            _int_tuple(offsets, path, f"{field}.chunks[{n}].offsets", ndim)
            _int_tuple(sizes, path, f"{field}.chunks[{n}].sizes", ndim)
        offsets, sizes = tuple(offsets), tuple(sizes)
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise _fail(path, f"{field}.chunks[{n}]", f"at {offsets} of size {sizes} lies outside the shape {shape}")
        chunk_bytes[(key, offsets)] = math.prod(sizes) * itemsize


def _storage_field(index: MetadataIndex) -> str:
    return f"storage_data[{index.fqn!r}" + (f" at {tuple(index.offset)}" if index.offset is not None else "") + "]"


def _check_storage(metadata: Metadata, path: Any, chunk_bytes: Dict[tuple, int]) -> None:
    if not isinstance(metadata.storage_data, dict):
        raise _fail(path, "storage_data", f"must be a mapping, not {type(metadata.storage_data).__name__}")
    sdm = metadata.state_dict_metadata
    file_names = set()  # names already found to be plain names inside the checkpoint
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise _fail(path, "storage_data", f"has a key {index!r:.200} that is not a MetadataIndex")
        if index.fqn not in sdm:
            raise _fail(path, _storage_field(index), "names a key that the metadata does not describe")
        offsets = None if index.offset is None else tuple(index.offset)
        nbytes = 0 if offsets is None else chunk_bytes.get((index.fqn, offsets))
        if nbytes is None:  # not the offsets of a checked chunk: check them here
            _int_tuple(index.offset, path, f"{_storage_field(index)} offset")
            nbytes = 0
        if type(info) is not _StorageInfo and not isinstance(info, _StorageInfo):
            raise _fail(path, _storage_field(index), f"must be a _StorageInfo, not {type(info).__name__}")
        name = info.relative_path
        if type(name) is not str or name not in file_names:
            if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
                raise _fail(path, f"{_storage_field(index)}.relative_path",
                            f"must name a file inside the checkpoint, not {name!r:.200}")
            file_names.add(name)
        if not _is_int(info.offset) or not _is_int(info.length):
            raise _fail(path, _storage_field(index), f"has offset {info.offset!r:.50} and length {info.length!r:.50}: "
                        "both must be non-negative integers")
        if nbytes > info.length:
            raise _fail(path, _storage_field(index), f"claims a chunk of {nbytes} bytes stored in {info.length} bytes "
                        f"of {name}")


def _check_extras(metadata: Metadata, path: Any) -> None:
    mcore = getattr(metadata, "mcore_data", None)
    if mcore is not None:
        if not isinstance(mcore, dict) or not all(isinstance(v, dict) for v in mcore.values()):
            raise _fail(path, "mcore_data", "must map keys to dicts")
        for key, extras in mcore.items():
            orig = extras.get("nd_reformulated_orig_global_shape")
            if orig is None:
                continue
            field = f"mcore_data[{key!r}].nd_reformulated_orig_global_shape"
            orig = _int_tuple(orig, path, field)
            md = metadata.state_dict_metadata.get(key)
            # stored as axis_fragmentations + (elements of a chunk,): as many elements as the original
            if isinstance(md, TensorStorageMetadata) and (
                    len(orig) + 1 != len(md.size) or math.prod(orig) != math.prod(md.size)):
                raise _fail(path, field, f"is {orig}, which a tensor stored flattened as {tuple(md.size)} cannot have")
    table = getattr(metadata, "checksums", None)
    if table is None:
        return
    if not isinstance(table, dict) or not isinstance(table.get("algorithm"), str) \
            or not isinstance(table.get("items"), dict) or not isinstance(table.get("scope", ""), str):
        raise _fail(path, "checksums", "must be a mapping with a string 'algorithm' and a mapping 'items'")
    for where, value in table["items"].items():
        if not (isinstance(where, tuple) and len(where) == 2 and isinstance(where[0], str) and _is_int(where[1])) \
                or not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64):
            raise _fail(path, "checksums['items']", f"has an entry {where!r:.100}: {value!r:.50} that is not "
                        "(file name, offset): 64-bit checksum")


def check_dcp_metadata(metadata: Metadata, path: Any) -> None:
    """Raise :class:`CheckpointingException` naming ``path`` and the field if ``metadata``
    is malformed: wrong types, negative or non-integer sizes and offsets, chunks outside
    their tensor or larger than the bytes they are stored in, data files outside the
    checkpoint directory, a malformed checksum table."""
    try:
        _check_all(metadata, path)
    except CheckpointingException:
        raise
    except Exception as e:  # noqa: BLE001 - a value of a type no check expected (e.g. unhashable)
        raise _fail(path, "a field", f"holds a value of an unexpected type ({type(e).__name__}: {e})") from e


def _check_all(metadata: Metadata, path: Any) -> None:
    if not isinstance(metadata.state_dict_metadata, dict):
        raise _fail(path, "state_dict_metadata", f"must be a mapping, not {type(metadata.state_dict_metadata).__name__}")
    chunk_bytes: Dict[tuple, int] = {}  # (key, chunk offsets) -> bytes of the chunk's values
    for key, md in metadata.state_dict_metadata.items():
        problem = key_problem(key)
        if problem is not None:
            raise _fail(path, "state_dict_metadata", f"holds a bad key: {problem}")
        if isinstance(md, TensorStorageMetadata):
            _check_tensor(key, md, path, chunk_bytes)
        elif not isinstance(md, BytesStorageMetadata):
            raise _fail(path, f"state_dict_metadata[{key!r}]", f"is a {type(md).__name__}, not tensor or bytes metadata")
    _check_storage(metadata, path, chunk_bytes)
    _check_extras(metadata, path)


def check_stored_sizes(metadata: Metadata, storage: Storage, keys: Iterable[str]) -> None:
    """Before allocating the whole tensors ``keys``: each must be covered by the elements of
    its stored chunks, and every byte range they are stored in must lie within its data file
    (each file is looked at once). Raises :class:`CheckpointingException` naming the key
    and file otherwise."""
    sizes: Dict[str, int] = {}
    checkpoint_dir = storage.describe()
    for key in keys:
        md = metadata.state_dict_metadata[key]
        stored = sum(math.prod(c.sizes) for c in md.chunks)
        if stored < math.prod(md.size):
            raise CheckpointingException(
                f"Checkpoint {checkpoint_dir} does not cover tensor {key!r}: its global shape {tuple(md.size)} "
                f"has {math.prod(md.size)} elements, its chunks store only {stored}"
            )
        for chunk in md.chunks:
            info = metadata.storage_data.get(MetadataIndex(key, torch.Size(chunk.offsets)))
            if info is None:
                raise CheckpointingException(
                    f"Checkpoint {checkpoint_dir} has no storage entry for chunk {tuple(chunk.offsets)} of {key!r}")
            if info.relative_path not in sizes:
                stored_file = storage.info(info.relative_path)
                if stored_file is None:
                    raise CheckpointingException(
                        f"Data file {storage.describe(info.relative_path)} of tensor {key!r} is missing or unreadable")
                sizes[info.relative_path] = stored_file.size
            if info.offset + info.length > sizes[info.relative_path]:
                raise CheckpointingException(
                    f"Tensor {key!r}: chunk {tuple(chunk.offsets)} is stored at bytes {info.offset}.."
                    f"{info.offset + info.length} of {storage.describe(info.relative_path)}, which has "
                    f"{sizes[info.relative_path]} bytes"
                )
