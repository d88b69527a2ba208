"""A worker process started once (a new interpreter: never a fork of the trainer, and it
does not re-run the trainer's main module as ``multiprocessing``'s spawn does) that runs calls
one after another: async saves' writers (:func:`..strategies.torch_dist.records.write_from_arena`; that worker
imports no torch) and Megatron-Core's :class:`~.async_callers.PersistentAsyncCaller`.

Calls and their results travel pickled through pipes (CPU tensors in their arguments
through shared memory, as ``torch.multiprocessing`` shares them). Shared host arenas
(:class:`~.arenas.StagingArena`) are handed over once, by file descriptor, and kept mapped
in the worker until forgotten, so a save's write reads the staged bytes in place. The
worker exits when this process does (it watches its parent), and a worker that dies fails
its pending calls with the exit code; the next call starts a new one.

It is started on the first arena-mode save with ``subprocess`` running
:func:`main`; the package imports lazily there, as in the CLI, so the writer starts in
~0.2 s of CPU and holds ~20 MB resident (with torch: ~3 s, ~250 MB). The storage travels as
its ``process_spec()``, an arena's descriptor once with ``SCM_RIGHTS``; the worker polls
``getppid()`` every 0.2 s.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import mmap
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Pipe
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Callable, Dict, Optional, Tuple

from ..core import CheckpointingException, error_message
from .process_qos import apply_writer_qos, writer_qos

logger = logging.getLogger(__name__)

#: in the worker: the arenas handed over, by id (``(mmap, size)``)
ARENAS: Dict[int, Tuple[mmap.mmap, int]] = {}
#: in the worker: the results connection, the running call's id and the lock of its sends
_CALL: Dict[str, Any] = {}
PARENT_POLL_S = 0.2  # how often the worker checks that its parent is alive
_ENV = "DIST_CKPT_WORKER_FDS"  # the worker's connections, parent, log level, whether calls hold tensors
_QOS_ENV = "DIST_CKPT_WORKER_QOS"  # "cpu,io" priorities (:mod:`.process_qos`; empty: unchanged)


def check_mp_mode(mp_mode: str) -> None:
    """Refuse an ``mp_mode`` (Megatron-Core's name for a ``multiprocessing`` start method)
    that is not one (the worker here is always a new interpreter, whatever it says)."""
    if mp_mode not in multiprocessing.get_all_start_methods():
        raise CheckpointingException(f"mp_mode must be one of {multiprocessing.get_all_start_methods()}, "
                                     f"not {mp_mode!r}")


def arena_bytes(arena_id: int) -> memoryview:
    """In the worker: the bytes of arena ``arena_id`` (handed over by :meth:`PersistentWorker.share_arena`)."""
    try:
        m, size = ARENAS[arena_id]
    except KeyError:
        raise CheckpointingException(f"Staging arena {arena_id} was not handed to this worker") from None
    return memoryview(m)[:size]


def report_progress(phase: str, done: int, total: int) -> None:
    """In the worker, during a call: send a byte report (a :data:`.progress.ByteSink`) to
    the caller, whose job hands it to its ``on_progress``."""
    with _CALL["lock"]:
        _CALL["results"].send((_CALL["id"], None, (phase, done, total)))


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)  # the trainer is gone: nothing would finalize what this writes


def main() -> None:
    """The worker process's entry: its two connections are inherited descriptors."""
    jobs_fd, results_fd, parent, log_level, tensors = map(int, os.environ.pop(_ENV).split(","))
    qos = os.environ.pop(_QOS_ENV, "")
    if qos:
        apply_writer_qos(tuple(int(v) if v else None for v in qos.split(",")))
    _serve(Connection(jobs_fd), Connection(results_fd), parent, log_level, bool(tensors))


def _serve(jobs: Any, results: Any, parent: int, log_level: int, tensors: bool = True) -> None:
    """The worker's loop: ``("call", id, fn, args, kwargs)`` → ``(id, ok, value)``;
    ``("arena", id, size)`` followed by its file descriptor; ``("forget", id)``; ``None`` ends.
    ``tensors``: calls and results may hold CPU tensors (torch is imported for them; the
    writer of async saves has none, and imports no torch)."""
    if tensors:
        import torch.multiprocessing  # noqa: F401 - registers the reductions that share CPU tensors

    logging.getLogger("dist_checkpointing").setLevel(log_level)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    while True:
        try:
            msg = jobs.recv()
        except EOFError:
            return
        if msg is None:
            return
        if msg[0] == "arena":
            fd = recv_handle(jobs)
            try:
                ARENAS[msg[1]] = (mmap.mmap(fd, msg[2]), msg[2])
            finally:
                os.close(fd)
            continue
        if msg[0] == "forget":
            entry = ARENAS.pop(msg[1], None)
            if entry is not None:
                try:
                    entry[0].close()
                except BufferError:  # a view still alive: unmapped when collected
                    pass
            continue
        _, call_id, fn, args, kwargs = msg
        _CALL.update(results=results, id=call_id, lock=_CALL.get("lock") or threading.Lock())
        try:
            reply = (call_id, True, fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            reply = (call_id, False, error_message(e))
        with _CALL["lock"]:
            try:
                results.send(reply)
            except Exception as e:  # noqa: BLE001 - an unpicklable result
                results.send((call_id, False, f"cannot send the result back: {error_message(e)}"))


_DEATH_WAIT_S = 10.0  # a worker whose pipe broke under a send: how long it may take to exit


class Job:
    """A call sent to the worker: :meth:`result` waits for its value; ``on_progress`` gets
    the byte reports the call sends (:func:`report_progress`), in the worker's result
    thread."""

    def __init__(self, worker: "PersistentWorker", call_id: int, what: str,
                 on_progress: Optional[Callable[[str, int, int], None]] = None):
        self._worker, self.call_id, self.what, self.on_progress = worker, call_id, what, on_progress
        self._done = threading.Event()
        self._ok = False
        self._value: Any = None

    def _set(self, ok: bool, value: Any) -> None:
        self._ok, self._value = ok, value
        self._done.set()

    def done(self) -> bool:
        """Whether the call has ended (with a value or an error)."""
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> Any:
        """The call's value; its error (or the worker's death) as :class:`CheckpointingException`."""
        if not self._done.wait(timeout):
            raise CheckpointingException(f"{self.what}: no result within {timeout} s")
        if not self._ok:
            raise CheckpointingException(f"{self.what} failed in the persistent worker: {self._value}")
        return self._value


class PersistentWorker:
    """One ``spawn`` ed worker process, started on the first call and reused until
    :meth:`close`; calls run in the order they are submitted. ``tensors``: whether calls
    and results may hold CPU tensors (shared through shared memory; the worker then imports
    torch at start)."""

    def __init__(self, name: str = "dist_checkpointing-worker", tensors: bool = True):
        self.name, self.tensors = name, tensors
        self.process: Any = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: Dict[int, Job] = {}
        self._arenas: set = set()  # ids of the arenas this worker holds
        self._jobs: Any = None

    @property
    def pid(self) -> Optional[int]:
        """The worker's process id (None before the first call)."""
        return self.process.pid if self.process is not None else None

    def _start(self) -> None:
        import torch.multiprocessing  # noqa: F401 - CPU tensors in calls travel through shared memory

        self._jobs, theirs = Pipe(duplex=True)  # a Unix socket: it can carry descriptors
        results, their_results = Pipe(duplex=False)
        level = logging.getLogger("dist_checkpointing").getEffectiveLevel()
        qos = writer_qos()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   **{_ENV: f"{theirs.fileno()},{their_results.fileno()},{os.getpid()},{level},{int(self.tensors)}",
                      _QOS_ENV: ",".join("" if v is None else str(v) for v in qos) if qos else ""})
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from dist_checkpointing.runtime.persistent_worker import main; main()"],
                env=env, pass_fds=(theirs.fileno(), their_results.fileno()), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
            their_results.close()
        self._arenas = set()
        threading.Thread(target=self._collect, args=(self.process, results), name=f"{self.name}-results",
                         daemon=True).start()

    def _collect(self, process: Any, results: Any) -> None:
        """Hand each result to its job; when the worker dies, fail the jobs still pending."""
        while True:
            try:
                call_id, ok, value = results.recv()
            except (EOFError, OSError):
                break
            if ok is None:  # a byte report of a running call
                with self._lock:
                    job = self._pending.get(call_id)
                if job is not None and job.on_progress is not None:
                    try:
                        job.on_progress(*value)
                    except Exception:  # noqa: BLE001 - a broken sink must not stop the results
                        logger.warning("%s: its progress report failed (ignored)", job.what, exc_info=True)
                continue
            with self._lock:
                job = self._pending.pop(call_id, None)
            if job is not None:
                job._set(ok, value)
        code = process.wait()
        with self._lock:
            if self.process is process:
                self.process = None
            pending, self._pending = self._pending, {}
        for job in pending.values():
            job._set(False, f"the persistent worker (pid {process.pid}) died (exit code {code})")

    def _send(self, msg: Any, fd: Optional[int] = None) -> None:
        if self.process is None or self.process.poll() is not None:
            self._start()
        self._jobs.send(msg)
        if fd is not None:
            send_handle(self._jobs, fd, self.process.pid)

    def share_arena(self, arena_id: int, fd: int, size: int) -> None:
        """Hand the shared memory behind ``fd`` (``size`` bytes) to the worker once; its
        calls read it with :func:`arena_bytes`."""
        with self._lock:
            if self.process is not None and self.process.poll() is None and arena_id in self._arenas:
                return
            self._send(("arena", arena_id, size), fd)
            self._arenas.add(arena_id)

    def forget_arena(self, arena_id: int) -> None:
        """Let the worker unmap an arena (no call may use it afterwards)."""
        with self._lock:
            if arena_id in self._arenas and self.process is not None:
                self._arenas.discard(arena_id)
                try:
                    self._jobs.send(("forget", arena_id))
                except OSError:
                    pass

    def submit(self, fn: Callable[..., Any], args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None,
               what: str = "A call", on_progress: Optional[Callable[[str, int, int], None]] = None) -> Job:
        """Run ``fn(*args, **kwargs)`` in the worker (``fn`` importable there); returns its
        :class:`Job` (``on_progress``: see :class:`Job`)."""
        with self._lock:
            job = Job(self, next(self._ids), what, on_progress)
            self._pending[job.call_id] = job
            try:
                self._send(("call", job.call_id, fn, tuple(args), dict(kwargs or {})))
            except (BrokenPipeError, ConnectionResetError) as e:  # the worker died under the send
                del self._pending[job.call_id]
                try:
                    code = self.process.wait(_DEATH_WAIT_S)
                except (AttributeError, subprocess.TimeoutExpired):
                    raise CheckpointingException(f"{what}: cannot send it to the persistent worker: "
                                                 f"{error_message(e)}") from e
                job._set(False, f"the persistent worker (pid {self.process.pid}) died (exit code {code})")
            except Exception as e:  # noqa: BLE001 - unpicklable arguments
                del self._pending[job.call_id]
                raise CheckpointingException(f"{what}: cannot send it to the persistent worker: "
                                             f"{error_message(e)}") from e
        return job

    def close(self, kill: bool = False, timeout: float = 60.0) -> None:
        """Stop the worker once its calls are done (``kill``: now)."""
        with self._lock:
            process = self.process
            if process is None:
                return
            if kill:
                process.kill()
            else:
                try:
                    self._jobs.send(None)
                except OSError:
                    pass
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


_shared: Optional[PersistentWorker] = None
_shared_lock = threading.Lock()


def shared_worker() -> PersistentWorker:
    """This process's writer worker (one per process; started on its first call; it runs
    :func:`..strategies.torch_dist.records.write_from_arena` and imports no torch)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = PersistentWorker("dist_checkpointing-writer", tensors=False)  # it writes from arenas
            atexit.register(_shared.close)
        return _shared


def _forget_after_fork() -> None:
    global _shared
    _shared = None  # a forked child must not talk to its parent's worker


os.register_at_fork(after_in_child=_forget_after_fork)
