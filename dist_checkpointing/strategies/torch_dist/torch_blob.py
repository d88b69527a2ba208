"""Direct access to ``torch.save`` blobs inside DCP data files.

Every tensor item of a torch_dist checkpoint is a complete ``torch.save`` zip archive.
Instead of ``torch.load`` (which copies the bytes twice), :func:`read_tensor_header`
parses the archive's directory and its small ``data.pkl`` to find where the raw tensor
bytes are, so the loader can read them straight into the destination tensor.
The ``data.pkl`` is interpreted by an unpickler that only understands tensor rebuilds
(:mod:`..pickling.blob_header`): nothing in the file is executed.

Owns: locating a tensor's bytes inside a ``torch.save`` blob without unpickling it; a
reader's ``Layouts``: a blob whose bytes that the parse reads (all before the data record,
and the zip directory at the end) equal those of one parsed before in the load (as the blobs
of one dtype and shape our writers write do) is not parsed again (two reads and a comparison
instead of the zip directory and the pickle; the records between the data and the directory
stay unread until the checksum hashes them, so an object store's block is not released and
fetched again).
"""

from __future__ import annotations

import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ...pickling.blob_header import load_blob_pickle
from ...storage import RangeReader
from ..resharding import contiguous_strides

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_SIG = 0x04034B50


class FileSlice:
    """A read-only, seekable view of ``[offset, offset + length)`` of a stored file.
    ``error`` keeps a storage error of a read (``zipfile`` reports it as a bad archive)."""

    def __init__(self, file: RangeReader, offset: int, length: int):
        self._file, self._offset, self._length, self._pos = file, offset, length, 0
        self.error: Optional[OSError] = None

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._length - self._pos
        n = min(n, self._length - self._pos)
        try:
            data = self._file.read(self._offset + self._pos, n)
        except OSError as e:
            self.error = e
            raise
        self._pos += len(data)
        return data


@dataclass
class TensorHeader:
    """Where a blob's tensor bytes are and how to interpret them."""

    dtype: torch.dtype
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    data_offset: int  # absolute file offset of the tensor's first element

    def is_contiguous(self) -> bool:
        """Whether the tensor's elements are laid out row-major without gaps."""
        expected = contiguous_strides(self.size)
        return all(sz <= 1 or st == ex for sz, st, ex in zip(self.size, self.stride, expected))

    def span_elements(self) -> int:
        """How many elements of storage the tensor spans, from its first element to its last."""
        return _span_elements(self.size, self.stride)


def _span_elements(size: Tuple[int, ...], stride: Tuple[int, ...]) -> int:
    return 0 if math.prod(size) == 0 else 1 + sum((s - 1) * st for s, st in zip(size, stride))


def _record_data_offset(file: RangeReader, blob_offset: int, blob_length: int, info: zipfile.ZipInfo) -> int:
    """Where the payload of the zip record ``info`` starts, relative to the blob; the
    payload must lie inside the blob."""
    raw = file.read(blob_offset + info.header_offset, _LOCAL_HEADER.size) if info.header_offset >= 0 else b""
    fields = _LOCAL_HEADER.unpack(raw) if len(raw) == _LOCAL_HEADER.size else None
    if fields is None or fields[0] != _LOCAL_HEADER_SIG:
        raise ValueError(f"bad local header for record {info.filename}")
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if start + info.file_size > blob_length:
        raise ValueError(f"record {info.filename} ({info.file_size} bytes at {start}) extends past the blob "
                         f"({blob_length} bytes)")
    return start


@dataclass(frozen=True)
class _Layout:
    """A parsed blob: the bytes its parse reads (``head``: everything before the data
    record; ``tail``: the zip directory, from ``tail_start`` to the end), and what it found."""

    data_start: int  # of the data record, in the blob
    tail_start: int
    head: bytes
    tail: bytes
    dtype: torch.dtype
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    storage_offset_bytes: int


#: a reader's parsed blobs by blob length, the latest first (:func:`read_tensor_header`'s ``layouts``)
Layouts = Dict[int, List[_Layout]]
_LAYOUTS_PER_LENGTH = 8


def _same_layout(file: RangeReader, offset: int, layout: _Layout) -> bool:
    return (file.read(offset, layout.data_start) == layout.head
            and file.read(offset + layout.tail_start, len(layout.tail)) == layout.tail)


def read_tensor_header(file: RangeReader, offset: int, length: int,
                       layouts: Optional[Layouts] = None) -> Optional[TensorHeader]:
    """Locate the tensor stored in the blob at ``[offset, offset+length)`` of ``file``.

    Returns ``None`` when the blob is not a plain single-tensor ``torch.save`` archive
    (the caller then falls back to ``torch.load``). Raises ``ValueError`` for a damaged
    archive; nothing outside the blob is read, and the tensor's bytes lie inside it.

    ``layouts`` (kept by the caller across blobs) skips the parse of a blob whose bytes that
    the parse reads — all before the data record, and the zip directory at the end — equal
    those of a blob parsed before (as the blobs of one dtype and shape that our writers
    write do, :mod:`.blob_template`): the parse would find the same. (The records between
    the data and the directory are not read here: a reader that hashes the whole record
    reads them once.)
    """
    for layout in layouts.get(length, ()) if layouts is not None else ():
        if _same_layout(file, offset, layout):
            return TensorHeader(layout.dtype, layout.size, layout.stride,
                                offset + layout.data_start + layout.storage_offset_bytes)
    blob = FileSlice(file, offset, length)
    try:
        zf = zipfile.ZipFile(blob)  # reads the central directory only
    except zipfile.BadZipFile:
        if blob.error is not None:
            raise blob.error from None
        raise
    infos = {i.filename: i for i in zf.infolist()}
    pkl_name = next((n for n in infos if n.endswith("/data.pkl") or n == "data.pkl"), None)
    if pkl_name is None:
        return None
    prefix = pkl_name[: -len("data.pkl")]
    pkl_info = infos[pkl_name]
    pkl_start = _record_data_offset(file, offset, length, pkl_info)
    pkl = file.read(offset + pkl_start, pkl_info.file_size)
    try:
        obj = load_blob_pickle(pkl)
    except (pickle.UnpicklingError, AttributeError, TypeError, EOFError):
        return None
    if not (isinstance(obj, tuple) and obj and obj[0] == "tensor"):
        return None
    _, storage, storage_offset, size, stride, dtype = obj
    data_info = infos.get(f"{prefix}data/{storage.key}")
    if data_info is None or dtype is None:
        return None
    data_start = _record_data_offset(file, offset, length, data_info)
    if len(size) != len(stride) or min((storage_offset, *size, *stride)) < 0:
        raise ValueError(f"invalid tensor geometry: size {size}, stride {stride}, storage offset {storage_offset}")
    itemsize = dtype.itemsize
    if (storage_offset + _span_elements(size, stride)) * itemsize > data_info.file_size:
        raise ValueError("tensor extends past its storage record")
    tail_start = getattr(zf, "start_dir", None)  # where zipfile found the directory
    if layouts is not None and isinstance(tail_start, int) and data_start + data_info.file_size <= tail_start <= length:
        layout = _Layout(data_start, tail_start, file.read(offset, data_start),
                         file.read(offset + tail_start, length - tail_start), dtype, size, stride,
                         storage_offset * itemsize)
        layouts[length] = [layout] + layouts.get(length, [])[:_LAYOUTS_PER_LENGTH - 1]
    return TensorHeader(dtype, size, stride, offset + data_start + storage_offset * itemsize)
