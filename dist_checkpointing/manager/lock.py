"""The root lock: one manager per checkpoint root at a time.

The manager's rank 0 creates ``root/.manager_lock`` with the storage's exclusive create
(of several racing creators exactly one wins), holding its host, pid, the pid's start time
and a random token. A second manager on the root is refused, unless the holder is a process
of this host that no longer runs (a crashed run): then the stale lock is taken over, so the
run can resume. A holder on another host cannot be checked: the error names the file to
remove once that run is known to be dead.

The lock is read only when it is a regular file: a link, FIFO, directory or device there is
refused unopened (a FIFO would block ``open`` for ever). A takeover (read the stale record,
delete it, create our own) runs under an ``flock`` of a file of this host's temporary
directory named after the lock's location, so of several processes of this host taking
over one stale lock at once exactly one deletes it; the others then find the new holder
alive. Only processes of the dead holder's host ever take a lock over, so a mutex of that
host suffices, for any storage.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
import uuid
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

from ..core import CheckpointingException
from ..integrity.liveness import runs, this_process
from ..storage import PosixStorage, Storage

logger = logging.getLogger(__name__)

LOCK_FNAME = ".manager_lock"
_MAX_LOCK_BYTES = 4096
_KIND_WORDS = {"dir": "a directory", "link": "a symbolic link", "other": "a FIFO, socket or device"}


def _open_mutex(path: str) -> int:
    """A descriptor of the regular file ``path`` (created if missing), links not followed."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(3):
        try:
            fd = os.open(path, flags)  # no O_CREAT: another user's file in a sticky /tmp opens
        except FileNotFoundError:
            try:
                os.close(os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                pass
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        break
    raise OSError(errno.EINVAL, f"{path} is not a regular file")


@contextmanager
def takeover_mutex(location: str) -> Iterator[None]:
    """Hold this host's mutex of the lock at ``location`` (a path or URL) while the block runs."""
    digest = hashlib.sha256(location.encode()).hexdigest()[:32]
    path = os.path.join(tempfile.gettempdir(), f"dist_checkpointing-{digest}.takeover")
    try:
        fd = _open_mutex(path)
    except OSError as e:
        raise CheckpointingException(f"Cannot take over the manager lock {location}: mutex {path}: {e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


class RootLock:
    """The lock of one checkpoint root, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.token = uuid.uuid4().hex
        self.held = False

    @property
    def _where(self) -> str:
        return self.storage.describe(LOCK_FNAME)

    def _mutex_key(self) -> str:
        """The lock's location, the same from every path to it (links resolved)."""
        if isinstance(self.storage, PosixStorage):
            return os.path.realpath(self._where)
        return self._where

    def _read(self) -> Optional[Dict[str, Any]]:
        """The holder's record (``{}`` when damaged), ``None`` when there is no lock; anything
        but a regular file is an error, raised before it is opened."""
        kind = self.storage.entry_kind(LOCK_FNAME)
        if kind is None:
            return None
        if kind != "file":
            raise CheckpointingException(
                f"The manager lock {self._where} is {_KIND_WORDS.get(kind, kind)}, not a regular file: "
                "refusing to use the root (remove it if no CheckpointManager uses the root)")
        try:
            raw = json.loads(self.storage.read_bytes(LOCK_FNAME, _MAX_LOCK_BYTES))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}
        except OSError as e:
            raise CheckpointingException(f"Cannot read the manager lock {self._where}: {e}") from e
        return raw if isinstance(raw, dict) else {}

    def acquire(self) -> None:
        """Take the lock, or raise :class:`CheckpointingException` naming its holder."""
        record = {**this_process(), "token": self.token, "time": time.time()}
        for _ in range(3):
            try:
                self.storage.create_exclusive(LOCK_FNAME, json.dumps(record).encode())
                self.held = True
                return
            except FileExistsError:
                pass
            except OSError as e:
                raise CheckpointingException(f"Cannot create the manager lock {self._where}: {e}") from e
            holder = self._read()
            if holder is None:
                continue  # released meanwhile: try again
            if runs(holder):
                raise CheckpointingException(
                    f"Checkpoint root {self.storage.describe()} is used by another CheckpointManager "
                    f"(host {holder.get('host')!r}, pid {holder.get('pid')!r}; lock {self._where}): refusing to "
                    "share it. If that run is dead, remove the lock file.")
            with takeover_mutex(self._mutex_key()):
                if self._read() == holder:  # still the dead holder's: no other process took it over
                    logger.warning("Taking over the stale manager lock %s of dead process %s",
                                   self._where, holder.get("pid"))
                    self.storage.delete(LOCK_FNAME)
        raise CheckpointingException(f"Cannot take the manager lock {self._where}: it keeps changing")

    def release(self) -> None:
        """Drop the lock if this manager still holds it."""
        if not self.held:
            return
        self.held = False
        try:
            holder = self._read()
        except CheckpointingException as e:
            logger.warning("Not releasing the manager lock: %s", e)
            return
        if holder is not None and holder.get("token") == self.token:
            self.storage.delete(LOCK_FNAME)
