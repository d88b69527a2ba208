"""Plain PyTorch DCP interop: ``torch.distributed.checkpoint`` driven by the user or by
Megatron-LM (``--ckpt-format torch_dcp`` / ``fsdp_dtensor``), on this library's sharded state
and machinery. This library's own ``torch_dist`` format (:mod:`..torch_dist`) needs none of
it. One concept per module:

* :mod:`.async_writer`: ``FileSystemWriterAsync``, the DCP storage writer of async saves (its
  snapshot and background write);
* :mod:`.async_save`: ``save_state_dict_async_plan`` / ``save_state_dict_async_finalize``, the
  two collective steps around that write;
* :mod:`.cached_reader`: ``CachedMetadataFileSystemReader``, a DCP reader whose ``.metadata``
  is read (checked) once and shared;
* :mod:`.checkpointable`: ShardedTensors as tensors DCP's planners save and load;
* :mod:`.state_dict`: sharded state as a flat DCP state dict (torch ShardedTensor bridges);
* :mod:`.planners`: ``MCoreSavePlanner`` / ``MCoreLoadPlanner``.

Megatron-Core's module names (``strategies.state_dict_saver``,
``strategies.cached_metadata_filesystem_reader``, ``strategies.checkpointable``) are these
modules themselves (:mod:`dist_checkpointing.compat.moved`); ``strategies.filesystem_async``
and ``strategies.torch`` re-export from here. Everything below is imported on first use:
importing the package imports no DCP."""

from ...compat.lazy import lazy_exports

_EXPORTS = {
    "FileSystemWriterAsync": ".async_writer",
    "save_state_dict_async_plan": ".async_save", "save_state_dict_async_finalize": ".async_save",
    "CachedMetadataFileSystemReader": ".cached_reader",
    "CheckpointableShardedTensor": ".checkpointable", "LocalShardsContainer": ".checkpointable",
    "mcore_to_pyt_state_dict": ".state_dict", "sharded_tensor_to_torch_sharded_tensor": ".state_dict",
    "MCoreLoadPlanner": ".planners", "MCoreSavePlanner": ".planners",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
