"""Megatron-Core's module name for the ``torch_dist`` strategy: a re-export of
:mod:`dist_checkpointing.strategies.torch_dist`, where the code lives (one module per
concept), so model code written for ``megatron.core.dist_checkpointing.strategies.torch``
ports by changing the import prefix."""

from .torch_dist import (
    COMMON_STATE_OBJECT_KEY,
    METADATA_FNAME,
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    data_file_path,
    get_reformulation_metadata,
    mcore_to_pyt_state_dict,
    original_global_shape,
    read_metadata,
    register_default_torch_strategies,
    sharded_tensor_to_torch_sharded_tensor,
)

__all__ = [
    "COMMON_STATE_OBJECT_KEY", "METADATA_FNAME", "MCoreLoadPlanner", "MCoreSavePlanner", "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy", "data_file_path", "get_reformulation_metadata", "mcore_to_pyt_state_dict",
    "original_global_shape", "read_metadata",
    "register_default_torch_strategies", "sharded_tensor_to_torch_sharded_tensor",
]
