"""Writing safetensors files one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header giving every
tensor's dtype, shape and byte range, then the tensors' bytes. The ``safetensors``
library's writers take every tensor of a file at once (all in memory); since the header
only needs shapes and dtypes, this writer emits the header first and then streams the
tensors in, so a whole model can be exported holding one tensor at a time. The files are
written through the storage layer (a local directory or an object-store prefix); they are
read by ``safetensors.safe_open`` (tested). A key the format cannot hold is refused before
anything is written (:func:`.format.key_refusal`), every header is parsed as a safetensors
reader parses it before it is written (:func:`.format.check_header`), and read back and
parsed again once its file is complete.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...core import CheckpointingException
from ...storage import Storage
from ...tensors.bytes_view import as_bytes
from .format import check_header, dtype_name, read_header


def read_back_header(storage: Storage, name: str) -> None:
    """Read the written file ``name`` back and parse its header as loads do (:func:`.format.read_header`)."""
    reader = storage.open_reader(name)
    try:
        read_header(reader, storage.describe(name))
    finally:
        reader.close()


class SafetensorsFileWriter:
    """The new safetensors file ``name`` of ``storage`` (streamed: :meth:`Storage.create_stream`):
    the header is written on creation from the announced ``(key, shape, dtype)`` list; then
    :meth:`write` takes each tensor, in that order; the file exists once :meth:`close` returns."""

    def __init__(self, storage: Storage, name: str, tensors: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]],
                 metadata: Optional[Dict[str, str]] = None):
        self.path = storage.describe(name)
        self._expected: List[Tuple[str, Tuple[int, ...], torch.dtype, int]] = []
        header: Dict[str, object] = {}
        offset = 0
        for key, shape, dtype in tensors:
            nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
            header[key] = {"dtype": dtype_name(key, dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected.append((key, tuple(shape), dtype, nbytes))
            offset += nbytes
        if metadata:
            header["__metadata__"] = dict(metadata)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-(8 + len(encoded)) % 8)  # the data starts 8-byte aligned
        check_header(encoded, self.path)
        self._file = storage.create_stream(name)
        self._file.write(len(encoded).to_bytes(8, "little") + encoded)
        self._next = 0
        self.nbytes = 8 + len(encoded) + offset

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append the next tensor's bytes (it must be the next announced one)."""
        if self._next >= len(self._expected):
            raise CheckpointingException(f"{self.path}: no more tensors were announced (got {key!r})")
        want_key, shape, dtype, nbytes = self._expected[self._next]
        if key != want_key or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointingException(
                f"{self.path}: expected {want_key!r} {shape} {dtype}, got {key!r} {tuple(tensor.shape)} {tensor.dtype}")
        data = as_bytes(tensor.detach().cpu())
        if data.numel():
            self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        """Finish the file, durable on return; every announced tensor must have been written
        (else the file is dropped)."""
        if self._next != len(self._expected):
            self._file.abort()
            raise CheckpointingException(
                f"{self.path}: {len(self._expected) - self._next} announced tensors were not written")
        self._file.close()

    def abort(self) -> None:
        """Drop the file (after an error): an object store never creates it."""
        self._file.abort()
