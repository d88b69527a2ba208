"""Loading Megatron-Core's ``zarr`` checkpoints (sharded backend ``zarr``, version 1), read
only and without the ``zarr`` package.

Megatron-Core's first sharded format (its default before ``torch_dist``; its save is
deprecated there and its load needs ``zarr`` or ``tensorstore``) stores each ShardedTensor
key as a zarr v2 array, the directory ``<key>/``: ``.zarray`` (JSON: ``shape``, ``chunks``
— one rank's chunk —, ``dtype``, ``compressor``: ``null``, ``order``: ``"C"``) and one
file per chunk of the grid (``0.1``), each the chunk's raw row-major bytes, padded to the
whole chunk at the edges. ShardedObjects are ``torch.save(obj)`` files
``<key>/shard_<offsets>_<shape>.pt``; the common state is ``common.pt`` as in ``torch_dist``.

The load describes the chunks each request touches as ``torch_dist`` metadata (every chunk
file one item, its tensor header known from ``.zarray``) and runs ``torch_dist``'s planner
and reader on it: resharding, flattened (distributed-optimizer) requests, dtype casts,
strict modes, reader threads and progress work as for ``torch_dist``. Compressed or
filtered arrays, Fortran order and big-endian dtypes are refused, naming the array.

Owns: ``ZarrLoadShardedStrategy``: Megatron-Core's ``zarr`` checkpoints, read only and
without the zarr package: each ``.zarray`` parsed and checked, the chunks a request touches
described as a ``torch_dist`` index in memory (one item per chunk file) and read by
``torch_dist``'s planner (``plan_load``), reader (a ``Reader`` whose headers come from
``.zarray``) and ``execute_reads``; the metadata readers and ``stored_items`` for the
offline tools.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple, Union

import torch

from ..core import CheckpointingException, key_problem, open_storage
from ..dict_utils import nested_values
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from ..storage import RangeReader, Storage
from .async_strategies import check_async_strategy
from .base import LoadShardedStrategy, StoredChunk, StoredItems, StoredRange, StoredTensor
from ..pickling.dcp_types import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageInfo,
                        TensorProperties, TensorStorageMetadata)
from .resharding import contiguous_strides, grid_chunks_overlapping, intersect
from .torch_dist.torch_blob import TensorHeader
from .fully_parallel import with_base_strategy
from .torch_dist.load import TorchDistLoadShardedStrategy, execute_reads, loaded_values
from .torch_dist.load_plan import ScratchArena, TensorRead, plan_load
from .torch_dist.reader import Reader

#: zarr v2 dtype strings Megatron-Core writes (NumPy's, and ``bfloat16`` through tensorstore)
DTYPES: Dict[str, torch.dtype] = {
    "|b1": torch.bool, "|u1": torch.uint8, "|i1": torch.int8, "<i2": torch.int16, "<i4": torch.int32,
    "<i8": torch.int64, "<u2": torch.uint16, "<u4": torch.uint32, "<u8": torch.uint64, "<f2": torch.float16,
    "<f4": torch.float32, "<f8": torch.float64, "<c8": torch.complex64, "<c16": torch.complex128,
    "bfloat16": torch.bfloat16,
}
_MAX_ZARRAY_BYTES = 1 << 16
#: the most chunks an array may have (Megatron-Core writes one per rank holding a part)
MAX_CHUNKS = 1 << 20


@dataclass(frozen=True)
class ZarrArray:
    """One stored array, as its ``.zarray`` describes it."""

    key: str
    shape: Tuple[int, ...]
    chunks: Tuple[int, ...]
    dtype: torch.dtype
    separator: str  # between a chunk's grid indices in its file name

    def chunk_region(self, index: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """``(offsets, sizes)`` of the chunk at grid ``index`` inside the global shape (an
        edge chunk's part inside it; its file holds the whole chunk)."""
        offsets = tuple(i * c for i, c in zip(index, self.chunks))
        return offsets, tuple(min(c, s - o) for c, s, o in zip(self.chunks, self.shape, offsets))

    def chunk_file(self, index: Tuple[int, ...]) -> str:
        """The storage name of the chunk at grid ``index``."""
        return f"{self.key}/{self.separator.join(map(str, index)) if index else '0'}"

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize


def _checked_key(key: str, what: str, checkpoint: str) -> str:
    """``key`` as a relative name inside the checkpoint (no absolute path, no ``..``; UTF-8
    text, :func:`~..core.key_problem`: a directory name that is not UTF-8 is refused)."""
    problem = key_problem(key)
    if problem is not None:
        raise CheckpointingException(f"{what} of the zarr checkpoint {checkpoint}: {problem}")
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise CheckpointingException(f"{what} {key!r} is not a name inside the zarr checkpoint {checkpoint}")
    return key


def read_array(storage: Storage, key: str) -> Optional[ZarrArray]:
    """The array ``key`` of the checkpoint (``None`` if it has none), its ``.zarray`` checked."""
    name = f"{_checked_key(key, 'Key', storage.describe())}/.zarray"
    if storage.info(name) is None:
        return None
    where = storage.describe(name)
    try:
        raw = storage.read_bytes(name, _MAX_ZARRAY_BYTES)
    except OSError as e:
        raise CheckpointingException(f"Cannot read {where}: {e}") from e
    if len(raw) > _MAX_ZARRAY_BYTES:
        raise CheckpointingException(f"{where} is larger than {_MAX_ZARRAY_BYTES} bytes: not a zarr array header")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:  # (RecursionError: nested deeper than the parser goes)
        raise CheckpointingException(f"{where} is not valid JSON: {e}") from e
    return _parse(key, meta, where)


def _parse(key: str, meta: object, where: str) -> ZarrArray:
    def bad(why: str) -> CheckpointingException:
        return CheckpointingException(f"Zarr array {key!r} ({where}): {why}")

    if not isinstance(meta, dict) or meta.get("zarr_format") != 2:
        raise bad("not a zarr version 2 array header")
    shape, chunks = meta.get("shape"), meta.get("chunks")
    if not (isinstance(shape, list) and isinstance(chunks, list) and len(shape) == len(chunks)
            and all(type(s) is int and s >= 0 for s in shape) and all(type(c) is int and c > 0 for c in chunks)):
        raise bad(f"shape {shape!r} and chunks {chunks!r} are not a shape and a chunk shape of as many axes")
    if meta.get("compressor") is not None or meta.get("filters"):
        codec = meta.get("compressor") or meta.get("filters")
        raise bad(f"compressed or filtered ({codec!r}); only uncompressed arrays (as Megatron-Core "
                  "writes them) are read: decompress it with zarr first")
    if meta.get("order", "C") != "C":
        raise bad(f"order {meta.get('order')!r}; only C (row-major) order is read")
    dtype = DTYPES.get(meta.get("dtype")) if isinstance(meta.get("dtype"), str) else None
    if dtype is None:
        raise bad(f"dtype {meta.get('dtype')!r} is not one of {sorted(DTYPES)}")
    separator = meta.get("dimension_separator") or "."
    if separator not in (".", "/"):
        raise bad(f"dimension_separator {separator!r} is neither '.' nor '/'")
    count = math.prod(-(-s // c) for s, c in zip(shape, chunks))
    if count > MAX_CHUNKS:
        raise bad(f"{count} chunks of {tuple(chunks)} (more than {MAX_CHUNKS}: not one per rank, as Megatron-Core "
                  "writes them; reading it would take one request per chunk)")
    return ZarrArray(key, tuple(shape), tuple(chunks), dtype, separator)


class ZarrReader(Reader):
    """The ``torch_dist`` reader on zarr chunk files: a chunk's header (dtype, its part
    inside the global shape, the whole chunk's strides) comes from ``.zarray``."""

    objects_in_lists = False  # objects are torch.save(obj) files

    def __init__(self, storage: Storage, allow_pickle: bool, arrays: Dict[str, ZarrArray]):
        super().__init__(storage, allow_pickle, None)
        self._arrays = arrays

    def _header(self, read: TensorRead, file: RangeReader) -> TensorHeader:
        chunks = self._arrays[read.key].chunks
        return TensorHeader(read.dtype, tuple(read.chunk[1]), contiguous_strides(chunks), 0)

    def _data_file_name(self, relative_path: str) -> str:
        return relative_path  # built from checked keys only (see zarr_metadata)


def _object_file(storage: Storage, unique_key: str) -> Tuple[str, Optional[int]]:
    """The file of a ShardedObject and its size (``None``: missing): ``<unique_key>.pt``,
    or as Megatron-Core's early saves named it (the unique key's last ``.`` part dropped)."""
    names = [f"{unique_key}.pt", f"{os.path.splitext(unique_key)[0]}.pt"]
    for name in names:
        info = storage.info(name)
        if info is not None:
            return name, info.size
    return names[0], None


def _stored_objects(key: str, files: List[str]) -> List[ShardedObject]:
    """The ShardedObjects of ``key`` whose files are ``files`` (other names are skipped). An
    early save's name lacks the last axis of the global shape (``shard_0.1_2``: two
    offsets, one size), which is then one more than the largest offset on it, as
    Megatron-Core reads such names."""
    found = []
    for file in files:
        m = re.fullmatch(r"shard_([\d.]+)_([\d.]+)\.pt", file)
        if m is None:
            continue
        offset, shape = (tuple(int(v) for v in part.split(".") if v) for part in m.groups())
        if len(shape) in (len(offset), len(offset) - 1):
            found.append((offset, shape))
    last = max((o[-1] for o, sh in found if len(sh) < len(o)), default=0)
    return [ShardedObject(key, None, sh if len(sh) == len(o) else (*sh, last + 1), o) for o, sh in found]


def _whole_grid(array: ZarrArray) -> Iterator[Tuple[int, ...]]:
    """Every chunk index of ``array``'s grid."""
    return itertools.product(*(range(-(-s // c)) for s, c in zip(array.shape, array.chunks)))


def _check_backed(storage: Storage, array: ZarrArray) -> None:
    """Every chunk file of ``array`` holds its bytes, before a tensor of the shape its
    ``.zarray`` claims is allocated (a request without data: the offline readers)."""
    for index in _whole_grid(array):
        info = storage.info(array.chunk_file(index))
        if info is None or info.size < array.chunk_bytes:
            raise CheckpointingException(
                f"Zarr array {array.key!r}: chunk file {storage.describe(array.chunk_file(index))} "
                f"{'is missing' if info is None else f'holds {info.size} bytes'}; its .zarray claims "
                f"{array.chunk_bytes} bytes per chunk")


def zarr_metadata(storage: Storage, sharded_state_dict: ShardedStateDict) -> Tuple[Metadata, Dict[str, ZarrArray]]:
    """``torch_dist`` metadata of the stored chunks the request touches (a key or object the
    checkpoint lacks is left out: the planner reports it), and the arrays by key."""
    arrays: Dict[str, Optional[ZarrArray]] = {}
    state: Dict[str, object] = {}
    storage_data: Dict[object, StorageInfo] = {}
    chunk_sets: Dict[str, Dict[Tuple[int, ...], ChunkStorageMetadata]] = {}
    backed: set = set()
    checkpoint = storage.describe()
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedObject):
            name, size = _object_file(storage, _checked_key(sh.unique_key, "ShardedObject", checkpoint))
            if size is not None:
                state[sh.unique_key] = BytesStorageMetadata()
                storage_data[MetadataIndex(sh.unique_key)] = StorageInfo(name, 0, size)
            continue
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.key not in arrays:
            arrays[sh.key] = array = read_array(storage, sh.key)
            if array is not None:
                chunk_sets[sh.key] = {}
                state[sh.key] = TensorStorageMetadata(TensorProperties(dtype=array.dtype), torch.Size(array.shape), [])
        array = arrays[sh.key]
        if array is None or sh.is_empty_chunk():
            continue
        if sh.data is None and sh.key not in backed:  # allocated from the header: its bytes must exist
            _check_backed(storage, array)
            backed.add(sh.key)
        region = intersect(sh.global_region(), ((0,) * len(array.shape), array.shape)) \
            if len(sh.global_region()[0]) == len(array.shape) else None
        for index in grid_chunks_overlapping(region, array.chunks) if region is not None else ():
            if index in chunk_sets[sh.key]:
                continue
            offsets, sizes = array.chunk_region(index)
            chunk_sets[sh.key][index] = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            storage_data[MetadataIndex(sh.key, offsets)] = StorageInfo(array.chunk_file(index), 0, array.chunk_bytes)
    for key, chunks in chunk_sets.items():
        state[key].chunks = list(chunks.values())
    return Metadata(state, storage_data=storage_data), {k: a for k, a in arrays.items() if a is not None}


class ZarrLoadShardedStrategy(LoadShardedStrategy):
    """Loads Megatron-Core's ``zarr`` checkpoints (see the module); Megatron-Core's name.

    Args:
        thread_count: reader threads per rank.
        allow_pickle: opt in to unpickling objects outside the safe allow-list.
        strict_dtypes: refuse a request whose dtype differs from the stored one (by
            default the stored values are cast, as for ``torch_dist``).
    """

    supported_backends = ("zarr",)
    supported_versions = (1,)

    def __init__(self, thread_count: int = 4, allow_pickle: bool = False, strict_dtypes: bool = False):
        self.thread_count = max(1, int(thread_count))
        self.allow_pickle = allow_pickle
        self.strict_dtypes = strict_dtypes

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def offline_reader(self) -> "ZarrLoadShardedStrategy":
        return ZarrLoadShardedStrategy(thread_count=1, strict_dtypes=self.strict_dtypes)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
             async_strategy: Optional[str] = "mcore") -> StateDict:
        """Each rank reads the chunks of its own request (no collectives: ``load``'s caller
        agrees on errors across ranks). ``async_strategy`` as for ``torch_dist``."""
        check_async_strategy(async_strategy)
        storage = open_storage(checkpoint_dir)
        metadata, arrays = zarr_metadata(storage, sharded_state_dict)
        scratch = ScratchArena()
        scratch.begin()
        plan = plan_load(sharded_state_dict, metadata, storage.describe(), scratch, self.strict_dtypes)
        execute_reads(plan, ZarrReader(storage, self.allow_pickle, arrays), self.thread_count)
        scratch.end()
        return loaded_values(sharded_state_dict, plan)

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """A whole-tensor ShardedTensor for every array directly under the checkpoint."""
        return {key: ShardedTensor(key, None, a.dtype, a.shape, a.shape, (0,) * len(a.shape), (1,) * len(a.shape))
                for key, a in _stored_arrays(open_storage(checkpoint_dir)).items()}

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """The tensors, and every ShardedObject file ``<key>/shard_*.pt`` (data-less, by unique key)."""
        storage = open_storage(checkpoint_dir)
        result = self.load_tensors_metadata(storage)
        result.update({obj.unique_key: obj for obj in _all_stored_objects(storage, set(result))})
        return result

    def stored_items(self, checkpoint_dir: Union[str, Path]) -> StoredItems:
        """Every array with each chunk file, and every object file, located (for the
        offline tools: ``inspect``, ``validate``); no checksums are recorded."""
        storage = open_storage(checkpoint_dir)
        items = StoredItems(located=True)
        arrays = _stored_arrays(storage)
        for key, array in sorted(arrays.items()):
            chunks = []
            for index in _whole_grid(array):
                name = array.chunk_file(index)
                info = storage.info(name)
                items.files[name] = info.size if info is not None else None
                chunks.append(StoredChunk(*array.chunk_region(index), StoredRange(name, 0, array.chunk_bytes)))
            items.tensors.append(StoredTensor(key, array.shape, array.dtype, chunks,
                                              math.prod(array.shape) * array.dtype.itemsize, False))
        for obj in sorted(_all_stored_objects(storage, set(arrays)), key=lambda o: o.unique_key):
            name, size = _object_file(storage, obj.unique_key)
            items.objects[obj.unique_key] = size or 0
            items.object_locations[obj.unique_key] = StoredRange(name, 0, size or 0)
            items.files[name] = size
        return items


def _stored_arrays(storage: Storage) -> Dict[str, ZarrArray]:
    """Every array directly under the checkpoint, by key (the empty ``.zarray`` lock files
    of Megatron-Core's ``<key>.sync`` directories are not arrays)."""
    arrays = {}
    for name, kind in storage.entries().items():
        info = storage.info(f"{name}/.zarray") if kind == "dir" else None
        if info is not None and info.size > 0:
            arrays[name] = read_array(storage, name)
    return arrays


def _all_stored_objects(storage: Storage, arrays: Set[str]) -> List[ShardedObject]:
    """The ShardedObjects of every directory of the checkpoint that is not an array."""
    return [obj for name, kind in storage.entries().items() if kind == "dir" and name not in arrays
            for obj in _stored_objects(name, storage.subdirectory(name).list())]


def zarr_strategy_like(strategy: LoadShardedStrategy) -> LoadShardedStrategy:
    """``strategy`` made to read a zarr checkpoint: a ``torch_dist`` load strategy (also
    inside a fully parallel wrapper) becomes a :class:`ZarrLoadShardedStrategy` with its
    options (Megatron-LM's trainer passes a ``TorchDistLoadShardedStrategy`` whatever the
    checkpoint's backend); any other strategy is returned as it is."""
    def convert(base: LoadShardedStrategy) -> LoadShardedStrategy:
        if isinstance(base, TorchDistLoadShardedStrategy):
            return ZarrLoadShardedStrategy(thread_count=base.thread_count, allow_pickle=base.allow_pickle,
                                           strict_dtypes=base.strict_dtypes)
        return base

    return with_base_strategy(strategy, convert)
