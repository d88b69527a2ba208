"""Save/load strategies. The registry resolves the built-in ones on their first lookup.

The names below are imported on first use (PEP 562): the persistent writer imports modules
of this package (:mod:`.records`) without torch."""

from ..compat.lazy import lazy_exports

_EXPORTS = {
    **{name: ".base" for name in (
        "AsyncSaveShardedStrategy", "LoadCommonStrategy", "LoadShardedStrategy", "LoadStrategyBase",
        "SaveCommonStrategy", "SaveShardedStrategy", "SaveStrategyBase", "StrategyAction",
        "get_default_strategy", "register_default_strategy")},
    "CommonStateObjectSaveStrategy": ".common_object",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
