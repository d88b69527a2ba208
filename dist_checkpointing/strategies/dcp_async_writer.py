"""Megatron-Core's ``FileSystemWriterAsync`` (Megatron-Core's module: ``filesystem_async``,
which re-exports it): the DCP storage writer of async saves of plain PyTorch DCP checkpoints,
whose files are written by :func:`.filesystem_async.write_file`."""

from __future__ import annotations

import io
import itertools
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..core import CheckpointingException, open_storage
from ..exchange.collectives import error_message
from .dcp_types import StorageInfo
from .filesystem_async import Payload, payload_nbytes, write_file


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

