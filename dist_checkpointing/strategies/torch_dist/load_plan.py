"""Load planning of the ``torch_dist`` strategy: which stored byte ranges fill which part of
each requested tensor, including resharding across grids and flattened (distributed
optimizer) keys, read directly into the request's tensors where the layouts allow and
assembled through reused scratch memory where they do not. No I/O: :mod:`.reader`
executes the plan.

Owns: load planning, no I/O: the stored byte ranges that fill each requested tensor
(resharding, flattened keys read directly or assembled through the reused ``ScratchArena``;
a chunk stored in another dtype is read as stored and cast into the request one chunk at a
time, a request in the stored dtype is read straight into its tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from ...pickling.dcp_types import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo as _StorageInfo,
    TensorStorageMetadata,
)

from ...core import CheckpointingException, check_key
from ...dict_utils import nested_values
from ...tensors.fp8 import fill_float8_, is_float8tensor
from ...mapping import ShardedObject, ShardedStateDict, ShardedTensor
from ..resharding import (
    Region,
    contiguous_start,
    contiguous_strides,
    flat_slice_bounding_region,
    grid_chunks_overlapping,
    intersect,
    linear_index,
    relative_slices,
)
from .coverage import coverage_faults, describe_faults, tiles
from .format import original_global_shape


class ScratchArena:
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
class TensorRead:
    """One stored chunk (of ``dtype``, as stored) read into the ``overlap`` of ``dest``
    (which may have another dtype: the values are cast)."""

    key: str
    storage: _StorageInfo
    chunk: Region
    dtype: torch.dtype
    dest: torch.Tensor  # request data viewed with prepended axes (global rank)
    dest_origin: Tuple[int, ...]
    overlap: Region


@dataclass
class ObjectRead:
    key: str
    storage: _StorageInfo
    result: List[Any] = field(default_factory=list)


# (tensor reads, object reads by id of the request's ShardedObject, copies to run after the reads)
LoadPlan = Tuple[List[TensorRead], Dict[int, ObjectRead], List[Callable[[], Any]]]


def stored_chunk_shape(key: str, md: TensorStorageMetadata, orig: Tuple[int, ...],
                        checkpoint_dir: str) -> Tuple[int, ...]:
    """The chunk shape of a key stored flattened as ``axis_fragmentations + (chunk numel,)``."""
    fragm, row_len = tuple(md.size[:-1]), md.size[-1]
    if len(fragm) != len(orig) or any(f <= 0 or o % f for o, f in zip(orig, fragm)) or \
            math.prod([o // f for o, f in zip(orig, fragm)]) != row_len:
        raise CheckpointingException(
            f"Key {key!r} in checkpoint {checkpoint_dir} is stored flattened as {tuple(md.size)}, which is "
            f"not a regular grid of its original shape {orig}"
        )
    return tuple(o // f for o, f in zip(orig, fragm))


def plan_load(sharded_state_dict: ShardedStateDict, metadata: Metadata, checkpoint_dir: str,
              scratch: ScratchArena, strict_dtypes: bool = False) -> LoadPlan:
    """The reads (and copies after them) that fill the request from the checkpoint.

    A tensor stored in another dtype than requested is cast into the request's tensor
    (one stored chunk at a time, as PyTorch's reader does for Megatron-Core); with
    ``strict_dtypes`` such a request raises instead."""
    tensor_reads: List[TensorRead] = []
    post_copies: List[Callable[[], Any]] = []
    object_reads: Dict[int, ObjectRead] = {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, (ShardedTensor, ShardedObject)):
            check_key(sh.key, f"Loading {type(sh).__name__}")
        if isinstance(sh, ShardedTensor):
            reads, copies = plan_tensor(sh, metadata, checkpoint_dir, scratch, strict_dtypes)
            tensor_reads.extend(reads)
            post_copies.extend(copies)
        elif isinstance(sh, ShardedObject):
            md = metadata.state_dict_metadata.get(sh.unique_key)
            if not isinstance(md, BytesStorageMetadata):
                raise CheckpointingException(
                    f"ShardedObject {sh.unique_key!r} not found in checkpoint {checkpoint_dir}"
                )
            object_reads[id(sh)] = ObjectRead(sh.unique_key, metadata.storage_data[MetadataIndex(sh.unique_key)])
        else:
            raise CheckpointingException(f"Cannot load {type(sh).__name__} {getattr(sh, 'key', sh)!r}")
    return tensor_reads, object_reads, post_copies


def plan_tensor(sh: ShardedTensor, metadata: Metadata, checkpoint_dir: str, scratch: ScratchArena,
                strict_dtypes: bool = False) -> Tuple[List[TensorRead], List[Callable[[], Any]]]:
    """Reads (and copies to run after them) that fill ``sh.data`` from the checkpoint
    (cast to the request's dtype unless ``strict_dtypes``: see :func:`plan_load`)."""
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
    if strict_dtypes and md.properties.dtype != sh.dtype:
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
        reads, copies = plan_tensor(values, metadata, checkpoint_dir, scratch, strict_dtypes)
        return reads, copies + [lambda: fill_float8_(fp8, values.data)]
    data = sh.data.detach()  # fill in place, also parameters that require grad
    if sh.allow_shape_mismatch:
        data.zero_()  # as Megatron-Core: what the checkpoint does not cover reads as zeros
    if sh.is_empty_chunk():
        return [], []
    rng = sh.flattened_range
    if rng is not None and orig is not None and sh.reformulated_region()[0] == tuple(md.size):
        # Same grid as saved: the slice is a range of one row of the stored tensor.
        _, offsets, sizes = sh.reformulated_region()
        return _region_reads(sh, md, metadata, (offsets, sizes), data.view(sizes), checkpoint_dir), []
    if orig is not None:
        direct = _direct_flat_reads(sh, md, metadata, orig, data, checkpoint_dir)
        if direct is not None:
            return direct, []
    finish: List[Callable[[], Any]] = []
    if rng is None:
        region = sh.global_region()
        dest = data[(None,) * sh.prepend_axis_num] if sh.prepend_axis_num else data
    else:
        # Another grid: read the rows of the request's chunk that hold its slice, then cut it.
        region, first = flat_slice_bounding_region(*sh.global_region(), sh.prepend_axis_num, rng)
        dest = scratch.empty(region[1], sh.dtype)
        finish.append(lambda: data.copy_(dest.reshape(-1)[rng.start - first: rng.stop - first]))
    if orig is None:
        return _region_reads(sh, md, metadata, region, dest, checkpoint_dir), finish
    reads, copies = _assemble_from_flat(sh, md, metadata, orig, region, dest, checkpoint_dir, scratch)
    return reads, copies + finish


def _region_reads(sh: ShardedTensor, md: TensorStorageMetadata, metadata: Metadata, request: Region,
                  dest: torch.Tensor, checkpoint_dir: str) -> List[TensorRead]:
    """Reads of the stored chunks overlapping ``request`` (in stored coordinates) into ``dest``.

    Every element of ``request`` must be stored exactly once (with ``allow_shape_mismatch``:
    every element inside the stored tensor): a gap or an overlap, even one hidden by the
    other (the same number of elements), is refused naming the key and the boxes."""
    reads, overlaps = [], []
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
        overlaps.append(overlap)
        reads.append(TensorRead(sh.key, storage, chunk, md.properties.dtype, dest, request[0], overlap))
    checked = intersect(request, ((0,) * len(md.size), tuple(md.size))) if sh.allow_shape_mismatch else request
    if checked is not None and not tiles(checked, overlaps):
        faults = coverage_faults(checked, overlaps)
        if faults:
            layout = "" if original_global_shape(metadata, sh.key) is None else \
                f" (coordinates of its stored flattened layout {tuple(md.size)})"
            raise CheckpointingException(
                f"Checkpoint {checkpoint_dir} does not cover the requested chunk of {sh.key!r} "
                f"(offset {request[0]}, shape {request[1]}) exactly once{layout}: {describe_faults(faults)} "
                "(saved with validate_access_integrity=False?)"
            )
    return reads


def _direct_flat_reads(sh: ShardedTensor, md: TensorStorageMetadata, metadata: Metadata,
                       orig: Tuple[int, ...], data: torch.Tensor, checkpoint_dir: str) -> Optional[List[TensorRead]]:
    """Reads straight into the request's tensor from a flattened key, when each overlap of
    the request's chunk with a stored chunk is one contiguous run in both row-major layouts
    (e.g. grids split along the leading axis): no buffers, no copies. ``None`` otherwise."""
    chunk_shape = stored_chunk_shape(sh.key, md, orig, checkpoint_dir)
    if not data.is_contiguous():
        return None
    flat_data = data.reshape(-1)
    request = sh.global_region()
    rng = sh.flattened_range
    lo_req, hi_req = (rng.start, rng.stop) if rng is not None else (0, flat_data.numel())
    reads: List[TensorRead] = []
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
        reads += _region_reads(sh, md, metadata, run, dest, checkpoint_dir)
    return reads


def _assemble_from_flat(sh: ShardedTensor, md: TensorStorageMetadata, metadata: Metadata,
                        orig: Tuple[int, ...], region: Region, dest: torch.Tensor,
                        checkpoint_dir: str, scratch: ScratchArena) -> Tuple[List[TensorRead], List[Callable[[], Any]]]:
    """Fill ``dest`` (the original-space ``region``) from a flattened key: for each stored
    chunk that ``region`` touches, read the span of its row between the first and the last
    needed element (from the DP slices that hold it) and copy the needed elements out."""
    chunk_shape = stored_chunk_shape(sh.key, md, orig, checkpoint_dir)
    strides = contiguous_strides(chunk_shape)
    reads: List[TensorRead] = []
    copies: List[Callable[[], Any]] = []
    for index in grid_chunks_overlapping(region, chunk_shape):
        chunk_origin = tuple(i * c for i, c in zip(index, chunk_shape))
        overlap = intersect(region, (chunk_origin, chunk_shape))
        if overlap is None:
            continue
        rel = [o - c for o, c in zip(overlap[0], chunk_origin)]
        first = linear_index(rel, strides)
        last = linear_index([r + s - 1 for r, s in zip(rel, overlap[1])], strides)
        span = scratch.empty((last - first + 1,), sh.dtype)
        span_region = (tuple(index) + (first,), (1,) * len(index) + (last - first + 1,))
        reads += _region_reads(sh, md, metadata, span_region, span.view(span_region[1]), checkpoint_dir)
        src = torch.as_strided(span, overlap[1], strides)
        dst = dest[relative_slices(overlap, region[0])]
        copies.append(lambda dst=dst, src=src: dst.copy_(src))
    return reads, copies
