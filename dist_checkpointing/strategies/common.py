"""Common (non-sharded) state: ``common.pt``, written by the coordinator rank.

Owns: the ``torch`` common strategy: ``common.pt`` and its checksum sidecar.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable, Union

import torch

from ..core import CheckpointingException, open_storage
from ..integrity.checksums import read_file_verified, write_file_with_checksum
from ..mapping import StateDict
from .base import LoadCommonStrategy, SaveCommonStrategy
from .registry import StrategyAction, register_default_strategy
from ..pickling.safe_load import safe_torch_load

COMMON_STATE_FNAME = "common.pt"


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is the file this strategy writes into a checkpoint directory."""
    return name == COMMON_STATE_FNAME


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Writes the common state with ``torch.save`` to ``common.pt`` (atomically)."""

    def __init__(self, backend: str = "torch", version: int = 1):
        super().__init__(backend, version)

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]) -> None:
        _serialized(common_state_dict, checkpoint_dir)()

    def stage_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]) -> Callable[[], None]:
        """Serialize the common state now; the returned function writes the bytes."""
        return _serialized(common_state_dict, checkpoint_dir)


def _serialized(common_state_dict: StateDict, checkpoint_dir: Union[str, Path]) -> Callable[[], None]:
    """``torch.save`` of the common state, now; returns the function that writes it."""
    buf = io.BytesIO()
    try:
        torch.save(common_state_dict, buf)
    except Exception as e:  # noqa: BLE001 - unpicklable user object
        raise CheckpointingException(f"Cannot serialize the common state: {e}") from e
    return lambda: write_file_with_checksum(checkpoint_dir, COMMON_STATE_FNAME, buf.getbuffer())


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Reads ``common.pt`` safely and verifies its checksum when one was recorded.

    Args:
        allow_pickle: opt in to unpickling arbitrary objects (runs code from the file:
            only for checkpoints you trust).
        verify_checksums: check the bytes against ``common.pt.checksum``.
    """

    supported_backends = ("torch",)
    supported_versions = (1,)

    def __init__(self, allow_pickle: bool = False, verify_checksums: bool = True):
        self.allow_pickle = allow_pickle
        self.verify_checksums = verify_checksums

    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        storage = open_storage(checkpoint_dir)
        data = read_file_verified(storage, COMMON_STATE_FNAME, self.verify_checksums)
        return safe_torch_load(data, f"common state {storage.describe(COMMON_STATE_FNAME)}", self.allow_pickle)


def register_default_common_strategies() -> None:
    """Register the ``torch`` common strategies. Not needed: the registry resolves the
    built-in strategies on their first lookup (kept for Megatron-Core compatibility)."""
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy())
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, TorchCommonSaveStrategy("torch", 1))
