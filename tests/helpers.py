"""Helpers shared by several test modules (the process pools live in ``conftest.py``)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Callable, Iterator, List, Sequence, Tuple

from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing.dict_utils import nested_values
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from dist_checkpointing.strategies.torch_dist import writing as torch_dist_writing


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Timeouts in the tests are hang detectors, not performance limits. One setting scales them:
# DIST_CKPT_TEST_TIMEOUT_SCALE (a factor; unset: the machine's load average per core at the
# moment, at least 1, at most 8). Pool calls also look at progress (wait_with_progress).
_SCALE_ENV = "DIST_CKPT_TEST_TIMEOUT_SCALE"
_HARD_CAP = 4.0  # a call still making progress fails after this many (scaled) timeouts
_QUIET_S = 10.0  # ... and a call past its timeout fails once its processes were idle this long


def timeout_scale() -> float:
    """The factor every test timeout is multiplied by (see ``DIST_CKPT_TEST_TIMEOUT_SCALE``)."""
    if os.environ.get(_SCALE_ENV):
        return float(os.environ[_SCALE_ENV])
    return min(8.0, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def slack(seconds: float) -> float:
    """``seconds`` scaled for this machine's load: the timeout to pass to a wait."""
    return seconds * timeout_scale()


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU time used so far by ``pids`` and their reaped children (Linux ``/proc``; 0 elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def wait_with_progress(poll: Callable[[float], bool], pids: Callable[[], List[int]], timeout: float,
                       quiet: float = _QUIET_S) -> bool:
    """Wait until ``poll(seconds)`` says ready; False for a hang.

    A hang is ``slack(timeout)`` seconds passed and then ``_QUIET_S`` seconds in which the
    processes ``pids()`` used no CPU, or ``_HARD_CAP`` times that timeout in any case: a
    slow or loaded machine keeps a call alive while its processes work."""
    start = time.monotonic()
    deadline, hard = start + slack(timeout), start + _HARD_CAP * slack(timeout)
    if poll(min(timeout, 1.0) if os.path.isdir("/proc") else slack(timeout)):
        return True
    history: List[Tuple[float, float]] = []  # (time, cpu seconds) once past the deadline
    while True:
        if poll(1.0):
            return True
        now = time.monotonic()
        if now < deadline:
            continue
        if now >= hard or not os.path.isdir("/proc"):
            return False
        history.append((now, cpu_seconds(pids())))
        old = [c for t, c in history if now - t >= quiet]
        if old and history[-1][1] - old[-1] < 0.05:
            return False


def assert_all_raise(excs: Sequence[BaseException], world: int, *fragments: str) -> None:
    """Every one of the ``world`` ranks raised a ``CheckpointingException`` whose message
    holds every fragment."""
    assert len(excs) == world
    for rank, e in enumerate(excs):
        assert isinstance(e, CheckpointingException), f"rank {rank}: {type(e).__name__}: {e}"
        for frag in fragments:
            assert frag in str(e), f"rank {rank}: {frag!r} not in {e}"


def flip_byte(path: Path, position: int) -> None:
    """Damage one byte of a file in place (XOR 0x5A)."""
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x5A]))


@contextlib.contextmanager
def slow_writes(delay: float) -> Iterator[None]:
    """The writer sleeps ``delay`` s before each data file (a forked writer inherits this
    patch), so what a test does right after ``save`` returns happens while it writes."""
    orig = torch_dist_writing.write_file

    def slow(*args, **kwargs):
        time.sleep(delay)
        return orig(*args, **kwargs)

    torch_dist_writing.write_file = slow
    try:
        yield
    finally:
        torch_dist_writing.write_file = orig


class RecordingLoad(TorchDistLoadShardedStrategy):
    """The real load strategy, remembering which shards it was asked to read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: List[Tuple[str, Tuple[int, ...]]] = []

    def load(self, sharded_state_dict, checkpoint_dir):  # type: ignore[no-untyped-def]
        self.reads.extend((sh.key, tuple(sh.global_offset)) for sh in nested_values(sharded_state_dict)
                          if isinstance(sh, ShardedTensor))
        return super().load(sharded_state_dict, checkpoint_dir)


def _set_index_threshold(rank: int, world: int, value: int) -> int:
    from dist_checkpointing.strategies.torch_dist import index_view

    old, index_view.INDEX_ABOVE_BYTES = index_view.INDEX_ABOVE_BYTES, value
    return old


@contextlib.contextmanager
def index_threshold(pools, value: int) -> Iterator[None]:
    """``index_view.INDEX_ABOVE_BYTES`` set to ``value`` in this process and on every rank of
    ``pools`` (e.g. 0: the small test checkpoints use the per-key index), restored after."""
    olds = [pool.run(_set_index_threshold, value)[0] for pool in pools]
    local = _set_index_threshold(0, 1, value)
    try:
        yield
    finally:
        _set_index_threshold(0, 1, local)
        for pool, old in zip(pools, olds):
            pool.run(_set_index_threshold, old)
