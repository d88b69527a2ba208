"""Strategy base classes: the members ``serialization`` uses on strategies are declared here.

The registry (``StrategyAction``, ``register_default_strategy``, ``get_default_strategy``,
``default_strategies``) lives in :mod:`.registry`; its names are re-exported here, where
Megatron-Core has them.

Owns: the strategy base classes, declaring every member ``serialization`` uses:
compatibility as data (``supported_backends``, ``supported_versions``, tested by
``check_backend_compatibility`` / ``check_version_compatibility``), ``last_written_bytes``,
``last_timings``, ``load_local``, ``load_common``, ``offline_reader``, ``release_scratch``,
``stored_items`` (the catalog of stored items the tools read, backend-neutral:
``StoredItems`` with ``StoredTensor``, ``StoredChunk``, ``StoredRange``: each chunk's
offsets and sizes, the file, byte range and recorded checksum it is stored at, every
object's, the size of every file named; ``range_problem``); ``CopyableStrategy`` (every
strategy's base: deep copies and pickles carry settings and caches, rebuild runtime
resources named in ``_runtime_attrs``, share process groups); re-exports the registry's
names.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch

from ..tensors.bytes_view import nbytes
from ..core import CheckpointingException
from ..mapping import ShardedStateDict, StateDict
from .registry import StrategyAction, default_strategies, get_default_strategy, register_default_strategy

__all__ = [
    "AsyncSaveShardedStrategy", "CopyableStrategy", "LoadCommonStrategy", "LoadShardedStrategy", "LoadStrategyBase", "SaveCommonStrategy",
    "SaveShardedStrategy", "SaveStrategyBase", "StoredChunk", "StoredItems", "StoredRange", "StoredTensor",
    "StrategyAction", "default_strategies", "get_default_strategy", "register_default_strategy",
]


@dataclass(frozen=True)
class StoredRange:
    """Where a stored item's bytes are: a byte range of one file of the checkpoint."""

    file: str  # file name inside the checkpoint
    offset: int
    length: int
    checksum: Optional[int] = None  # the checksum recorded for the item (None: none recorded)


@dataclass(frozen=True)
class StoredChunk:
    """One stored chunk of a tensor, in the coordinates of ``StoredTensor.stored_shape``."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    location: Optional[StoredRange]  # None: the checkpoint records no bytes for the chunk


@dataclass
class StoredTensor:
    """One global tensor as a checkpoint stores it."""

    key: str
    shape: Tuple[int, ...]  # the original global shape (also for flattened keys)
    dtype: torch.dtype
    chunks: List[StoredChunk]  # empty: the strategy does not say
    nbytes: int  # bytes of the global tensor's values
    flattened: bool  # stored N-D reformulated (distributed-optimizer slices)
    stored_shape: Optional[Tuple[int, ...]] = None  # the shape the chunks tile (None: ``shape``)


@dataclass
class StoredItems:
    """What a checkpoint stores (:meth:`LoadShardedStrategy.stored_items`), from its
    metadata alone: every tensor with its chunks and every object, and, when ``located``,
    the file and byte range each is stored at and the size of each file named."""

    tensors: List[StoredTensor] = field(default_factory=list)  # sorted by key
    objects: Dict[str, int] = field(default_factory=dict)  # ShardedObject unique key -> stored bytes
    located: bool = False  # chunks and objects name their stored bytes (False: the strategy does not say)
    object_locations: Dict[str, StoredRange] = field(default_factory=dict)  # unique key -> its stored bytes
    files: Dict[str, Optional[int]] = field(default_factory=dict)  # file named above -> size (None: missing)
    checksums_recorded: bool = False  # the checkpoint records item checksums

    def range_problem(self, what: str, location: StoredRange) -> Optional[str]:
        """Why ``location`` (of the item described as ``what``) does not lie inside its
        file (``None`` when it does)."""
        size = self.files.get(location.file)
        if size is None:
            return f"{what}: data file {location.file} is missing"
        if location.offset < 0 or location.length < 0 or location.offset + location.length > size:
            return (f"{what}: {location.file} has {size} bytes, the item needs bytes "
                    f"{location.offset}..{location.offset + location.length}")
        return None


class CopyableStrategy:
    """Deep copies and pickles of a strategy carry its settings and caches (as
    Megatron-Core's do), not its runtime resources: the attributes named in
    ``_runtime_attrs`` (locks, reusable buffers) are left out and rebuilt fresh by
    :meth:`_new_runtime`. A deep copy shares the process groups it refers to (they
    cannot be copied); pickling a strategy that holds one fails, as in Megatron-Core."""

    _runtime_attrs: Tuple[str, ...] = ()

    def _new_runtime(self) -> Dict[str, Any]:
        """Fresh values of the ``_runtime_attrs``."""
        return {}

    def __getstate__(self) -> Dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._runtime_attrs}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.update(self._new_runtime())

    def __deepcopy__(self, memo: Dict[int, Any]) -> "CopyableStrategy":
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = self.__getstate__()
        for group in _process_groups(state.values()):  # (also the same group held by a helper)
            memo[id(group)] = group
        new.__setstate__(copy.deepcopy(state, memo))
        return new


def _process_groups(values: Any) -> List[Any]:
    """The process groups among ``values`` (shared, not copied, by deep copies)."""
    group_type = getattr(torch.distributed, "ProcessGroup", None)
    return [v for v in values if group_type is not None and isinstance(v, group_type)]


class LoadStrategyBase(CopyableStrategy, ABC):
    """Base of load strategies. What a strategy reads is declared as data:
    ``supported_backends`` and ``supported_versions`` (of ``metadata.json``), which the
    compatibility checks below test (a strategy may override the checks instead)."""

    supported_backends: Tuple[str, ...] = ()
    supported_versions: Tuple[int, ...] = ()

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise if checkpoints of ``loaded_backend`` cannot be read."""
        if loaded_backend not in self.supported_backends:
            raise CheckpointingException(f"{type(self).__name__} cannot read backend {loaded_backend!r} "
                                         f"(it reads {', '.join(map(repr, self.supported_backends)) or 'none'})")

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise if checkpoints of ``loaded_version`` cannot be read."""
        if loaded_version not in self.supported_versions:
            raise CheckpointingException(f"{type(self).__name__} cannot read version {loaded_version!r} "
                                         f"(it reads {', '.join(map(repr, self.supported_versions)) or 'none'})")

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy reads ShardedObjects itself."""
        return False


class SaveStrategyBase(CopyableStrategy, ABC):
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

    #: seconds of the phases of the last :meth:`load` on this rank (``{"plan": ..., "read": ...}``), if measured
    last_timings: Optional[Dict[str, float]] = None

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

    def key_mismatch(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
                     need_missing: bool) -> Optional[Tuple[Set[str], Set[str]]]:
        """``(missing, unexpected)`` keys of a strict load found without every rank reading
        the checkpoint's whole metadata (collective), or ``None`` (the default) to have
        ``load`` compare the request with :meth:`load_sharded_metadata`."""
        return None

    def stored_items(self, checkpoint_dir: Union[str, Path]) -> StoredItems:
        """Every stored tensor and object, from the metadata alone (for the offline tools).
        The default describes the tensors of :meth:`load_tensors_metadata` (no chunks, not
        located) and no objects."""
        return StoredItems([StoredTensor(key, tuple(sh.global_shape), sh.dtype, [],
                                         nbytes(tuple(sh.global_shape), sh.dtype), False)
                            for key, sh in sorted(self.load_tensors_metadata(checkpoint_dir).items())])

    def stored_file_problems(self, checkpoint_dir: Union[str, Path]) -> Tuple[List[str], List[str]]:
        """``(problems, notes)`` of the files besides the metadata that a load may read
        (e.g. an index), for the ``validate`` tool; the default has none."""
        return [], []

    def offline_reader(self) -> "LoadShardedStrategy":
        """A strategy reading this backend for the offline tools, which read one whole
        tensor at a time: with the least memory (e.g. one reader thread) and no unsafe
        unpickling. The default is this strategy itself."""
        return self

    def release_scratch(self) -> None:
        """Free temporary memory kept from the last load (the default keeps none)."""

    def load_local(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> StateDict:
        """Load in this process alone, with no collectives (for the offline readers). The
        default is :meth:`load`; a strategy whose ``load`` is collective overrides this."""
        return self.load(sharded_state_dict, checkpoint_dir)

    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        """The common state of checkpoints that keep it in the sharded backend (``metadata.json``
        without a common backend: Megatron-Core >= 0.19's ShardedObject ``common_state``)."""
        raise CheckpointingException(
            f"{checkpoint_dir} keeps its common state in the sharded backend, which "
            f"{type(self).__name__} cannot read"
        )

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

    #: tensor bytes this rank wrote in the last save (or snapshotted, for an async save), if known
    last_written_bytes: Optional[int] = None
    #: seconds of the phases of the last :meth:`save` on this rank (``{"plan": ..., "write": ...}``), if measured
    last_timings: Optional[Dict[str, float]] = None
    #: on rank 0, once the last save's metadata is written: the files it names (``.metadata``
    #: included) and their sizes, which the commit checks the store kept; ``None`` if not known
    last_written_files: Optional[Dict[str, int]] = None

    def data_file_names(self, rank: int) -> List[str]:
        """Names of the files rank ``rank`` may write (the longest of each pattern), checked
        up front against what the store keeps as written; ``[]`` if not known."""
        return []

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        """Write this rank's main replicas; collective over the default process group."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded save strategy that can return the writing as an async request."""

    #: True when :meth:`async_save` raises on every rank by itself (collective-safe), so
    #: ``save`` adds no agreement after it (one that would wait for its queued copies).
    async_save_agreed: bool = False

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
                   async_strategy: Optional[str] = "nvrx") -> Any:
        """Stage the state and return an ``AsyncRequest`` that writes it (``async_strategy``:
        Megatron-Core >= 0.16's name of the async machinery, :mod:`.async_strategies`)."""
