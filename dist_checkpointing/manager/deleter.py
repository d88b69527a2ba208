"""Background deletion of checkpoint directories (rank 0's thread).

A complete checkpoint is deleted ``metadata.json`` first — from then on it is incomplete
and never loaded — then the rest; a crash in between leaves a leftover that the next
manager recognises and removes. Deletion never blocks the caller, and a directory that
is being loaded in this process waits until the load is over.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from contextlib import contextmanager
from typing import Callable, Deque, Iterator, Optional, Set, Tuple

from ..core import CONFIG_FNAME, CheckpointingException
from ..storage import Storage
from .crash import crash_point
from .layout import is_ours, parse_step_dir

logger = logging.getLogger(__name__)


class BackgroundDeleter:
    """Deletes directories under ``storage`` in a thread, one after another.

    ``child(name)`` opens the storage of a directory under the root (to check that a
    leftover holds only this library's files before deleting it).
    """

    def __init__(self, storage: Storage, child: Callable[[str], Storage]):
        self.storage = storage
        self.child = child
        self._cond = threading.Condition()
        self._queue: Deque[Tuple[str, bool]] = deque()
        self._loading: Set[str] = set()
        self._current: Optional[str] = None
        self._stopped = False
        self.errors: list = []
        self._thread = threading.Thread(target=self._loop, name="dist_checkpointing-manager-delete", daemon=True)
        self._thread.start()

    def delete(self, name: str, committed: bool) -> None:
        """Queue ``name`` for deletion: a complete checkpoint (``committed``: its
        ``metadata.json`` goes first) or a leftover (deleted only if it is still incomplete
        and holds only this library's files)."""
        with self._cond:
            if name != self._current and all(n != name for n, _ in self._queue):
                self._queue.append((name, committed))
                self._cond.notify_all()

    def remove_now(self, name: str) -> None:
        """Delete the leftover ``name`` now, in the caller's thread (a new save needs its
        directory); waits for a deletion of it already running."""
        with self._cond:
            self._queue = deque(item for item in self._queue if item[0] != name)
            while self._current == name:
                self._cond.wait()
        self._delete(name, committed=False)

    @contextmanager
    def loading(self, name: str) -> Iterator[None]:
        """Keep ``name`` from being deleted while the block runs; raises if it is being deleted."""
        with self._cond:
            if self._current == name or any(n == name for n, _ in self._queue):
                raise CheckpointingException(f"{self.storage.describe(name)} is being deleted: cannot load it")
            self._loading.add(name)
        try:
            yield
        finally:
            with self._cond:
                self._loading.discard(name)
                self._cond.notify_all()

    def wait(self) -> None:
        """Wait until the queue is empty and nothing is being deleted."""
        with self._cond:
            while self._queue or self._current is not None:
                self._cond.wait()

    def stop(self, finish: bool = True) -> None:
        """Stop the thread, after the queued deletions if ``finish``."""
        with self._cond:
            if not finish:
                self._queue.clear()
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()

    def _next(self) -> Optional[Tuple[str, bool]]:
        with self._cond:
            while True:
                ready = [item for item in self._queue if item[0] not in self._loading]
                if ready:
                    self._queue.remove(ready[0])
                    self._current = ready[0][0]
                    return ready[0]
                if self._stopped and not self._queue:
                    return None
                self._cond.wait()  # woken by a new item, the end of a load, or stop()

    def _loop(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            try:
                self._delete(*item)
            except Exception as e:  # noqa: BLE001 - logged; the leftover is retried by a later manager
                logger.warning("Could not delete %s: %s", self.storage.describe(item[0]), e)
                self.errors.append(f"{self.storage.describe(item[0])}: {e}")
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _delete(self, name: str, committed: bool) -> None:
        if committed:
            self.storage.delete(f"{name}/{CONFIG_FNAME}")  # first: from now on it is never loaded
            crash_point("delete", parse_step_dir(name) or 0)
        elif self.storage.info(f"{name}/{CONFIG_FNAME}") is not None or not is_ours(self.child(name)):
            logger.warning("Not deleting %s: it is not a leftover of this library's saves", self.storage.describe(name))
            return
        self.storage.delete_tree(name)
        logger.info("Deleted %s", self.storage.describe(name))
