"""The ``torch_dist`` strategy: ShardedTensors and ShardedObjects in PyTorch DCP's format.

On disk (see ``docs/format.md``): every main-replica chunk is a ``torch.save`` blob in a
``__{rank}_{n}.distcp`` file, ShardedObjects are ``torch.save([data])`` blobs under their
unique key, and the DCP ``.metadata`` maps every key to its global shape, its chunks and
their byte ranges. The format is the one Megatron-Core and ``torch.distributed.checkpoint``
read and write; the machinery is this library's own:

* save writes each rank's items with ``thread_count`` threads through reused staging
  buffers (no planning round trip before writing), then gathers the per-rank byte ranges
  to rank 0, which writes ``.metadata``: one 2-byte ``all_reduce`` of the outcome and
  one gather of item locations to rank 0 alone per save;
* load parses each blob's small header and reads the tensor bytes straight into the
  request's own tensors (or just the needed span when resharding).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import math
import os
import pickle
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as TorchTensorProperties
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..collectives import (
    all_gather_object,
    all_reduce_max_uint8,
    broadcast_object,
    error_message,
    gather_object,
    get_rank,
    get_world_size,
    is_distributed,
    raise_if_any,
    run_agreed,
)
from ..core import CheckpointingException
from ..save_claim import current_save_id
from ..integrity import (
    SCOPE_RECORD,
    RecordVerifier,
    checksum,
    item_checksum_scope,
    item_checksum_table,
    mismatch_error,
    write_file_with_checksum,
)
from ..dict_utils import dict_list_map_outplace, nested_values
from ..fp8 import dequantize, fill_float8_, is_float8tensor
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from .async_utils import AsyncRequest, ForkedCall
from .base import AsyncSaveShardedStrategy, LoadShardedStrategy, StrategyAction, register_default_strategy
from .filesystem_async import (
    BUFFERS_PER_FILE,
    HostStaging,
    adopt_staging_buffers,
    reserve_staging_buffers,
    return_staging_buffers,
    tensor_bytes,
    write_file,
)
from .memory_maps import not_isolated_by_fork
from .resharding import (
    Region,
    contiguous_start,
    contiguous_strides,
    flat_slice_bounding_region,
    grid_chunks_overlapping,
    intersect,
    linear_index,
    relative_slices,
)
from .metadata_checks import check_dcp_metadata, check_stored_sizes
from .safe_pickle import load_dcp_metadata, safe_torch_load
from .torch_blob import TensorHeader, read_tensor_header

METADATA_FNAME = ".metadata"
DCP_VERSION = "1.0.0"
COMMON_STATE_OBJECT_KEY = "common_state/shard_0_1"


# ----------------------------------------------------------------------------- save


@dataclass
class _SaveItem:
    key: str  # DCP key: ShardedTensor.key or ShardedObject.unique_key
    payload: Union[torch.Tensor, bytes]
    nbytes: int
    # (global shape as stored, dtype, offsets, sizes, original global shape if reformulated)
    tensor_meta: Optional[Tuple[Tuple[int, ...], torch.dtype, Tuple[int, ...], Tuple[int, ...], Optional[Tuple[int, ...]]]]


def _object_payload(obj: ShardedObject) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save([obj.data], buf)
    except Exception as e:  # noqa: BLE001 - unpicklable user object
        raise CheckpointingException(f"Cannot serialize ShardedObject {obj.unique_key!r}: {e}") from e
    return buf.getvalue()


def _collect_save_items(sharded_state_dict: ShardedStateDict) -> List[_SaveItem]:
    items: List[_SaveItem] = []
    for sh in nested_values(sharded_state_dict):
        if not is_main_replica(sh.replica_id):
            continue
        if isinstance(sh, ShardedTensor):
            if sh.data is None:
                raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save")
            sh.validate_metadata_integrity()
            if sh.flattened_range is not None and sh.flattened_range.stop == sh.flattened_range.start:
                continue  # an empty slice of a chunk: nothing to store
            # FP8 tensors (Transformer Engine) are stored as their high-precision values.
            local = dequantize(sh.data) if is_float8tensor(sh.data) else sh.data
            if sh.flattened_range is not None:
                # Megatron-Core 0.15 layout: the slice is a range of the last axis of the
                # N-D reformulated tensor; written by its holder, no communication.
                shape, offsets, sizes = sh.reformulated_region()
                data = local.reshape(sizes)
                meta = (shape, sh.dtype, offsets, sizes, tuple(sh.global_shape))
            else:
                offsets, sizes = sh.global_region()
                data = local[(None,) * sh.prepend_axis_num] if sh.prepend_axis_num else local
                meta = (sh.global_shape, sh.dtype, offsets, sizes, None)
            items.append(_SaveItem(sh.key, data, data.numel() * data.element_size(), meta))
        elif isinstance(sh, ShardedObject):
            payload = _object_payload(sh)
            items.append(_SaveItem(sh.unique_key, payload, len(payload), None))
        else:
            raise CheckpointingException(f"Unexpected sharded item {type(sh).__name__} for key {sh.key!r}")
    return items


def _assign_files(items: List[_SaveItem], rank: int, thread_count: int,
                  separation_hint: Optional[str]) -> Dict[str, List[_SaveItem]]:
    """Split items into at most ``thread_count`` files per group, balancing bytes."""
    groups: Dict[str, List[_SaveItem]] = {}
    for item in items:
        prefix = ""
        if separation_hint and item.key.startswith(separation_hint):
            prefix = separation_hint.replace("/", "_")
        groups.setdefault(prefix, []).append(item)
    files: Dict[str, List[_SaveItem]] = {}
    for prefix, group in groups.items():
        buckets: List[List[_SaveItem]] = [[] for _ in range(max(1, thread_count))]
        loads = [0] * len(buckets)
        for item in sorted(group, key=lambda it: -it.nbytes):
            i = loads.index(min(loads))
            buckets[i].append(item)
            loads[i] += item.nbytes
        order = {id(it): n for n, it in enumerate(group)}
        non_empty = [sorted(b, key=lambda it: order[id(it)]) for b in buckets if b]
        for n, bucket in enumerate(non_empty):
            files[f"{prefix}__{rank}_{n}.distcp"] = bucket
    return files


# One location entry per written item: (key, tensor_meta or None, file, offset, length, checksum)
_Location = Tuple[str, Optional[tuple], str, int, int, Optional[int]]


def _checksum_table(per_rank_checksums: List[List[Tuple[str, int, Optional[int]]]]) -> Dict[str, Any]:
    return item_checksum_table(
        {(fname, offset): cs for entries in per_rank_checksums for fname, offset, cs in entries if cs is not None})


def _storage_meta(checkpoint_dir: Path) -> StorageMeta:
    """DCP's record of this save: the directory and the id of the save that holds it
    (:mod:`~dist_checkpointing.save_claim`; a fresh id when none does)."""
    return StorageMeta(checkpoint_id=str(checkpoint_dir), save_id=current_save_id(checkpoint_dir) or uuid.uuid4().hex)


def _build_metadata(per_rank: List[List[_Location]], checkpoint_dir: Path) -> Metadata:
    """Global DCP metadata from every rank's item locations, with consistency checks."""
    state_dict_metadata: Dict[str, Any] = {}
    orig_shapes: Dict[str, Optional[Tuple[int, ...]]] = {}
    storage_data: Dict[MetadataIndex, _StorageInfo] = {}
    owner: Dict[MetadataIndex, int] = {}
    shape_owner: Dict[str, int] = {}
    for rank, locations in enumerate(per_rank):
        for key, tensor_meta, fname, offset, length, _ in locations:
            if tensor_meta is None:
                index = MetadataIndex(key)
                if key in state_dict_metadata and not isinstance(state_dict_metadata[key], BytesStorageMetadata):
                    raise CheckpointingException(f"Key {key!r} is saved both as a tensor and as an object")
                state_dict_metadata[key] = BytesStorageMetadata()
            else:
                global_shape, dtype, offsets, sizes, orig_shape = tensor_meta
                index = MetadataIndex(key, torch.Size(offsets))
                md = state_dict_metadata.get(key)
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
                elif not isinstance(md, TensorStorageMetadata):
                    raise CheckpointingException(f"Key {key!r} is saved both as a tensor and as an object")
                elif tuple(md.size) != tuple(global_shape) or md.properties.dtype != dtype:
                    raise CheckpointingException(
                        f"ShardedTensor {key!r}: rank {shape_owner[key]} saves global shape "
                        f"{tuple(md.size)} dtype {md.properties.dtype}, rank {rank} saves "
                        f"{tuple(global_shape)} dtype {dtype}"
                    )
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
        storage_meta=_storage_meta(checkpoint_dir),
        version=DCP_VERSION,
    )
    # Megatron-Core's loader looks up per-key extras here: the original global shape of
    # flattened (N-D reformulated) tensors, nothing for the others.
    metadata.mcore_data = {
        k: ({"nd_reformulated_orig_global_shape": orig_shapes[k]} if orig_shapes.get(k) is not None else {})
        for k, md in state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
    }
    metadata.checksums = _checksum_table([[(loc[2], loc[3], loc[5]) for loc in locs] for locs in per_rank])
    return metadata


def _as_plain_metadata(metadata: Metadata) -> Metadata:
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


def _write_metadata(metadata: Metadata, checkpoint_dir: Path) -> None:
    write_file_with_checksum(checkpoint_dir / METADATA_FNAME, pickle.dumps(metadata))


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves ShardedTensors and ShardedObjects in the torch_dist (DCP) format.

    Args:
        backend, version: recorded in ``metadata.json``.
        keep_only_main_replica: accepted for Megatron-Core compatibility; only main
            replicas are ever written.
        thread_count: writer threads (and files) per rank.
        cached_metadata: when every rank writes the same items as in the previous save
            with this strategy, skip gathering item locations and reuse the previous
            global metadata.
        separation_hint: keys starting with this prefix go to separate files
            ``{hint}__{rank}_{n}.distcp``.
        checksums: record an xxh3-64 checksum of every stored item (verified on load).
        async_snapshot: how :meth:`async_save` takes its snapshot. ``"fork"`` (default): a
            forked child process sees the tensors copy-on-write and writes them; the call
            returns after the fork (a fraction of one memcpy), but every page the caller
            writes while the child runs is copied by the kernel on its first write, and
            written pages stay write-protected until then (see the user guide); tensors a
            fork does not isolate are copied into host buffers first (:func:`_needs_staging`:
            other devices, pinned memory, shared and file-backed mappings such as
            ``np.memmap`` or ``torch.load(mmap=True)``; every CPU tensor where
            ``/proc/self/maps`` cannot be read). ``"copy"``: every tensor is copied into
            host buffers reused from the previous save of the same structure (one memcpy;
            device tensors into pinned memory), then written by the async queue's thread;
            no later cost to the caller.
    """

    def __init__(self, backend: str = "torch_dist", version: int = 1, keep_only_main_replica: bool = True,
                 thread_count: int = 2, cached_metadata: bool = False, separation_hint: Optional[str] = None,
                 checksums: bool = True, async_snapshot: str = "fork"):
        super().__init__(backend, version)
        if async_snapshot not in ("fork", "copy"):
            raise CheckpointingException(f"async_snapshot must be 'fork' or 'copy', not {async_snapshot!r}")
        self.async_snapshot = async_snapshot
        self.checksums = checksums
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = max(1, int(thread_count))
        self.cached_metadata = cached_metadata
        self.separation_hint = separation_hint
        self._cache: Optional[Tuple[List[str], Metadata]] = None
        self._staging = HostStaging()

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        checkpoint_dir = Path(checkpoint_dir)
        locations: List[_Location] = []
        error: Optional[str] = None
        try:
            locations = self._write_files(self._plan_files(sharded_state_dict), checkpoint_dir)
        except Exception as e:  # noqa: BLE001 - agreed on below
            error = error_message(e)
        self._publish(locations, error, checkpoint_dir)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> AsyncRequest:
        """Snapshot this rank's items and write them in the background.

        Returns an :class:`AsyncRequest` whose ``async_fn`` writes the data (or waits for
        the forked writer) and whose finalize step gathers the item locations and writes
        ``.metadata`` (collective). Once this returns the caller may change its tensors:
        with ``async_snapshot="fork"`` a forked writer sees them as they are now
        (copy-on-write; tensors a fork does not isolate — on other devices, in pinned
        memory, in shared or file-backed mappings — are first copied into host buffers),
        with ``"copy"`` every tensor has been copied into host buffers. The buffers are
        kept for the next save of the same structure (released by :meth:`release`, which
        ``AsyncCallsQueue.close`` calls). Collective: ``run_agreed`` agrees on the
        preparation.
        """
        checkpoint_dir = Path(checkpoint_dir)
        copy_all = self.async_snapshot == "copy"
        files = run_agreed(lambda: self._stage(self._plan_files(sharded_state_dict), copy_all),
                           "Preparing the async save")
        written: Dict[str, Any] = {}

        def finalize() -> None:
            self._publish(written["locations"], None, checkpoint_dir)

        if copy_all:
            done = self._staging.hold([it.payload for items in files.values() for it in items
                                       if isinstance(it.payload, torch.Tensor)])

            def write() -> None:
                try:
                    written["locations"] = self._write_files(files, checkpoint_dir)
                finally:
                    done()

            return AsyncRequest(write, (), [finalize], resources=[self])
        # The writer's file staging buffers: the pool's (already touched), reserved for it.
        buffers = reserve_staging_buffers(min(self.thread_count, max(1, len(files))) * BUFFERS_PER_FILE)

        def write_in_child() -> List[_Location]:
            adopt_staging_buffers(buffers)
            return self._write_files(files, checkpoint_dir)

        try:
            writer = ForkedCall(write_in_child, f"Writing {checkpoint_dir} on rank {get_rank()}")
        except BaseException:
            return_staging_buffers(buffers)
            raise
        written["buffers"] = buffers
        return AsyncRequest(_wait_for_writer, (writer, written), [finalize], resources=[self])

    def release(self) -> None:
        """Free the host buffers kept for staging the tensors of async saves."""
        self._staging.release()

    def _stage(self, files: Dict[str, List[_SaveItem]], copy_all: bool = False) -> Dict[str, List[_SaveItem]]:
        """The same files with tensors replaced by host copies: every tensor (``copy_all``),
        else those a fork does not snapshot (:func:`_needs_staging`)."""
        tensors = [((fname, i), it.payload) for fname, items in files.items() for i, it in enumerate(items)
                   if isinstance(it.payload, torch.Tensor)]
        needed = [True] * len(tensors) if copy_all else _needs_staging([t for _, t in tensors])
        chosen = [slot_tensor for slot_tensor, need in zip(tensors, needed) if need]
        copies = self._staging.stage(chosen, pin=copy_all)
        staged = {fname: list(items) for fname, items in files.items()}
        for ((fname, i), _), copy in zip(chosen, copies):
            staged[fname][i] = replace(staged[fname][i], payload=copy)
        return staged

    def _plan_files(self, sharded_state_dict: ShardedStateDict) -> Dict[str, List[_SaveItem]]:
        items = _collect_save_items(sharded_state_dict)
        #: tensor bytes this rank writes in the current save (logged by ``save``)
        self.last_written_bytes = sum(it.nbytes for it in items if it.tensor_meta is not None)
        return _assign_files(items, get_rank(), self.thread_count, self.separation_hint)

    def _publish(self, locations: List[_Location], error: Optional[str], checkpoint_dir: Path) -> None:
        """Agree on every rank's write outcome; rank 0 writes ``.metadata`` (collective).

        One 2-byte ``all_reduce`` (did any rank fail? did any rank's layout change since the
        last save with ``cached_metadata``?), then the item locations — or, for an unchanged
        layout, only their checksums — gathered to rank 0 alone, then rank 0's outcome
        broadcast. Error messages travel only after a failure."""
        rank = get_rank()
        layout = sorted((loc[:5] for loc in locations), key=lambda loc: (loc[2], loc[3]))
        digest = hashlib.sha256(pickle.dumps(layout)).hexdigest()
        unchanged = self._cache is not None and self._cache[0] == digest and (rank != 0 or self._cache[1] is not None)
        failed, changed = all_reduce_max_uint8([int(error is not None), int(not unchanged)])
        if failed:
            raise_if_any(all_gather_object(error), "Writing the checkpoint data")

        metadata_error: Optional[str] = None
        reuse = self.cached_metadata and not changed
        # Same layout as last time: only the checksums (8 bytes per item) travel.
        per_rank = gather_object([(loc[2], loc[3], loc[5]) for loc in locations] if reuse else locations)
        if rank == 0:
            try:
                if reuse:
                    metadata = self._cache[1]
                    metadata.storage_meta = _storage_meta(checkpoint_dir)
                    metadata.checksums = _checksum_table(per_rank)
                else:
                    metadata = _build_metadata(per_rank, checkpoint_dir)
                _write_metadata(metadata, checkpoint_dir)
                if self.cached_metadata:
                    self._cache = (digest, metadata)
            except Exception as e:  # noqa: BLE001 - broadcast below
                metadata_error = error_message(e)
        elif self.cached_metadata:
            self._cache = (digest, None)  # only rank 0 needs the metadata itself
        metadata_error = broadcast_object(metadata_error)
        if metadata_error is not None:
            raise CheckpointingException(f"Writing the checkpoint metadata failed on rank 0: {metadata_error}")

    def _write_files(self, files: Dict[str, List[_SaveItem]], checkpoint_dir: Path) -> List[_Location]:
        def write_one(fname: str) -> List[_Location]:
            bucket = files[fname]
            spans = write_file(checkpoint_dir / fname, [it.payload for it in bucket], self.checksums)
            return [(it.key, it.tensor_meta, fname, off, length, cs) for it, (off, length, cs) in zip(bucket, spans)]

        if len(files) <= 1:
            results = [write_one(f) for f in files]
        else:
            with ThreadPoolExecutor(min(self.thread_count, len(files))) as pool:
                results = list(pool.map(write_one, files))
        return [loc for result in results for loc in result]


def _needs_staging(tensors: List[torch.Tensor]) -> List[bool]:
    """For each tensor, whether a forked writer would not see it as it is now: memory on
    another device, pinned memory (not inherited reliably), or CPU memory a fork does not
    isolate (shared or file-backed mappings; every CPU tensor where the process's mappings
    cannot be read: :func:`.memory_maps.not_isolated_by_fork`)."""
    needed = [True] * len(tensors)
    cpu = [i for i, t in enumerate(tensors) if t.device.type == "cpu" and not _is_pinned(t)]
    for i, unisolated in zip(cpu, not_isolated_by_fork([tensors[i] for i in cpu])):
        needed[i] = unisolated
    return needed


def _is_pinned(t: torch.Tensor) -> bool:
    try:
        return t.is_pinned()
    except RuntimeError:  # no accelerator to ask
        return False


def _wait_for_writer(writer: ForkedCall, written: Dict[str, Any]) -> None:
    """The ``async_fn`` of an async save: wait for the forked writer, keep its locations,
    give its staging buffers back to the pool."""
    try:
        written["locations"] = writer.result()
    finally:
        return_staging_buffers(written.pop("buffers", []))


# ----------------------------------------------------------------------------- load

_metadata_cache: Dict[str, Tuple[Tuple[int, int], Metadata]] = {}
_metadata_cache_lock = threading.Lock()


def read_metadata(checkpoint_dir: Union[str, Path]) -> Metadata:
    """The DCP metadata of a checkpoint (cached while the file is unchanged)."""
    path = Path(checkpoint_dir) / METADATA_FNAME
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointingException(f"Checkpoint metadata file {path} is missing") from e
    stamp = (st.st_mtime_ns, st.st_size)
    with _metadata_cache_lock:
        cached = _metadata_cache.get(str(path))
        if cached is not None and cached[0] == stamp:
            return cached[1]
    metadata = load_dcp_metadata(path)
    check_dcp_metadata(metadata, path)
    with _metadata_cache_lock:
        _metadata_cache.clear()
        _metadata_cache[str(path)] = (stamp, metadata)
    return metadata


class _ScratchArena:
    """Temporary buffers of one load (assembly spans of flattened keys), carved from memory
    that is kept for the next load: touching fresh memory costs more than the copies.
    At most ``max_cached_bytes`` stay cached between loads."""

    _ALIGN = 64

    def __init__(self, max_cached_bytes: int = 256 << 20):
        self.max_cached_bytes = max_cached_bytes
        self._cached: Optional[torch.Tensor] = None
        self._arena: Optional[torch.Tensor] = None
        self._used = 0

    def begin(self) -> None:
        """Start carving for a new load from the cached arena."""
        self._arena, self._used = self._cached, 0

    def empty(self, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor valid until the next :meth:`begin`."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        aligned = -(-max(nbytes, 1) // self._ALIGN) * self._ALIGN
        if self._arena is None or self._used + aligned > self._arena.numel():
            size = max(aligned, 2 * (self._arena.numel() if self._arena is not None else 0), 16 << 20)
            self._arena, self._used = torch.empty(size, dtype=torch.uint8), 0
        view = self._arena[self._used:self._used + nbytes]
        self._used += aligned
        return view.view(dtype).view(shape)

    def end(self) -> None:
        """Keep the last (largest) arena for the next load, if it is not too big."""
        if self._arena is not None and self._arena.numel() <= self.max_cached_bytes:
            self._cached = self._arena
        self._arena = None

    def release(self) -> None:
        """Free the cached memory."""
        self._cached = self._arena = None


@dataclass
class _TensorRead:
    key: str
    storage: _StorageInfo
    chunk: Region
    dtype: torch.dtype
    dest: torch.Tensor  # request data viewed with prepended axes (global rank)
    dest_origin: Tuple[int, ...]
    overlap: Region


@dataclass
class _ObjectRead:
    key: str
    storage: _StorageInfo
    result: List[Any] = field(default_factory=list)


class _Reader:
    """Executes reads with one fd per file and cached blob headers.

    ``checksums`` maps ``(file, offset)`` to an item's checksum: of its whole record when
    ``whole_records``, else (older checkpoints) of a tensor's data bytes or an object's
    record. Every item's claimed byte range is checked against its file's size before
    anything is read or allocated for it.
    """

    def __init__(self, checkpoint_dir: Path, allow_pickle: bool, checksums: Optional[Dict[Tuple[str, int], int]],
                 whole_records: bool = True):
        self.dir = checkpoint_dir
        self.allow_pickle = allow_pickle
        self.checksums = checksums or {}
        self.whole_records = whole_records
        self._files: Dict[str, Tuple[int, int]] = {}  # relative path -> (fd, size)
        self._headers: Dict[Tuple[str, int], Optional[TensorHeader]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def _open(self, key: str, storage: _StorageInfo) -> int:
        """The fd of the item's data file, once the file is known to hold the item's bytes."""
        with self._lock:
            opened = self._files.get(storage.relative_path)
            if opened is None:
                path = data_file_path(self.dir, storage.relative_path)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise CheckpointingException(f"Cannot open checkpoint data file {path}: {e}") from e
                opened = self._files[storage.relative_path] = (fd, os.fstat(fd).st_size)
        fd, size = opened
        if storage.offset < 0 or storage.length < 0 or storage.offset + storage.length > size:
            raise CheckpointingException(
                f"Item {key!r}: the checkpoint metadata claims bytes {storage.offset}..{storage.offset + storage.length} "
                f"of {self.dir / storage.relative_path}, which holds {size} bytes"
            )
        return fd

    def _header(self, read: _TensorRead, fd: int) -> Optional[TensorHeader]:
        cache_key = (read.storage.relative_path, read.storage.offset)
        with self._lock:
            if cache_key in self._headers:
                return self._headers[cache_key]
        header = read_tensor_header(fd, read.storage.offset, read.storage.length)
        if (header is not None and header.dtype == read.dtype and header.size != tuple(read.chunk[1])
                and header.is_contiguous() and math.prod(header.size) == math.prod(read.chunk[1])):
            header = TensorHeader(header.dtype, tuple(read.chunk[1]), contiguous_strides(read.chunk[1]),
                                  header.data_offset)
        if header is not None and (header.dtype != read.dtype or header.size != tuple(read.chunk[1])):
            raise CheckpointingException(
                f"Item {read.key!r} at {self.dir / read.storage.relative_path}:{read.storage.offset} holds a "
                f"{header.dtype} tensor of shape {header.size}, but the metadata says {read.dtype} "
                f"{tuple(read.chunk[1])}"
            )
        with self._lock:
            self._headers[cache_key] = header
        return header

    def read_tensor(self, read: _TensorRead) -> None:
        where = f"{self.dir / read.storage.relative_path}:{read.storage.offset}"
        fd = self._open(read.key, read.storage)
        try:
            header = self._header(read, fd)
        except CheckpointingException:
            raise
        except Exception as e:  # noqa: BLE001 - damaged archive
            raise CheckpointingException(f"Item {read.key!r} at {where} is damaged: {e}") from e
        dest = read.dest[relative_slices(read.overlap, read.dest_origin)]
        expected = self.checksums.get((read.storage.relative_path, read.storage.offset))
        what = f"tensor {read.key!r} (chunk at {tuple(read.chunk[0])})"
        if header is None:
            return self._read_tensor_via_torch_load(read, fd, dest, where, expected, what)
        rel = [o - c for o, c in zip(read.overlap[0], read.chunk[0])]
        first = sum(r * st for r, st in zip(rel, header.stride))
        last = sum((r + s - 1) * st for r, s, st in zip(rel, read.overlap[1], header.stride))
        itemsize = dest.element_size()
        whole = tuple(read.overlap[1]) == tuple(read.chunk[1])
        # A checksum covers the chunk's whole data span (data-only checksums: of a contiguous chunk).
        verify = expected is not None and (self.whole_records or header.is_contiguous())
        if verify:  # read the whole span; with whole_records the rest of the record is hashed too
            read_from, read_to = 0, header.span_elements() - 1
        else:
            read_from, read_to = first, last
        data = (header.data_offset + read_from * itemsize, (read_to - read_from + 1) * itemsize)
        verifier = RecordVerifier(fd, (read.storage.offset, read.storage.length), data, expected,
                                  self.whole_records, what, where) if verify else None
        if whole and header.is_contiguous() and dest.device.type == "cpu" and dest.is_contiguous():
            _pread_into(fd, tensor_bytes(dest), header.data_offset, where, what, verifier)
            return
        span = torch.empty(data[1], dtype=torch.uint8)
        _pread_into(fd, span.numpy(), data[0], where, what, verifier)
        src = torch.as_strided(span.view(read.dtype), read.overlap[1], header.stride, first - read_from)
        dest.copy_(src)

    def _read_tensor_via_torch_load(self, read: _TensorRead, fd: int, dest: torch.Tensor, where: str,
                                    expected: Optional[int], what: str) -> None:
        raw = self._read_record(fd, read.storage, where, what, expected if self.whole_records else None)
        loaded = safe_torch_load(raw, f"item {read.key!r} at {where}", self.allow_pickle)
        if is_float8tensor(loaded):  # a pickled Transformer Engine FP8 tensor (Megatron-Core's FP8 saves)
            loaded = dequantize(loaded)
        if not isinstance(loaded, torch.Tensor) or tuple(loaded.shape) != tuple(read.chunk[1]):
            raise CheckpointingException(f"Item {read.key!r} at {where} does not hold the expected tensor")
        if expected is not None and not self.whole_records and checksum(tensor_bytes(loaded.contiguous())) != expected:
            raise mismatch_error(what, where)
        rel = tuple(slice(o - c, o - c + s) for o, c, s in zip(read.overlap[0], read.chunk[0], read.overlap[1]))
        dest.copy_(loaded[rel])

    def read_object(self, read: _ObjectRead) -> None:
        where = f"{self.dir / read.storage.relative_path}:{read.storage.offset}"
        what = f"ShardedObject {read.key!r}"
        fd = self._open(read.key, read.storage)
        expected = self.checksums.get((read.storage.relative_path, read.storage.offset))
        raw = self._read_record(fd, read.storage, where, what, expected)
        loaded = safe_torch_load(raw, f"{what} at {where}", self.allow_pickle)
        if not (isinstance(loaded, list) and len(loaded) == 1):
            raise CheckpointingException(f"{what} at {where} has an unexpected layout")
        read.result.append(loaded[0])

    @staticmethod
    def _read_record(fd: int, storage: _StorageInfo, where: str, what: str, expected: Optional[int]) -> bytes:
        """An item's whole record (inside its file: see :meth:`_open`), verified against
        ``expected`` if given, before anything unpickles it."""
        raw = os.pread(fd, storage.length, storage.offset)
        if len(raw) != storage.length:
            raise CheckpointingException(f"{what} at {where} is truncated")
        if expected is not None and checksum(raw) != expected:
            raise mismatch_error(what, where)
        return raw


def data_file_path(checkpoint_dir: Path, relative_path: str) -> Path:
    """The path of a data file named in ``.metadata``; only plain names inside the
    checkpoint directory are accepted (a crafted ``.metadata`` cannot reach other files)."""
    if not relative_path or os.path.basename(relative_path) != relative_path or relative_path in (".", ".."):
        raise CheckpointingException(
            f"Checkpoint metadata in {checkpoint_dir} names data file {relative_path!r}, which is "
            "not a file inside the checkpoint directory"
        )
    return checkpoint_dir / relative_path


def _stored_chunk_shape(key: str, md: TensorStorageMetadata, orig: Tuple[int, ...],
                        checkpoint_dir: Path) -> Tuple[int, ...]:
    """The chunk shape of a key stored flattened as ``axis_fragmentations + (chunk numel,)``."""
    fragm, row_len = tuple(md.size[:-1]), md.size[-1]
    if len(fragm) != len(orig) or any(f <= 0 or o % f for o, f in zip(orig, fragm)) or \
            math.prod([o // f for o, f in zip(orig, fragm)]) != row_len:
        raise CheckpointingException(
            f"Key {key!r} in checkpoint {checkpoint_dir} is stored flattened as {tuple(md.size)}, which is "
            f"not a regular grid of its original shape {orig}"
        )
    return tuple(o // f for o, f in zip(orig, fragm))


def original_global_shape(metadata: Metadata, key: str) -> Optional[Tuple[int, ...]]:
    """The original global shape of a key stored N-D reformulated (flattened), else ``None``."""
    extras = (getattr(metadata, "mcore_data", None) or {}).get(key) or {}
    shape = extras.get("nd_reformulated_orig_global_shape")
    return tuple(shape) if shape is not None else None


_VERIFY_PIECE = 1 << 20  # hash what was just read while it is still in the CPU cache


def _pread_into(fd: int, buf, offset: int, where: str, what: str, verifier: Optional[RecordVerifier] = None) -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; with a ``verifier``, check the record's checksum."""
    mv = memoryview(buf).cast("B")
    piece = _VERIFY_PIECE if verifier is not None else mv.nbytes
    done = 0
    while done < mv.nbytes:
        n = os.preadv(fd, [mv[done:done + piece]], offset + done)
        if n <= 0:
            raise CheckpointingException(f"Unexpected end of file reading {what} at {where}")
        if verifier is not None:
            verifier.update(mv[done:done + n])
        done += n
    if verifier is not None:
        verifier.finish()


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Loads the torch_dist format (ours, Megatron-Core's and plain DCP's) with resharding.

    Args:
        thread_count: reader threads per rank.
        allow_pickle: opt in to unpickling objects outside the safe allow-list (runs code
            from the checkpoint: only for checkpoints you trust).
        verify_checksums: verify every item read against its recorded checksum
            (checkpoints without checksums, e.g. Megatron-Core's, load unverified).

    Resharding loads of flattened keys assemble through temporary buffers that the
    strategy keeps for its next load (at most 256 MiB; :meth:`release_scratch` frees them).
    """

    def __init__(self, thread_count: int = 4, allow_pickle: bool = False, verify_checksums: bool = True):
        self.thread_count = max(1, int(thread_count))
        self.allow_pickle = allow_pickle
        self.verify_checksums = verify_checksums
        self._scratch = _ScratchArena()

    def release_scratch(self) -> None:
        """Free the temporary memory kept from the last resharding load of flattened keys."""
        self._scratch.release()

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != "torch_dist":
            raise CheckpointingException(f"{type(self).__name__} cannot read backend {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != 1:
            raise CheckpointingException(f"{type(self).__name__} cannot read version {loaded_version!r}")

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> StateDict:
        """Collective load: errors on any rank are raised on every rank."""
        checkpoint_dir = Path(checkpoint_dir)
        plan = run_agreed(lambda: self._plan(sharded_state_dict, checkpoint_dir), "Planning the load")
        run_agreed(lambda: self._execute(plan, checkpoint_dir), "Reading the checkpoint")
        return self._result(sharded_state_dict, plan)

    def load_local(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> StateDict:
        """Load in this process alone (no collectives): for offline tools. Tensors requested
        without data (e.g. from :meth:`load_tensors_metadata`) are allocated only once their
        keys' stored sizes are checked against the data files."""
        checkpoint_dir = Path(checkpoint_dir)
        dataless = {sh.key for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor) and sh.data is None}
        if dataless:
            metadata = read_metadata(checkpoint_dir)
            check_stored_sizes(metadata, checkpoint_dir,
                               [k for k in dataless if isinstance(metadata.state_dict_metadata.get(k), TensorStorageMetadata)])
        plan = self._plan(sharded_state_dict, checkpoint_dir)
        self._execute(plan, checkpoint_dir)
        return self._result(sharded_state_dict, plan)

    def _plan(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path):
        metadata = read_metadata(checkpoint_dir)
        self._scratch.begin()
        tensor_reads: List[_TensorRead] = []
        post_copies: List[Callable[[], Any]] = []
        object_reads: Dict[int, _ObjectRead] = {}
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor):
                reads, copies = self._plan_tensor(sh, metadata, checkpoint_dir)
                tensor_reads.extend(reads)
                post_copies.extend(copies)
            elif isinstance(sh, ShardedObject):
                md = metadata.state_dict_metadata.get(sh.unique_key)
                if not isinstance(md, BytesStorageMetadata):
                    raise CheckpointingException(
                        f"ShardedObject {sh.unique_key!r} not found in checkpoint {checkpoint_dir}"
                    )
                object_reads[id(sh)] = _ObjectRead(sh.unique_key, metadata.storage_data[MetadataIndex(sh.unique_key)])
            else:
                raise CheckpointingException(f"Cannot load {type(sh).__name__} {getattr(sh, 'key', sh)!r}")
        return tensor_reads, object_reads, post_copies

    def _plan_tensor(self, sh: ShardedTensor, metadata: Metadata,
                     checkpoint_dir: Path) -> Tuple[List[_TensorRead], List[Callable[[], Any]]]:
        """Reads (and copies to run after them) that fill ``sh.data`` from the checkpoint."""
        md = metadata.state_dict_metadata.get(sh.key)
        if md is None:
            raise CheckpointingException(f"ShardedTensor {sh.key!r} not found in checkpoint {checkpoint_dir}")
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointingException(f"Key {sh.key!r} is an object in checkpoint {checkpoint_dir}, not a tensor")
        orig = original_global_shape(metadata, sh.key)
        stored_shape = orig if orig is not None else tuple(md.size)
        if stored_shape != sh.global_shape and not sh.allow_shape_mismatch:
            raise CheckpointingException(
                f"Global shape mismatch for key {sh.key!r}: checkpoint {checkpoint_dir} has "
                f"{stored_shape}, the request expects {sh.global_shape}"
            )
        if md.properties.dtype != sh.dtype:
            raise CheckpointingException(
                f"Dtype mismatch for key {sh.key!r}: checkpoint {checkpoint_dir} has "
                f"{md.properties.dtype}, the request expects {sh.dtype}"
            )
        sh.init_data("cpu")
        sh.validate_metadata_integrity()
        if is_float8tensor(sh.data):
            # Read the high-precision values, then quantize them into the FP8 tensor.
            fp8 = sh.data
            values = replace(sh, data=torch.empty(tuple(fp8.shape), dtype=sh.dtype))
            reads, copies = self._plan_tensor(values, metadata, checkpoint_dir)
            return reads, copies + [lambda: fill_float8_(fp8, values.data)]
        data = sh.data.detach()  # fill in place, also parameters that require grad
        rng = sh.flattened_range
        if rng is not None and rng.stop == rng.start:
            return [], []
        if rng is not None and orig is not None and sh.reformulated_region()[0] == tuple(md.size):
            # Same grid as saved: the slice is a range of one row of the stored tensor.
            _, offsets, sizes = sh.reformulated_region()
            return self._region_reads(sh, md, metadata, (offsets, sizes), data.view(sizes), checkpoint_dir), []
        if orig is not None:
            direct = self._direct_flat_reads(sh, md, metadata, orig, data, checkpoint_dir)
            if direct is not None:
                return direct, []
        finish: List[Callable[[], Any]] = []
        if rng is None:
            region = sh.global_region()
            dest = data[(None,) * sh.prepend_axis_num] if sh.prepend_axis_num else data
        else:
            # Another grid: read the rows of the request's chunk that hold its slice, then cut it.
            region, first = flat_slice_bounding_region(*sh.global_region(), sh.prepend_axis_num, rng)
            dest = self._scratch.empty(region[1], sh.dtype)
            finish.append(lambda: data.copy_(dest.reshape(-1)[rng.start - first: rng.stop - first]))
        if orig is None:
            return self._region_reads(sh, md, metadata, region, dest, checkpoint_dir), finish
        reads, copies = self._assemble_from_flat(sh, md, metadata, orig, region, dest, checkpoint_dir)
        return reads, copies + finish

    def _region_reads(self, sh: ShardedTensor, md: TensorStorageMetadata, metadata: Metadata, request: Region,
                      dest: torch.Tensor, checkpoint_dir: Path) -> List[_TensorRead]:
        """Reads of the stored chunks overlapping ``request`` (in stored coordinates) into ``dest``."""
        reads, covered = [], 0
        for chunk_md in md.chunks:
            chunk = (tuple(chunk_md.offsets), tuple(chunk_md.sizes))
            overlap = intersect(request, chunk)
            if overlap is None:
                continue
            storage = metadata.storage_data.get(MetadataIndex(sh.key, torch.Size(chunk[0])))
            if storage is None:
                raise CheckpointingException(
                    f"Checkpoint {checkpoint_dir} has no storage entry for chunk {chunk[0]} of {sh.key!r}"
                )
            covered += math.prod(overlap[1])
            reads.append(_TensorRead(sh.key, storage, chunk, sh.dtype, dest, request[0], overlap))
        if covered != math.prod(request[1]) and not sh.allow_shape_mismatch:
            raise CheckpointingException(
                f"Checkpoint {checkpoint_dir} does not cover the requested chunk of {sh.key!r} "
                f"(offset {request[0]}, shape {request[1]}): {covered} of {math.prod(request[1])} "
                "elements are stored"
            )
        return reads

    def _direct_flat_reads(self, sh: ShardedTensor, md: TensorStorageMetadata, metadata: Metadata,
                           orig: Tuple[int, ...], data: torch.Tensor, checkpoint_dir: Path) -> Optional[List[_TensorRead]]:
        """Reads straight into the request's tensor from a flattened key, when each overlap of
        the request's chunk with a stored chunk is one contiguous run in both row-major layouts
        (e.g. grids split along the leading axis): no buffers, no copies. ``None`` otherwise."""
        chunk_shape = _stored_chunk_shape(sh.key, md, orig, checkpoint_dir)
        if not data.is_contiguous():
            return None
        flat_data = data.reshape(-1)
        request = sh.global_region()
        rng = sh.flattened_range
        lo_req, hi_req = (rng.start, rng.stop) if rng is not None else (0, flat_data.numel())
        reads: List[_TensorRead] = []
        for index in grid_chunks_overlapping(request, chunk_shape):
            chunk_origin = tuple(i * c for i, c in zip(index, chunk_shape))
            overlap = intersect(request, (chunk_origin, chunk_shape))
            if overlap is None:
                continue
            r0 = contiguous_start(request[1], [o - r for o, r in zip(overlap[0], request[0])], overlap[1])
            s0 = contiguous_start(chunk_shape, [o - c for o, c in zip(overlap[0], chunk_origin)], overlap[1])
            if r0 is None or s0 is None:
                return None
            lo, hi = max(r0, lo_req), min(r0 + math.prod(overlap[1]), hi_req)
            if lo >= hi:
                continue
            run = (tuple(index) + (s0 + lo - r0,), (1,) * len(index) + (hi - lo,))
            dest = flat_data[lo - lo_req: hi - lo_req].view(run[1])
            reads += self._region_reads(sh, md, metadata, run, dest, checkpoint_dir)
        return reads

    def _assemble_from_flat(self, sh: ShardedTensor, md: TensorStorageMetadata, metadata: Metadata,
                            orig: Tuple[int, ...], region: Region, dest: torch.Tensor,
                            checkpoint_dir: Path) -> Tuple[List[_TensorRead], List[Callable[[], Any]]]:
        """Fill ``dest`` (the original-space ``region``) from a flattened key: for each stored
        chunk that ``region`` touches, read the span of its row between the first and the last
        needed element (from the DP slices that hold it) and copy the needed elements out."""
        chunk_shape = _stored_chunk_shape(sh.key, md, orig, checkpoint_dir)
        strides = contiguous_strides(chunk_shape)
        reads: List[_TensorRead] = []
        copies: List[Callable[[], Any]] = []
        for index in grid_chunks_overlapping(region, chunk_shape):
            chunk_origin = tuple(i * c for i, c in zip(index, chunk_shape))
            overlap = intersect(region, (chunk_origin, chunk_shape))
            if overlap is None:
                continue
            rel = [o - c for o, c in zip(overlap[0], chunk_origin)]
            first = linear_index(rel, strides)
            last = linear_index([r + s - 1 for r, s in zip(rel, overlap[1])], strides)
            span = self._scratch.empty((last - first + 1,), sh.dtype)
            span_region = (tuple(index) + (first,), (1,) * len(index) + (last - first + 1,))
            reads += self._region_reads(sh, md, metadata, span_region, span.view(span_region[1]), checkpoint_dir)
            src = torch.as_strided(span, overlap[1], strides)
            dst = dest[relative_slices(overlap, region[0])]
            copies.append(lambda dst=dst, src=src: dst.copy_(src))
        return reads, copies

    def _execute(self, plan, checkpoint_dir: Path) -> None:
        tensor_reads, object_reads, post_copies = plan
        table = getattr(read_metadata(checkpoint_dir), "checksums", None) if self.verify_checksums else None
        scope = item_checksum_scope(table, str(checkpoint_dir)) if table is not None else None
        reader = _Reader(checkpoint_dir, self.allow_pickle, table["items"] if table else None, scope == SCOPE_RECORD)
        try:
            tasks = [(reader.read_tensor, r) for r in tensor_reads] + [(reader.read_object, r) for r in object_reads.values()]
            tasks.sort(key=lambda t: (t[1].storage.relative_path, t[1].storage.offset))
            if self.thread_count == 1 or len(tasks) <= 1:
                for fn, arg in tasks:
                    fn(arg)
            else:
                with ThreadPoolExecutor(self.thread_count) as pool:
                    for f in [pool.submit(fn, arg) for fn, arg in tasks]:
                        f.result()
        finally:
            reader.close()
        for copy in post_copies:  # assembled flattened data into its destination
            copy()
        self._scratch.end()

    @staticmethod
    def _result(sharded_state_dict: ShardedStateDict, plan) -> StateDict:
        _, object_reads, _ = plan

        def unwrap(sh: Any) -> Any:
            if isinstance(sh, ShardedTensor):
                return sh.data
            if isinstance(sh, ShardedObject):
                return object_reads[id(sh)].result[0]
            return sh

        return dict_list_map_outplace(unwrap, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Whole-tensor ShardedTensors in the original global shape (flattened keys too)."""
        metadata = read_metadata(checkpoint_dir)
        result = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                shape = original_global_shape(metadata, key) or tuple(md.size)
                result[key] = ShardedTensor(key, None, md.properties.dtype, shape, shape, (0,) * len(shape),
                                            (1,) * len(shape))
        return result

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Tensors keyed by key; ShardedObjects keyed by unique key (data-less)."""
        result = self.load_tensors_metadata(checkpoint_dir)
        for key, md in read_metadata(checkpoint_dir).state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                try:
                    result[key] = ShardedObject.empty_from_unique_key(key)
                except CheckpointingException:
                    continue  # a bytes item that is not a ShardedObject
        return result

    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        """The common state of checkpoints that store it as the ``common_state`` object."""
        request = {"common": ShardedObject.empty_from_unique_key(COMMON_STATE_OBJECT_KEY)}
        return self.load_local(request, checkpoint_dir)["common"]

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
        """Remove tensors whose key starts with ``key_prefix``; data files that hold
        nothing else are deleted."""
        checkpoint_dir = Path(checkpoint_dir)
        metadata = _as_plain_metadata(read_metadata(checkpoint_dir))
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
        _write_metadata(metadata, checkpoint_dir)
        for fname in files_before - {si.relative_path for si in metadata.storage_data.values()}:
            try:
                os.remove(data_file_path(checkpoint_dir, fname))
            except FileNotFoundError:
                pass


# ----------------------------------------------------------------------------- plain DCP bridges


def sharded_tensor_to_torch_sharded_tensor(sh_tens: List[ShardedTensor], rank: Optional[int] = None) -> TorchShardedTensor:
    """Wrap this rank's chunks of one key as a ``torch.distributed`` ShardedTensor.

    For driving plain ``torch.distributed.checkpoint.save/load`` with this library's
    sharded state. Needs an initialized process group and a regular grid
    (``axis_fragmentations``); chunks of the grid held by no local ShardedTensor are
    attributed to another rank (DCP only uses the local shards and the global shape).
    """
    if not is_distributed():
        raise CheckpointingException("sharded_tensor_to_torch_sharded_tensor needs an initialized process group")
    if not sh_tens:
        raise CheckpointingException("sharded_tensor_to_torch_sharded_tensor needs at least one ShardedTensor")
    rank = get_rank() if rank is None else rank
    first = sh_tens[0]
    fragm = first.axis_fragmentations
    if fragm is None:
        raise CheckpointingException(f"ShardedTensor {first.key!r}: a torch ShardedTensor needs a regular grid")
    chunk_sizes = []
    for axis, (glob, fr) in enumerate(zip(first.global_shape, fragm)):
        if axis < first.prepend_axis_num:
            chunk_sizes.append(1)
        elif glob % fr:
            raise CheckpointingException(f"ShardedTensor {first.key!r}: axis {axis} of size {glob} is not split evenly")
        else:
            chunk_sizes.append(glob // fr)
    local = {}
    for sh in sh_tens:
        if sh.flattened_range is not None:
            raise CheckpointingException(
                f"ShardedTensor {sh.key!r} is flattened: the torch ShardedTensor bridge takes whole chunks only "
                "(save flattened state with dist_checkpointing.save)"
            )
        if (sh.key, sh.global_shape, sh.dtype, sh.axis_fragmentations) != (first.key, first.global_shape, first.dtype, fragm):
            raise CheckpointingException(f"ShardedTensors {first.key!r} and {sh.key!r} do not describe one grid")
        if sh.data is None or list(sh.global_region()[1]) != chunk_sizes:
            raise CheckpointingException(f"ShardedTensor {sh.key!r} at {sh.global_offset} is not a chunk of its grid")
        local[tuple(sh.global_offset)] = sh
    device = first.data.device
    other = (rank + 1) % get_world_size()
    shards_md = []
    for index in itertools.product(*(range(f) for f in fragm)):
        offsets = [i * c for i, c in zip(index, chunk_sizes)]
        owner = rank if tuple(offsets) in local else other
        if owner == rank and tuple(offsets) not in local:
            raise CheckpointingException(
                f"ShardedTensor {first.key!r}: chunk {offsets} has no owner in a world of one rank"
            )
        shards_md.append(ShardMetadata(offsets, list(chunk_sizes), f"rank:{owner}/{device}"))
    local_shards = [
        Shard.from_tensor_and_offsets(sh.data[(None,) * sh.prepend_axis_num], list(sh.global_offset), rank)
        for _, sh in sorted(local.items())
    ]
    properties = TorchTensorProperties(dtype=first.dtype, layout=torch.strided, requires_grad=False,
                                       memory_format=torch.contiguous_format, pin_memory=False)
    metadata = ShardedTensorMetadata(shards_md, torch.Size(first.global_shape), properties)
    return TorchShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)


def mcore_to_pyt_state_dict(state_dict: ShardedStateDict, is_loading: bool = False,
                            init_device: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    """A flat ``{key: torch ShardedTensor | BytesIO}`` dict for plain DCP.

    Use with :class:`MCoreSavePlanner` / :class:`MCoreLoadPlanner`. Saving
    (``is_loading=False``) keeps main replicas only and serializes ShardedObjects under
    their unique keys (the torch_dist object layout). Loading allocates missing tensors
    on ``init_device``; DCP then fills the request's own tensors, and the load planner
    puts each object under its unique key.
    """
    tensors: Dict[str, List[ShardedTensor]] = {}
    result: Dict[str, Any] = {}
    for sh in nested_values(state_dict):
        if isinstance(sh, ShardedTensor):
            if is_loading:
                sh.init_data(init_device)
            elif not is_main_replica(sh.replica_id):
                continue
            tensors.setdefault(sh.key, []).append(sh)
        elif isinstance(sh, ShardedObject):
            if is_loading:
                result[sh.unique_key] = io.BytesIO()
            elif is_main_replica(sh.replica_id):
                result[sh.unique_key] = io.BytesIO(_object_payload(sh))
    for key, group in tensors.items():
        result[key] = sharded_tensor_to_torch_sharded_tensor(group)
    return result


# ----------------------------------------------------------------------------- plain DCP planners


class MCoreSavePlanner(DefaultSavePlanner):
    """A DCP save planner whose metadata carries Megatron-Core's ``mcore_data``.

    For users who drive ``torch.distributed.checkpoint.save`` themselves:
    ``nd_flattened_global_shapes`` maps keys to their original global shape when they are
    stored N-D reformulated (recorded as ``nd_reformulated_orig_global_shape``).
    """

    def __init__(self, *args: Any, nd_flattened_global_shapes: Optional[Dict[str, Tuple[int, ...]]] = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.nd_flattened_global_shapes = dict(nd_flattened_global_shapes or {})

    def transform_object(self, write_item, object: Any):
        """BytesIO values are already serialized (see :func:`mcore_to_pyt_state_dict`)."""
        if isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)

    def create_global_plan(self, all_plans):
        global_plan, metadata = super().create_global_plan(all_plans)
        metadata.mcore_data = {key: {"nd_reformulated_orig_global_shape": tuple(shape)}
                               for key, shape in self.nd_flattened_global_shapes.items()}
        return global_plan, metadata


class MCoreLoadPlanner(DefaultLoadPlanner):
    """A DCP load planner that checks requested global shapes against the checkpoint
    and reads objects safely.

    ``shapes_validation_sharded_tensors`` are the ShardedTensors whose global shapes must
    match; a mismatch raises :class:`CheckpointingException` naming the key (plain DCP
    would fail later with a less helpful error, or silently load a smaller tensor).
    """

    def __init__(self, *args: Any, shapes_validation_sharded_tensors: Tuple[ShardedTensor, ...] = (),
                 allow_pickle: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = tuple(shapes_validation_sharded_tensors)
        self.allow_pickle = allow_pickle

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """Objects are unpickled with the safe allow-list and unwrapped from their list."""
        fqn = read_item.dest_index.fqn
        obj = safe_torch_load(value, f"object {fqn!r}", self.allow_pickle)
        if isinstance(obj, list) and len(obj) == 1:
            obj = obj[0]
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def create_local_plan(self):
        for sh in self.shapes_validation_sharded_tensors:
            md = self.metadata.state_dict_metadata.get(sh.key)
            if md is None:
                raise CheckpointingException(f"ShardedTensor {sh.key!r} not found in the checkpoint")
            if not isinstance(md, TensorStorageMetadata) or (
                    tuple(md.size) != sh.global_shape and not sh.allow_shape_mismatch):
                raise CheckpointingException(
                    f"Global shape mismatch for key {sh.key!r}: checkpoint has "
                    f"{tuple(getattr(md, 'size', ()))}, the request expects {sh.global_shape}"
                )
        return super().create_local_plan()


def register_default_torch_strategies() -> None:
    """Register the torch_dist strategies (done automatically on first lookup)."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy())
    register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy())
