"""Megatron-Core 0.15's ``strategies.checkpointable``: ShardedTensors as tensors that plain
``torch.distributed.checkpoint`` saves and loads.

:class:`CheckpointableShardedTensor` wraps one ShardedTensor, :class:`LocalShardsContainer`
several of one key held by a rank (DCP wants one tensor per key and rank). Both implement
PyTorch's ``_Checkpointable`` protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), which DCP's default planners call instead of inspecting the
tensor: a chunk is the ShardedTensor's ``global_offset`` / ``local_shape`` in its
``global_shape``. They stand for data, they are not tensors to compute with (every
operation raises). This library's own ``torch_dist`` strategy does not need them.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ...core import CheckpointingException
from ...tensors.sharded import ShardedTensor


def _chunk(sh_ten: ShardedTensor) -> ChunkStorageMetadata:
    """The DCP chunk of a (non-flattened, prepended-axis-free) ShardedTensor, checked
    against its data."""
    if sh_ten.data is None or tuple(sh_ten.data.shape) != tuple(sh_ten.local_shape):
        got = None if sh_ten.data is None else tuple(sh_ten.data.shape)
        raise CheckpointingException(
            f"ShardedTensor {sh_ten.key!r}: data of shape {got} is not the chunk of shape "
            f"{tuple(sh_ten.local_shape)} it describes"
        )
    return ChunkStorageMetadata(offsets=torch.Size(sh_ten.global_offset), sizes=torch.Size(sh_ten.local_shape))


class CheckpointableShardedTensor(torch.Tensor):
    """One ShardedTensor as a DCP-checkpointable tensor of its global shape."""

    _data: torch.Tensor
    _sh_ten: ShardedTensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(sh_ten.global_shape))

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor):
        self._data = data
        self._sh_ten = sh_ten

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        """Wrap ``sh_ten`` (its ``data`` is what DCP writes and fills)."""
        if not isinstance(sh_ten, ShardedTensor):
            raise CheckpointingException(f"CheckpointableShardedTensor wraps a ShardedTensor, not {type(sh_ten).__name__}")
        return cls(sh_ten.data, sh_ten)

    def __create_write_items__(self, fqn: str, sh_ten: "CheckpointableShardedTensor",
                               index: Optional[int] = None) -> List[WriteItem]:
        """The one write item of the chunk (``index``: its position in a container)."""
        inner = sh_ten._sh_ten
        chunk = _chunk(inner)
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets, index), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk,
                                                      properties=TensorProperties.create_from_tensor(inner.data),
                                                      size=torch.Size(inner.global_shape)))]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        """The chunk this rank holds (what a load fills)."""
        return [_chunk(self._sh_ten)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The chunk's data (there is one)."""
        return self._sh_ten.data

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{cls.__name__} stands for checkpoint data; it supports no tensor operation ({func})")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._sh_ten!r})"


class LocalShardsContainer(torch.Tensor):
    """Several :class:`CheckpointableShardedTensor` of one key held by this rank, as one
    DCP-checkpointable tensor."""

    _local_shards: List[CheckpointableShardedTensor]

    @staticmethod
    def __new__(cls, local_shards: List[torch.Tensor]) -> "LocalShardsContainer":
        if not local_shards:
            raise CheckpointingException("LocalShardsContainer needs at least one local shard")
        return torch.Tensor._make_wrapper_subclass(cls, local_shards[0].size())

    def __init__(self, local_shards: List[torch.Tensor]):
        wrong = [type(s).__name__ for s in local_shards if not isinstance(s, CheckpointableShardedTensor)]
        if wrong:
            raise CheckpointingException(f"LocalShardsContainer holds CheckpointableShardedTensors, not {wrong}")
        self._local_shards = list(local_shards)

    def __create_write_items__(self, fqn: str, local_shards_cont: "LocalShardsContainer") -> List[WriteItem]:
        """Every shard's write item, each with its position as the index hint."""
        return [item for i, shard in enumerate(local_shards_cont._local_shards)
                for item in shard.__create_write_items__(fqn, shard, index=i)]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [chunk for shard in self._local_shards for chunk in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The data of the shard at ``index.offset`` (the ``index.index`` hint tried first)."""
        if index.offset is None:
            raise CheckpointingException(f"LocalShardsContainer of {index.fqn!r}: a shard is looked up by its offset")
        shards = self._local_shards
        hint = index.index
        if hint is not None and 0 <= hint < len(shards) and torch.Size(shards[hint]._sh_ten.global_offset) == index.offset:
            return shards[hint]._sh_ten.data
        for shard in shards:
            if torch.Size(shard._sh_ten.global_offset) == index.offset:
                return shard._sh_ten.data
        raise CheckpointingException(f"LocalShardsContainer of {index.fqn!r} holds no shard at offset {tuple(index.offset)}")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{cls.__name__} stands for checkpoint data; it supports no tensor operation ({func})")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._local_shards!r})"
