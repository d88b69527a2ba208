"""Reading whole global tensors of a checkpoint, one at a time, in one process (for the
offline tools), through the checkpoint's load strategy: every size its catalog of stored
items claims is checked against the stored bytes before anything is allocated for it.

Owns: ``TensorReader``: whole global tensors one at a time into one reused buffer, through
the checkpoint's load strategy (``offline_reader().load_local``), the sizes its catalog
claims checked against the files first.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import replace
from typing import List, Optional

import torch

from ..tensors.bytes_view import nbytes
from ..core import CheckpointingException, Location, malformed, open_storage
from ..readers import get_default_load_sharded_strategy, load_tensors_metadata
from ..strategies.base import StoredItems


def _return_freed_memory() -> None:
    """Give freed heap memory back to the system (glibc keeps it otherwise, so temporary
    read buffers would stay resident for the rest of a long export)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _check_claimed_sizes(checkpoint_dir: Location, items: StoredItems, keys: List[str]) -> None:
    """Refuse sizes in the catalog that the stored bytes cannot back, before anything is
    allocated for them: each chunk's byte range must lie inside its file and hold at least
    the chunk's bytes, and the chunks' ranges together at least the whole tensor's."""
    where = open_storage(checkpoint_dir).describe()
    wanted = set(keys)
    for t in items.tensors:
        if t.key not in wanted:
            continue
        with malformed(f"{where}: the entry of tensor {t.key!r} is malformed"):
            stored, files = 0, set()
            for chunk in t.chunks:
                if chunk.location is None:
                    raise CheckpointingException(f"{where} has no storage entry for chunk {chunk.offsets} "
                                                 f"of tensor {t.key!r}")
                at = chunk.location
                problem = items.range_problem(f"item {t.key!r} (chunk at {chunk.offsets})", at)
                if problem is None and math.prod(chunk.sizes) * t.dtype.itemsize > at.length:
                    problem = (f"tensor {t.key!r}: its chunk at {chunk.offsets} of size {chunk.sizes} "
                               f"needs {math.prod(chunk.sizes) * t.dtype.itemsize} bytes, {at.file} stores "
                               f"it in {at.length}")
                if problem is not None:
                    raise CheckpointingException(f"{checkpoint_dir}: {problem}")
                stored += at.length
                files.add(at.file)
            if t.nbytes > stored:
                raise CheckpointingException(
                    f"{checkpoint_dir}: tensor {t.key!r} of shape {t.shape} ({t.dtype}) needs "
                    f"{t.nbytes} bytes, its chunks are stored in {stored} bytes "
                    f"(of {', '.join(sorted(files)) or 'no data file'})")


class TensorReader:
    """Reads whole global tensors one at a time into one reused buffer. Chunks that are
    not contiguous in the whole tensor pass through a temporary buffer of at most one
    chunk, freed after each tensor. The sizes the metadata claims are checked against
    the stored bytes before the buffer is allocated."""

    def __init__(self, checkpoint_dir: Location, keys: List[str], items: Optional[StoredItems] = None):
        self.dir = checkpoint_dir
        self.meta = load_tensors_metadata(checkpoint_dir)
        strategy = get_default_load_sharded_strategy(checkpoint_dir)
        items = items if items is not None else strategy.stored_items(checkpoint_dir)
        if items.located:  # a strategy that does not locate its items checks its own reads
            _check_claimed_sizes(checkpoint_dir, items, keys)
        self.strategy = strategy.offline_reader()
        largest = max((nbytes(tuple(self.meta[k].global_shape), self.meta[k].dtype) for k in keys), default=0)
        with malformed(f"Reading the tensors of {checkpoint_dir}: no buffer for the largest ({largest} bytes)"):
            self._buffer = torch.empty(largest, dtype=torch.uint8)

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (a view of the reused buffer: valid until the next read)."""
        sh = self.meta[key]
        shape = tuple(sh.global_shape)
        view = self._buffer[:nbytes(shape, sh.dtype)].view(sh.dtype).view(shape)
        # a flattened key's request is 1-D (the whole range): the same buffer, read in place
        self.strategy.load_local({key: replace(sh, data=view if sh.flattened_range is None else view.reshape(-1))},
                                 self.dir)
        self.strategy.release_scratch()
        _return_freed_memory()
        return view

    def close(self) -> None:
        self.strategy.release_scratch()
