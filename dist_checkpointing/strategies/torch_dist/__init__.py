"""The ``torch_dist`` strategy: ShardedTensors and ShardedObjects in PyTorch DCP's format.

On disk (see ``docs/format.md``): every main-replica chunk is a ``torch.save`` blob in a
``__{rank}_{n}.distcp`` file, ShardedObjects are ``torch.save([data])`` blobs under their
unique key, and the DCP ``.metadata`` maps every key to its global shape, its chunks and
their byte ranges. The format is the one Megatron-Core and ``torch.distributed.checkpoint``
read and write; the machinery is this library's own. One concept per module:

* :mod:`.format`: file names and fixed values;
* :mod:`.save_plan`: the items a rank writes and their split into files;
* :mod:`.save`: the save strategy (sync, async from host copies, async from a fork);
* :mod:`.metadata`: building, writing and reading ``.metadata``;
* :mod:`.load_plan`: which stored bytes fill which requested tensor (resharding, flattened keys);
* :mod:`.reader`: the checksummed reads;
* :mod:`.load`: the load strategy;
* :mod:`.maintenance`: ``remove_sharded_tensors``;
* the format's bytes: :mod:`.writing` (a rank's data files) and :mod:`.records` (where every
  byte of a data file is written; no torch: the persistent writer runs it),
  :mod:`.blob_template` (a tensor's ``torch.save`` blob around its bytes), :mod:`.torch_blob`
  (reading a blob's bytes in place), :mod:`.metadata_checks` (a ``.metadata`` checked field by field),
  :mod:`.coverage` (which requested elements the stored chunks cover exactly once).

``dist_checkpointing.strategies.torch`` re-exports the Megatron-Core names. The bridges and
planners for plain ``torch.distributed.checkpoint`` live in :mod:`..dcp` (still exported
here, where earlier versions had them).
"""

from ...compat.lazy import lazy_exports
from ..registry import StrategyAction, register_default_strategy

# public name -> its module, imported on first use (reading metadata needs neither the save
# strategy nor the DCP bridges, which import all of torch.distributed.checkpoint)
_EXPORTS = {
    "MCoreLoadPlanner": "..dcp.planners", "MCoreSavePlanner": "..dcp.planners",  # (their earlier home)
    "mcore_to_pyt_state_dict": "..dcp.state_dict", "sharded_tensor_to_torch_sharded_tensor": "..dcp.state_dict",
    **{name: ".format" for name in ("COMMON_STATE_OBJECT_KEY", "METADATA_FNAME", "data_file_path",
                                    "original_global_shape")},
    "TorchDistLoadShardedStrategy": ".load", "get_reformulation_metadata": ".load",
    "read_metadata": ".metadata", "TorchDistSaveShardedStrategy": ".save",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


def register_default_torch_strategies() -> None:
    """Register the torch_dist strategies. Not needed: the registry resolves the built-in
    strategies on their first lookup (kept for Megatron-Core compatibility)."""
    from .load import TorchDistLoadShardedStrategy
    from .save import TorchDistSaveShardedStrategy

    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy())
    register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy())


__all__ = [
    "COMMON_STATE_OBJECT_KEY", "METADATA_FNAME", "MCoreLoadPlanner", "MCoreSavePlanner", "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy", "data_file_path", "get_reformulation_metadata", "mcore_to_pyt_state_dict",
    "original_global_shape", "read_metadata",
    "register_default_torch_strategies", "sharded_tensor_to_torch_sharded_tensor",
]
