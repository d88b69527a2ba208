"""A pool of real processes joined in a gloo process group, reused across tests.

Starting ranks costs seconds, so each world size gets one pool per test session, and the
ranks are forked from a server process that has already imported torch (multiprocessing's
``forkserver``; ``spawn`` where there is none): a rank then costs a fork and a gloo
rendezvous, not a fresh interpreter importing torch (~2.5 s of CPU each).
``pool.run(fn, *args)`` runs the module-level function ``fn(rank, world_size, *args)`` on
every rank and returns the per-rank results; an exception on any rank is re-raised in
the test with the rank's traceback. A call that does not finish within its timeout
fails the test and the pool is restarted (a hang is a bug, never a pass).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from .helpers import free_port, wait_with_progress

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RankError(Exception):
    """An exception raised by a function on one of the ranks."""

    def __init__(self, rank: int, exc: BaseException, tb: str):
        super().__init__(f"rank {rank}: {type(exc).__name__}: {exc}\n{tb}")
        self.rank, self.exc = rank, exc


# This module imports the library and the test helpers. torch's compiler stack (~1.5 s of CPU)
# is imported at import by Megatron-Core (its fused kernels are torch.compile'd): the ranks
# and launched scripts that import Megatron-Core then take ~0.2 s instead of ~1.9 s.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", __name__]


def _context():
    """The start method for ranks: ``forkserver`` preloading torch, else ``spawn``."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def _worker(rank: int, world_size: int, port: int, conn, dump_path: str, env: dict) -> None:
    sys.path.insert(0, _ROOT)
    # the fork server's environment is the one it started with: take the test process's now
    os.environ.clear()
    os.environ.update(env)
    dump = open(dump_path, "w")  # every thread's stack on SIGUSR1 (the pool asks on a hang)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except Exception as e:  # noqa: BLE001 - e.g. the port taken meanwhile: the pool starts again
        conn.send(("not started", repr(e)))
        return
    conn.send(("started", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            result = (True, fn(rank, world_size, *args))
        except BaseException as e:  # noqa: BLE001 - shipped to the test
            result = (False, (e, traceback.format_exc()))
        try:
            conn.send(result)
        except Exception as e:  # noqa: BLE001 - unpicklable result
            conn.send((False, (RuntimeError(f"unpicklable result: {e}"), "")))
    dist.destroy_process_group()


def _descendants(pids: List[int]) -> List[int]:
    """The processes descended from ``pids`` (Linux ``/proc``; none elsewhere)."""
    parent_of = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], set(pids)
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier}
        found += sorted(frontier)
    return found


class DistPool:
    """``world_size`` ranks in a gloo group, waiting for functions to run."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs: List[mp.Process] = []
        self._conns: list = []
        self._start()

    def _start(self, attempts: int = 3) -> None:
        """Start the ranks and wait until their group is up; a start that fails (the free
        port taken by another process before rank 0 bound it) is retried on a new port."""
        for _ in range(attempts):
            self._spawn()
            failure = self._wait_started()
            if failure is None:
                return
            self.close()
            self._procs, self._conns = [], []
        raise RuntimeError(f"a pool of {self.world_size} ranks did not start in {attempts} attempts: {failure}")

    def _wait_started(self, timeout: float = 300.0) -> Optional[str]:
        """``None`` once every rank's process group is up, else why not."""
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                return f"rank {rank} did not join within {timeout} s"
            try:
                status, detail = conn.recv()
            except EOFError:
                return f"rank {rank} exited"
            if status != "started":
                return f"rank {rank}: {detail}"
        return None

    def _spawn(self) -> None:
        ctx = _context()
        port = free_port()
        self._dumps = []
        for rank in range(self.world_size):
            fd, path = tempfile.mkstemp(prefix=f"dist_pool_rank{rank}_", suffix=".txt")
            os.close(fd)
            self._dumps.append(path)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world_size, port, child, self._dumps[rank], dict(os.environ)),
                            daemon=True)
            p.start()
            self._procs.append(p)
            self._conns.append(parent)

    def _dispatch(self, fn: Callable[..., Any], args: tuple, timeout: float) -> List[Tuple[bool, Any]]:
        """Send ``fn`` to every rank and collect ``(ok, value)`` per rank; a hang fails."""
        self.submit(fn, *args)
        return self.collect(fn, timeout)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start ``fn(rank, world_size, *args)`` on every rank without waiting (for running
        two pools at once); :meth:`collect` its replies."""
        for conn in self._conns:
            conn.send((fn, args))

    def collect(self, fn: Callable[..., Any], timeout: float = 120.0) -> List[Tuple[bool, Any]]:
        """``(ok, value)`` per rank of the call started by :meth:`submit`; a hang fails.

        A hang is told from a slow machine by progress (:func:`helpers.wait_with_progress`):
        the call fails once ``timeout`` has passed and the ranks' processes have then used
        no CPU for a while, or after ``timeout`` times the hard-cap factor in any case."""
        replies = []
        for rank, conn in enumerate(self._conns):
            if not wait_with_progress(conn.poll, self._pids, timeout):
                stacks = self._stacks()
                self.restart()
                raise TimeoutError(f"rank {rank} did not finish {fn.__name__}: no progress after {timeout} s (hang)\n{stacks}")
            replies.append(conn.recv())
        return replies

    def _pids(self) -> List[int]:
        """The ranks' processes and their descendants (forked writers, workers)."""
        pids = [p.pid for p in self._procs if p.pid is not None]
        return pids + _descendants(pids)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> List[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the results by rank."""
        replies = self._dispatch(fn, args, timeout)
        for rank, (ok, value) in enumerate(replies):
            if not ok:
                raise RankError(rank, *value)
        return [value for _, value in replies]

    def run_expect_error(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> List[BaseException]:
        """Run ``fn`` and return every rank's exception; fail if any rank succeeded."""
        replies = self._dispatch(fn, args, timeout)
        for rank, (ok, value) in enumerate(replies):
            if ok:
                raise AssertionError(f"rank {rank} did not raise (returned {value!r})")
        return [value[0] for _, value in replies]

    def _stacks(self) -> str:
        """Every thread's stack on every rank (faulthandler), for a hang's report."""
        for pid in self._pids():  # with forked writers: they inherit the handler and the file
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
        out = []
        for rank, path in enumerate(self._dumps):
            try:
                with open(path) as f:
                    out.append(f"--- rank {rank} ---\n{f.read()[-6000:]}")
            except OSError:
                pass
        return "\n".join(out)

    def restart(self) -> None:
        self.close()
        self._procs, self._conns = [], []
        self._start()

    def shutdown(self) -> None:
        """Ask every rank to leave (returns at once; :meth:`close` waits for them)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass

    def close(self) -> None:
        """Stop the ranks: ask them to leave, wait a little, kill what is left."""
        self.shutdown()
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        for path in getattr(self, "_dumps", []):
            try:
                os.unlink(path)
            except OSError:
                pass


class OwnPools:
    """A test module's own pools, one per world size, started on first use: for ranks that
    import something (e.g. Megatron-Core) the shared pools' ranks must never see."""

    def __init__(self) -> None:
        self._pools: Dict[int, DistPool] = {}

    def get(self, world: int) -> DistPool:
        if world not in self._pools:
            self._pools[world] = DistPool(world)
        return self._pools[world]

    def close(self) -> None:
        for p in self._pools.values():
            p.shutdown()  # every pool asked first: they leave together
        for p in self._pools.values():
            p.close()
        self._pools.clear()
