"""Megatron-Core's ``FileSystemWriterAsync`` (Megatron-Core's module: ``filesystem_async``,
which re-exports it): the DCP storage writer of async saves of plain PyTorch DCP checkpoints,
on the machinery of every save: the snapshot decision and host copies of
:mod:`...runtime.snapshot`, the file packer :func:`..torch_dist.save_plan.pack_by_bytes`, the
writer :func:`..torch_dist.writing.write_file` on :func:`..torch_dist.records.write_record_files`'s
threads."""

from __future__ import annotations

import io
import itertools
import os
import threading
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ...core import CheckpointingException, gc_paused, open_storage
from ...runtime.collectives import error_message, get_rank
from ...pickling.dcp_types import StorageInfo
from ..torch_dist.records import write_record_files
from ..torch_dist.save_plan import pack_by_bytes
from ..torch_dist.writing import Payload, payload_nbytes, write_file
from ...runtime.forked_call import ForkedCall
from ...runtime.snapshot import ForkHostCopies, fork_host_copies, snapshot_mode

DcpFile = Tuple[str, List[Tuple[Any, Payload]]]  # a file's name and its (MetadataIndex, payload) items


_written: Dict[str, Any] = {}  # write id -> its WriteResults, or its error
_written_lock = threading.Lock()


SNAPSHOTS = ("auto", "copy")


class FileSystemWriterAsync(FileSystemWriter):
    """Megatron-Core's DCP storage writer whose writing runs later, in the background: the
    async save of **plain PyTorch DCP** checkpoints (Megatron-LM's ``--ckpt-format
    torch_dcp`` / ``fsdp_dtensor`` with ``--async-save``; :mod:`.async_save` plans
    and finalizes it).

    :meth:`prepare_write_data` takes the snapshot; once it returns the caller may change its
    tensors. ``async_snapshot="auto"`` (default): when every tensor is in CPU memory, a forked
    child process sees them copy-on-write and writes them (the call returns after the fork;
    tensors a fork does not isolate — pinned, shared or file-backed memory — are copied to host
    memory first, :func:`...runtime.memory_maps.needs_host_copy`); with accelerator tensors (never a fork
    of a process holding a device context), and with ``"copy"``, every tensor is copied to
    host memory and this process writes. :meth:`get_save_function_and_args` gives the function
    that writes the files (``__{rank}_{n}.distcp``, DCP's item format, ``thread_count``
    files per rank; keys starting with ``separation_hint`` into files of their own), or waits
    for the forked writer; :meth:`retrieve_write_results` gives what was written, for
    ``.metadata``. ``use_msc`` (Multi-Storage Client) is not provided;
    ``use_cpu_shm_for_gpu_tensors`` is what the snapshot does anyway. The write function
    reports to this process: run it here (a thread, as ``AsyncCallsQueue`` does), not in
    another process. Also a plain DCP ``StorageWriter`` (:meth:`write_data`, no snapshot).
    """

    def __init__(self, path: Union[str, os.PathLike], *args: Any, separation_hint: Optional[str] = None,
                 use_msc: bool = False, use_cpu_shm_for_gpu_tensors: bool = False, async_snapshot: str = "auto",
                 **kwargs: Any) -> None:
        if use_msc:
            raise CheckpointingException(f"{path}: the Multi-Storage Client (use_msc) is not provided by "
                                         "dist_checkpointing")
        if async_snapshot not in SNAPSHOTS:
            raise CheckpointingException(f"async_snapshot must be one of {SNAPSHOTS}, not {async_snapshot!r}")
        super().__init__(path, *args, **kwargs)
        self.separation_hint = separation_hint
        self.use_cpu_shm_for_gpu_tensors = use_cpu_shm_for_gpu_tensors
        self.async_snapshot = async_snapshot
        self._write: Optional[Tuple[Callable[..., None], List[Any]]] = None
        self._write_id: Optional[str] = None

    def _files(self, plan: SavePlan, planner: SavePlanner, snapshot: bool) -> Tuple[List[DcpFile], bool]:
        """The plan's items grouped into this rank's files, and whether a fork takes the
        snapshot (:func:`...runtime.snapshot.snapshot_mode`: never with accelerator tensors).
        With ``snapshot``, tensors are copied to host memory where a fork would not isolate
        them, or all of them without a fork (:func:`...runtime.snapshot.fork_host_copies`)."""
        items = [(item.index, planner.resolve_data(item)) for item in plan.items]
        tensors = [(i, data) for i, (_, data) in enumerate(items) if isinstance(data, torch.Tensor)]
        fork = snapshot_mode(self.async_snapshot, [t for _, t in tensors], fork_safe=True, stream=False) == "fork"
        if snapshot:
            for i, copy in fork_host_copies(tensors, fork, ForkHostCopies()).items():
                items[i] = (items[i][0], copy)
        groups: Dict[str, List[Tuple[Any, Payload]]] = {}
        for index, data in items:
            payload = data.getvalue() if isinstance(data, io.BytesIO) else data
            if isinstance(payload, torch.Tensor):
                payload = payload.detach()
            hinted = self.separation_hint and index.fqn.startswith(self.separation_hint)
            groups.setdefault(self.separation_hint if hinted else "", []).append((index, payload))
        # DCP's file names: the raw separation hint, the plan's prefix, one count over the groups
        prefix = plan.storage_data.prefix
        files, count = [], itertools.count()
        for hint, entries in sorted(groups.items()):
            bins = pack_by_bytes(entries, min(self.thread_count, len(entries)), lambda x: payload_nbytes(x[1]),
                                 in_order=False)
            files += [(f"{hint}{prefix}{next(count)}.distcp", b) for b in bins]
        return files, fork

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Take the snapshot of the plan's items (see the class) and prepare their writing."""
        files, fork = self._files(plan, planner, snapshot=True)
        write_id, path = uuid.uuid4().hex, os.fspath(self.path)
        if fork:
            with gc_paused():
                child = ForkedCall(lambda: _write(path, files, self.thread_count),
                                   f"Writing {path} (rank {get_rank()})")
            self._write = (_collect_forked_write, [child, write_id])
        else:
            self._write = (write_dcp_files, [path, files, write_id, self.thread_count])
        self._write_id = write_id

    def get_save_function_and_args(self) -> Tuple[Callable[..., Any], None, List[Any]]:
        """``(write function, preload function (none), its arguments)`` of the writing."""
        if self._write is None:
            raise CheckpointingException(f"{self.path}: prepare_write_data was not called before the write")
        (fn, args), self._write = self._write, None
        return fn, None, args

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """DCP's synchronous write: the items as they are, written now."""
        write_id = self._write_id = uuid.uuid4().hex
        write_dcp_files(os.fspath(self.path), self._files(plan, planner, snapshot=False)[0], write_id,
                        self.thread_count)
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


def _write(path: str, files: List[DcpFile], thread_count: int) -> List[WriteResult]:
    """Write ``files`` into the checkpoint directory ``path`` (by the writer of every save,
    :func:`..torch_dist.writing.write_file` on :func:`..torch_dist.records.write_record_files`'s
    threads); their ``WriteResult`` s."""
    payloads = {name: [p for _, p in items] for name, items in files}
    spans = write_record_files(write_file, payloads, open_storage(path), False, thread_count, payload_nbytes)
    return [WriteResult(index=index, size_in_bytes=length, storage_data=StorageInfo(name, offset, length))
            for (name, items), file_spans in zip(files, spans)
            for (index, _), (offset, length, _) in zip(items, file_spans)]


def _record(write_id: str, run: Callable[[], Any]) -> None:
    """Keep what ``run`` returns (or its error, then raised) for ``retrieve_write_results``."""
    try:
        outcome: Any = run()
    except Exception as e:  # noqa: BLE001 - recorded for the finalization, then raised
        outcome = error_message(e)
        raise
    finally:
        with _written_lock:
            _written[write_id] = outcome


def write_dcp_files(path: str, files: List[DcpFile], write_id: str, thread_count: int = 1) -> None:
    """Write ``files`` into the checkpoint directory ``path`` (the async part of a
    ``"copy"`` snapshot) and record their ``WriteResult`` s, or the error."""
    _record(write_id, lambda: _write(path, files, thread_count))


def _collect_forked_write(child: ForkedCall, write_id: str) -> None:
    """Wait for the forked writer (the async part of an ``"auto"`` snapshot) and record its
    ``WriteResult`` s, or its error."""
    _record(write_id, child.result)
