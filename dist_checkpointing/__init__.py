"""dist_checkpointing: save and load the sharded training state of parallel models.

A drop-in for Megatron-Core's ``megatron.core.dist_checkpointing``: change the import
prefix and model code written for it works unchanged.
"""

# Import torch's distributed checkpointing now rather than on the first save/load: importing
# it after init_process_group can make the process abort at exit (torch 2.13, gloo).
import torch.distributed.checkpoint  # noqa: F401

from .compat import moved as _moved

_moved.install()  # module paths of earlier versions (e.g. dist_checkpointing.convert) still import

from .core import CheckpointingConfig, CheckpointingException
from .manager import CheckpointManager
from .mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from .serialization import (
    check_is_distributed_checkpoint,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from .strategies.safe_globals import register_safe_globals
from .validation import StrictHandling

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager", "CheckpointingConfig", "CheckpointingException", "LocalNonpersistentObject", "ShardedObject",
    "ShardedStateDict", "ShardedTensor", "ShardedTensorFactory", "StateDict", "StrictHandling",
    "apply_factories", "apply_factory_merges", "check_is_distributed_checkpoint", "is_main_replica",
    "load", "load_common_state_dict", "load_content_metadata", "load_plain_tensors",
    "load_sharded_metadata", "load_tensors_metadata", "register_safe_globals", "remove_sharded_tensors",
    "save",
]
