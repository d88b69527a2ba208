"""This library's sharded state as a plain ``torch.distributed.checkpoint`` state dict, for
users who drive DCP themselves (Megatron-Core's ``mcore_to_pyt_state_dict`` and
``sharded_tensor_to_torch_sharded_tensor``): a key's ShardedTensors become torch
ShardedTensors or :mod:`.checkpointable` tensors, ShardedObjects serialized bytes (the
``torch_dist`` object layout). The planners that go with it: :mod:`.planners`."""

from __future__ import annotations

import io
import itertools
from typing import Any, Dict, List, Optional, Union

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as TorchTensorProperties

from ...runtime.collectives import get_rank, get_world_size, is_distributed
from ...core import CheckpointingException
from ...dict_utils import nested_values
from ...mapping import ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica
from .checkpointable import CheckpointableShardedTensor, LocalShardsContainer
from ..torch_dist.save_plan import object_payload


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
    """A flat ``{key: tensor | BytesIO}`` dict for plain DCP, as Megatron-Core builds it.

    Use with :class:`~.planners.MCoreSavePlanner` / :class:`~.planners.MCoreLoadPlanner`. A key's ShardedTensors
    become a :class:`~.checkpointable.CheckpointableShardedTensor` (several on this rank:
    a :class:`~.checkpointable.LocalShardsContainer`), any grid or none; those with
    prepended axes or a flattened range on a regular grid (Megatron-Core < 0.14's kinds)
    a ``torch.distributed`` ShardedTensor. Saving (``is_loading=False``) keeps main
    replicas only and serializes ShardedObjects under their unique keys (the torch_dist
    object layout). Loading allocates missing tensors on ``init_device`` (zeros with
    ``allow_shape_mismatch``, whose tensors are zeroed, as in Megatron-Core); DCP then fills
    the request's own tensors, and the load planner puts each object under its unique key.
    Results are keyed by the ShardedTensor's key, or, in Megatron-Core's form of the input
    (``{name: [ShardedTensors of one key]}`` for every entry), by ``name``.
    """
    names = _megatron_form_names(state_dict)
    tensors: Dict[str, List[ShardedTensor]] = {}
    result: Dict[str, Any] = {}
    for sh in nested_values(state_dict):
        if isinstance(sh, ShardedTensor):
            if is_loading:
                sh.init_data(init_device, torch.zeros if sh.allow_shape_mismatch else torch.empty)
                sh.data = sh.data.detach()
                if sh.allow_shape_mismatch:
                    sh.data.zero_()
            elif not is_main_replica(sh.replica_id):
                continue
            tensors.setdefault(sh.key, []).append(sh)
        elif isinstance(sh, ShardedObject):
            if is_loading:
                result[sh.unique_key] = io.BytesIO()
            elif is_main_replica(sh.replica_id):
                result[sh.unique_key] = io.BytesIO(object_payload(sh))
    for key, group in tensors.items():
        first = group[0]
        name = names.get(key, key)
        if (first.prepend_axis_num or first.flattened_range is not None) and first.has_regular_grid:
            result[name] = sharded_tensor_to_torch_sharded_tensor(group)
        elif first.flattened_range is not None:
            raise CheckpointingException(f"ShardedTensor {key!r} is flattened on an irregular grid: plain DCP "
                                         "cannot take it (save it with dist_checkpointing.save)")
        else:
            shards = [CheckpointableShardedTensor.from_sh_ten(sh) for sh in group]
            result[name] = shards[0] if len(shards) == 1 else LocalShardsContainer(shards)
    return result


def _megatron_form_names(state_dict: Any) -> Dict[str, str]:
    """``{ShardedTensor key: name}`` when ``state_dict`` is ``{name: [ShardedTensors of one
    key]}`` throughout (how Megatron-Core calls :func:`mcore_to_pyt_state_dict`), else ``{}``."""
    names: Dict[str, str] = {}
    if not isinstance(state_dict, dict):
        return names
    for name, value in state_dict.items():
        if not (isinstance(value, list) and value and all(isinstance(sh, ShardedTensor) for sh in value)
                and len({sh.key for sh in value}) == 1):
            return {}
        names[value[0].key] = name
    return names
