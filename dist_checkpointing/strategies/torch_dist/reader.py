"""The checksummed reader of ``torch_dist`` data files: one storage reader
(:meth:`~...storage.Storage.open_reader`) per file, each blob's small header parsed (no
unpickling) and the tensor bytes read straight into the destination,
every claimed byte range checked against the file's size first, every item verified
against its recorded checksum while it is read."""

from __future__ import annotations

import math
import threading
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
from ...pickling.dcp_types import StorageInfo as _StorageInfo

from ...core import CheckpointingException
from ...tensors.bytes_view import tensor_bytes
from ...tensors.fp8 import dequantize, is_float8tensor
from ...integrity.checksums import RecordVerifier, checksum, mismatch_error
from ...storage import RangeReader, Storage
from ..resharding import contiguous_strides, relative_slices
from ...pickling.safe_load import safe_torch_load
from .torch_blob import Layouts, TensorHeader, read_tensor_header
from .format import checked_data_file_name
from .load_plan import ObjectRead, TensorRead


class Reader:
    """Executes reads with one open file per data file and cached blob headers.

    ``checksums`` maps ``(file, offset)`` to an item's checksum: of its whole record when
    ``whole_records``, else (older checkpoints) of a tensor's data bytes or an object's
    record. Every item's claimed byte range is checked against its file's size before
    anything is read or allocated for it.
    """

    #: whether an object's record is ``torch.save([obj])`` (DCP's bytes items) or ``torch.save(obj)``
    objects_in_lists = True

    def __init__(self, storage: Storage, allow_pickle: bool, checksums: Optional[Dict[Tuple[str, int], int]],
                 whole_records: bool = True):
        self.storage = storage
        self.allow_pickle = allow_pickle
        self.checksums = checksums or {}
        self.whole_records = whole_records
        self._files: Dict[str, RangeReader] = {}  # relative path -> open file
        self._headers: Dict[Tuple[str, int], Optional[TensorHeader]] = {}
        self._layouts: Layouts = {}  # blobs parsed, by length: the next of the same layout is not parsed again
        self._planned: Dict[str, List[Tuple[int, int]]] = {}  # relative path -> runs (offset, n) to read
        self._lock = threading.Lock()

    def plan(self, reads: Iterable[Union[TensorRead, ObjectRead]]) -> None:
        """The reads about to be run, by several threads: each file plans the runs of
        adjacent items smaller than :data:`PLANNED_ITEM_BYTES`
        (:meth:`~...storage.RangeReader.will_read_ranges`) when it is opened, so that an
        object store fetches many small records in a few large parallel requests, the next
        file's as soon as this one's are all being fetched (:meth:`_file`). (A larger item
        is announced by the thread that reads it: :func:`_read_into`.)"""
        items = [read.storage for read in reads]
        valid = [i for i in items if isinstance(i.relative_path, str) and isinstance(i.offset, int)
                 and isinstance(i.length, int) and i.offset >= 0 and 0 < i.length < PLANNED_ITEM_BYTES]
        for item in sorted(valid, key=lambda i: (i.relative_path, i.offset)):  # (others fail when read)
            runs = self._planned.setdefault(item.relative_path, [])
            if runs and item.offset == runs[-1][0] + runs[-1][1]:
                runs[-1] = (runs[-1][0], runs[-1][1] + item.length)
            else:
                runs.append((item.offset, item.length))

    def _file(self, relative_path: str) -> RangeReader:
        """The data file ``relative_path``, opened once; on opening, its planned runs are
        announced, and once they are all being fetched, the next planned file is opened too
        (so that its read-ahead starts before the threads reach it)."""
        with self._lock:
            file = self._files.get(relative_path)
            if file is not None:
                return file
            name = self._data_file_name(relative_path)
            try:
                file = self._files[relative_path] = self.storage.open_reader(name)
            except OSError as e:
                raise CheckpointingException(
                    f"Cannot open checkpoint data file {self.storage.describe(name)}: {e}") from e
        runs = [(a, n) for a, n in self._planned.get(relative_path, ()) if a + n <= file.size]
        if runs:  # (a claim beyond the file fails in its own read)
            file.will_read_ranges(runs, then=lambda: self._open_next(relative_path))
        return file

    def _data_file_name(self, relative_path: str) -> str:
        """The storage name of the data file a read names, once checked to be one of the
        checkpoint's own files (a crafted metadata cannot reach others)."""
        return checked_data_file_name(self.storage.describe(), relative_path)

    def _open_next(self, relative_path: str) -> None:
        """Open the planned file after ``relative_path`` (an error is left to its reads)."""
        order = sorted(self._planned)
        at = order.index(relative_path) + 1
        if at < len(order):
            try:
                self._file(order[at])
            except CheckpointingException:
                pass

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def _where(self, storage: _StorageInfo) -> str:
        return f"{self.storage.describe(storage.relative_path)}:{storage.offset}"

    def _open(self, key: str, storage: _StorageInfo) -> RangeReader:
        """The item's data file, once the file is known to hold the item's bytes."""
        file = self._file(storage.relative_path)
        if storage.offset < 0 or storage.length < 0 or storage.offset + storage.length > file.size:
            raise CheckpointingException(
                f"Item {key!r}: the checkpoint metadata claims bytes {storage.offset}..{storage.offset + storage.length} "
                f"of {self.storage.describe(storage.relative_path)}, which holds {file.size} bytes"
            )
        return file

    def _header(self, read: TensorRead, file: RangeReader) -> Optional[TensorHeader]:
        cache_key = (read.storage.relative_path, read.storage.offset)
        with self._lock:
            if cache_key in self._headers:
                return self._headers[cache_key]
        header = read_tensor_header(file, read.storage.offset, read.storage.length, self._layouts)
        if (header is not None and header.dtype == read.dtype and header.size != tuple(read.chunk[1])
                and header.is_contiguous() and math.prod(header.size) == math.prod(read.chunk[1])):
            header = TensorHeader(header.dtype, tuple(read.chunk[1]), contiguous_strides(read.chunk[1]),
                                  header.data_offset)
        if header is not None and (header.dtype != read.dtype or header.size != tuple(read.chunk[1])):
            raise CheckpointingException(
                f"Item {read.key!r} at {self._where(read.storage)} holds a "
                f"{header.dtype} tensor of shape {header.size}, but the metadata says {read.dtype} "
                f"{tuple(read.chunk[1])}"
            )
        with self._lock:
            self._headers[cache_key] = header
        return header

    def read_tensor(self, read: TensorRead) -> None:
        where = self._where(read.storage)
        file = self._open(read.key, read.storage)
        try:
            header = self._header(read, file)
        except CheckpointingException:
            raise
        except OSError as e:
            raise CheckpointingException(f"Reading item {read.key!r} at {where} failed: {e}") from e
        except Exception as e:  # noqa: BLE001 - damaged archive
            raise CheckpointingException(f"Item {read.key!r} at {where} is damaged: {e}") from e
        dest = read.dest[relative_slices(read.overlap, read.dest_origin)]
        expected = self.checksums.get((read.storage.relative_path, read.storage.offset))
        what = f"tensor {read.key!r} (chunk at {tuple(read.chunk[0])})"
        if header is None:
            return self._read_tensor_via_torch_load(read, file, dest, where, expected, what)
        rel = [o - c for o, c in zip(read.overlap[0], read.chunk[0])]
        first = sum(r * st for r, st in zip(rel, header.stride))
        last = sum((r + s - 1) * st for r, s, st in zip(rel, read.overlap[1], header.stride))
        itemsize = read.dtype.itemsize  # as stored
        whole = tuple(read.overlap[1]) == tuple(read.chunk[1])
        # A checksum covers the chunk's whole data span (data-only checksums: of a contiguous chunk).
        verify = expected is not None and (self.whole_records or header.is_contiguous())
        if verify:  # read the whole span; with whole_records the rest of the record is hashed too
            read_from, read_to = 0, header.span_elements() - 1
        else:
            read_from, read_to = first, last
        data = (header.data_offset + read_from * itemsize, (read_to - read_from + 1) * itemsize)
        verifier = RecordVerifier(file, (read.storage.offset, read.storage.length), data, expected,
                                  self.whole_records, what, where) if verify else None
        if (whole and header.is_contiguous() and dest.device.type == "cpu" and dest.is_contiguous()
                and dest.dtype == read.dtype):
            _read_into(file, tensor_bytes(dest), header.data_offset, where, what, verifier)
            return
        span = torch.empty(data[1], dtype=torch.uint8)
        _read_into(file, span.numpy(), data[0], where, what, verifier)
        src = torch.as_strided(span.view(read.dtype), read.overlap[1], header.stride, first - read_from)
        dest.copy_(src)  # casts a chunk stored in another dtype

    def _read_tensor_via_torch_load(self, read: TensorRead, file: RangeReader, dest: torch.Tensor, where: str,
                                    expected: Optional[int], what: str) -> None:
        raw = self._read_record(file, read.storage, where, what, expected if self.whole_records else None)
        loaded = safe_torch_load(raw, f"item {read.key!r} at {where}", self.allow_pickle)
        if is_float8tensor(loaded):  # a pickled Transformer Engine FP8 tensor (Megatron-Core's FP8 saves)
            loaded = dequantize(loaded)
        if not isinstance(loaded, torch.Tensor) or tuple(loaded.shape) != tuple(read.chunk[1]):
            raise CheckpointingException(f"Item {read.key!r} at {where} does not hold the expected tensor")
        if expected is not None and not self.whole_records and checksum(tensor_bytes(loaded.contiguous())) != expected:
            raise mismatch_error(what, where)
        rel = tuple(slice(o - c, o - c + s) for o, c, s in zip(read.overlap[0], read.chunk[0], read.overlap[1]))
        dest.copy_(loaded[rel])

    def read_object(self, read: ObjectRead) -> None:
        where = self._where(read.storage)
        what = f"ShardedObject {read.key!r}"
        file = self._open(read.key, read.storage)
        expected = self.checksums.get((read.storage.relative_path, read.storage.offset))
        raw = self._read_record(file, read.storage, where, what, expected)
        loaded = safe_torch_load(raw, f"{what} at {where}", self.allow_pickle)
        if not self.objects_in_lists:
            loaded = [loaded]
        elif not (isinstance(loaded, list) and len(loaded) == 1):
            raise CheckpointingException(f"{what} at {where} has an unexpected layout")
        read.result.append(loaded[0])

    @staticmethod
    def _read_record(file: RangeReader, storage: _StorageInfo, where: str, what: str, expected: Optional[int]) -> bytes:
        """An item's whole record (inside its file: see :meth:`_open`), verified against
        ``expected`` if given, before anything unpickles it."""
        raw = _read_bytes(file, storage.offset, storage.length, where, what)
        if len(raw) != storage.length:
            raise CheckpointingException(f"{what} at {where} is truncated")
        if expected is not None and checksum(raw) != expected:
            raise mismatch_error(what, where)
        return raw


def read_nbytes(read: Union[TensorRead, ObjectRead]) -> int:
    """The bytes one read delivers (progress reports): a tensor's requested overlap, an
    object's record."""
    if isinstance(read, TensorRead):
        return math.prod(read.overlap[1]) * read.dtype.itemsize
    return read.storage.length


_VERIFY_PIECE = 1 << 20  # hash what was just read while it is still in the CPU cache
PLANNED_ITEM_BYTES = 32 << 20  # smaller items are planned per file (Reader.plan); larger ones, per thread


def _read_bytes(file: RangeReader, offset: int, n: int, where: str, what: str) -> bytes:
    """``n`` bytes at ``offset``; a storage error names the item and the file."""
    try:
        return file.read(offset, n)
    except OSError as e:
        raise CheckpointingException(f"Reading {what} at {where} failed: {e}") from e


def _read_into(file: RangeReader, buf, offset: int, where: str, what: str,
               verifier: Optional[RecordVerifier] = None) -> None:
    """Fill ``buf`` from ``file`` at ``offset``; with a ``verifier``, check the record's checksum."""
    mv = memoryview(buf).cast("B")
    piece = _VERIFY_PIECE if verifier is not None else mv.nbytes
    if piece < mv.nbytes:
        file.will_read(offset, mv.nbytes)
    done = 0
    while done < mv.nbytes:
        try:
            n = file.readinto(mv[done:done + piece], offset + done)
        except OSError as e:
            raise CheckpointingException(f"Reading {what} at {where} failed: {e}") from e
        if n <= 0:
            raise CheckpointingException(f"Unexpected end of file reading {what} at {where}")
        if verifier is not None:
            verifier.update(mv[done:done + n])
        done += n
    if verifier is not None:
        verifier.finish()
