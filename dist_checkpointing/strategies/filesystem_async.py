"""Serializing save payloads into storage streams, and the host copies of async saves.

A data file is a sequence of ``torch.save`` blobs (the DCP item format), written by
:func:`write_file` (:mod:`.records` writes the bytes). This module keeps Megatron-Core's name,
and its ``FileSystemWriterAsync`` (the background writer of plain DCP checkpoints, in
:mod:`.dcp_async_writer`; imported on first use: the read-only tools import no DCP).
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch

from ..compat.lazy import lazy_exports
from ..runtime.persistent_worker import check_mp_mode
from ..tensors.bytes_view import as_bytes
from ..tensors.values import plain_values
from ..storage import Storage
from .blob_template import blob_parts
from .records import Record, TensorRecord, write_records

Payload = Union[torch.Tensor, bytes]

# Megatron-Core's writer reports through this process-wide queue, which Megatron-LM's
# trainer creates (get_write_results_queue), shuts down and resets; ours reports through the
# AsyncRequest, so nothing here writes to it.
_results_queue = None
_results_queue_lock = threading.Lock()


def get_write_results_queue(mp_mode: str = "spawn") -> Any:
    """Megatron-Core's process-wide results queue (a ``multiprocessing`` queue of the
    ``mp_mode`` context, made on the first call), for callers that create it at start-up.
    Nothing here reports through it: async saves report through their
    :class:`AsyncRequest`, :class:`FileSystemWriterAsync` through the writer."""
    global _results_queue
    check_mp_mode(mp_mode)
    with _results_queue_lock:
        if _results_queue is None:
            _results_queue = multiprocessing.get_context(mp_mode).Queue()
        return _results_queue


class HostStaging:
    """Host (CPU) copies of the tensors a fork-mode async save cannot leave to copy-on-write,
    kept for the next save of the same structure: a slot whose tensor keeps its shape and
    dtype reuses its buffer (already touched, so the copy runs at memory speed). Reuse is
    safe while an earlier writer runs: a forked writer has its own copy of the pages."""

    def __init__(self) -> None:
        self._buffers: Dict[Hashable, torch.Tensor] = {}

    def stage(self, tensors: Sequence[Tuple[Hashable, torch.Tensor]]) -> List[torch.Tensor]:
        """Copy each ``(slot, tensor)`` into its slot's buffer; buffers of slots not in this
        call are dropped."""
        buffers: Dict[Hashable, torch.Tensor] = {}
        out = []
        for slot, t in tensors:
            buf = self._buffers.get(slot)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype)
            buf.copy_(t.detach())
            buffers[slot] = buf
            out.append(buf)
        self._buffers = buffers
        return out

    def release(self) -> None:
        """Free every buffer."""
        self._buffers = {}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(as_bytes(t).numpy()).cast("B")


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
    ``name`` of ``storage`` (:func:`.records.write_records`): ``(offset, length, checksum)``
    of each payload in the file. A tensor's blob is what ``torch.save`` writes with the zip
    CRC off (:mod:`.blob_template`; neither ``torch.load`` nor DCP verifies the CRC), its
    bytes written from the tensor's memory (a device tensor's host copy is made just
    before). ``on_written(nbytes)``, if given, is called after each payload with its
    :func:`payload_nbytes` (progress reports)."""
    return write_records(storage, name, payloads, compute_checksums, on_written, _tensor_record, payload_nbytes)


__getattr__, __dir__ = lazy_exports(__name__, {"FileSystemWriterAsync": "dist_checkpointing.strategies.dcp_async_writer"})
