"""The Megatron-Core >= 0.19 layout of the common state: no ``common.pt``; the common
state is the ShardedObject ``common_state`` (``common_state/shard_0_1`` in ``.metadata``),
written by rank 0 with the sharded state, and ``metadata.json`` records no common backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from ..core import CheckpointingException
from ..dict_utils import nested_values
from ..mapping import ShardedObject, ShardedStateDict, StateDict
from .base import SaveCommonStrategy

COMMON_STATE_OBJECT_NAME = "common_state"


class CommonStateObjectSaveStrategy(SaveCommonStrategy):
    """Save the common state as Megatron-Core 0.19 does: ``save(...,
    common_strategy=CommonStateObjectSaveStrategy())`` adds the ShardedObject
    ``common_state`` (every rank's copy a replica, rank 0's the main one) to the sharded
    state, so the sharded strategy writes it; ``metadata.json`` gets only the sharded
    backend. Megatron-Core 0.19 reads such checkpoints without its deprecated
    ``common.pt`` path; this library reads both layouts."""

    def __init__(self) -> None:
        super().__init__(None, None)  # type: ignore[arg-type] - recorded as absent in metadata.json

    def add_to_sharded(self, sharded_state_dict: ShardedStateDict, common_state_dict: StateDict,
                       rank: int) -> None:
        """Put the common state into ``sharded_state_dict`` as the ``common_state`` object."""
        for sh in nested_values(sharded_state_dict):
            if sh.key == COMMON_STATE_OBJECT_NAME:
                raise CheckpointingException(
                    f"The sharded state has an item with key {COMMON_STATE_OBJECT_NAME!r}, which this layout "
                    "reserves for the common state: rename it or save with the default common strategy")
        sharded_state_dict[COMMON_STATE_OBJECT_NAME] = ShardedObject(
            COMMON_STATE_OBJECT_NAME, common_state_dict, (1,), (0,), replica_id=rank)

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]) -> None:
        """Nothing: the sharded strategy writes the common state (see :meth:`add_to_sharded`)."""
