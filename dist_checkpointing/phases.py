"""The phases of one ``save`` / ``load`` call: per-phase wall time reported to the caller's
``progress_callback`` as each phase ends, byte progress (callback and a tqdm bar on rank 0),
and the one DEBUG line logged at the end (:class:`Phases`)."""

from __future__ import annotations

import logging
import math
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional

from .dict_utils import nested_values
from .runtime.collectives import get_rank
from .mapping import ShardedStateDict, ShardedTensor, is_main_replica
from .runtime.progress import ByteSink, reporting_bytes

logger = logging.getLogger("dist_checkpointing.serialization")

ProgressCallback = Callable[[Dict[str, Any]], None]


def local_bytes(sharded: ShardedStateDict, main_only: bool) -> int:
    """Bytes of this rank's ShardedTensors (only main replicas when ``main_only``)."""
    total = 0
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor) and (not main_only or is_main_replica(sh.replica_id)):
            rng = sh.flattened_range
            total += (rng.stop - rng.start if rng is not None else math.prod(sh.local_shape)) * sh.dtype.itemsize
    return total


class Phases:
    """Per-phase wall time of one save/load, reported to the callback as each phase ends
    and logged as one line at the end."""

    def __init__(self, callback: Optional[ProgressCallback], progress_bar: Optional[bool] = None):
        self.callback = callback
        self.start = self._last = time.perf_counter()
        self.seconds: Dict[str, float] = {}
        self.nbytes = 0
        # a tqdm bar on rank 0: when asked for, or (shown after a second) when stderr is a terminal
        self._bar_delay = 0.0 if progress_bar else 1.0
        self._want_bar = get_rank() == 0 and (progress_bar if progress_bar is not None else _stderr_is_terminal())
        self._bar: Any = None

    @contextmanager
    def metering(self) -> Iterator[None]:
        """Within the block, the strategy's bytes written / read are reported as they go
        (:meth:`_bytes`): to the callback, and to the bar."""
        if self.callback is None and not self._want_bar:
            yield
            return
        try:
            with reporting_bytes(self._bytes):
                yield
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def background_sink(self) -> Optional[ByteSink]:
        """The sink of an async save's background write: the callback only (a bar would
        cut into the training's output after ``save`` has returned)."""
        return self._callback_bytes if self.callback is not None else None

    def _bytes(self, phase: str, done: int, total: int) -> None:
        """A byte report of the strategy (from any of its threads, in order)."""
        if self._want_bar:
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=phase, unit="B", unit_scale=True, unit_divisor=1024,
                                 file=sys.stderr, delay=self._bar_delay, leave=False)
            self._bar.total = total
            self._bar.update(done - self._bar.n)
        self._callback_bytes(phase, done, total)

    def _callback_bytes(self, phase: str, done: int, total: int) -> None:
        if self.callback is None:
            return
        try:
            self.callback({"phase": phase, "bytes_done": done, "bytes_total": total,
                           "elapsed": time.perf_counter() - self.start})
        except Exception:  # noqa: BLE001 - a broken callback must not break the write
            logger.warning("progress_callback raised during phase %r (ignored)", phase, exc_info=True)

    def end(self, phase: str, inner: Optional[Dict[str, float]] = None) -> None:
        now = time.perf_counter()
        elapsed = now - self._last
        self._last = now
        if inner:  # a strategy's own split of this phase (e.g. read + exchange)
            for name, seconds in inner.items():
                self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            rest = elapsed - sum(inner.values())
            if rest > 0:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + rest
        else:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed
        if self.callback is not None:
            try:
                self.callback({"phase": phase, "seconds": elapsed, "bytes": self.nbytes,
                               "elapsed": now - self.start})
            except Exception:  # noqa: BLE001 - a broken callback must not split the ranks
                logger.warning("progress_callback raised during phase %r (ignored)", phase, exc_info=True)

    def log(self, what: str, checkpoint_dir: Any) -> None:
        total = time.perf_counter() - self.start
        split = ", ".join(f"{k} {v:.3f} s" for k, v in self.seconds.items())
        logger.debug("%s %s: %.1f MiB on this rank in %.3f s (%.2f GB/s; %s)", what, checkpoint_dir,
                    self.nbytes / 2**20, total, self.nbytes / max(total, 1e-9) / 1e9, split)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
