"""Serializing save payloads into storage streams, and the host copies of async saves.

A data file is a sequence of ``torch.save`` blobs (the DCP item format), written by
:func:`write_file` (:mod:`.records` writes the bytes). This module keeps Megatron-Core's name,
and its :class:`FileSystemWriterAsync`: the background writer of plain DCP checkpoints.
"""

from __future__ import annotations

import io
import itertools
import multiprocessing
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from ..core import CheckpointingException
from ..exchange.collectives import error_message
from .dcp_types import StorageInfo
from ..tensors.bytes_view import as_bytes
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
    if mp_mode not in multiprocessing.get_all_start_methods():
        raise CheckpointingException(f"mp_mode must be one of {multiprocessing.get_all_start_methods()}, "
                                     f"not {mp_mode!r}")
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
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    t = t.resolve_conj().resolve_neg()  # the values, not a lazy conjugate or negative view
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


# ----------------------------------------------------------------------------- plain DCP async writes

_written: Dict[str, Any] = {}  # write id -> its WriteResults, or its error
_written_lock = threading.Lock()


class FileSystemWriterAsync(FileSystemWriter):
    """Megatron-Core's DCP storage writer whose writing runs later, in the background: the
    async save of **plain PyTorch DCP** checkpoints (Megatron-LM's ``--ckpt-format
    torch_dcp`` / ``fsdp_dtensor`` with ``--async-save``; :mod:`.state_dict_saver` plans
    and finalizes it).

    :meth:`prepare_write_data` takes the snapshot: every tensor is copied to host memory
    (the caller may change its tensors once it returns); :meth:`get_save_function_and_args`
    gives the function that writes the files (``__{rank}_{n}.distcp``, DCP's item format,
    ``thread_count`` files per rank; keys starting with ``separation_hint`` into files of
    their own) and :meth:`retrieve_write_results` what it wrote, for ``.metadata``.
    ``use_msc`` (Multi-Storage Client) is not provided; ``use_cpu_shm_for_gpu_tensors`` is
    what the snapshot does anyway. The write function reports to this process: run it here
    (a thread, as ``AsyncCallsQueue`` does), not in another process. Also a plain DCP
    ``StorageWriter`` (:meth:`write_data`).
    """

    def __init__(self, path: Union[str, os.PathLike], *args: Any, separation_hint: Optional[str] = None,
                 use_msc: bool = False, use_cpu_shm_for_gpu_tensors: bool = False, **kwargs: Any) -> None:
        if use_msc:
            raise CheckpointingException(f"{path}: the Multi-Storage Client (use_msc) is not provided by "
                                         "dist_checkpointing")
        super().__init__(path, *args, **kwargs)
        self.separation_hint = separation_hint
        self.use_cpu_shm_for_gpu_tensors = use_cpu_shm_for_gpu_tensors
        self._files: Optional[List[Tuple[str, List[Tuple[Any, Payload]]]]] = None
        self._write_id: Optional[str] = None

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Snapshot the plan's items into host memory and group them into this rank's files."""
        groups: Dict[str, List[Tuple[Any, Payload]]] = {}
        for item in plan.items:
            data = planner.resolve_data(item)
            payload = data.getvalue() if isinstance(data, io.BytesIO) else _host_copy(data)
            hinted = self.separation_hint and item.index.fqn.startswith(self.separation_hint)
            groups.setdefault(self.separation_hint if hinted else "", []).append((item.index, payload))
        prefix = plan.storage_data.prefix
        files, count = [], itertools.count()
        for hint, items in sorted(groups.items()):
            bins: List[List[Tuple[Any, Payload]]] = [[] for _ in range(max(1, min(self.thread_count, len(items))))]
            sizes = [0] * len(bins)
            for index, payload in sorted(items, key=lambda x: -payload_nbytes(x[1])):  # largest first, to the emptiest
                i = sizes.index(min(sizes))
                bins[i].append((index, payload))
                sizes[i] += payload_nbytes(payload)
            files += [(f"{hint}{prefix}{next(count)}.distcp", b) for b in bins if b]
        self._files, self._write_id = files, uuid.uuid4().hex

    def get_save_function_and_args(self) -> Tuple[Callable[..., Any], None, List[Any]]:
        """``(write function, preload function (none), its arguments)`` of the writing."""
        if self._files is None:
            raise CheckpointingException(f"{self.path}: prepare_write_data was not called before the write")
        files, self._files = self._files, None
        return write_dcp_files, None, [os.fspath(self.path), files, self._write_id, self.thread_count]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """DCP's synchronous write: snapshot and write now."""
        self.prepare_write_data(plan, planner)
        fn, _, args = self.get_save_function_and_args()
        fn(*args)
        future: Future = Future()
        future.set_result(self.retrieve_write_results())
        return future

    def retrieve_write_results(self) -> List[WriteResult]:
        """What the write wrote (raises if it failed or has not run)."""
        with _written_lock:
            outcome = _written.pop(self._write_id, None)
        if outcome is None:
            raise CheckpointingException(f"{self.path}: no results of its write (it has not run, or ran in "
                                         "another process)")
        if isinstance(outcome, str):
            raise CheckpointingException(f"{self.path}: the write failed: {outcome}")
        return outcome


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` that later changes to ``t`` do not reach."""
    t = t.detach()
    return t.to("cpu", copy=True) if t.device.type == "cpu" else t.to("cpu")


def write_dcp_files(path: str, files: List[Tuple[str, List[Tuple[Any, Payload]]]], write_id: str,
                    thread_count: int = 1) -> None:
    """Write ``files`` into the checkpoint directory ``path`` (the async part of a
    :class:`FileSystemWriterAsync` save) and record their ``WriteResult`` s, or the error,
    for ``retrieve_write_results``."""
    from ..core import open_storage

    try:
        storage = open_storage(path)

        def write(entry: Tuple[str, List[Tuple[Any, Payload]]]) -> List[WriteResult]:
            name, items = entry
            spans = write_file(storage, name, [p for _, p in items], compute_checksums=False)
            return [WriteResult(index=index, size_in_bytes=length, storage_data=StorageInfo(name, offset, length))
                    for (index, _), (offset, length, _) in zip(items, spans)]

        with ThreadPoolExecutor(max(1, min(thread_count, len(files)))) as pool:
            outcome: Any = [r for results in pool.map(write, files) for r in results]
    except Exception as e:  # noqa: BLE001 - recorded for the finalization, then raised
        outcome = error_message(e)
        raise
    finally:
        with _written_lock:
            _written[write_id] = outcome

