"""Writing a rank's data files: :func:`write_files` (each file through
:func:`~..filesystem_async.write_file` on its own thread), here or in the persistent writer
process from a staging arena (:func:`arena_plan`, then :func:`arena_records`, the files as
:func:`~..records.write_from_arena` receives them there)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...storage import Storage
from ...tensors.bytes_view import nbytes
from ..blob_template import blob_parts
from ..filesystem_async import _exact_cpu_tensor, payload_nbytes, write_file
from ..records import ArenaRecord, Span, write_record_files
from ...runtime.arenas import arena_layout
from .metadata import Location
from .save_plan import SaveItem


def _write_file(*args) -> List[Span]:
    return write_file(*args)  # looked up at each call: tests slow or break it


def write_files(files: Dict[str, List[SaveItem]], storage: Storage, checksums: bool,
                thread_count: int) -> List[Location]:
    """Write each file (files in parallel on ``thread_count`` threads); the location of
    every item written. The bytes written are reported to the caller's progress sink, if
    any (:mod:`..progress`)."""
    payloads = {fname: [it.payload for it in items] for fname, items in files.items()}
    spans = write_record_files(_write_file, payloads, storage, checksums, thread_count, payload_nbytes)
    return locations({fname: [(it.key, it.tensor_meta) for it in items] for fname, items in files.items()}, spans)


def locations(files: Dict[str, Sequence[Tuple[Any, ...]]], spans: Sequence[Sequence[Span]]) -> List[Location]:
    """The location of every item of ``files`` (each item's key and tensor_meta first) from
    the spans written for each file."""
    return [(item[0], item[1], fname, off, length, cs)
            for (fname, items), file_spans in zip(files.items(), spans)
            for item, (off, length, cs) in zip(items, file_spans)]


# An item of an arena-mode save once staged: its key, tensor_meta and either the bytes of a
# ShardedObject or where its tensor lies in the arena (offset, dtype, shape). The plan keeps
# no reference to the source tensors, so they can be freed once copied.
ArenaItem = Tuple[str, Optional[tuple], Union[bytes, Tuple[int, torch.dtype, Tuple[int, ...]]]]


def arena_plan(files: Dict[str, List[SaveItem]]
               ) -> Tuple[List[torch.Tensor], List[int], int, Dict[str, List[ArenaItem]]]:
    """Where each tensor of ``files`` goes in a staging arena: ``(tensors, offsets, arena
    size, the files as arena items)``."""
    tensors = [it.payload for items in files.values() for it in items if isinstance(it.payload, torch.Tensor)]
    offsets, size = arena_layout(tensors)
    where = iter(offsets)
    plan = {fname: [(it.key, it.tensor_meta,
                     (next(where), it.payload.dtype, tuple(it.payload.shape))
                     if isinstance(it.payload, torch.Tensor) else it.payload) for it in items]
            for fname, items in files.items()}
    return tensors, offsets, size, plan


def _arena_view(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    return flat[offset:offset + nbytes(shape, dtype)].view(dtype).view(shape)


def arena_files(plan: Dict[str, List[ArenaItem]], flat: torch.Tensor) -> Dict[str, List[SaveItem]]:
    """The files of :func:`arena_plan` with their tensors as views of the arena ``flat``."""
    files: Dict[str, List[SaveItem]] = {}
    for fname, items in plan.items():
        files[fname] = []
        for key, meta, payload in items:
            if isinstance(payload, tuple):
                payload = _arena_view(flat, *payload)
            files[fname].append(SaveItem(key, payload, payload_nbytes(payload), meta))
    return files


def arena_records(plan: Dict[str, List[ArenaItem]], flat: torch.Tensor
                  ) -> Tuple[Dict[str, List[ArenaRecord]], List[Tuple[bytes, bytes]]]:
    """The files of :func:`arena_plan` as the persistent writer receives them (no torch
    types: it has no torch): each file's records and the blob templates
    (:mod:`..blob_template`) they refer to."""
    index: Dict[Tuple[torch.dtype, Tuple[int, ...]], int] = {}
    templates: List[Tuple[bytes, bytes]] = []
    sent: Dict[str, List[ArenaRecord]] = {}
    for fname, items in plan.items():
        records: List[ArenaRecord] = []
        for _, _, payload in items:
            if not isinstance(payload, tuple):
                records.append(payload)
                continue
            offset, dtype, shape = payload
            if (dtype, shape) not in index:
                index[dtype, shape] = len(templates)
                templates.append(blob_parts(dtype, shape, lambda: _exact_cpu_tensor(_arena_view(flat, *payload))))
            records.append((offset, nbytes(shape, dtype), index[dtype, shape]))
        sent[fname] = records
    return sent, templates
