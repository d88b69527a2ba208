"""The offline readers (``load_common_state_dict``, ``load_tensors_metadata``,
``load_sharded_metadata``, ``load_plain_tensors``, ``load_content_metadata``) and
``remove_sharded_tensors``: one process, no process group; importable from
:mod:`.serialization` too. Each takes a local directory, a URL (with optional
``storage_options`` for its client) or a :class:`~.storage.Storage`."""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple, Union

from .core import CheckpointingConfig, CheckpointingException, checkpoint_location, load_config
from .integrity.checksums import SIDECAR_SUFFIX
from .integrity.manifest import refresh_manifest
from .mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from .storage import Storage, StorageOptions
from .strategies.base import LoadCommonStrategy, LoadShardedStrategy, StrategyAction, get_default_strategy
from .strategies.torch_dist.format import INDEX_FNAME, METADATA_FNAME

__all__ = [
    "load_common_state_dict", "load_tensors_metadata", "load_sharded_metadata", "load_plain_tensors",
    "load_content_metadata", "remove_sharded_tensors", "get_default_load_sharded_strategy",
]

CONTENT_METADATA_KEY = "content_metadata"
CkptDir = Union[str, os.PathLike, Storage]
CkptShardedMetadata = Dict[str, Union[ShardedTensor, ShardedObject]]


def sharded_load_strategy(config: CheckpointingConfig,
                          strategy: Union[None, LoadShardedStrategy, Tuple[str, int]]) -> LoadShardedStrategy:
    """The sharded load strategy for a checkpoint's ``config``: the registered one, or
    ``strategy`` (an instance or ``(backend, version)``) checked to be compatible. A
    ``torch_dist`` strategy given for a ``zarr`` or ``safetensors`` checkpoint reads it with
    that backend's strategy and the same options (:func:`~.strategies.zarr.zarr_strategy_like`,
    :func:`~.strategies.safetensors.load.safetensors_strategy_like`)."""
    if strategy is None:
        return get_default_strategy(StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version)
    if isinstance(strategy, tuple):  # (backend, version), as Megatron-Core accepts
        strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, *strategy)
    if config.sharded_backend == "zarr":  # a torch_dist strategy given for Megatron-Core's earlier format
        from .strategies.zarr import zarr_strategy_like

        strategy = zarr_strategy_like(strategy)
    elif config.sharded_backend == "safetensors":  # ... or for a Hugging Face directory
        from .strategies.safetensors.load import safetensors_strategy_like

        strategy = safetensors_strategy_like(strategy)
    strategy.check_backend_compatibility(config.sharded_backend)
    strategy.check_version_compatibility(config.sharded_backend_version)
    return strategy


def load_common(config: CheckpointingConfig, checkpoint_dir: CkptDir, common_strategy: Optional[LoadCommonStrategy],
                sharded_strategy: LoadShardedStrategy) -> StateDict:
    """The common state, through the common strategy of ``config`` (or ``common_strategy``)."""
    if config.common_backend is None:
        # Megatron-Core >= 0.19: the common state is the ShardedObject `common_state`.
        return sharded_strategy.load_common(checkpoint_dir)
    if common_strategy is None:
        common_strategy = get_default_strategy(StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version)
    else:
        common_strategy.check_backend_compatibility(config.common_backend)
        common_strategy.check_version_compatibility(config.common_backend_version)
    return common_strategy.load_common(checkpoint_dir)


def get_default_load_sharded_strategy(checkpoint_dir: Optional[CkptDir] = None) -> LoadShardedStrategy:
    """The sharded load strategy that matches the checkpoint's ``metadata.json``; without a
    checkpoint (as Megatron-Core >= 0.16 allows), the ``torch_dist`` one."""
    if checkpoint_dir is None:
        return get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1)
    return sharded_load_strategy(load_config(checkpoint_dir), None)


def load_common_state_dict(checkpoint_dir: CkptDir, storage_options: StorageOptions = None) -> StateDict:
    """The common (non-sharded) state of a checkpoint."""
    checkpoint_dir = checkpoint_location(checkpoint_dir, storage_options)
    config = load_config(checkpoint_dir)
    return load_common(config, checkpoint_dir, None, sharded_load_strategy(config, None))


def load_tensors_metadata(checkpoint_dir: CkptDir, sharded_strategy: Optional[LoadShardedStrategy] = None,
                          storage_options: StorageOptions = None) -> ShardedStateDict:
    """Data-less ShardedTensors describing every global tensor of the checkpoint."""
    checkpoint_dir = checkpoint_location(checkpoint_dir, storage_options)
    config = load_config(checkpoint_dir)
    return sharded_load_strategy(config, sharded_strategy).load_tensors_metadata(checkpoint_dir)


def load_sharded_metadata(checkpoint_dir: CkptDir, sharded_strategy: Optional[LoadShardedStrategy] = None,
                          common_strategy: Optional[LoadCommonStrategy] = None,
                          storage_options: StorageOptions = None) -> CkptShardedMetadata:
    """Data-less ShardedTensors and ShardedObjects (keyed by unique key) of the checkpoint.

    ``common_strategy`` is accepted as in Megatron-Core, where it lists the ShardedObjects a
    sharded strategy cannot; every sharded strategy here lists them, so it is not used."""
    checkpoint_dir = checkpoint_location(checkpoint_dir, storage_options)
    config = load_config(checkpoint_dir)
    return sharded_load_strategy(config, sharded_strategy).load_sharded_metadata(checkpoint_dir)


def load_plain_tensors(checkpoint_dir: CkptDir, storage_options: StorageOptions = None, *,
                       original_shape: bool = False) -> StateDict:
    """Every global tensor of the checkpoint, whole, as ``{key: tensor}`` (one process).

    A key stored flattened (distributed-optimizer slices, ``flattened_range``) comes back
    1-D, as Megatron-Core 0.15 returns it; ``original_shape=True`` returns it in its
    original N-D global shape instead (the same values: the 1-D tensor is a view of it).
    """
    checkpoint_dir = checkpoint_location(checkpoint_dir, storage_options)
    strategy = sharded_load_strategy(load_config(checkpoint_dir), None)
    request = strategy.load_tensors_metadata(checkpoint_dir)
    loaded = strategy.load_local(request, checkpoint_dir)  # flattened keys: 1-D (their requests are)
    if original_shape:
        for key, sh in request.items():
            if isinstance(sh, ShardedTensor) and sh.flattened_range is not None:
                loaded[key] = loaded[key].reshape(sh.global_shape)
    return loaded


def load_content_metadata(checkpoint_dir: Optional[CkptDir] = None, *,
                          preloaded_state_dict: Optional[StateDict] = None,
                          storage_options: StorageOptions = None) -> Optional[dict]:
    """The ``content_metadata`` given to ``save`` (``None`` if there was none)."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise CheckpointingException("load_content_metadata needs checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir, storage_options)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


def remove_sharded_tensors(checkpoint_dir: CkptDir, key_prefix: str, storage_options: StorageOptions = None) -> None:
    """Remove the tensors whose key starts with ``key_prefix`` from a checkpoint (one process)."""
    checkpoint_dir = checkpoint_location(checkpoint_dir, storage_options)
    config = load_config(checkpoint_dir)
    sharded_load_strategy(config, None).remove_sharded_tensors(checkpoint_dir, key_prefix)
    # the strategy rewrote its metadata and deleted data files: an integrity.json follows
    refresh_manifest(checkpoint_dir, [name + suffix for name in (METADATA_FNAME, INDEX_FNAME)
                                      for suffix in ("", SIDECAR_SUFFIX)])
