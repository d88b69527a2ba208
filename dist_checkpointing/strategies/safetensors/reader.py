"""The bytes of a request read from safetensors files: each stored tensor is row-major at
a known offset, so a requested region is a set of contiguous runs of the file (one for a
shard along the first axis, one per row for a shard along the last). Each run is read
straight into the destination when it can be (same dtype, contiguous, on the CPU), and
the runs are announced to the storage before the reads (an object store fetches them in
parallel ranged requests). Runs shorter than :data:`MIN_RUN_BYTES` are read as the span
from the first to the last (the disk reads whole pages anyway)."""

from __future__ import annotations

import math
from typing import Iterable, List, Set, Tuple, Union

import torch

from ...core import CheckpointingException
from ...tensors.bytes_view import tensor_bytes
from ..resharding import contiguous_strides, relative_slices
from ..torch_dist.load_plan import ObjectRead, TensorRead
from ..torch_dist.reader import PLANNED_ITEM_BYTES, Reader, _read_into

#: runs shorter than this are read as one span with the gaps between them
MIN_RUN_BYTES = 4096

Runs = List[Tuple[int, int]]  # (file offset, byte count)


def tensor_runs(read: TensorRead) -> Tuple[Runs, bool]:
    """The file's byte runs holding the read's overlap, in row-major order of the overlap,
    and whether they are exact (``False``: one span, gaps included)."""
    shape, itemsize = tuple(read.chunk[1]), read.dtype.itemsize
    rel = [o - c for o, c in zip(read.overlap[0], read.chunk[0])]
    sizes = tuple(read.overlap[1])
    base = read.storage.offset
    if math.prod(sizes) == 0:
        return [], True
    if not shape:
        return [(base, itemsize)], True
    strides = contiguous_strides(shape)
    # the last axis not taken whole: the runs are the overlap's rows along it and the axes after
    axis = len(shape) - 1
    while axis > 0 and sizes[axis] == shape[axis] and rel[axis] == 0:
        axis -= 1
    run = sizes[axis] * strides[axis] * itemsize
    first = sum(r * s for r, s in zip(rel, strides)) * itemsize
    if axis == 0:
        return [(base + first, run)], True
    count = math.prod(sizes[:axis])
    if run < MIN_RUN_BYTES and count > 1:
        last = sum((r + s - 1) * st for r, s, st in zip(rel, sizes, strides)) * itemsize + itemsize
        return [(base + first, last - first)], False
    outer = [range(r, r + s) for r, s in zip(rel[:axis], sizes[:axis])]
    runs: Runs = []
    for index in _product(outer):
        start = sum(i * st for i, st in zip(index, strides)) + rel[axis] * strides[axis]
        runs.append((base + start * itemsize, run))
    return runs, True


def _product(ranges: List[range]) -> Iterable[Tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (head,) + rest


class SafetensorsReader(Reader):
    """Reads :class:`~..torch_dist.load_plan.TensorRead` s whose storage entries are raw
    row-major tensors of the safetensors files ``files`` (no pickles, no checksums)."""

    def __init__(self, storage, files: Set[str]):
        super().__init__(storage, allow_pickle=False, checksums=None)
        self.files = set(files)

    def _data_file_name(self, relative_path: str) -> str:
        if relative_path not in self.files:
            raise CheckpointingException(f"{self.storage.describe(str(relative_path))} is not a file of this checkpoint")
        return relative_path

    def plan(self, reads: Iterable[Union[TensorRead, ObjectRead]]) -> None:
        """Announce the runs of ``reads`` (by file, sorted) before they are read."""
        for read in reads:
            if isinstance(read, TensorRead):
                for offset, n in tensor_runs(read)[0]:
                    if 0 < n < PLANNED_ITEM_BYTES:
                        self._planned.setdefault(read.storage.relative_path, []).append((offset, n))
        for runs in self._planned.values():
            runs.sort()
            merged: Runs = []
            for offset, n in runs:
                if merged and offset <= merged[-1][0] + merged[-1][1]:
                    end = max(merged[-1][0] + merged[-1][1], offset + n)
                    merged[-1] = (merged[-1][0], end - merged[-1][0])
                else:
                    merged.append((offset, n))
            runs[:] = merged

    def read_tensor(self, read: TensorRead) -> None:
        where = self._where(read.storage)
        file = self._open(read.key, read.storage)
        what = f"tensor {read.key!r}"
        dest = read.dest[relative_slices(read.overlap, read.dest_origin)]
        runs, exact = tensor_runs(read)
        total = sum(n for _, n in runs)
        direct = exact and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == read.dtype
        span = None if direct else torch.empty(total, dtype=torch.uint8)
        buf = tensor_bytes(dest if direct else span)
        done = 0
        for offset, n in runs:
            _read_into(file, buf[done:done + n], offset, where, what)
            done += n
        if direct:
            return
        values = span.view(read.dtype)
        if exact:
            src = values.view(tuple(read.overlap[1]))
        else:  # the span from the first run to the last: the overlap's strides within the stored tensor
            src = torch.as_strided(values, tuple(read.overlap[1]), contiguous_strides(read.chunk[1]))
        dest.copy_(src)  # casts to the request's dtype, moves to its device

    def read_object(self, read: ObjectRead) -> None:
        raise CheckpointingException(f"{read.key!r}: a safetensors checkpoint holds tensors only")
