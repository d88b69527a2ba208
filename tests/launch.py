"""Run a Python script, ``-m`` module, ``-c`` code or torchrun job the way a fresh
``python`` would, but forked from the test session's fork server, which has already
imported torch (``dist_pool``'s; it also serves the pools' ranks).

A fresh interpreter spends ~3 s of CPU importing torch and the library; a fork from the
preloaded server ~0.03 s. The child behaves as ``python ARGV`` run in ``cwd`` with ``env``:
``sys.argv``, ``sys.path`` (the script's folder or the working directory, then
``PYTHONPATH``, then the interpreter's own entries), ``PYTHONWARNINGS`` and
``OMP_NUM_THREADS`` (read at start-up), ``__main__``, stdin from /dev/null,
stdout/stderr captured, and at the end what an exiting interpreter does (wait for
non-daemon threads, run ``atexit`` handlers, flush) with the script's exit code; a signal
that kills it gives ``-signum`` as ``subprocess`` reports it. What it does not reproduce:
the imports the server made (torch, its compiler stack, the library: ``dist_pool._PRELOAD``)
— tests about what a fresh interpreter imports, or how long it takes to start, use
``subprocess``.

:class:`Torchrun` gives the ranks of ``torchrun --nnodes N --nproc-per-node P`` the
environment torchrun gives them (rank 0 hosts the store instead of an agent) and, like
torchrun's agents, stops the job once one rank fails.
"""

from __future__ import annotations

import atexit
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .dist_pool import _context
from .helpers import free_port

_LIVE: List["Launched"] = []
_BASE_PATH: List[str] = []
_OUTPUTS: List[str] = []  # the session's folder for captured output (removed by kill_all)


def _outputs() -> str:
    if not _OUTPUTS:
        _OUTPUTS.append(tempfile.mkdtemp(prefix="launched_"))
    return _OUTPUTS[0]


def _interpreter_path() -> List[str]:
    """``sys.path`` of a fresh interpreter without ``PYTHONPATH`` (its first entry dropped)."""
    if not _BASE_PATH:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, "-c", "import sys; print('\\n'.join(sys.path[1:]))"],
                             env=env, capture_output=True, text=True, check=True).stdout
        _BASE_PATH.extend(p for p in out.splitlines() if p)
    return list(_BASE_PATH)


def _exit_code(e: SystemExit) -> int:
    """The process exit status ``raise SystemExit(e.code)`` gives (as the interpreter does)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _child(argv: List[str], env: Dict[str, str], cwd: str, out_path: str, err_path: str,
           base_path: List[str]) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")
    if env.get("PYTHONWARNINGS"):
        warnings._processoptions(env["PYTHONWARNINGS"].split(","))
    if env.get("OMP_NUM_THREADS", "").isdigit() and "torch" in sys.modules:  # read by torch at its import
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    option = argv[0] if argv[0] in ("-m", "-c") else None
    first = "" if option == "-c" else cwd if option else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + base_path
    code = 0
    try:
        if option == "-m":
            sys.argv = [argv[1]] + argv[2:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif option == "-c":
            sys.argv = ["-c"] + argv[2:]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - reported as the interpreter reports it
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next  # the script's frames only, as a fresh interpreter shows them
        traceback.print_exception(type(e), e, tb)
        code = 1
    threading._shutdown()  # what an exiting interpreter does, in its order
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class Launched:
    """A running ``python ARGV`` forked from the fork server (``subprocess.Popen``'s methods
    the tests use)."""

    def __init__(self, argv: Sequence[str], env: Optional[Dict[str, str]] = None, cwd: Optional[os.PathLike] = None):
        self.args = list(map(str, argv))
        self._dir = tempfile.mkdtemp(dir=_outputs())
        self._out, self._err = os.path.join(self._dir, "stdout"), os.path.join(self._dir, "stderr")
        ctx = _context()
        self._proc = ctx.Process(target=_child, daemon=False, args=(
            self.args, dict(os.environ if env is None else env), str(cwd or os.getcwd()), self._out, self._err,
            _interpreter_path()))
        self._proc.start()
        self.pid = self._proc.pid
        _LIVE.append(self)

    @property
    def returncode(self) -> Optional[int]:
        return self._proc.exitcode

    def poll(self) -> Optional[int]:
        return self._proc.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        if self in _LIVE:
            _LIVE.remove(self)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: Optional[float] = None) -> Tuple[str, str]:
        """Wait (``subprocess.TimeoutExpired`` past ``timeout``) and return stdout, stderr."""
        self.wait(timeout)
        return self.output()

    def wait_for_output(self, text: str, timeout: float) -> bool:
        """Whether ``text`` appeared on stdout within ``timeout`` s (False once it exited)."""
        deadline = time.monotonic() + timeout
        while text not in self.output()[0]:
            if self.poll() is not None or time.monotonic() >= deadline:
                return text in self.output()[0]
            time.sleep(0.02)
        return True

    def output(self) -> Tuple[str, str]:
        """What the process wrote so far to stdout and stderr."""
        texts = []
        for path in (self._out, self._err):
            try:
                texts.append(Path(path).read_text(errors="replace"))
            except OSError:
                texts.append("")
        return texts[0], texts[1]


def run(argv: Sequence[str], env: Optional[Dict[str, str]] = None, cwd: Optional[os.PathLike] = None,
        timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True)`` through a
    fork: ``argv`` starts with the script, ``-m`` or ``-c``; a timeout kills it and raises
    ``subprocess.TimeoutExpired``."""
    proc = Launched(argv, env, cwd)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def torchrun_env(env: Dict[str, str], rank: int, local_rank: int, world: int, nproc: int, node: int, nnodes: int,
                 port: int, run_id: str) -> Dict[str, str]:
    """The variables torchrun (torch 2.13's local elastic agent) sets for one rank; no agent
    store: rank 0 hosts it."""
    env = dict(env)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), GROUP_RANK=str(node), ROLE_RANK=str(rank),
               ROLE_NAME="default", LOCAL_WORLD_SIZE=str(nproc), WORLD_SIZE=str(world), GROUP_WORLD_SIZE=str(nnodes),
               ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=run_id,
               TORCHELASTIC_USE_AGENT_STORE="False")
    return env


class Torchrun:
    """The ranks of ``len(envs)`` torchrun agents (one per simulated node, ``envs[node]`` its
    environment), ``nproc`` forks of ``python ARGV`` each, with torchrun's variables. As with
    torchrun, once a rank fails the job is over: its agent stops the node's other ranks and
    the rendezvous closes, so the other agents stop theirs (SIGTERM, SIGKILL after ``grace``
    s); every node then reports failure."""

    def __init__(self, argv: Sequence[str], nproc: int, cwd: os.PathLike, envs: Sequence[Dict[str, str]],
                 run_id: str = "none"):
        port, nnodes = free_port(), len(envs)
        self.nodes = [[Launched(argv, torchrun_env(env, node * nproc + r, r, nproc * nnodes, nproc, node, nnodes,
                                                   port, run_id), cwd)
                       for r in range(nproc)] for node, env in enumerate(envs)]

    def wait(self, timeout: float, grace: float = 5.0) -> List[int]:
        """Each node's exit status (0: all its ranks exited 0); ``subprocess.TimeoutExpired``
        past ``timeout`` s (every rank killed)."""
        ranks = [r for node in self.nodes for r in node]
        deadline, stopping = time.monotonic() + timeout, False
        while True:
            codes = [r.poll() for r in ranks]
            if all(c is not None for c in codes):
                break
            if not stopping and any(c not in (None, 0) for c in codes):
                stopping = True
                for r in ranks:
                    r.terminate()
                deadline = min(deadline, time.monotonic() + grace)
            if time.monotonic() >= deadline:
                for r in ranks:
                    r.kill()
                    r.wait()
                if not stopping:
                    raise subprocess.TimeoutExpired(ranks[0].args, timeout)
                break
            time.sleep(0.05)
        for r in ranks:
            r.wait()
        return [next((r.returncode for r in node if r.returncode), 0) for node in self.nodes]

    def output(self) -> str:
        """Every rank's stdout then stderr, labelled."""
        parts = []
        for node, ranks in enumerate(self.nodes):
            for local, r in enumerate(ranks):
                out, err = r.output()
                parts.append(f"--- node {node} local rank {local} stdout ---\n{out}"
                             f"--- node {node} local rank {local} stderr ---\n{err}")
        return "\n".join(parts)


def kill_all() -> None:
    """Kill what tests left running and remove the captured output (at the end of the session)."""
    for proc in list(_LIVE):
        proc.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
    _LIVE.clear()
    for path in _OUTPUTS:
        shutil.rmtree(path, ignore_errors=True)
    _OUTPUTS.clear()
