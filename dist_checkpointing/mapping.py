"""The mapping layer: how a rank's local state relates to the global checkpoint.

A :class:`ShardedTensor` says where a local tensor sits in a global tensor; a
:class:`ShardedObject` is one piece of a grid of picklable objects; a
:class:`ShardedTensorFactory` turns one local tensor into several sharded ones before
saving and merges them back after loading; a :class:`LocalNonpersistentObject` is kept
out of the checkpoint. Everything else in a state dict is *common state*.

:class:`ShardedTensor` and the types every sharded item shares live in
:mod:`.sharded_tensor`; every name is importable from here, where Megatron-Core has it.

Owns: the data model as Megatron-Core names it: ``ShardedObject``, ``ShardedTensorFactory``,
``LocalNonpersistentObject``, ``apply_factories``, ``apply_factory_merges``; re-exports
``tensors/sharded.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace
from .tensors.sharded import ReplicaId, ShardedBase, ShardedStateDict, ShardedTensor, StateDict, is_main_replica

CommonStateDict = Dict[str, Any]
FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Optional[slice]], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]

__all__ = [
    "CommonStateDict", "FactoryBuildFn", "FactoryMergeFn", "LocalNonpersistentObject", "ReplicaId", "ShardedBase",
    "ShardedObject", "ShardedStateDict", "ShardedTensor", "ShardedTensorFactory", "StateDict", "KeyMap", "apply_key_map", "key_mapper", "apply_factories", "apply_factory_merges", "is_main_replica",
]


_UNIQUE_KEY_RE = re.compile(r"^(?P<key>.+)/shard_(?P<offset>[\d.]*)_(?P<shape>[\d.]*)$", re.DOTALL)


@dataclass
class ShardedObject(ShardedBase):
    """One piece of a grid of picklable objects (e.g. a per-rank RNG state).

    ``global_shape`` is the grid of pieces and ``global_offset`` this piece's position;
    each piece is stored under :attr:`unique_key`.
    """

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(v) for v in self.global_shape)
        self.global_offset = tuple(int(v) for v in self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise CheckpointingException(f"ShardedObject key must be a non-empty str, got {self.key!r}")
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global_shape {self.global_shape} and "
                f"global_offset {self.global_offset} have different lengths"
            )
        for off, size in zip(self.global_offset, self.global_shape):
            if not 0 <= off < size:
                raise CheckpointingException(
                    f"ShardedObject {self.key!r}: offset {self.global_offset} outside the grid "
                    f"{self.global_shape}"
                )

    @property
    def unique_key(self) -> str:
        """``{key}/shard_{offsets}_{shape}`` with dot-joined numbers: the storage key."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """The data-less ShardedObject stored under ``unique_key``."""
        m = _UNIQUE_KEY_RE.match(unique_key)
        if m is None:
            raise CheckpointingException(f"{unique_key!r} is not a ShardedObject unique key")

        def _ints(s: str) -> Tuple[int, ...]:
            return tuple(int(v) for v in s.split(".")) if s else ()

        return cls(m["key"], None, _ints(m["shape"]), _ints(m["offset"]), replica_id)

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key='{self.key}')"


@dataclass
class ShardedTensorFactory(ShardedBase):
    """Builds a sharded sub-dict from one tensor before save; merges it back after load.

    ``build_fn(key, data, replica_id, flattened_range)`` returns a (nested) sharded state
    dict; ``merge_fn(loaded)`` receives the same structure with loaded values and returns
    the tensor to put in place of the factory.
    """

    key: str
    data: torch.Tensor
    build_fn: Callable[..., Any]
    merge_fn: Callable[[Any], Any]
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> Any:
        """Run ``build_fn``."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Factories are validated through the objects they build."""

    def without_data(self) -> "ShardedTensorFactory":
        raise CheckpointingException(f"ShardedTensorFactory {self.key!r} cannot drop its data")


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every :class:`ShardedTensorFactory` by what it builds (in place)."""

    def apply(x: Any) -> Any:
        if isinstance(x, ShardedTensorFactory):
            x = x.build()
        return x

    dict_list_map_inplace(apply, sharded_state_dict)


def apply_factory_merges(x1: Any, x2: Any, key: Tuple = ()) -> Any:
    """Merge the loaded values ``x1`` back through the factories of ``x2`` (in place).

    ``x2`` is the request as given (with factories); where it holds a factory, the
    corresponding part of ``x1`` is passed to the factory's ``merge_fn``.
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                if isinstance(v2, ShardedTensorFactory):
                    raise CheckpointingException(
                        f"Missing loaded value for factory key {key + (k,)}"
                    )
                continue
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise CheckpointingException(
                f"Cannot merge factories at {key}: lists of lengths {len(x1)} and {len(x2)}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key=key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):  # factories extracted with return_lists_as_dicts
        for i, v2 in x2.items():
            if not isinstance(i, int) or not 0 <= i < len(x1):
                raise CheckpointingException(
                    f"Cannot merge factories at {key}: key {i!r} is not a position in a list of length {len(x1)}"
                )
            x1[i] = apply_factory_merges(x1[i], v2, key=key + (i,))
    return x1


@dataclass
class LocalNonpersistentObject:
    """An object kept out of the checkpoint; on load the local ``obj`` is put back."""

    obj: Any = field(default=None)

    def unwrap(self) -> Any:
        """The wrapped object."""
        return self.obj


KeyMap = Union[Dict[str, str], Callable[[str], str]]


def key_mapper(key_map: KeyMap) -> Callable[[str], str]:
    """``key_map`` (a dict: keys it does not name are kept; or a callable) as a function
    ``key -> stored key`` that refuses anything but a string."""
    if not (isinstance(key_map, dict) or callable(key_map)):
        raise CheckpointingException(f"key_map must be a dict or a callable, not {type(key_map).__name__}")

    def mapped(key: str) -> str:
        new = key_map.get(key, key) if isinstance(key_map, dict) else key_map(key)
        if not isinstance(new, str):
            raise CheckpointingException(f"key_map gave {new!r} for the key {key!r}, not a string key")
        return new

    return mapped


def apply_key_map(sharded_state_dict: ShardedStateDict, key_map: Optional[KeyMap]) -> ShardedStateDict:
    """A copy of the structure of ``sharded_state_dict`` in which every sharded item
    (ShardedTensor, ShardedObject, ShardedTensorFactory) has the key ``key_map`` gives it:
    a dict (keys it does not name are kept) or a callable ``key -> stored key``. The items
    share their tensors with the originals (a load fills the caller's tensors)."""
    if key_map is None:
        return sharded_state_dict
    mapped = key_mapper(key_map)

    def rekey(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: rekey(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rekey(v) for v in x]
        if not isinstance(x, ShardedBase):
            return x
        new = mapped(x.key)
        return x if new == x.key else replace(x, key=new)

    return rekey(sharded_state_dict)
