"""The ``torch.save`` blob of a tensor as *prefix + the tensor's bytes + suffix*.

With the zip CRC off (:func:`~..storage.zip_crc.zip_crc_disabled`, as our writers save), a
``torch.save`` blob of a contiguous CPU tensor depends on its elements only in the data
record: everything before it (the pickle, the record headers) and after it (the remaining
records, the zip directory) is fixed by the dtype and shape. :func:`blob_parts` takes both
parts from one ``torch.save`` per (dtype, shape), without copying the elements, so a data
file's records can be written as three plain byte writes — by this process or by the
persistent writer, which then needs no torch (:mod:`.records`).
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch

from ...core import CheckpointingException
from ...storage.zip_crc import zip_crc_disabled

_CACHE: Dict[Tuple[torch.dtype, Tuple[int, ...]], Tuple[bytes, bytes]] = {}
_CACHE_MAX = 4096  # distinct (dtype, shape) kept; a model has far fewer
_lock = threading.Lock()


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class _Recorder:
    """A write-only stream for ``torch.save`` keeping every write but those inside
    ``[start, end)`` of memory (the tensor's own bytes), which it only counts."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.before: List[bytes] = []
        self.after: List[bytes] = []
        self.data_writes = 0  # writes of the tensor's bytes
        self.data_bytes = 0
        self._pos = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self._pos += n
        address = _address(view)
        if n and self.start <= address and address + n <= self.end:
            if self.after:
                raise CheckpointingException("torch.save wrote the tensor's bytes in separate places")
            self.data_writes += 1
            self.data_bytes += n
        elif self.data_writes:
            self.after.append(bytes(view))
        else:
            self.before.append(bytes(view))
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass


def blob_parts(dtype: torch.dtype, shape: Tuple[int, ...], tensor: Callable[[], torch.Tensor]) -> Tuple[bytes, bytes]:
    """``(prefix, suffix)`` such that ``prefix + the bytes of t + suffix`` is what
    ``torch.save(t)`` writes with the zip CRC off, for every contiguous CPU tensor ``t`` of
    ``dtype`` and ``shape`` whose storage is exactly its elements (as the writers pass them).
    Cached per (dtype, shape); on a miss, ``tensor()`` gives such a tensor to save (its
    elements are not read)."""
    key = (dtype, tuple(shape))
    parts = _CACHE.get(key)
    if parts is not None:
        return parts
    t = tensor()
    nbytes = t.numel() * t.element_size()
    start = t.data_ptr()
    recorder = _Recorder(start, start + nbytes)
    with zip_crc_disabled():
        torch.save(t, recorder)
    if recorder.data_bytes != nbytes:
        raise CheckpointingException(f"torch.save of a {t.dtype} tensor of shape {tuple(t.shape)} did not write its "
                                     f"{nbytes} bytes as one data record (wrote {recorder.data_bytes})")
    parts = (b"".join(recorder.before), b"".join(recorder.after))
    with _lock:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = parts
    return parts
