"""Scheduling priority of the processes that write checkpoints in the background.

Megatron-LM (>= 0.16) asks that its checkpoint writer run at a lower CPU priority (a
``nice`` value) and I/O class (``ionice``), so that writing a checkpoint does not slow the
training loop or its data loaders. :func:`set_process_qos` lowers the current process's
priorities (never raises them: that needs superuser); :func:`set_writer_qos` records the
priorities for this process's background writers — its persistent writer worker and the
forked writers of async saves — which call :func:`apply_writer_qos` when they start.
Imports nothing but the standard library (the persistent writer imports no torch).
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Optional, Tuple

from ..core import CheckpointingException

logger = logging.getLogger(__name__)

#: ``(cpu_priority, io_priority)`` for this process's background writers (``None``: unchanged)
_writer_qos: Optional[Tuple[Optional[int], Optional[int]]] = None
IO_CLASSES = (0, 1, 2, 3)  # ionice classes: none, realtime, best-effort, idle


def check_qos(cpu_priority: Optional[int], io_priority: Optional[int]) -> None:
    """Refuse priorities that are not ints (naming the argument); values outside the
    ranges are ignored by :func:`set_process_qos`, as in Megatron-Core."""
    for name, value in (("cpu_priority", cpu_priority), ("io_priority", io_priority)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise CheckpointingException(f"{name} must be an int or None, not {value!r}")


def set_process_qos(cpu_priority: Optional[int], io_priority: Optional[int]) -> None:
    """Lower this process's priorities: ``cpu_priority`` is the target ``nice`` value
    (0-19; a process already at or above it is left alone), ``io_priority`` the I/O
    scheduling class (0-3, 3 = idle; through ``ionice``). Failures are logged, never raised."""
    check_qos(cpu_priority, io_priority)
    pid = os.getpid()
    if cpu_priority is not None and 0 <= cpu_priority <= 19:
        try:
            current = os.nice(0)
            if cpu_priority > current:
                os.nice(cpu_priority - current)
            else:
                logger.debug("pid %d: nice %d already at or above %d", pid, current, cpu_priority)
        except OSError as e:
            logger.warning("pid %d: cannot set the CPU priority (nice %d): %s", pid, cpu_priority, e)
    if io_priority is not None and io_priority in IO_CLASSES:
        try:
            subprocess.run(["ionice", "-c", str(io_priority), "-p", str(pid)], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = e.stderr.decode(errors="replace").strip() if isinstance(e, subprocess.CalledProcessError) else e
            logger.warning("pid %d: cannot set the I/O priority class %d: %s", pid, io_priority, detail)


def set_writer_qos(cpu_priority: Optional[int], io_priority: Optional[int]) -> None:
    """The priorities this process's background writers take when they start."""
    global _writer_qos
    check_qos(cpu_priority, io_priority)
    _writer_qos = (cpu_priority, io_priority)


def writer_qos() -> Optional[Tuple[Optional[int], Optional[int]]]:
    """The priorities set with :func:`set_writer_qos` (``None`` if never set)."""
    return _writer_qos


def apply_writer_qos(qos: Optional[Tuple[Optional[int], Optional[int]]] = None) -> None:
    """In a writer process: take ``qos`` (default: what :func:`set_writer_qos` recorded)."""
    qos = qos if qos is not None else _writer_qos
    if qos is not None:
        set_process_qos(*qos)
