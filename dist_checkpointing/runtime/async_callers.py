"""Megatron-Core's async callers: one :class:`AsyncRequest` at a time run in another process.

* :class:`TemporalAsyncCaller` forks a process per call (our :class:`ForkedCall`: a
  copy-on-write snapshot of this process, killed if this process dies).
* :class:`PersistentAsyncCaller` starts one worker process (a new interpreter,
  :mod:`.persistent_worker`) on its first call and sends it every request; the request
  (``async_fn`` and its arguments) must be picklable, and ``async_fn`` must be importable
  by the worker (CPU tensors travel through shared memory).

Both run ``preload_fn`` (if any) in the caller before the call starts; its result becomes
``async_fn_args[1]``, as in Megatron-Core. Whether the current call is done is agreed over
all ranks (one 2-byte ``all_reduce`` per check unless ``no_dist``), and an error of any
rank's call is raised on every rank (a :class:`CheckpointingException` naming the ranks).
:class:`~.async_utils.AsyncCallsQueue` does not use these classes: it runs requests in a
background thread of this process (our async saves fork their own writer, or hand their
staged bytes to this process's persistent writer), which needs no picklable request.
"""

from __future__ import annotations

import functools
import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Callable, Deque, Optional, Tuple, Union

from .collectives import all_gather_object, all_reduce_max_uint8, error_message, get_rank, raise_if_any
from ..core import CheckpointingException, gc_paused
from .async_request import AsyncRequest, _preloaded
from .forked_call import ForkedCall
from .persistent_worker import Job, PersistentWorker

logger = logging.getLogger(__name__)

_disable_gc = gc_paused  # Megatron-Core's name: garbage collection off for a block or a decorated function


class AsyncCaller(ABC):
    """Runs one async call at a time in another process; every method is called on every rank."""

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Start ``async_req.async_fn`` (nothing if it is None)."""

    @abstractmethod
    def _poll(self, blocking: bool) -> Tuple[bool, Optional[str]]:
        """(whether the current call still runs here, its error if it ended with one)."""

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """Whether the current call is done on every rank (on this one with ``no_dist``);
        ``blocking`` waits for it. An error on any rank is raised on every rank."""
        alive, error = self._poll(blocking)
        flags = [int(alive), int(error is not None)]
        if not no_dist:
            flags = all_reduce_max_uint8(flags)
        if flags[0]:
            return False
        if flags[1]:
            self._call_done()
            if no_dist:
                raise CheckpointingException(f"Async call failed: {error}")
            raise_if_any(all_gather_object(error), "Async call")
        self._call_done()
        return True

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """True when no rank passes a true ``is_alive`` (one 1-byte ``all_reduce``)."""
        return not all_reduce_max_uint8([int(bool(is_alive))])[0]

    def _call_done(self) -> None:
        """Forget the current call once it is agreed done."""

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Wait for the calls (or kill them with ``abort``) and stop."""


class TemporalAsyncCaller(AsyncCaller):
    """A forked process per call (a copy-on-write snapshot of this process)."""

    def __init__(self) -> None:
        self.process: Optional[Union[ForkedCall, _ThreadCall]] = None
        self._error: Optional[str] = None

    @_disable_gc()
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Fork a process running ``async_fn`` (``preload_fn`` first, here). A request whose
        snapshot is staged in this process (``async_snapshot="stream"``/``"copy"``: device
        copies in flight, written by this process's persistent writer) is never forked — a
        child of a process holding CUDA state cannot use it: its ``async_fn`` runs in a
        thread of this process instead."""
        if async_req.async_fn is None:
            return
        fn = functools.partial(async_req.async_fn, *_preloaded(async_req).async_fn_args, **async_req.async_fn_kwargs)
        what = f"Async call {async_req.call_idx}"
        self.process = _ThreadCall(fn, what) if async_req.staged is not None else ForkedCall(fn, what)

    def _poll(self, blocking: bool) -> Tuple[bool, Optional[str]]:
        if self.process is None:
            return False, self._error
        if not blocking and not self.process.done():
            return True, None
        try:
            self.process.result()
        except CheckpointingException as e:
            self._error = str(e)
        self.process = None
        return False, self._error

    def _call_done(self) -> None:
        self._error = None

    def close(self, abort: bool = False) -> None:
        """Wait for the forked process, or kill it with ``abort``."""
        if self.process is not None:
            if abort:
                self.process.kill()
            try:
                self.process.result()
            except CheckpointingException as e:
                if not abort:
                    logger.warning("%s", e)
            self.process = None


class _ThreadCall:
    """``fn()`` run in a thread of this process, with :class:`ForkedCall`'s interface (it
    cannot be killed: :meth:`kill` leaves it to finish)."""

    def __init__(self, fn: Callable[[], Any], what: str):
        self.what = what
        self._outcome: Optional[Tuple[bool, Any]] = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(fn,), name="dist_checkpointing-async-call", daemon=True).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._outcome = (True, fn())
        except BaseException as e:  # noqa: BLE001 - raised by result()
            self._outcome = (False, f"{self.what}: {error_message(e)}")
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> Any:
        self._done.wait()
        ok, value = self._outcome  # type: ignore[misc]
        if not ok:
            raise CheckpointingException(value)
        return value

    def kill(self) -> None:
        """Nothing to kill: a thread of this process finishes its write."""


class PersistentAsyncCaller(AsyncCaller):
    """One worker process (:class:`~.persistent_worker.PersistentWorker`: a new interpreter,
    started on the first call) runs every call in order."""

    def __init__(self) -> None:
        self.worker = PersistentWorker("dist_checkpointing-persistent-async")
        self._jobs: Deque[Job] = deque()

    @property
    def process(self) -> Any:
        """The worker process (``None`` before the first call or after :meth:`close`)."""
        return self.worker.process

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Send the request to the worker (started now if needed)."""
        if async_req.async_fn is None:
            return
        self._jobs.append(self.worker.submit(
            async_req.async_fn, tuple(_preloaded(async_req).async_fn_args), dict(async_req.async_fn_kwargs),
            what=f"Async call {async_req.call_idx}"))

    def _poll(self, blocking: bool) -> Tuple[bool, Optional[str]]:
        if not self._jobs:
            return False, None
        job = self._jobs[0]
        if not blocking and not job.done():
            return True, None
        try:
            job.result()
        except CheckpointingException as e:
            return False, f"rank {get_rank()}: {e}"
        return False, None

    def _call_done(self) -> None:
        if self._jobs:
            self._jobs.popleft()

    def close(self, abort: bool = False) -> None:
        """Let the worker finish its calls and stop (kill it with ``abort``)."""
        self.worker.close(kill=abort)
        self._jobs.clear()

    def __del__(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None and worker.process is not None and worker.process.poll() is None:
            worker.process.kill()
