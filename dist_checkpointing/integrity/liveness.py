"""Whether the process that wrote a record (a manager's lock, a save's claim) still runs.

A record names its writer by host, pid and the pid's start time (to tell a pid the kernel
has given to a later process). Only a writer on this host can be checked: one on another
host is reported as running.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Dict, Optional


def start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (Linux ``/proc``); ``None`` when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def this_process() -> Dict[str, Any]:
    """The fields that name the calling process in a record: host, pid, start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": start_time(os.getpid())}


def on_this_host(record: Dict[str, Any]) -> bool:
    """Whether the writer of ``record`` ran on this host."""
    return record.get("host") == socket.gethostname()


def runs(record: Dict[str, Any]) -> bool:
    """Whether the process that wrote ``record`` still runs: ``True`` for a writer on another
    host (it cannot be checked), ``False`` for a record that names no valid pid."""
    if not on_this_host(record):
        return True
    pid = record.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or a pid no process can have
        return False
    except PermissionError:  # another user's process
        return True
    started = start_time(pid)
    return started is None or record.get("started") in (None, started)
