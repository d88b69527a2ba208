"""The registry of default strategies, selected by ``(action, backend, version)``.

The built-in strategies are listed here by module path and resolved (imported and
instantiated) on their first lookup, so ``torch_dist`` is available without importing
anything beyond ``dist_checkpointing`` and this module imports no strategy. User
strategies are added with :func:`register_default_strategy` (and win over a built-in of
the same key).

The files the built-in formats write are declared here too (by module path, resolved
when needed) and registered with :func:`..core.register_checkpoint_files`: a directory
holding such files but no ``metadata.json`` is reported as an incomplete checkpoint.

Owns: ``StrategyAction``, the registry (``register_default_strategy``,
``get_default_strategy``, ``default_strategies``): the built-in strategies listed by module
path and created on their first lookup; the built-in formats' file-name checks, registered
with ``core``.
"""

from __future__ import annotations

import importlib
import threading
from collections import defaultdict
from enum import Enum
from typing import Any, DefaultDict, Dict, List, Optional, Tuple

from ..core import CheckpointingConfig, CheckpointingException, register_checkpoint_files, register_implicit_checkpoint


class StrategyAction(Enum):
    """What a strategy does."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


#: ``{action.value: {(backend, version): strategy}}``: the registered (and resolved built-in) strategies
default_strategies: DefaultDict[str, Dict[Tuple[str, int], Any]] = defaultdict(dict)

_PACKAGE = __name__.rsplit(".", 1)[0]
# (action, backend, version) -> "module:class" of a built-in strategy, instantiated without arguments
_BUILTINS: Dict[Tuple[StrategyAction, str, int], str] = {
    (StrategyAction.LOAD_SHARDED, "torch_dist", 1): f"{_PACKAGE}.torch_dist.load:TorchDistLoadShardedStrategy",
    (StrategyAction.LOAD_SHARDED, "zarr", 1): f"{_PACKAGE}.zarr:ZarrLoadShardedStrategy",
    (StrategyAction.LOAD_SHARDED, "safetensors", 1): f"{_PACKAGE}.safetensors.load:SafetensorsLoadShardedStrategy",
    (StrategyAction.SAVE_SHARDED, "safetensors", 1): f"{_PACKAGE}.safetensors.save:SafetensorsSaveShardedStrategy",
    (StrategyAction.SAVE_SHARDED, "torch_dist", 1): f"{_PACKAGE}.torch_dist.save:TorchDistSaveShardedStrategy",
    (StrategyAction.LOAD_COMMON, "torch", 1): f"{_PACKAGE}.common:TorchCommonLoadStrategy",
    (StrategyAction.SAVE_COMMON, "torch", 1): f"{_PACKAGE}.common:TorchCommonSaveStrategy",
}
# "module:function" telling whether a file name is one the built-in formats write
_BUILTIN_FILE_CHECKS = (f"{_PACKAGE}.torch_dist.format:is_checkpoint_file", f"{_PACKAGE}.common:is_checkpoint_file")
_lock = threading.Lock()


def _resolve(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def register_default_strategy(action: StrategyAction, backend: str, version: int, strategy: Any) -> None:
    """Make ``strategy`` the default for ``(action, backend, version)``."""
    default_strategies[action.value][(backend, int(version))] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Any:
    """The strategy registered for ``(action, backend, version)`` (a built-in one is
    created on its first lookup)."""
    try:
        key = (backend, int(version))
        registered = default_strategies[action.value]
        if key not in registered and (action, *key) in _BUILTINS:
            with _lock:
                if key not in registered:
                    registered[key] = _resolve(_BUILTINS[(action, *key)])()
        return registered[key]
    except (KeyError, TypeError, ValueError) as e:
        known = sorted(set(default_strategies[action.value]) | {k[1:] for k in _BUILTINS if k[0] == action})
        raise CheckpointingException(
            f"No {action.value} strategy registered for backend {backend!r} version "
            f"{version!r} (registered: {known})"
        ) from e


def is_builtin_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is a file that a built-in format writes into a checkpoint directory."""
    return any(_resolve(check)(name) for check in _BUILTIN_FILE_CHECKS)


def builtin_implicit_config(names: List[str]) -> Optional[CheckpointingConfig]:
    """The config of a directory without ``metadata.json`` that a built-in strategy reads
    anyway: a Hugging Face safetensors checkpoint (:func:`.safetensors.source.implicit_config`)."""
    return _resolve(f"{_PACKAGE}.safetensors.source:implicit_config")(names)


register_checkpoint_files(is_builtin_checkpoint_file)
register_implicit_checkpoint(builtin_implicit_config)
