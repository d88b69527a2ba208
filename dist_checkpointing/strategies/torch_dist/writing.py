"""Writing a rank's data files: :func:`write_files` (each file through
:func:`~..filesystem_async.write_file` on its own thread), here or in the persistent writer
process from a staging arena (:func:`arena_plan`, then :func:`arena_records`, the files as
:func:`~..records.write_from_arena` receives them there)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ...storage import Storage
from ..blob_template import blob_parts
from ..filesystem_async import _exact_cpu_tensor, payload_nbytes, write_file
from ..records import ArenaRecord, Span, write_record_files
from ..staging import arena_layout
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
    return locations(files, write_record_files(_write_file, payloads, storage, checksums, thread_count,
                                               payload_nbytes))


def locations(files: Dict[str, List[SaveItem]], spans: Sequence[Sequence[Span]]) -> List[Location]:
    """The location of every item of ``files`` from the spans written for each file."""
    return [(it.key, it.tensor_meta, fname, off, length, cs)
            for (fname, items), file_spans in zip(files.items(), spans)
            for it, (off, length, cs) in zip(items, file_spans)]


def arena_plan(files: Dict[str, List[SaveItem]]) -> Tuple[List[torch.Tensor], List[int], int]:
    """Where each tensor of ``files`` goes in a staging arena: ``(tensors, offsets, arena size)``."""
    tensors = [it.payload for items in files.values() for it in items if isinstance(it.payload, torch.Tensor)]
    offsets, size = arena_layout(tensors)
    return tensors, offsets, size


def _arena_view(flat: torch.Tensor, offset: int, t: torch.Tensor) -> torch.Tensor:
    return flat[offset:offset + payload_nbytes(t)].view(t.dtype).view(t.shape)


def arena_files(files: Dict[str, List[SaveItem]], offsets: Sequence[int], flat: torch.Tensor) -> Dict[str, List[SaveItem]]:
    """``files`` with their tensors replaced by their copies in the arena ``flat`` (at ``offsets``)."""
    where = iter(offsets)
    return {fname: [SaveItem(it.key, _arena_view(flat, next(where), it.payload), it.nbytes, it.tensor_meta)
                     if isinstance(it.payload, torch.Tensor) else it for it in items]
            for fname, items in files.items()}


def arena_records(files: Dict[str, List[SaveItem]], offsets: Sequence[int], flat: torch.Tensor
                  ) -> Tuple[Dict[str, List[ArenaRecord]], List[Tuple[bytes, bytes]]]:
    """``files`` as the persistent writer receives them (no torch types: it has no torch):
    each file's records and the blob templates (:mod:`..blob_template`) they refer to."""
    where = iter(offsets)
    index: Dict[Tuple[torch.dtype, Tuple[int, ...]], int] = {}
    templates: List[Tuple[bytes, bytes]] = []
    sent: Dict[str, List[ArenaRecord]] = {}
    for fname, items in files.items():
        records: List[ArenaRecord] = []
        for it in items:
            t = it.payload
            if not isinstance(t, torch.Tensor):
                records.append(t)
                continue
            offset, key = next(where), (t.dtype, tuple(t.shape))
            if key not in index:
                index[key] = len(templates)
                templates.append(blob_parts(t.dtype, key[1], lambda: _exact_cpu_tensor(_arena_view(flat, offset, t))))
            records.append((offset, payload_nbytes(t), index[key]))
        sent[fname] = records
    return sent, templates
