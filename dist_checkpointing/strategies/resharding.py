"""Geometry of chunks in a global tensor: which stored chunks overlap a requested one, and
how flattened (N-D reformulated) chunks map back to the original tensor.

Also Megatron-Core 0.15's public N-D reformulation helpers, with its names and behaviour:
a flattened ShardedTensor of global shape ``[X, Y]`` and local shape ``[x, y]`` is stored
as the tensor ``[X // x, Y // y, x * y]`` (:func:`nd_flattened_tensor_reformulated_global_shape`);
:func:`apply_nd_flattened_tensors_reformulation` turns a flattened request made at another
grid into requests of whole stored chunks, :func:`restore_nd_flattened_tensors_formulation`
cuts the request's slice out of what they load. This library's own load reads flattened
keys at any grid directly and does not need them; they are for code written against
Megatron-Core's functions.

Owns: chunk geometry: intersection of regions, volumes, relative slices; for flattened
tensors the grid chunks a region touches, row-major linear indices and the bounding block of
a flat slice; Megatron-Core 0.15's N-D reformulation API on that geometry
(``TensorReformulationMetadata``, ``is_nd_flattened_tensor``,
``apply_nd_flattened_tensors_reformulation`` / ``restore_nd_flattened_tensors_formulation``:
a flattened request at another grid as factories of whole stored chunks; our own load does
not use them).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch

from ..core import CheckpointingException
from ..dict_utils import dict_list_map_inplace, extract_matching_values
from ..mapping import ShardedTensorFactory, apply_factories, apply_factory_merges
from ..tensors.sharded import ShardedStateDict, ShardedTensor, StateDict

Region = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)


def intersect(a: Region, b: Region) -> Optional[Region]:
    """The overlap of two regions, or ``None`` if they do not overlap."""
    offsets, sizes = [], []
    for a_off, a_size, b_off, b_size in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(a_off, b_off), min(a_off + a_size, b_off + b_size)
        if lo >= hi:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def relative_slices(region: Region, origin: Sequence[int]) -> Tuple[slice, ...]:
    """Index of ``region`` within a tensor whose first element sits at ``origin``."""
    return tuple(slice(off - o, off - o + size) for off, size, o in zip(region[0], region[1], origin))


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """Row-major strides (in elements) of a tensor of ``shape``."""
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def linear_index(coords: Sequence[int], strides: Sequence[int]) -> int:
    """Position of ``coords`` in a row-major layout with ``strides``."""
    return sum(c * s for c, s in zip(coords, strides))


def grid_chunks_overlapping(region: Region, chunk_shape: Sequence[int]) -> Iterator[Tuple[int, ...]]:
    """Indices of the chunks of a regular grid (chunks of ``chunk_shape``) that ``region`` touches."""
    ranges = [range(off // c, (off + size - 1) // c + 1) for off, size, c in zip(region[0], region[1], chunk_shape)]
    return itertools.product(*ranges)


def flat_slice_bounding_region(chunk_offsets: Sequence[int], chunk_sizes: Sequence[int], prepend: int,
                               flat_range: slice) -> Tuple[Region, int]:
    """The smallest block of whole rows of a chunk that holds the flat slice ``flat_range``
    of it (flat indices count over the non-prepended axes), and the flat index of the
    block's first element. Reading this block is all a flattened request needs."""
    local = tuple(chunk_sizes[prepend:])
    if not local:
        return (tuple(chunk_offsets), tuple(chunk_sizes)), 0
    row = math.prod(local[1:])
    first_row, last_row = flat_range.start // row, (flat_range.stop - 1) // row
    offsets = list(chunk_offsets)
    sizes = list(chunk_sizes)
    offsets[prepend] += first_row
    sizes[prepend] = last_row - first_row + 1
    return (tuple(offsets), tuple(sizes)), first_row * row


def contiguous_start(box_sizes: Sequence[int], rel_offsets: Sequence[int], sizes: Sequence[int]) -> Optional[int]:
    """If the sub-box (``rel_offsets``, ``sizes``) of a box is one contiguous run of the
    box's row-major layout, the flat index where it starts; else ``None``. That is the case
    when, past the first axis longer than 1, the sub-box spans whole axes of the box."""
    n = len(box_sizes)
    first_long = next((j for j in range(n) if sizes[j] > 1), n)
    if any(sizes[j] != box_sizes[j] for j in range(first_long + 1, n)):
        return None
    return linear_index(rel_offsets, contiguous_strides(box_sizes))


# ----------------------------------------------------------------------------- Megatron-Core's N-D reformulation API

# What restores the original formulation: the factories that reformulated the request.
ReformulationRestoreMetadata = ShardedStateDict


@dataclass
class TensorReformulationMetadata:
    """How a flattened key is stored: its original global shape and the reformulated
    shape actually saved (the grid of chunks plus one axis of a chunk's elements)."""

    ckpt_orig_global_shape: Tuple[int, ...]
    ckpt_reform_global_shape: Tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ckpt_orig_global_shape:
            raise CheckpointingException("TensorReformulationMetadata needs a non-empty original global shape")


def is_nd_flattened_tensor(sh_ten: Any) -> bool:
    """Whether ``sh_ten`` is a flattened ShardedTensor (a ``flattened_range`` is set)."""
    return isinstance(sh_ten, ShardedTensor) and sh_ten.flattened_range is not None


def nd_flattened_tensor_reformulated_global_shape(sh_ten: ShardedTensor) -> Tuple[int, ...]:
    """The stored (reformulated) global shape of the flattened ``sh_ten``:
    ``axis_fragmentations + (prod(local_shape),)``."""
    if not is_nd_flattened_tensor(sh_ten):
        raise CheckpointingException(f"{sh_ten!r} is not a flattened ShardedTensor")
    return tuple(sh_ten.axis_fragmentations) + (math.prod(sh_ten.local_shape),)


def apply_nd_flattened_tensors_reformulation(
    sharded_state_dict: ShardedStateDict, reformulation_metadata: Dict[str, TensorReformulationMetadata],
) -> Tuple[ShardedStateDict, ReformulationRestoreMetadata]:
    """Reformulate (in place) every flattened tensor of ``sharded_state_dict`` stored at
    another grid into requests of the whole stored chunks its chunk overlaps.

    ``reformulation_metadata`` must hold every flattened key (as
    :func:`~dist_checkpointing.strategies.torch.get_reformulation_metadata` reads it);
    a missing 1-D key is left as is (a checkpoint that stored it without metadata).
    Returns the reformulated dict and what
    :func:`restore_nd_flattened_tensors_formulation` needs after the load.
    """

    def reformulate(sh: Any) -> Any:
        if not is_nd_flattened_tensor(sh):
            return sh
        metadata = reformulation_metadata.get(sh.key)
        if metadata is None:
            if len(sh.global_shape) == 1:
                return sh
            raise CheckpointingException(
                f"Missing reformulation metadata for flattened tensor {sh.key!r}; "
                f"metadata given for {sorted(reformulation_metadata)}"
            )
        if tuple(metadata.ckpt_reform_global_shape) == nd_flattened_tensor_reformulated_global_shape(sh):
            return sh  # stored at this grid: read as requested
        return reformulate_single_nd_flattened_tensor(sh, metadata)

    dict_list_map_inplace(reformulate, sharded_state_dict)
    factories, _ = extract_matching_values(sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory),
                                           return_lists_as_dicts=True)
    apply_factories(sharded_state_dict)

    def drop_data(factory: ShardedTensorFactory) -> ShardedTensorFactory:
        factory.data = None  # only the merge is needed later: keep no reference to the tensor
        return factory

    dict_list_map_inplace(drop_data, factories)
    return sharded_state_dict, factories


def restore_nd_flattened_tensors_formulation(
    state_dict: StateDict, formulation_restore_metadata: ReformulationRestoreMetadata,
) -> StateDict:
    """The inverse of :func:`apply_nd_flattened_tensors_reformulation` on the loaded state
    dict: each reformulated tensor becomes the request's flat slice again (in place)."""
    return apply_factory_merges(state_dict, formulation_restore_metadata)


def _stored_grid(sh_ten: ShardedTensor, metadata: TensorReformulationMetadata) -> Tuple[int, ...]:
    """The stored chunk shape (prepended axes included) that ``metadata`` describes, checked."""
    orig, reform = tuple(metadata.ckpt_orig_global_shape), tuple(metadata.ckpt_reform_global_shape)
    fragments = reform[:-1]
    if len(fragments) != len(orig) or len(fragments) != len(sh_ten.axis_fragmentations) \
            or any(f <= 0 or size % f for size, f in zip(orig, fragments)):
        raise CheckpointingException(
            f"Flattened tensor {sh_ten.key!r}: stored shape {reform} is no grid of the original shape {orig} "
            f"for a request with fragmentations {tuple(sh_ten.axis_fragmentations)}"
        )
    chunk = tuple(size // f for size, f in zip(orig, fragments))
    if math.prod(chunk) != reform[-1] or any(c != 1 for c in chunk[:sh_ten.prepend_axis_num]):
        raise CheckpointingException(
            f"Flattened tensor {sh_ten.key!r}: stored chunks of shape {chunk} do not match the stored "
            f"reformulated shape {reform} (prepended axes: {sh_ten.prepend_axis_num})"
        )
    return chunk


def reformulate_single_nd_flattened_tensor(
    sh_ten: ShardedTensor, reformulation_metadata: TensorReformulationMetadata,
) -> ShardedTensorFactory:
    """A factory that requests, for the flattened ``sh_ten``, every stored chunk (whole)
    that its chunk of the original tensor overlaps — keyed ``(global_offset, chunk local
    shape)`` — and merges what they load into ``sh_ten``'s flat slice."""
    chunk = _stored_grid(sh_ten, reformulation_metadata)
    pre = sh_ten.prepend_axis_num
    orig = tuple(reformulation_metadata.ckpt_orig_global_shape)
    local = chunk[pre:]
    request = sh_ten.without_data()
    own_region = request.global_region()
    pieces = {}
    for index in grid_chunks_overlapping(own_region, chunk):
        offset = tuple(i * c for i, c in zip(index, chunk))
        pieces[(offset, local)] = ShardedTensor(
            request.key, None, request.dtype, local, orig, offset, tuple(reformulation_metadata.ckpt_reform_global_shape[:-1]),
            request.replica_id, pre, request.allow_shape_mismatch, flattened_range=slice(0, math.prod(local)),
        )

    def build(*_: Any) -> Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], ShardedTensor]:
        return pieces

    @torch.no_grad()
    def merge(loaded: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
        if not loaded:
            raise CheckpointingException(f"Flattened tensor {request.key!r}: no stored chunk was loaded")
        first = next(iter(loaded.values()))
        whole = torch.empty(request.local_shape, dtype=request.dtype, device=first.device)
        own = (own_region[0][pre:], own_region[1][pre:])
        for (offset, shape), piece in loaded.items():
            overlap = intersect((offset[pre:], shape), own)
            if overlap is not None:
                whole[relative_slices(overlap, own[0])] = piece.view(shape)[relative_slices(overlap, offset[pre:])]
        return whole.flatten()[request.flattened_range]

    return ShardedTensorFactory(request.key, sh_ten.data, build, merge, request.replica_id, request.flattened_range)
