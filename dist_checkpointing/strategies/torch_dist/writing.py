"""Writing a rank's data files: :func:`write_files` (each file through :func:`write_file` on
its own thread, its bytes by :func:`..records.write_records` into the storage: three modules
from ``save`` to a :class:`~...storage.Storage`), here or in the persistent writer
process from a staging arena (:func:`arena_plan`, then :func:`arena_records`, the files as
:func:`~..records.write_from_arena` receives them there).

Owns: a rank's data files from its save items: ``write_files`` (sync: ``write_file`` per
file on its own thread — a payload as a record, a tensor's host copy made just before it is
written, its bytes by ``records.write_records``: ``save`` → ``writing`` → ``records`` →
``Storage``), ``locations``, ``arena_plan`` (where each tensor goes in the arena; the plan
keeps no reference to the source tensors) / ``arena_files`` / ``arena_records`` (an
arena-mode save's files: as views of the arena, or as the persistent writer receives them —
offsets, byte counts, blob templates, object bytes: no torch types).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...storage import Storage
from ...tensors.bytes_view import as_bytes, nbytes, tensor_bytes
from ...tensors.values import plain_values
from .blob_template import blob_parts
from .records import ArenaRecord, Record, Span, TensorRecord, write_record_files, write_records
from ...runtime.arenas import arena_layout
from .location_table import ItemLocation
from .save_plan import SaveItem


Payload = Union[torch.Tensor, bytes]


def _exact_cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with exactly ``t``'s elements as its storage (``torch.save`` writes the
    whole storage, so a view of a large buffer must not drag the buffer along)."""
    t = plain_values(t)  # the values: FP8 dequantized, no lazy conjugate or negative view
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes:
        return t
    if nbytes == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    # A new storage over the same memory, exactly the elements' bytes (no copy).
    return torch.from_numpy(as_bytes(t).numpy()).view(t.dtype).view(t.shape)


def payload_nbytes(payload: Payload) -> int:
    """The data bytes of a payload (a tensor's elements, or the bytes as is)."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return len(payload)


def _tensor_record(payload: Payload) -> Record:
    """A payload as a record: a tensor's blob from its template, bytes as they are."""
    if isinstance(payload, torch.Tensor):
        t = _exact_cpu_tensor(payload)
        prefix, suffix = blob_parts(t.dtype, t.shape, lambda: t)
        return TensorRecord(prefix, tensor_bytes(t), suffix)
    return payload


def write_file(storage: Storage, name: str, payloads: Sequence[Payload],
               compute_checksums: bool = True,
               on_written: Optional[Callable[[int], None]] = None) -> List[Tuple[int, int, Optional[int]]]:
    """Write ``payloads`` (tensors as ``torch.save`` blobs, bytes as is) into the new file
    ``name`` of ``storage`` (:func:`..records.write_records`): ``(offset, length, checksum)``
    of each payload in the file. A tensor's blob is what ``torch.save`` writes with the zip
    CRC off (:mod:`..blob_template`; neither ``torch.load`` nor DCP verifies the CRC), its
    bytes written from the tensor's memory (a device tensor's host copy is made just
    before). ``on_written(nbytes)``, if given, is called after each payload with its
    :func:`payload_nbytes` (progress reports)."""
    return write_records(storage, name, payloads, compute_checksums, on_written, _tensor_record, payload_nbytes)


def write_files(files: Dict[str, List[SaveItem]], storage: Storage, checksums: bool,
                thread_count: int) -> List[ItemLocation]:
    """Write each file (files in parallel on ``thread_count`` threads); the location of
    every item written. The bytes written are reported to the caller's progress sink, if
    any (:mod:`..progress`)."""
    payloads = {fname: [it.payload for it in items] for fname, items in files.items()}
    # write_file looked up at each call: tests slow or break it
    spans = write_record_files(write_file, payloads, storage, checksums, thread_count, payload_nbytes)
    return locations({fname: [(it.key, it.tensor_meta) for it in items] for fname, items in files.items()}, spans)


def locations(files: Dict[str, Sequence[Tuple[Any, ...]]], spans: Sequence[Sequence[Span]]) -> List[ItemLocation]:
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
