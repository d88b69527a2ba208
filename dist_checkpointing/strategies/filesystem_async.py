"""Serializing save payloads into storage streams, and the host copies of async saves.

A data file is a sequence of ``torch.save`` blobs (the DCP item format), written by
:func:`write_file` into one stream of the storage layer (:mod:`..storage`: the staged
``O_DIRECT`` writer, its buffer pool and the fsync rules live there). This module keeps
Megatron-Core's name.
"""

from __future__ import annotations

from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch

from ..tensors.bytes_view import as_bytes
from ..core import CheckpointingException
from ..integrity.checksums import new_hasher
from ..storage import Storage, WriteStream
from ..storage.zip_crc import zip_crc_disabled

Payload = Union[torch.Tensor, bytes]

# Megatron-Core's writer reports through this process-wide queue, which Megatron-LM's
# trainer shuts down and resets; ours reports through the AsyncRequest, so it stays None.
_results_queue = None


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
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
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


def write_file(storage: Storage, name: str, payloads: Sequence[Payload],
               compute_checksums: bool = True,
               on_written: Optional[Callable[[int], None]] = None) -> List[Tuple[int, int, Optional[int]]]:
    """Write ``payloads`` (tensors as ``torch.save`` blobs, bytes as is) into the new file
    ``name`` of ``storage``, through one :meth:`~..storage.Storage.create_stream`.

    Returns ``(offset, length, checksum)`` of each payload in the file; the checksum
    (``None`` unless ``compute_checksums``) covers the payload's whole record, the
    ``length`` bytes at ``offset``. It is computed piece by piece right after each piece
    is copied into the staging buffer (still in the CPU cache), while the stream's I/O
    thread writes the previous buffer, so it mostly hides behind the disk. The blobs' zip
    CRC32 is not computed (see :func:`zip_crc_disabled`). A storage error is a
    :class:`CheckpointingException` naming the file. ``on_written(nbytes)``, if given, is
    called after each payload with its :func:`payload_nbytes` (progress reports).
    """
    try:
        stream = storage.create_stream(name)
    except OSError as e:
        raise CheckpointingException(f"Cannot create checkpoint file {storage.describe(name)}: {e}") from e
    try:
        with zip_crc_disabled():
            spans = _write_payloads(stream, payloads, compute_checksums, on_written)
        stream.close()
    except Exception as e:  # noqa: BLE001 - named below
        stream.abort()
        cause = stream.error or e
        raise CheckpointingException(
            f"Writing checkpoint file {storage.describe(name)} failed: {type(cause).__name__}: {cause}") from cause
    except BaseException:
        stream.abort()
        raise
    return spans


def _write_payloads(stream: WriteStream, payloads: Sequence[Payload], compute_checksums: bool,
                    on_written: Optional[Callable[[int], None]]) -> List[Tuple[int, int, Optional[int]]]:
    spans: List[Tuple[int, int, Optional[int]]] = []
    for payload in payloads:
        start = stream.tell()
        if compute_checksums:
            stream.start_checksum(new_hasher())
        if isinstance(payload, torch.Tensor):
            torch.save(_exact_cpu_tensor(payload), stream)
        else:
            stream.write(payload)
        spans.append((start, stream.tell() - start, stream.take_checksum() if compute_checksums else None))
        if on_written is not None:
            on_written(payload_nbytes(payload))
    return spans
