"""Helpers on sharded state dicts, as Megatron-Core's ``dist_checkpointing.utils`` names them.

Splitting a state dict by the kind of its leaves (``extract_*``: each returns
``(matching, rest)`` with the nesting kept), renaming sharded keys in place
(``add_prefix_for_sharding``, ``replace_prefix_for_sharding``, ``apply_prefix_mapping``),
turning FP8 tensors into their high-precision values, and the debug-timing helpers
Megatron-Core's code logs through (``logger_stack``, ``debug_time``, ``debug_msg``).

Owns: megatron-Core's ``utils``: ``extract_*`` splits, key prefix helpers, ``zip_strict``,
``force_all_tensors_to_non_fp8``, debug-timing helpers.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from time import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

_KEYED = (ShardedTensor, ShardedTensorFactory, ShardedObject)

#: Megatron-Core's identity of a shard: ``(key, global offset, (start, stop) of the flattened range or None)``
_ShardId = Tuple[str, Tuple[int, ...], Optional[Tuple[int, int]]]


def _sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    """The identity of the data a ShardedTensor holds, the same on every rank that holds a
    replica of it (Megatron-Core's private helper, which its code and tests import)."""
    rng = sharded_tensor.flattened_range
    return sharded_tensor.key, tuple(sharded_tensor.global_offset), None if rng is None else (rng.start, rng.stop)


def zip_strict(*args: Any) -> Iterator[Tuple[Any, ...]]:
    """``zip`` of iterables that must have equal lengths; a ``ValueError`` names the lengths."""
    lists = [list(a) for a in args]
    lens = [len(a) for a in lists]
    if len(set(lens)) > 1:
        raise ValueError(f"Tried to zip iterables of unequal lengths: {lens}!")
    return zip(*lists)


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (the ShardedTensors, everything else), both with the original nesting."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensors and ShardedTensorFactories, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory)))


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensors, factories and LocalNonpersistentObjects, everything else)."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, LocalNonpersistentObject, ShardedTensorFactory)))


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (every sharded item: ShardedBase, everything else: the common state)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (the LocalNonpersistentObjects, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded item (ShardedBase), in place."""

    def add_prefix(x: Any) -> Any:
        if isinstance(x, ShardedBase):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add_prefix, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in the key of every ShardedTensor, factory and
    ShardedObject, in place; a key that does not start with ``old_prefix`` is a ``ValueError``."""

    def replace_prefix(x: Any) -> Any:
        if isinstance(x, _KEYED):
            if not x.key.startswith(old_prefix):
                raise ValueError(f"Expected {x.key} to begin with prefix {old_prefix}")
            x.key = new_prefix + x.key[len(old_prefix):]
        return x

    dict_list_map_inplace(replace_prefix, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rename, in place, the keys that start with one of ``prefix_map``'s old prefixes (the
    first that matches, in the map's order) to its new prefix; other keys stay."""

    def replace_prefixes(x: Any) -> Any:
        if isinstance(x, _KEYED):
            for old_prefix, new_prefix in prefix_map.items():
                if x.key.startswith(old_prefix):
                    x.key = new_prefix + x.key[len(old_prefix):]
                    break
        return x

    dict_list_map_inplace(replace_prefixes, sharded_state_dict)


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Replace, in place, the data of every leaf holding an FP8 (Transformer Engine) tensor
    by its dequantized high-precision values."""
    from .tensors.fp8 import dequantize, is_float8tensor  # torch only; kept out of the data model's imports

    for v in nested_values(sharded_state_dict):
        if hasattr(v, "data") and is_float8tensor(v.data):
            v.data = dequantize(v.data)


def _clean_metadata_for_serialization(metadata: Optional[dict]) -> Optional[dict]:
    """A copy of sharded-state-dict content metadata without the entries that cannot be
    saved (process groups: Megatron-LM's ``dp_cp_group``); what Megatron-LM passes to
    ``save(content_metadata=...)``."""
    if metadata is None:
        return None
    import torch.distributed as dist

    return {k: v for k, v in metadata.items() if k != "dp_cp_group" and not isinstance(v, dist.ProcessGroup)}


fallback_logger = logging.getLogger(__name__)
_LOGGER_NAME_STACK: List[str] = []
_LOGGER_STACK: List[logging.Logger] = []


@contextmanager
def logger_stack(name: Optional[str] = None,
                 current_logger: Optional[logging.Logger] = None) -> Iterator[Tuple[str, logging.Logger]]:
    """Push ``name`` and/or ``current_logger`` for the block; yields (the dotted names pushed
    so far, the innermost logger pushed, or this module's logger)."""
    if name:
        _LOGGER_NAME_STACK.append(name)
    if current_logger:
        _LOGGER_STACK.append(current_logger)
    last_logger = _LOGGER_STACK[-1] if _LOGGER_STACK else fallback_logger
    try:
        yield ".".join(_LOGGER_NAME_STACK), last_logger
    finally:
        if name and _LOGGER_NAME_STACK:
            _LOGGER_NAME_STACK.pop()
        if current_logger and _LOGGER_STACK:
            _LOGGER_STACK.pop()


@contextmanager
def debug_time(name: str, logger: Optional[logging.Logger] = None, threshold: float = float("-inf"),
               level: Optional[int] = None) -> Iterator[None]:
    """Log ``"<names> took <s>s"`` after the block: at DEBUG, or at WARNING (``level`` if
    given) when a ``threshold`` is set and the block took at least that long."""
    with logger_stack(name, logger) as (stacked_name, last_logger):
        start = time()
        try:
            yield
        finally:
            took = time() - start
            if took >= threshold:
                if level is None:
                    level = logging.DEBUG if threshold == float("-inf") else logging.WARNING
                last_logger.log(level, f"{stacked_name} took {took:.4f}s")


def debug_msg(msg: str) -> None:
    """Log ``msg`` at DEBUG through the current :func:`logger_stack`, prefixed by its names."""
    with logger_stack(None, None) as (stacked_name, last_logger):
        last_logger.debug(f"{stacked_name} {msg}")
