"""Writing safetensors files one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header giving every
tensor's dtype, shape and byte range, then the tensors' bytes. The ``safetensors``
library's writers take every tensor of a file at once (all in memory); since the header
only needs shapes and dtypes, this writer emits the header first and then streams the
tensors in, so a whole model can be exported holding one tensor at a time. The files are
written through the storage layer (a local directory or an object-store prefix); they are
read by ``safetensors.safe_open`` (tested). A key the format cannot hold is refused before
anything is written (:func:`key_refusal`), every header is parsed as a safetensors reader
parses it before it is written (:func:`check_header`), and read back and parsed again once
its file is complete.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..tensors.bytes_view import as_bytes
from ..core import CheckpointingException, key_problem
from ..storage import Storage

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.complex64: "C64",
}
INDEX_FNAME = "model.safetensors.index.json"
_METADATA_KEY = "__metadata__"  # the header's entry of free-form strings, not a tensor
_MAX_HEADER_BYTES = 100_000_000  # what safetensors' reader accepts


def key_refusal(key: str) -> Optional[str]:
    """Why a tensor of the key ``key`` cannot be stored in a safetensors file (``None``: it can)."""
    if key == _METADATA_KEY:
        return f"tensor key {key!r} is the name safetensors reserves for its header's metadata"
    return key_problem(key)


def _strict_text(value: object) -> bool:
    return isinstance(value, str) and key_problem(value) is None


def check_header(encoded: bytes, where: str) -> None:
    """Parse the JSON header ``encoded`` as safetensors' reader does (strict UTF-8, no lone
    surrogates even as ``\\u`` escapes, an object of tensor entries with a known dtype,
    a shape and back-to-back data offsets, ``__metadata__`` of strings only); raises
    :class:`CheckpointingException` naming ``where`` and the entry otherwise."""
    def bad(problem: str) -> CheckpointingException:
        return CheckpointingException(f"{where}: the safetensors header would not be readable: {problem}")

    if len(encoded) > _MAX_HEADER_BYTES:
        raise bad(f"it is {len(encoded)} bytes long, readers accept at most {_MAX_HEADER_BYTES}")
    try:
        header = json.loads(encoded.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"it is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("it is not a JSON object")
    end = 0
    names = set(DTYPE_NAMES.values())
    for key, entry in header.items():
        if not _strict_text(key):
            raise bad(key_refusal(key) or f"key {key!r} is not text")
        if key == _METADATA_KEY:
            if not (isinstance(entry, dict) and all(_strict_text(k) and _strict_text(v) for k, v in entry.items())):
                raise bad(f"{_METADATA_KEY} must map strings to strings")
            continue
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if isinstance(entry, dict) else (None, None)
        if not (isinstance(entry, dict) and entry.get("dtype") in names and isinstance(shape, list)
                and all(isinstance(d, int) and d >= 0 for d in shape) and isinstance(offsets, list)
                and len(offsets) == 2 and offsets[0] == end and offsets[1] >= end):
            raise bad(f"the entry of {key!r} is not a tensor stored after the one before it")
        end = offsets[1]


def read_back_header(storage: Storage, name: str) -> None:
    """Read the header of the written file ``name`` back and :func:`check_header` it."""
    where = storage.describe(name)
    reader = storage.open_reader(name)
    try:
        length = int.from_bytes(reader.read(0, 8), "little") if reader.size >= 8 else -1
        if not 0 <= length <= min(_MAX_HEADER_BYTES, reader.size - 8):
            raise CheckpointingException(f"{where}: the written file has no complete safetensors header")
        check_header(reader.read(8, length), where)
    finally:
        reader.close()


def dtype_name(key: str, dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``; raises for a dtype the format cannot hold."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise CheckpointingException(f"Tensor {key!r}: safetensors cannot store dtype {dtype}") from None


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


def shard_names(count: int) -> List[str]:
    """File names of a model split into ``count`` files (the Hugging Face convention)."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(storage: Storage, weight_map: Dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json`` in ``storage`` (atomically): which file holds each tensor."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    storage.write_atomic(INDEX_FNAME, (json.dumps(index, indent=2) + "\n").encode())
