"""Writing a rank's data files: :func:`write_files` (each file through
:func:`~..filesystem_async.write_file` on its own thread), here or in the persistent writer
process from a staging arena (:func:`arena_plan`, then :func:`write_from_arena` run by
:mod:`..persistent_worker`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ...storage import Storage
from ..filesystem_async import payload_nbytes, write_file
from ..persistent_worker import arena_bytes
from ..progress import byte_meter
from ..staging import arena_layout
from .metadata import Location
from .save_plan import SaveItem

# How an item travels to the persistent writer: its key, tensor_meta and either the bytes of
# a ShardedObject or where its tensor lies in the arena (offset, dtype, shape).
ArenaItem = Tuple[str, Optional[tuple], Union[bytes, Tuple[int, torch.dtype, Tuple[int, ...]]]]


def write_files(files: Dict[str, List[SaveItem]], storage: Storage, checksums: bool,
                thread_count: int) -> List[Location]:
    """Write each file (files in parallel on ``thread_count`` threads); the location of
    every item written. The bytes written are reported to the caller's progress sink, if
    any (:mod:`..progress`)."""
    payloads = [[it.payload for it in items] for items in files.values()]
    meter = byte_meter("write", sum(payload_nbytes(p) for ps in payloads for p in ps))
    args = (repeat(storage), files, payloads, repeat(checksums), repeat(meter and meter.add))
    if len(files) <= 1:
        spans = list(map(write_file, *args))
    else:
        with ThreadPoolExecutor(min(thread_count, len(files))) as pool:
            spans = list(pool.map(write_file, *args))
    if meter is not None:
        meter.finish()
    return [(it.key, it.tensor_meta, fname, off, length, cs)
            for fname, file_spans in zip(files, spans) for it, (off, length, cs) in zip(files[fname], file_spans)]


def arena_plan(files: Dict[str, List[SaveItem]]) -> Tuple[List[torch.Tensor], List[int], int, Dict[str, List[ArenaItem]]]:
    """Where each tensor of ``files`` goes in a staging arena: ``(tensors, offsets, arena
    size, the files as the persistent writer receives them)``."""
    tensors = [it.payload for items in files.values() for it in items if isinstance(it.payload, torch.Tensor)]
    offsets, size = arena_layout(tensors)
    where = iter(offsets)
    sent: Dict[str, List[ArenaItem]] = {}
    for fname, items in files.items():
        sent[fname] = [(it.key, it.tensor_meta,
                        (next(where), it.payload.dtype, tuple(it.payload.shape))
                        if isinstance(it.payload, torch.Tensor) else it.payload) for it in items]
    return tensors, offsets, size, sent


def arena_files(sent: Dict[str, List[ArenaItem]], flat: torch.Tensor) -> Dict[str, List[SaveItem]]:
    """The files of :func:`arena_plan` with their tensors as views of the arena ``flat``."""
    files: Dict[str, List[SaveItem]] = {}
    for fname, items in sent.items():
        files[fname] = []
        for key, meta, payload in items:
            if isinstance(payload, tuple):
                offset, dtype, shape = payload
                n = dtype.itemsize
                for d in shape:
                    n *= d
                payload = flat[offset:offset + n].view(dtype).view(shape)
            files[fname].append(SaveItem(key, payload, payload_nbytes(payload), meta))
    return files


def write_from_arena(spec: Tuple[Callable[..., Storage], Tuple[Any, ...]], arena_id: int,
                     sent: Dict[str, List[ArenaItem]], checksums: bool, thread_count: int) -> List[Location]:
    """In the persistent writer: write the files of :func:`arena_plan` from arena
    ``arena_id`` into the storage ``spec`` opens."""
    factory, args = spec
    flat = torch.frombuffer(arena_bytes(arena_id), dtype=torch.uint8)
    return write_files(arena_files(sent, flat), factory(*args), checksums, thread_count)
