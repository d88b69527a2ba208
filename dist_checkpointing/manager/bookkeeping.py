"""Rank 0's background worker: the root's bookkeeping writes and checkpoint deletions.

Tasks run in one thread, in the order they are queued (the tracker of a step is written
before the deletions its retention decided), so neither the writes (each one ``fsync``)
nor the deletions hold up training; deletions wait while a save runs. A complete checkpoint is deleted ``metadata.json``
first — from then on it is incomplete and never loaded — then the rest; a crash in
between leaves a leftover that the next manager recognises and removes. The deletion of a
directory that is being loaded in this process waits until the load is over (later tasks
go on meanwhile).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Deque, Iterator, Optional, Set

from ..core import CONFIG_FNAME, CheckpointingException
from ..storage import Storage
from .crash import crash_point
from .layout import parse_step_dir
from .ownership import checkpoint_files, leftover_files

logger = logging.getLogger(__name__)


#: the worker thread's nice value: freeing a large checkpoint's pages is kernel work done in
#: the deleting thread, which would otherwise take CPU from training and from a save running
#: at the same time (bench_manager.py)
WORKER_NICE = 19


def _lower_priority() -> None:
    """Run the calling thread at ``WORKER_NICE`` (Linux: a thread's nice value is its own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
    except (AttributeError, OSError):
        pass


@dataclass(frozen=True)
class _Task:
    name: Optional[str]  # the directory to delete (None: run ``fn``)
    committed: bool = False
    fn: Optional[Callable[[], None]] = None


class Bookkeeper:
    """Runs rank 0's root tasks in a thread, one after another: :meth:`submit` (a write)
    and :meth:`delete` (a directory under ``storage``).

    ``child(name)`` opens the storage of a directory under the root (to find what in it
    this library wrote).
    """

    def __init__(self, storage: Storage, child: Callable[[str], Storage]):
        self.storage = storage
        self.child = child
        self._cond = threading.Condition()
        self._queue: Deque[_Task] = deque()
        self._loading: Set[str] = set()
        self._current: Optional[str] = None  # the directory being deleted
        self._busy = False
        self._saves = 0  # saves in progress: deletions wait for them
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="dist_checkpointing-manager", daemon=True)
        self._thread.start()

    def _queued(self, name: str) -> bool:
        return self._current == name or any(task.name == name for task in self._queue)

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` (its errors are logged)."""
        with self._cond:
            self._queue.append(_Task(None, fn=fn))
            self._cond.notify_all()

    def delete(self, name: str, committed: bool) -> None:
        """Queue ``name`` for deletion: a complete checkpoint (``committed``: its
        ``metadata.json`` goes first) or a leftover (only if it is still incomplete); only
        what this library wrote is deleted (:mod:`.ownership`)."""
        with self._cond:
            if not self._queued(name):
                self._queue.append(_Task(name, committed))
                self._cond.notify_all()

    def remove_now(self, name: str) -> None:
        """Delete the leftover ``name`` now, in the caller's thread (a new save needs its
        directory); waits for a deletion of it already running."""
        with self._cond:
            self._queue = deque(task for task in self._queue if task.name != name)
            while self._current == name:
                self._cond.wait()
        self._delete(name, committed=False)

    def hold_deletions(self) -> None:
        """A save starts: no deletion starts, and one running pauses at its next piece, until
        :meth:`release_deletions` (deleting a large checkpoint slows a concurrent save down:
        the file system frees its blocks and pages while the save writes and syncs)."""
        with self._cond:
            self._saves += 1

    def release_deletions(self) -> None:
        """The save of the matching :meth:`hold_deletions` is over."""
        with self._cond:
            self._saves -= 1
            self._cond.notify_all()

    def _wait_for_saves(self) -> None:
        with self._cond:
            while self._saves:
                self._cond.wait()

    @contextmanager
    def loading(self, name: str) -> Iterator[None]:
        """Keep ``name`` from being deleted while the block runs; raises if it is being deleted."""
        with self._cond:
            if self._queued(name):
                raise CheckpointingException(f"{self.storage.describe(name)} is being deleted: cannot load it")
            self._loading.add(name)
        try:
            yield
        finally:
            with self._cond:
                self._loading.discard(name)
                self._cond.notify_all()

    def wait(self) -> None:
        """Wait until every queued task is done."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()

    def stop(self, finish: bool = True) -> None:
        """Stop the thread, after the queued deletions if ``finish``."""
        with self._cond:
            if not finish:
                self._queue.clear()
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()

    def _next(self) -> Optional[_Task]:
        with self._cond:
            while True:
                ready = [task for task in self._queue
                         if task.name is None or (task.name not in self._loading and not self._saves)]
                if ready:
                    self._queue.remove(ready[0])
                    self._current = ready[0].name
                    self._busy = True
                    return ready[0]
                if self._stopped and not self._queue:
                    return None
                self._cond.wait()  # woken by a new item, the end of a load, or stop()

    def _loop(self) -> None:
        _lower_priority()
        while True:
            task = self._next()
            if task is None:
                return
            try:
                if task.fn is not None:
                    task.fn()
                else:
                    self._delete(task.name, task.committed)  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - logged; a later write or manager retries
                what = f"deleting {self.storage.describe(task.name)}" if task.name else "updating the root"
                logger.warning("CheckpointManager: %s failed: %s", what, e)
            finally:
                with self._cond:
                    self._current = None
                    self._busy = False
                    self._cond.notify_all()

    def _delete(self, name: str, committed: bool) -> None:
        """Delete what this library wrote of the step directory ``name`` (:mod:`.ownership`);
        the directory itself once nothing else is left in it. A link in its place is removed
        itself when it was a complete checkpoint, never followed."""
        if self.storage.entry_kind(name) == "link":
            if committed:
                self.storage.delete(name)
                logger.info("Deleted the link %s (not what it points to)", self.storage.describe(name))
            else:
                logger.warning("Not deleting %s: it is a link, not a leftover of this library's saves",
                               self.storage.describe(name))
            return
        directory = self.child(name)
        if committed:
            self.storage.delete(f"{name}/{CONFIG_FNAME}")  # first: from now on it is never loaded
            crash_point("delete", parse_step_dir(name) or 0)
            files = checkpoint_files(directory)
        elif self.storage.info(f"{name}/{CONFIG_FNAME}") is not None:
            logger.warning("Not deleting %s: it is a complete checkpoint", self.storage.describe(name))
            return
        else:
            files = leftover_files(directory)
            if not files.removable:
                logger.warning("Not deleting %s: %s", self.storage.describe(name), files.why)
                return
        directory.delete_many(files.ours, pause=self._wait_for_saves)  # in pieces, held while a save runs
        if files.kept:
            logger.warning("Kept %s: it holds what this library did not write: %s", self.storage.describe(name),
                           ", ".join(files.kept))
            return
        self.storage.remove_dir(name)
        logger.info("Deleted %s", self.storage.describe(name))
