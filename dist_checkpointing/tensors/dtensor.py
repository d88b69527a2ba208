"""DTensor leaves (FSDP2, torchtitan, ``parallelize_module``) as sharded tensors.

A ``DTensor`` in a sharded state dict is saved as the :class:`ShardedTensor` of its local
shard, so it loads into any layout (other meshes, other placements, Megatron-style
ShardedTensors) and the reverse. A DTensor has no key of its own: its key is its
**dotted path** in the state dict (``{"layers": [{"weight": w}]}`` → ``"layers.0.weight"``,
the rule of ``dist-ckpt import``), so a model must be nested the same way to load it back
(or be given the same keys as ShardedTensors).

Placements: ``Shard(dim)`` on any mesh dims (uneven shards and one tensor dim split by
several mesh dims included; ``_StridedShard``, FSDP2 + TP on one dim, when the local shard
is one block of the global tensor) and ``Replicate()``, whose mesh coordinates form the
``replica_id`` (the coordinate 0 of every replicated mesh dim is the main replica).
Anything else (``Partial``) is refused naming the key. A rank whose shard is empty
(uneven sharding) holds a non-main replica of an empty chunk: nothing is written or read.

Owns: dTensor leaves: ``dtensor_to_sharded_tensor`` (a DTensor's local shard as a
ShardedTensor keyed by its dotted path: offsets from torch's
``compute_local_shape_and_global_offset``, ``Replicate`` mesh coordinates as ``replica_id``,
``Partial`` and scattered ``_StridedShard`` shards refused), ``dtensors_to_sharded`` (the
save/load split's hook), ``restore_dtensors`` (the request's DTensors back into the loaded
result).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from ..core import CheckpointingException
from ..mapping import ShardedTensor

try:  # DTensor is optional (older or stripped-down torch builds)
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - depends on the torch build
    DTensor = None  # type: ignore[assignment,misc]
try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - depends on the torch version
    _StridedShard = None  # type: ignore[assignment,misc]

__all__ = ["is_dtensor", "dtensor_to_sharded_tensor", "dtensors_to_sharded", "restore_dtensors"]


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``."""
    return DTensor is not None and isinstance(value, DTensor)


def _strided_block_ok(dt: "DTensor", dim: int, coordinate: Sequence[int], offset: int, size: int) -> bool:
    """Whether this rank's shard along tensor ``dim`` is the block ``[offset, offset + size)``:
    the global indices are sharded the way ``distribute_tensor`` shards data (placements
    left to right), which a ``_StridedShard`` may leave scattered. ``False`` also when this
    torch's placements cannot be asked (``_split_tensor`` is private)."""
    mesh_shape = dt.device_mesh.shape
    index = torch.arange(dt.shape[dim]).view([-1 if d == dim else 1 for d in range(dt.ndim)])
    try:
        for mesh_dim, placement in enumerate(dt.placements):
            if getattr(placement, "dim", None) == dim:
                chunks = placement._split_tensor(index, mesh_shape[mesh_dim], with_padding=False)[0]
                index = chunks[coordinate[mesh_dim]]
    except (AttributeError, TypeError, IndexError):
        return False
    return index.numel() == size and torch.equal(index.reshape(-1), torch.arange(offset, offset + size))


def dtensor_to_sharded_tensor(key: str, dt: "DTensor") -> ShardedTensor:
    """The ShardedTensor ``key`` of this rank's shard of ``dt`` (an empty shard is never a
    main replica: nothing is written or read for it). Raises :class:`CheckpointingException`
    naming ``key`` for placements that a ShardedTensor cannot express."""
    mesh, placements = dt.device_mesh, tuple(dt.placements)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise CheckpointingException(f"DTensor {key!r}: this rank is not part of its device mesh {mesh}")
    replica: List[int] = []
    shard_counts = [1] * dt.ndim
    strided_dims = set()
    for mesh_dim, placement in enumerate(placements):
        if _StridedShard is not None and isinstance(placement, _StridedShard):
            strided_dims.add(placement.dim)
        elif isinstance(placement, Replicate):
            replica.append(coordinate[mesh_dim])
            continue
        elif not isinstance(placement, Shard):
            raise CheckpointingException(
                f"DTensor {key!r}: placement {placement!r} on mesh dim {mesh_dim} cannot be saved as a sharded "
                "tensor (only Shard and Replicate can); redistribute it first, e.g. "
                "dt.redistribute(placements=[Replicate()] * mesh.ndim)"
            )
        shard_counts[placement.dim] *= mesh.shape[mesh_dim]
    global_shape = tuple(dt.shape)
    local_shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    local = dt.to_local().detach()
    if tuple(local.shape) != tuple(local_shape):
        raise CheckpointingException(
            f"DTensor {key!r}: its local tensor has shape {tuple(local.shape)}, but its placements "
            f"{placements} on mesh {tuple(mesh.shape)} give {tuple(local_shape)} (padded shards are not supported)"
        )
    for dim in sorted(strided_dims):
        if not _strided_block_ok(dt, dim, coordinate, offset[dim], local_shape[dim]):
            raise CheckpointingException(
                f"DTensor {key!r}: placements {placements} leave this rank's shard scattered along dim {dim} "
                "(or this torch cannot tell), not one block of the global tensor; redistribute it to "
                "Shard/Replicate placements first"
            )
    if local.numel() == 0:  # nothing to write or read: never a main replica
        replica.append(1)
    even = all(g % n == 0 for g, n in zip(global_shape, shard_counts))
    return ShardedTensor(
        key, local, local.dtype, tuple(local_shape), global_shape, tuple(offset),
        tuple(shard_counts) if even else None, replica_id=tuple(replica) if replica else 0,
    )


def _dotted(path: Tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def dtensors_to_sharded(state_dict: Dict[str, Any]) -> None:
    """Replace, in place, every DTensor leaf of the nested dicts and lists of ``state_dict``
    by the ShardedTensor of its local shard keyed by its dotted path."""

    def walk(node: Any, path: Tuple[Any, ...]) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            if isinstance(v, (dict, list)):
                walk(v, path + (k,))
            elif is_dtensor(v):
                node[k] = dtensor_to_sharded_tensor(_dotted(path + (k,)), v)

    if DTensor is not None:
        walk(state_dict, ())


def restore_dtensors(result: Any, request: Any) -> Any:
    """Put the request's DTensors back into the loaded ``result`` where it holds their
    loaded local tensors (filled in place; copied in when a strategy returned new tensors
    of the local shape and dtype). Returns ``result``."""
    if is_dtensor(request):
        if not isinstance(result, torch.Tensor) or result is request:
            return result
        local = request.to_local().detach()
        if (result.shape, result.dtype) != (local.shape, local.dtype):
            return result
        if result.data_ptr() != local.data_ptr():
            local.copy_(result)
        return request
    if isinstance(request, dict) and isinstance(result, dict):
        for k, v in request.items():
            if k in result:
                result[k] = restore_dtensors(result[k], v)
    elif isinstance(request, list) and isinstance(result, list) and len(request) == len(result):
        for i, v in enumerate(request):
            result[i] = restore_dtensors(result[i], v)
    return result
