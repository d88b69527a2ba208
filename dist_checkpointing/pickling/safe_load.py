"""Loading pickled checkpoint content without executing arbitrary code (the policy every
stored pickle is opened with: this allow-list, the user's safe globals, the stand-ins).

* :func:`safe_torch_load` wraps ``torch.load(weights_only=True)`` with the allow-list of
  :mod:`.safe_globals` (stdlib, NumPy, Megatron-Core / TE stand-ins, registered classes);
  anything else needs the explicit ``allow_pickle=True`` opt-in and fails with a message
  naming the blocked globals.
* :func:`load_dcp_metadata` unpickles a DCP ``.metadata`` file with an allow-list of
  PyTorch DCP classes, mapping Megatron-Core's metadata classes to local stand-ins, so
  checkpoints written by Megatron-Core load without Megatron installed.

Owns: ``safe_torch_load`` (``weights_only`` ``torch.load`` under the ``safe_globals``
allow-list, the user's safe globals and the stand-ins: ``common.pt``, objects, the local
tier's values, ``dist-ckpt import``), ``load_dcp_metadata`` (``.metadata`` with the DCP
allow-list), Megatron metadata stand-in classes; old path ``strategies/safe_pickle.py``.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import IO, Any, Union

import torch

from . import dcp_types
from ..core import CheckpointingException, Location, open_storage
from ..integrity.checksums import read_file_verified
from .restricted import RestrictedUnpickler
from .safe_globals import UnsafeCall, safe_globals_context
from .stand_ins import StandInMismatch


def safe_torch_load(f: Union[IO[bytes], bytes, str, "os.PathLike[str]"], what: str, allow_pickle: bool = False,
                    mmap: bool = False) -> Any:
    """``torch.load`` of ``f`` (bytes, a file object or a path; CPU; ``mmap``: a path's
    storages mapped, not read) with the safe allow-list; ``what`` names it in errors."""
    if isinstance(f, (bytes, bytearray, memoryview)):
        f = io.BytesIO(f)
    if allow_pickle:
        try:
            return torch.load(f, map_location="cpu", weights_only=False, mmap=mmap)
        except Exception as e:  # noqa: BLE001 - corrupted data of any kind
            raise CheckpointingException(f"Cannot load {what}: {type(e).__name__}: {e}") from e
    with safe_globals_context():
        try:
            return torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)
        except (StandInMismatch, UnsafeCall) as e:
            hint = "import the real class before loading, or " if isinstance(e, StandInMismatch) else ""
            raise CheckpointingException(
                f"Refusing to unpickle {what}: {e}. If you trust this checkpoint, {hint}load it with "
                "allow_pickle=True on the load strategy.") from e
        except pickle.UnpicklingError as e:
            blocked = _blocked_globals(f)
            if not blocked:  # nothing unsafe to name: the bytes themselves are broken
                raise CheckpointingException(
                    f"Cannot load {what}: the data is corrupted ({str(e).splitlines()[0]})") from e
            raise CheckpointingException(
                f"Refusing to unpickle {what}: it needs globals outside the safe allow-list "
                f"({blocked}). If you trust this checkpoint, load it with allow_pickle=True on the "
                "load strategy, or allow these classes with dist_checkpointing.register_safe_globals."
            ) from e
        except Exception as e:  # noqa: BLE001 - corrupted data of any kind
            raise CheckpointingException(f"Cannot load {what}: {type(e).__name__}: {e}") from e


def _blocked_globals(f: Any) -> str:
    """The globals of the torch.save archive ``f`` that the allow-list lacks ("" if unreadable)."""
    try:
        if hasattr(f, "seek"):
            f.seek(0)
        return ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(f))
    except Exception:  # noqa: BLE001 - not even a readable torch.save archive
        return ""


class MCoreMetadata(dcp_types.Metadata):
    """Stand-in for Megatron-Core 0.15's ``MCoreMetadata`` (adds ``mcore_data``)."""


class MCoreSavePlan(dcp_types.SavePlan):
    """Stand-in for Megatron-Core's ``MCoreSavePlan`` (pickled inside 0.15 metadata)."""


# DCP's metadata classes (their light stand-ins where DCP is not imported: see dcp_types)
_ALLOWED = dict(dcp_types.CLASSES)
_ALLOWED.update({
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    ("builtins", "slice"): slice,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"): MCoreMetadata,
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"): MCoreSavePlan,
    ("dist_checkpointing.strategies.safe_pickle", "MCoreMetadata"): MCoreMetadata,  # this module's old path
    ("dist_checkpointing.pickling.safe_load", "MCoreMetadata"): MCoreMetadata,
})


def load_dcp_metadata(checkpoint_dir: Location, name: str = ".metadata",
                      verify_checksum: bool = True) -> dcp_types.Metadata:
    """Unpickle a checkpoint's DCP ``.metadata`` file safely (checking its checksum sidecar if any)."""
    storage = open_storage(checkpoint_dir)
    path = storage.describe(name)
    data = read_file_verified(storage, name, verify_checksum)
    try:
        metadata = RestrictedUnpickler(data, _ALLOWED, lambda module, name: CheckpointingException(
            f"{path}: DCP metadata refers to {module}.{name}, which is not on the allow-list of classes a "
            "checkpoint's metadata may contain")).load()
    except CheckpointingException:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or corrupted pickle
        raise CheckpointingException(f"Cannot read checkpoint metadata {path}: {e}") from e
    if not isinstance(metadata, dcp_types.Metadata):
        raise CheckpointingException(f"{path} does not hold DCP metadata")
    return metadata
