"""Asynchronous calls: work that runs in the background and is finalized collectively.

* :class:`AsyncRequest` — a function to run in the background (``async_fn``) and the
  steps that complete it (``finalize_fns``, run on every rank once every rank's
  ``async_fn`` is done).
* :class:`AsyncCallsQueue` — schedules requests and finalizes them in order. Whether a
  call is done is agreed over all ranks (one 2-byte ``all_reduce`` per check), so ranks
  never finalize different calls; an error in any rank's ``async_fn`` is raised on every
  rank at finalization, and the queue stays usable.
* :class:`ForkedCall` — runs a function in a forked child process: the child sees a
  copy-on-write snapshot of this process's memory as it was at the fork, so the caller
  may change its tensors right away. Used by async saves to write the data files.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import pickle
import queue
import select
import signal
import struct
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..exchange.collectives import all_gather_object, all_reduce_max_uint8, error_message, is_distributed, raise_if_any, run_agreed
from ..core import CheckpointingException

logger = logging.getLogger(__name__)


@dataclass
class AsyncRequest:
    """A background function and the steps that complete it.

    Args:
        async_fn: run in the background with ``async_fn_args`` / ``async_fn_kwargs``
            (``None``: nothing to run).
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: run in order on every rank, in the caller's thread, once every
            rank's ``async_fn`` has finished without error. They may be collective.
        async_fn_kwargs: keyword arguments of ``async_fn``.
        resources: objects with a ``release()`` method kept alive across calls (e.g. reused
            staging buffers); :meth:`AsyncCallsQueue.close` releases them.
        preload_fn: called when the request is scheduled (in the caller's thread); its result
            replaces ``async_fn_args[1]`` (Megatron-Core's device-to-host staging hook).
        call_idx: the index the queue gave the request (set when it is scheduled).
    """

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...] = ()
    finalize_fns: List[Callable[[], Any]] = field(default_factory=list)
    async_fn_kwargs: Dict[str, Any] = field(default_factory=dict)
    preload_fn: Optional[Callable[[], Any]] = None
    is_frozen: bool = False
    call_idx: int = 0
    resources: List[Any] = field(default_factory=list)

    def _check_not_frozen(self) -> None:
        if self.is_frozen:
            raise CheckpointingException("This AsyncRequest is already scheduled and cannot be changed")

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` after the current finalize steps."""
        self._check_not_frozen()
        self.finalize_fns.append(fn)

    def add_pre_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` before the current finalize steps."""
        self._check_not_frozen()
        self.finalize_fns.insert(0, fn)

    def add_async_step(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in the background before ``async_fn``; ``async_fn`` runs even if
        ``fn`` fails (the call then fails with ``fn``'s error)."""
        self._check_not_frozen()
        self.async_fn, self.async_fn_args, self.async_fn_kwargs = (
            _Chained(fn, self.async_fn, self.async_fn_args, self.async_fn_kwargs), (), {})

    def execute_sync(self) -> None:
        """Run everything now, in this thread: ``async_fn``, then (if it succeeded on every
        rank) the finalize steps. Collective like finalization: errors are raised on every
        rank."""
        call = _Call(-1, _preloaded(self))
        call.run()
        _finalize(call, is_distributed(), "Async request")

    def freeze(self) -> "AsyncRequest":
        """A frozen copy (what a queue keeps once the request is scheduled)."""
        return replace(self, finalize_fns=list(self.finalize_fns), resources=list(self.resources), is_frozen=True)


def _preloaded(request: AsyncRequest) -> AsyncRequest:
    """``request`` with ``preload_fn`` run now and its result as ``async_fn_args[1]``."""
    if request.preload_fn is None:
        return request
    args = list(request.async_fn_args)
    if len(args) < 2:
        raise CheckpointingException(
            f"preload_fn replaces async_fn_args[1], but the request has {len(args)} args")
    args[1] = request.preload_fn()
    return replace(request, async_fn_args=tuple(args), preload_fn=None)


class _Chained:
    """``step()`` then ``fn(*args, **kwargs)`` (always run); ``step``'s error wins."""

    def __init__(self, step: Callable[[], Any], fn: Optional[Callable[..., Any]], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]):
        self.step, self.fn, self.args, self.kwargs = step, fn, args, kwargs

    def __call__(self) -> None:
        error: Optional[BaseException] = None
        try:
            self.step()
        except BaseException as e:  # noqa: BLE001 - re-raised once fn has run
            error = e
        if self.fn is not None:
            try:
                self.fn(*self.args, **self.kwargs)
            except BaseException:
                if error is None:
                    raise
        if error is not None:
            raise error


class _Call:
    def __init__(self, idx: int, request: AsyncRequest):
        self.idx = idx
        self.request = request
        self.done = threading.Event()
        self.error: Optional[str] = None

    def run(self) -> None:
        try:
            if self.request.async_fn is not None:
                self.request.async_fn(*self.request.async_fn_args, **self.request.async_fn_kwargs)
        except BaseException as e:  # noqa: BLE001 - reported at finalization
            self.error = error_message(e)
        finally:
            self.done.set()


def _finalize(call: _Call, collective: bool, what: str, failed: Optional[bool] = None) -> None:
    """Raise on every rank if ``call`` failed on any rank; else run its finalize steps, each
    agreed over all ranks. ``failed``: whether it failed anywhere, if already agreed."""
    if collective:
        if failed is None or failed:
            raise_if_any(all_gather_object(call.error), what)
        for fn in call.request.finalize_fns:
            run_agreed(fn, f"Finalizing: {what}")
        return
    if call.error is not None:
        raise CheckpointingException(f"{what} failed: {call.error}")
    for fn in call.request.finalize_fns:
        fn()


class _Worker:
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

    Scheduling and finalizing are collective: every rank schedules the same requests in
    the same order and calls :meth:`maybe_finalize_async_calls` at the same points.
    """

    def __init__(self, persistent: bool = False):
        self.persistent = persistent
        self._calls: List[_Call] = []
        self._next_idx = 0
        self._worker: Optional[_Worker] = None
        self._resources: Dict[int, Any] = {}
        self._closed = False

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
                self._worker = _Worker()
            self._worker.submit(call)
        else:
            threading.Thread(target=call.run, name=f"dist_checkpointing-async-{call.idx}", daemon=True).start()
        return call.idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize, in order, the calls that are done on every rank; return their indices.

        With ``blocking`` wait for every scheduled call. Each check costs one 2-byte
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
            flags = [int(not call.done.is_set()), int(call.error is not None)]
            if collective:
                flags = all_reduce_max_uint8(flags)
            if flags[0]:
                break
            self._calls.pop(0)
            _finalize(call, collective, f"Async call {call.idx}", failed=bool(flags[1]))
            finalized.append(call.idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        """How many scheduled calls are not finalized yet."""
        return len(self._calls)

    def close(self, abort: bool = False) -> None:
        """Finalize every scheduled call (blocking), stop the worker and release the
        requests' resources. Further scheduling raises. Collective, like finalization.
        With ``abort`` (not collective) pending calls are dropped unfinalized: their
        checkpoints stay incomplete."""
        if self._closed:
            return
        try:
            if abort:
                self._calls.clear()
            self.maybe_finalize_async_calls(blocking=True)
        finally:
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


# ----------------------------------------------------------------------------- forked calls

_live_children: "weakref.WeakSet[ForkedCall]" = weakref.WeakSet()
_PR_SET_PDEATHSIG = 1


def _resolve_prctl() -> Optional[Callable[..., int]]:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_prctl: Optional[Callable[..., int]] = None  # resolved in the parent: a child must not dlopen


def _die_with_parent() -> None:
    """In a forked child: get SIGKILL when the thread that forked it ends (Linux). Forks
    are made by the long-lived forker thread, so that is when this process ends."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _Forker:
    """A daemon thread that makes every fork, so that a child's parent-death signal is tied
    to a thread that lives as long as the process (not to the caller's thread), and no
    other fork of ours can inherit a pipe's write end."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Tuple[Callable[[], Any], queue.Queue]]" = queue.Queue()
        threading.Thread(target=self._loop, name="dist_checkpointing-forker", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, reply = self._jobs.get()
            try:
                reply.put((True, _fork_child(fn)))
            except BaseException as e:  # noqa: BLE001 - raised in the caller
                reply.put((False, e))

    def fork(self, fn: Callable[[], Any]) -> Tuple[int, int]:
        """``(pid, read end of the result pipe)`` of a child running ``fn``; the caller
        waits, so its memory does not change until the fork is done."""
        reply: "queue.Queue[Tuple[bool, Any]]" = queue.Queue()
        self._jobs.put((fn, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value


_forker: Optional[_Forker] = None
_forker_lock = threading.Lock()


def _get_forker() -> _Forker:
    global _forker, _prctl
    with _forker_lock:
        if _forker is None:
            _prctl = _resolve_prctl()
            _forker = _Forker()
        return _forker


FORK_START_TIMEOUT_S = 10.0  # a forked child that has not started by then is killed and forked again
_FORK_ATTEMPTS = 3


def _fork_child(fn: Callable[[], Any]) -> Tuple[int, int]:
    """Fork a child running ``fn``; ``(pid, read end of its report pipe)``. A child that does
    not get out of ``fork`` (rarely, one hangs in the runtime's after-fork handlers of this
    multi-threaded process) is killed and forked again."""
    for attempt in range(_FORK_ATTEMPTS):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            _run_child(fn, read_fd, write_fd)  # never returns
        os.close(write_fd)
        ready, _, _ = select.select([read_fd], [], [], FORK_START_TIMEOUT_S)
        if ready:
            os.read(read_fd, 1)  # the child's start byte (or EOF: it died, its report says so)
            return pid, read_fd
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        logger.warning("A forked writer (process %d) did not start within %.0f s; forking again (attempt %d of %d)",
                       pid, FORK_START_TIMEOUT_S, attempt + 2, _FORK_ATTEMPTS)
    raise CheckpointingException(f"No forked writer started in {_FORK_ATTEMPTS} attempts "
                                 f"({FORK_START_TIMEOUT_S:.0f} s each)")


def _run_child(fn: Callable[[], Any], read_fd: int, write_fd: int) -> None:
    status = 0
    try:
        os.write(write_fd, b"S")  # started
        os.close(read_fd)
        _die_with_parent()
        try:
            payload = pickle.dumps((True, fn()))
        except BaseException as e:  # noqa: BLE001 - sent to the parent
            payload = pickle.dumps((False, error_message(e)))
        # Length first: the parent has the whole report without waiting for this process to
        # exit (tearing down a large address space takes tens of milliseconds).
        view = memoryview(struct.pack("<Q", len(payload)) + payload)
        while view:
            view = view[os.write(write_fd, view):]
    except BaseException:  # noqa: BLE001 - nothing else can be reported
        status = 1
    finally:
        os._exit(status)


_exiting: List[int] = []  # children that reported and are exiting, not reaped yet
_exiting_lock = threading.Lock()


def reap_exited_children(block: bool = False) -> None:
    """Reap the forked children that have reported their result (they exit on their own
    right after); with ``block``, wait until every one of them has exited."""
    with _exiting_lock:
        left = []
        for pid in _exiting:
            try:
                done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                continue
            if not done:
                left.append(pid)
        _exiting[:] = left


class ForkedCall:
    """``fn()`` run in a forked child process; :meth:`result` returns its (picklable) return
    value or raises :class:`CheckpointingException` with the child's error.

    The child sees this process's private memory as it was at the fork (copy-on-write):
    nothing is copied up front, and pages this process changes afterwards are copied by
    the kernel on first write. (Shared memory — ``share_memory_()`` tensors — is not
    copied: stage such tensors before forking.) The child must only read memory and do file
    I/O (no process-group collectives, no CUDA); it exits with ``os._exit``, running no
    atexit handlers. It is killed if this process dies, and at interpreter exit if still
    running.
    """

    def __init__(self, fn: Callable[[], Any], what: str):
        self.what = what
        self.pid, self._read_fd = _get_forker().fork(fn)
        self._outcome: Optional[Tuple[bool, Any]] = None
        self._wait_lock = threading.Lock()
        self._reaped = False
        self._reap_lock = threading.Lock()
        _live_children.add(self)

    def result(self) -> Any:
        """Wait for the child; its return value, or an exception with its error."""
        with self._wait_lock:
            if self._outcome is None:
                self._outcome = self._collect()
        ok, value = self._outcome
        if not ok:
            raise CheckpointingException(value)
        return value

    def _collect(self) -> Tuple[bool, Any]:
        data = b""
        try:
            while len(data) < 8 or len(data) < 8 + struct.unpack("<Q", data[:8])[0]:
                chunk = os.read(self._read_fd, 1 << 20)
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(self._read_fd)
        _live_children.discard(self)
        if len(data) >= 8 and len(data) == 8 + struct.unpack("<Q", data[:8])[0]:
            with self._reap_lock:
                self._reaped = True  # from now on the pid is the reaper's: never kill it
            with _exiting_lock:
                _exiting.append(self.pid)
            reap_exited_children()
            try:
                return pickle.loads(data[8:])
            except Exception as e:  # noqa: BLE001 - a corrupt report
                return False, f"{self.what}: unreadable report from process {self.pid}: {e}"
        with self._reap_lock:
            _, status = os.waitpid(self.pid, 0)
            self._reaped = True
        if data:
            return False, f"{self.what}: process {self.pid} died while reporting its result"
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            return False, f"{self.what}: process {self.pid} was killed by signal {sig} ({signal.Signals(sig).name})"
        return False, f"{self.what}: process {self.pid} exited with status {os.waitstatus_to_exitcode(status)} without a result"

    def done(self) -> bool:
        """Whether the child has reported (or died): :meth:`result` will not wait long."""
        if self._outcome is not None:
            return True
        return bool(select.select([self._read_fd], [], [], 0)[0])

    def kill(self) -> None:
        """Kill the child if it is still running (whoever waits for it sees the error)."""
        with self._reap_lock:
            if not self._reaped:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@atexit.register
def _kill_live_children() -> None:
    for child in list(_live_children):
        child.kill()
    reap_exited_children(block=True)


from .async_callers import AsyncCaller, PersistentAsyncCaller, TemporalAsyncCaller, _disable_gc  # noqa: E402,F401
