"""The ``data.pkl`` of a ``torch.save`` blob, read without torch's unpickler: only tensor
rebuilds (as tuples describing the tensor), storage classes, dtypes and ``OrderedDict``
are allowed; the storages are persistent ids, returned as :class:`StorageRef`
(:mod:`..strategies.torch_dist.torch_blob` finds their bytes). Nothing in the blob is executed."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from .restricted import RestrictedUnpickler


@dataclass
class StorageRef:
    """A storage a tensor rebuild refers to: its dtype (``None``: untyped) and record key."""

    dtype: Optional[torch.dtype]
    key: str


def _rebuild_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride), dtype)


class _StorageClass:
    def __init__(self, dtype: Optional[torch.dtype]):
        self.dtype = dtype


# ``torch.FloatStorage`` and the like, as pickles name them (the map torch's own safe
# unpickler uses; reading the deprecated attributes themselves would warn)
_LEGACY_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}

_ALLOWED: Dict[Tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch.storage", "UntypedStorage"): _StorageClass(None),
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", name): _StorageClass(dtype) for name, dtype in _LEGACY_STORAGE_DTYPES.items()},
}


class _BlobUnpickler(RestrictedUnpickler):
    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return StorageRef(pid[1].dtype, str(pid[2]))


def load_blob_pickle(data: bytes) -> Any:
    """The object of a blob's ``data.pkl`` (tensors as ``("tensor", StorageRef, offset, size,
    stride, dtype)``); ``pickle.UnpicklingError`` for anything but plain tensors."""
    return _BlobUnpickler(data, _ALLOWED, lambda m, n: pickle.UnpicklingError(f"not a plain tensor: {m}.{n}")).load()
