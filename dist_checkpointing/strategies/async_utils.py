"""Asynchronous calls: work that runs in the background and is finalized collectively.

* :class:`AsyncRequest` — a function to run in the background (``async_fn``) and the
  steps that complete it (``finalize_fns``, run on every rank once every rank's
  ``async_fn`` is done).
* :class:`AsyncCallsQueue` — schedules requests and finalizes them in order. Whether a
  call is done is agreed over all ranks (one 4-byte ``all_reduce`` per check), so ranks
  never finalize different calls; an error in any rank's ``async_fn`` is raised on every
  rank at finalization, and the queue stays usable.
* :class:`ForkedCall` — runs a function in a forked child process: the child sees a
  copy-on-write snapshot of this process's memory as it was at the fork, so the caller
  may change its tensors right away. Used by async saves to write the data files.

Finalization (:meth:`AsyncCallsQueue.maybe_finalize_async_calls`) examines the oldest calls
in order: one 4-byte ``all_reduce`` (MAX) per call -- done here, failed here, how many
finalize steps here -- and a call is finalized only once done on every rank. A failure
anywhere: one ``all_gather_object`` of the messages, every rank raises the same
``CheckpointingException``, the call is dropped (never committed). Finalize steps run each
inside ``run_agreed`` where every rank has as many; where the counts differ (Megatron-LM adds
steps on rank 0 only) each rank runs its own, then one ``run_agreed``. With nothing
scheduled it returns without communicating (scheduling is collective).
:meth:`AsyncRequest.execute_sync` runs a request in the caller's thread with the same
agreement.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Dict, List, Optional

from ..runtime import forked_call
from ..runtime.async_request import (  # noqa: F401  (_Chained: tests)
    AsyncRequest, _Call, _Chained, _finalize, _preloaded, same_step_counts, step_counts)
from ..runtime.forked_call import ForkedCall, reap_exited_children  # noqa: F401  (ForkedCall: re-exported)
from ..runtime.collectives import all_reduce_max_uint8, is_distributed
from ..core import CheckpointingException
from ..runtime.persistent_worker import check_mp_mode, shared_worker
from ..runtime.process_qos import set_process_qos, set_writer_qos

logger = logging.getLogger(__name__)

WARMUP_TIMEOUT_S = 120.0  # starting the writer (a new interpreter) takes well under a second


class _CallThread:
    """A background thread that runs calls one after another until stopped."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Optional[_Call]]" = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="dist_checkpointing-async", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            call = self._jobs.get()
            if call is None:
                return
            call.run()
            call = None  # do not keep the last request (and what it holds) alive while idle

    def submit(self, call: _Call) -> None:
        self._jobs.put(call)

    def stop(self) -> None:
        self._jobs.put(None)
        self.thread.join()


class AsyncCallsQueue:
    """Runs :class:`AsyncRequest` s in the background and finalizes them in order.

    Args:
        persistent: run the requests' ``async_fn`` in one background thread started on
            the first request and reused until :meth:`close`; ``False`` (the default, as in
            Megatron-Core) starts a thread per request. (Megatron-Core runs them in a forked
            process per request, or in one spawned worker: :mod:`.async_callers` has those
            callers; our async saves fork their own writer, so a thread is enough here.)

        cpu_shm_mode: NVIDIA Resiliency Extension's argument (copy accelerator tensors into
            host shared memory for the writer), accepted for Megatron-LM: this library's
            async saves do that for accelerator tensors anyway.

    Scheduling and finalizing are collective: every rank schedules the same requests in
    the same order and calls :meth:`maybe_finalize_async_calls` at the same points.
    """

    def __init__(self, persistent: bool = False, *, cpu_shm_mode: bool = False):
        self.persistent = persistent
        self.cpu_shm_mode = cpu_shm_mode
        self._calls: List[_Call] = []
        self._next_idx = 0
        self._worker: Optional[_CallThread] = None
        self._resources: Dict[int, Any] = {}
        self._closed = False

    @classmethod
    def warmup_persistent_caller(cls, rank: int, mp_mode: str = "spawn", cpu_priority: Optional[int] = 10,
                                 io_priority: Optional[int] = None, *, cpu_shm_mode: bool = False) -> None:
        """Start this process's background writer now (Megatron-LM calls this at start-up, so
        the first async save does not wait for it) and set the priorities of its writers: the
        persistent writer and the forked writers of async saves run at ``nice``
        ``cpu_priority`` and I/O class ``io_priority`` (:mod:`.process_qos`; never raised
        above the trainer's). Not collective. ``rank`` is only logged; ``mp_mode`` must be a
        ``multiprocessing`` start method, but the writer is always a new interpreter (never
        a fork of the trainer); ``cpu_shm_mode`` is accepted as in the constructor."""
        check_mp_mode(mp_mode)
        set_writer_qos(cpu_priority, io_priority)
        worker = shared_worker()
        try:
            worker.submit(set_process_qos, (cpu_priority, io_priority), what="Starting the writer").result(
                WARMUP_TIMEOUT_S)
        except CheckpointingException as e:
            raise CheckpointingException(f"rank {rank}: {e}") from e
        logger.debug("rank %s: background writer started (pid %s)", rank, worker.pid)

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request`` in the background; returns its call index."""
        if self._closed:
            raise CheckpointingException("Cannot schedule an async request: the AsyncCallsQueue is closed")
        if not isinstance(async_request, AsyncRequest):
            raise CheckpointingException(f"Not an AsyncRequest: {async_request!r}")
        async_request.is_frozen = True  # later changes to it would be ignored: refuse them
        async_request.call_idx = self._next_idx
        request = _preloaded(async_request)
        for resource in request.resources:
            self._resources[id(resource)] = resource
        call = _Call(self._next_idx, request)
        self._next_idx += 1
        self._calls.append(call)
        if self.persistent:
            if self._worker is None:
                self._worker = _CallThread()
            self._worker.submit(call)
        else:
            threading.Thread(target=call.run, name=f"dist_checkpointing-async-{call.idx}", daemon=True).start()
        return call.idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize, in order, the calls that are done on every rank; return their indices.

        With ``blocking`` wait for every scheduled call. Each check costs one 4-byte
        ``all_reduce`` over the world (none with ``no_dist`` or nothing scheduled). A call
        whose ``async_fn`` failed on any rank raises :class:`CheckpointingException` on
        every rank, naming the ranks and causes; it is dropped (never finalized) and the
        queue stays usable.
        """
        finalized: List[int] = []
        collective = is_distributed() and not no_dist
        while self._calls:
            call = self._calls[0]
            if blocking:
                call.done.wait()
            flags = [int(not call.done.is_set()), int(call.error is not None), *step_counts(call)]
            if collective:
                flags = all_reduce_max_uint8(flags)
            if flags[0]:
                break
            self._calls.pop(0)
            _finalize(call, collective, f"Async call {call.idx}", failed=bool(flags[1]),
                      same_steps=same_step_counts(flags[2:]))
            finalized.append(call.idx)
        return finalized

    def wait_for_staging(self) -> None:
        """Block until the snapshots of every scheduled call are taken (their host copies
        done; see :meth:`AsyncRequest.wait_for_staging`): call it before changing saved
        tensors from a stream other than the one current at the save. Not collective."""
        for call in list(self._calls):
            call.request.wait_for_staging()

    def get_num_unfinalized_calls(self) -> int:
        """How many scheduled calls are not finalized yet."""
        return len(self._calls)

    def close(self, abort: bool = False) -> None:
        """Finalize every scheduled call (blocking), stop the worker and release the
        requests' resources. Further scheduling raises. Collective, like finalization.
        With ``abort`` (not collective) pending calls are dropped unfinalized: their
        checkpoints stay incomplete, and nothing writes into them once this returns (their
        background work is waited for: a manager opened next may delete them)."""
        if self._closed:
            return
        dropped: List[_Call] = []
        try:
            if abort:
                dropped, self._calls = self._calls, []
            self.maybe_finalize_async_calls(blocking=True)
        finally:
            for call in dropped:
                call.done.wait()
            self._closed = True
            if self._worker is not None:
                self._worker.stop()
                self._worker = None
            for resource in self._resources.values():
                resource.release()
            self._resources.clear()
            reap_exited_children(block=True)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and self._worker is not None:
            self._worker._jobs.put(None)  # let the daemon thread end; nothing is finalized


# Megatron-Core's names in this module: the async callers (the forked calls' settings live in
# :mod:`.forked_call`, where they are read)
from ..runtime.async_callers import AsyncCaller, PersistentAsyncCaller, TemporalAsyncCaller, _disable_gc  # noqa: E402,F401
_set_process_qos = set_process_qos  # Megatron-Core's name (Megatron-LM lowers its deletion worker's priority with it)
