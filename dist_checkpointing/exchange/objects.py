"""How ShardedObjects loaded in a group reach the ranks that need them: which rank reads
each, and the exchange of what was read.

Owns: how loaded ShardedObjects travel: ``object_loaders``, ``local_object_keys``,
``exchange_loaded_objects_gather_object``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..runtime.collectives import all_gather_object
from ..dict_utils import nested_values
from ..mapping import ShardedObject, ShardedStateDict


def exchange_loaded_objects_gather_object(
    loaded_objects: Dict[str, Any], parallelization_group: Optional[Any] = None
) -> Dict[str, Any]:
    """Every object loaded by any rank of the group, by unique key (one
    ``all_gather_object`` inside the group)."""
    result: Dict[str, Any] = {}
    for objects in all_gather_object(loaded_objects, parallelization_group):
        result.update(objects)
    return result

def object_loaders(per_rank_objects: List[List[str]]) -> Tuple[Dict[str, int], Dict[str, List[int]]]:
    """For ShardedObjects needed in a group: which group rank reads each (the needer with
    the fewest objects so far, deterministic), and every rank that needs it."""
    needers: Dict[str, List[int]] = {}
    for rank, keys in enumerate(per_rank_objects):
        for key in keys:
            needers.setdefault(key, []).append(rank)
    counts = [0] * len(per_rank_objects)
    loader: Dict[str, int] = {}
    for key in sorted(needers, key=lambda k: (len(needers[k]), k)):
        rank = min(needers[key], key=lambda r: (counts[r], r))
        counts[rank] += 1
        loader[key] = rank
    return loader, needers


def local_object_keys(sharded_state_dict: ShardedStateDict) -> List[str]:
    """Unique keys of the ShardedObjects in a state dict (each once)."""
    return sorted({sh.unique_key for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedObject)})
