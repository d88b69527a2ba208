"""Save/load strategies. The root holds Megatron-Core's module names (``async_utils``, ``base``,
``common``, ``filesystem_async``, ``fully_parallel``, ``nvrx``, ``resharding``, ``torch``,
``zarr``) and the contracts (``registry``, ``async_strategies``, ``common_object``); the
``torch_dist`` format lives in :mod:`.torch_dist`, plain-DCP interop in :mod:`.dcp` (where
Megatron-Core's ``state_dict_saver``, ``cached_metadata_filesystem_reader`` and
``checkpointable`` are), Hugging Face safetensors directories in :mod:`.safetensors`
(``SafetensorsLoadShardedStrategy``, ``SafetensorsSaveShardedStrategy``), the process services in
:mod:`dist_checkpointing.runtime`, every unpickler in :mod:`dist_checkpointing.pickling`. The
registry resolves the built-in strategies on their first lookup.

The names below are imported on first use (PEP 562): the persistent writer imports modules
of this package (:mod:`.records`) without torch."""

from ..compat.lazy import lazy_exports

_EXPORTS = {
    **{name: ".base" for name in (
        "AsyncSaveShardedStrategy", "LoadCommonStrategy", "LoadShardedStrategy", "LoadStrategyBase",
        "SaveCommonStrategy", "SaveShardedStrategy", "SaveStrategyBase", "StrategyAction",
        "get_default_strategy", "register_default_strategy")},
    "CommonStateObjectSaveStrategy": ".common_object",
    "SafetensorsLoadShardedStrategy": ".safetensors.load",
    "SafetensorsSaveShardedStrategy": ".safetensors.save",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
