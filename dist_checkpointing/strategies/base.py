"""Strategy base classes and the registry of default strategies.

A strategy is selected by ``(action, backend, version)``. Built-in strategies register
themselves lazily on the first lookup, so users never have to import anything to make
``torch_dist`` available; user strategies are added with :func:`register_default_strategy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import Any, Callable, DefaultDict, Dict, Tuple, Union

from ..core import CheckpointingException
from ..mapping import ShardedStateDict, StateDict


class StrategyAction(Enum):
    """What a strategy does."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


default_strategies: DefaultDict[str, Dict[Tuple[str, int], Any]] = defaultdict(dict)
_builtins_registered = False


def _register_builtins() -> None:
    global _builtins_registered
    if _builtins_registered:
        return
    _builtins_registered = True
    from .common import register_default_common_strategies
    from .torch import register_default_torch_strategies

    register_default_common_strategies()
    register_default_torch_strategies()


def register_default_strategy(
    action: StrategyAction, backend: str, version: int, strategy: Any
) -> None:
    """Make ``strategy`` the default for ``(action, backend, version)``."""
    _register_builtins()
    default_strategies[action.value][(backend, int(version))] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Any:
    """The strategy registered for ``(action, backend, version)``."""
    _register_builtins()
    try:
        return default_strategies[action.value][(backend, int(version))]
    except (KeyError, TypeError, ValueError) as e:
        known = sorted(default_strategies[action.value])
        raise CheckpointingException(
            f"No {action.value} strategy registered for backend {backend!r} version "
            f"{version!r} (registered: {known})"
        ) from e


class LoadStrategyBase(ABC):
    """Base of load strategies."""

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise if checkpoints of ``loaded_backend`` cannot be read."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise if checkpoints of ``loaded_version`` cannot be read."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy reads ShardedObjects itself."""
        return False


class SaveStrategyBase(ABC):
    """Base of save strategies; ``backend`` and ``version`` go into ``metadata.json``."""

    def __init__(self, backend: str, version: int):
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy writes ShardedObjects itself."""
        return False

    def __str__(self) -> str:
        return f"{self.__class__.__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common (non-sharded) state."""

    @abstractmethod
    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        """Return the common state dict stored in ``checkpoint_dir``."""


class LoadShardedStrategy(LoadStrategyBase):
    """Loads sharded tensors (and objects, if it can handle them)."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> StateDict:
        """Load the request; return the same structure with loaded values."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Data-less ShardedTensors (whole global tensors) for every tensor in the checkpoint."""

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Metadata of tensors and (if supported) objects; objects keyed by unique key."""
        if self.can_handle_sharded_objects:
            raise NotImplementedError
        return self.load_tensors_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
        """Drop the tensors whose key starts with ``key_prefix`` from the checkpoint."""
        raise CheckpointingException(f"{type(self).__name__} cannot remove sharded tensors")


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common (non-sharded) state."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]) -> None:
        """Write the common state (called on the coordinator rank only)."""

    def stage_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]) -> Callable[[], None]:
        """For an async save: capture the common state as it is now and return a function
        that writes it later (on the async queue's thread). The default writes it now."""
        self.save_common(common_state_dict, checkpoint_dir)
        return _written_already

    def add_to_sharded(self, sharded_state_dict: ShardedStateDict, common_state_dict: StateDict, rank: int) -> None:
        """Called on every rank before the save is validated: a strategy that stores the
        common state inside the sharded state adds it to ``sharded_state_dict`` here. The
        default stores it separately (:meth:`save_common`) and adds nothing."""


def _written_already() -> None:
    """The writer :meth:`SaveCommonStrategy.stage_common` returns when it wrote at once."""


class SaveShardedStrategy(SaveStrategyBase):
    """Saves sharded tensors (and objects, if it can handle them). Called on every rank."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        """Write this rank's main replicas; collective over the default process group."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded save strategy that can return the writing as an async request."""

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> Any:
        """Stage the state and return an ``AsyncRequest`` that writes it."""
