"""Reading whole global tensors of a checkpoint, one at a time, in one process (for the
offline tools), with every size the ``.metadata`` claims checked against the stored bytes
before anything is allocated for it.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import replace
from typing import Any, Dict, List, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from .bytes_view import nbytes
from .core import CheckpointingException, Location, malformed, open_storage
from .serialization import load_tensors_metadata
from .strategies.torch_dist.format import checked_data_file_name, original_global_shape
from .strategies.torch_dist.load import TorchDistLoadShardedStrategy
from .strategies.torch_dist.metadata import read_metadata


def _return_freed_memory() -> None:
    """Give freed heap memory back to the system (glibc keeps it otherwise, so temporary
    read buffers would stay resident for the rest of a long export)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def range_problem(checkpoint_dir: Location, index: MetadataIndex, storage: Any, file_sizes: Dict[str, int]) -> Optional[str]:
    """Why the byte range ``storage`` recorded for ``index`` is not inside its data file
    (``None`` if it is); ``file_sizes`` caches each file's size (-1: missing)."""
    what = f"item {index.fqn!r}" + (f" (chunk at {tuple(index.offset)})" if index.offset is not None else "")
    files = open_storage(checkpoint_dir)
    name = checked_data_file_name(files.describe(), storage.relative_path)
    if storage.relative_path not in file_sizes:
        info = files.info(name)
        file_sizes[storage.relative_path] = info.size if info is not None else -1
    size = file_sizes[storage.relative_path]
    if size < 0:
        return f"{what}: data file {storage.relative_path} is missing"
    if storage.offset < 0 or storage.length < 0 or storage.offset + storage.length > size:
        return (f"{what}: {storage.relative_path} has {size} bytes, the item needs bytes "
                f"{storage.offset}..{storage.offset + storage.length}")
    return None


def _check_claimed_sizes(checkpoint_dir: Location, metadata: Metadata, keys: List[str]) -> None:
    """Refuse sizes in ``.metadata`` that the stored bytes cannot back, before anything is
    allocated for them: each chunk's byte range must lie inside its data file and hold at
    least the chunk's bytes, and the chunks' ranges together at least the whole tensor's."""
    file_sizes: Dict[str, int] = {}
    where = open_storage(checkpoint_dir).describe(".metadata")
    for key in keys:
        with malformed(f"{where}: the entry of tensor {key!r} is malformed"):
            md = metadata.state_dict_metadata[key]
            itemsize = md.properties.dtype.itemsize
            stored, files = 0, set()
            for chunk in md.chunks:
                index = MetadataIndex(key, chunk.offsets)
                storage = metadata.storage_data.get(index)
                if storage is None:
                    raise CheckpointingException(f"{where} has no storage entry for chunk {tuple(chunk.offsets)} "
                                                 f"of tensor {key!r}")
                problem = range_problem(checkpoint_dir, index, storage, file_sizes)
                if problem is None and math.prod(chunk.sizes) * itemsize > storage.length:
                    problem = (f"tensor {key!r}: its chunk at {tuple(chunk.offsets)} of size {tuple(chunk.sizes)} "
                               f"needs {math.prod(chunk.sizes) * itemsize} bytes, {storage.relative_path} stores "
                               f"it in {storage.length}")
                if problem is not None:
                    raise CheckpointingException(f"{checkpoint_dir}: {problem}")
                stored += storage.length
                files.add(storage.relative_path)
            shape = original_global_shape(metadata, key) or tuple(md.size)
            if nbytes(shape, md.properties.dtype) > stored:
                raise CheckpointingException(
                    f"{checkpoint_dir}: tensor {key!r} of shape {shape} ({md.properties.dtype}) needs "
                    f"{nbytes(shape, md.properties.dtype)} bytes, its chunks are stored in {stored} bytes "
                    f"(of {', '.join(sorted(files)) or 'no data file'})")


class TensorReader:
    """Reads whole global tensors one at a time into one reused buffer. Chunks that are
    not contiguous in the whole tensor pass through a temporary buffer of at most one
    chunk, freed after each tensor. The sizes the metadata claims are checked against
    the stored bytes before the buffer is allocated."""

    def __init__(self, checkpoint_dir: Location, keys: List[str]):
        self.dir = checkpoint_dir
        self.meta = load_tensors_metadata(checkpoint_dir)
        _check_claimed_sizes(checkpoint_dir, read_metadata(checkpoint_dir), keys)
        # One reader thread: at most one temporary chunk buffer at a time.
        self.strategy = TorchDistLoadShardedStrategy(thread_count=1)
        largest = max((nbytes(tuple(self.meta[k].global_shape), self.meta[k].dtype) for k in keys), default=0)
        with malformed(f"Reading the tensors of {checkpoint_dir}: no buffer for the largest ({largest} bytes)"):
            self._buffer = torch.empty(largest, dtype=torch.uint8)

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (a view of the reused buffer: valid until the next read)."""
        sh = self.meta[key]
        shape = tuple(sh.global_shape)
        view = self._buffer[:nbytes(shape, sh.dtype)].view(sh.dtype).view(shape)
        self.strategy.load_local({key: replace(sh, data=view)}, self.dir)
        self.strategy.release_scratch()
        _return_freed_memory()
        return view

    def close(self) -> None:
        self.strategy.release_scratch()
