"""Megatron-Core's module name for the ``torch_dist`` strategy: a re-export of
:mod:`dist_checkpointing.strategies.torch_dist`, where the code lives (one module per
concept), and of the plain-DCP bridges and planners of :mod:`.dcp`, so model code written
for ``megatron.core.dist_checkpointing.strategies.torch``
ports by changing the import prefix. ``get_async_strategy`` (Megatron-Core >= 0.16) lives in
:mod:`.async_strategies`."""

from .async_strategies import get_async_strategy
from .dcp.planners import MCoreLoadPlanner, MCoreSavePlanner
from .dcp.state_dict import mcore_to_pyt_state_dict, sharded_tensor_to_torch_sharded_tensor
from .torch_dist import (
    COMMON_STATE_OBJECT_KEY,
    METADATA_FNAME,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    data_file_path,
    get_reformulation_metadata,
    original_global_shape,
    read_metadata,
    register_default_torch_strategies,
)

__all__ = [
    "COMMON_STATE_OBJECT_KEY", "METADATA_FNAME", "MCoreLoadPlanner", "MCoreSavePlanner", "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy", "data_file_path", "get_async_strategy", "get_reformulation_metadata", "mcore_to_pyt_state_dict",
    "original_global_shape", "read_metadata",
    "register_default_torch_strategies", "sharded_tensor_to_torch_sharded_tensor",
]
