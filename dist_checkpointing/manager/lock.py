"""The root lock: one manager per checkpoint root at a time.

The manager's rank 0 creates ``root/.manager_lock`` with the storage's exclusive create
(of several racing creators exactly one wins), holding its host, pid, the pid's start time
and a random token. A second manager on the root is refused, unless the holder is a process
of this host that no longer runs (a crashed run): then the stale lock is taken over, so the
run can resume. A holder on another host cannot be checked: the error names the file to
remove once that run is known to be dead.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from typing import Any, Dict, Optional

from ..core import CheckpointingException
from ..storage import Storage

logger = logging.getLogger(__name__)

LOCK_FNAME = ".manager_lock"
_MAX_LOCK_BYTES = 4096


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (Linux ``/proc``), to tell a reused pid; ``None``
    when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _alive(record: Dict[str, Any]) -> bool:
    """Whether the process that wrote ``record`` (on this host) still runs."""
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    started = _start_time(pid)
    return started is None or record.get("started") in (None, started)


class RootLock:
    """The lock of one checkpoint root, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.token = uuid.uuid4().hex
        self.held = False

    def _read(self) -> Optional[Dict[str, Any]]:
        try:
            raw = json.loads(self.storage.read_bytes(LOCK_FNAME, _MAX_LOCK_BYTES))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return raw if isinstance(raw, dict) else {}

    def acquire(self) -> None:
        """Take the lock, or raise :class:`CheckpointingException` naming its holder."""
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid()),
                  "token": self.token, "time": time.time()}
        where = self.storage.describe(LOCK_FNAME)
        for _ in range(3):
            try:
                self.storage.create_exclusive(LOCK_FNAME, json.dumps(record).encode())
                self.held = True
                return
            except FileExistsError:
                pass
            except OSError as e:
                raise CheckpointingException(f"Cannot create the manager lock {where}: {e}") from e
            holder = self._read()
            if holder is None:
                continue  # released meanwhile: try again
            if holder.get("host") != record["host"] or _alive(holder):
                raise CheckpointingException(
                    f"Checkpoint root {self.storage.describe()} is used by another CheckpointManager "
                    f"(host {holder.get('host')!r}, pid {holder.get('pid')!r}; lock {where}): refusing to share it. "
                    "If that run is dead, remove the lock file.")
            logger.warning("Taking over the stale manager lock %s of dead process %s", where, holder.get("pid"))
            if self._read() == holder:  # not replaced by another manager meanwhile
                self.storage.delete(LOCK_FNAME)
        raise CheckpointingException(f"Cannot take the manager lock {where}: it keeps changing")

    def release(self) -> None:
        """Drop the lock if this manager still holds it."""
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder is not None and holder.get("token") == self.token:
            self.storage.delete(LOCK_FNAME)
