"""Functions run in a forked child process: the child sees a copy-on-write snapshot of this
process's memory as it was at the fork, so the caller may change its tensors right away
(async saves' writers, the two-tier local snapshot). Re-exported by :mod:`.async_utils`.

Every fork is made by one long-lived daemon thread of the library (the caller waits): the
child asks the kernel to kill it when that thread -- in effect the process -- dies
(``PR_SET_PDEATHSIG`` is tied to the forking thread; ``prctl`` is resolved in the parent, so
the child does not ``dlopen``), and no two forks race for a pipe's write end. The child's
first act is a start byte: a child silent for ``FORK_START_TIMEOUT_S`` (10 s) is killed and
forked again (three attempts, then an error) -- the tests found children hung inside
``os.fork()`` itself, in a multi-threaded process's after-fork handlers. The child uses only
its own fresh threads, file I/O and loaded modules (no process-group or CUDA calls), sends
its report length-first through the pipe (the parent need not wait for the teardown of the
child's address space) and leaves with ``os._exit``; exited children are reaped later (at
the latest by ``AsyncCallsQueue.close()`` or at exit, where an ``atexit`` hook kills writers
still running). A child killed by a signal or without a full report is an error naming the
process and the signal. A forked writer's 16 MiB write buffers are reserved from the
process-wide pool (:func:`..storage.buffers.reserve_write_buffers`) and mapped in with one
``madvise(MADV_POPULATE_READ)`` before first use.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import pickle
import queue
import select
import signal
import struct
import threading
import weakref
from typing import Any, Callable, List, Optional, Tuple

from ..pickling.trusted import loads_trusted
from ..core import CheckpointingException
from .collectives import error_message
from .process_qos import apply_writer_qos

logger = logging.getLogger(__name__)


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
    # no garbage collection here: a collection would run the finalizers of the parent's
    # garbage (a process group's C++ destructor joins threads this process does not have:
    # SIGABRT); this process only writes and exits
    gc.disable()
    status = 0
    try:
        os.write(write_fd, b"S")  # started
        os.close(read_fd)
        _die_with_parent()
        try:
            apply_writer_qos()  # the priorities Megatron-LM asks of its checkpoint writers
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
    I/O (no process-group collectives, no CUDA); it collects no garbage (the parent's
    garbage is not its to finalize) and exits with ``os._exit``, running no atexit
    handlers. It is killed if this process dies, and at interpreter exit if still running.
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
                return loads_trusted(data[8:])  # the forked child's report
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
        return self.wait(0)

    def wait(self, timeout: float) -> bool:
        """:meth:`done`, waiting up to ``timeout`` seconds for it."""
        if self._outcome is not None:
            return True
        return bool(select.select([self._read_fd], [], [], timeout)[0])

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
