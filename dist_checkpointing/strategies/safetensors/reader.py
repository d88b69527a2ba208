"""The bytes of a request read from safetensors files: each stored tensor is row-major at
a known offset, so a requested region is a set of equal runs of the file (one for a shard
along the first axis, one per row for a shard along the last). The runs are computed once
per read (numpy), announced to the storage before the reads (an object store fetches them
in parallel ranged requests), and read by one :meth:`~...storage.RangeReader.readinto_runs`
call — straight into the destination when it can be (same dtype, contiguous, on the
CPU). Runs shorter than :data:`MIN_RUN_BYTES` are read as the span from the first to the
last."""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Set, Tuple, Union

import numpy as np
import torch

from ...core import CheckpointingException
from ...tensors.bytes_view import tensor_bytes
from ..resharding import contiguous_strides, relative_slices
from ..torch_dist.load_plan import ObjectRead, TensorRead
from ..torch_dist.reader import PLANNED_ITEM_BYTES, Reader

#: runs shorter than this are read as one span with the gaps between them (the span costs
#: less than a read per run there)
MIN_RUN_BYTES = 1024


#: ``(starts, length, exact)``: the file offsets of equal runs of ``length`` bytes holding a
#: read's overlap in its row-major order; ``exact=False``: one span, gaps included
Runs = Tuple[List[int], int, bool]


def tensor_runs(read: TensorRead) -> Runs:
    """The runs of ``read`` (see :data:`Runs`)."""
    shape, itemsize = tuple(read.chunk[1]), read.dtype.itemsize
    rel = [o - c for o, c in zip(read.overlap[0], read.chunk[0])]
    sizes = tuple(read.overlap[1])
    base = read.storage.offset
    if math.prod(sizes) == 0:
        return [], 0, True
    if not shape:
        return [base], itemsize, True
    strides = contiguous_strides(shape)
    # the last axis not taken whole: the runs are the overlap's rows along it and the axes after
    axis = len(shape) - 1
    while axis > 0 and sizes[axis] == shape[axis] and rel[axis] == 0:
        axis -= 1
    run = sizes[axis] * strides[axis] * itemsize
    first = sum(r * s for r, s in zip(rel, strides)) * itemsize
    if axis == 0:
        return [base + first], run, True
    if run < MIN_RUN_BYTES:
        last = sum((r + s - 1) * st for r, s, st in zip(rel, sizes, strides)) * itemsize + itemsize
        return [base + first], last - first, False
    starts = np.zeros(1, dtype=np.int64)
    for i in range(axis):
        starts = np.add.outer(starts, (rel[i] + np.arange(sizes[i], dtype=np.int64)) * strides[i]).ravel()
    return (base + (starts + rel[axis] * strides[axis]) * itemsize).tolist(), run, True


class SafetensorsReader(Reader):
    """Reads :class:`~..torch_dist.load_plan.TensorRead` s whose storage entries are raw
    row-major tensors of the safetensors files ``files`` (no pickles, no checksums)."""

    def __init__(self, storage, files: Set[str]):
        super().__init__(storage, allow_pickle=False, checksums=None)
        self.files = set(files)
        self._runs: Dict[int, Runs] = {}  # id(read) -> its runs

    def _data_file_name(self, relative_path: str) -> str:
        if relative_path not in self.files:
            raise CheckpointingException(f"{self.storage.describe(str(relative_path))} is not a file of this checkpoint")
        return relative_path

    def plan(self, reads: Iterable[Union[TensorRead, ObjectRead]]) -> None:
        """Compute the runs of ``reads`` and announce them, by file, merged, before they are read."""
        by_file: Dict[str, List[np.ndarray]] = {}
        for read in reads:
            if isinstance(read, TensorRead):
                runs = self._runs[id(read)] = tensor_runs(read)
                if runs[0] and 0 < runs[1] < PLANNED_ITEM_BYTES:
                    by_file.setdefault(read.storage.relative_path, []).append(
                        np.array(runs[0], dtype=np.int64) + np.array([[0], [runs[1]]], dtype=np.int64))
        for name, pieces in by_file.items():
            lo, hi = np.concatenate(pieces, axis=1)
            order = np.argsort(lo, kind="stable")
            lo, hi = lo[order], np.maximum.accumulate(hi[order])
            new = np.ones(len(lo), dtype=bool)
            new[1:] = lo[1:] > hi[:-1]  # a run starting after every earlier one ended starts a range
            first = np.flatnonzero(new)
            ends = np.append(first[1:], len(lo)) - 1
            self._planned[name] = list(zip(lo[first].tolist(), (hi[ends] - lo[first]).tolist()))

    def read_tensor(self, read: TensorRead) -> None:
        where = self._where(read.storage)
        file = self._open(read.key, read.storage)
        dest = read.dest[relative_slices(read.overlap, read.dest_origin)]
        runs = self._runs.pop(id(read), None) or tensor_runs(read)
        starts, length, exact = runs
        total = len(starts) * length
        direct = exact and dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == read.dtype
        span = None if direct else torch.empty(total, dtype=torch.uint8)
        try:
            file.readinto_runs(tensor_bytes(dest if direct else span), starts, length)
        except OSError as e:
            raise CheckpointingException(f"Reading tensor {read.key!r} at {where} failed: {e}") from e
        except EOFError as e:
            raise CheckpointingException(f"Unexpected end of file reading tensor {read.key!r} at {where}: {e}") from e
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
