"""Save/load strategies. The registry resolves the built-in ones on their first lookup."""

from .base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    LoadStrategyBase,
    SaveCommonStrategy,
    SaveShardedStrategy,
    SaveStrategyBase,
    StrategyAction,
    get_default_strategy,
    register_default_strategy,
)
from .common_object import CommonStateObjectSaveStrategy

__all__ = [
    "AsyncSaveShardedStrategy", "CommonStateObjectSaveStrategy", "LoadCommonStrategy", "LoadShardedStrategy", "LoadStrategyBase",
    "SaveCommonStrategy", "SaveShardedStrategy", "SaveStrategyBase", "StrategyAction",
    "get_default_strategy", "register_default_strategy",
]
