"""Megatron-Core's module name for the writer of async saves: Megatron-Core's results queue,
and re-exports of where the code lives — a data file's payloads are written by
:func:`~.torch_dist.writing.write_file` (its bytes by :mod:`.records`), the background
writer of plain DCP checkpoints is :mod:`.dcp.async_writer`'s ``FileSystemWriterAsync``
(imported on first use: the read-only tools import no DCP).
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

from ..compat.lazy import lazy_exports
from ..runtime.persistent_worker import check_mp_mode
from .torch_dist.writing import write_file  # noqa: F401 - re-exported: its old path

# Megatron-Core's writer reports through this process-wide queue, which Megatron-LM's
# trainer creates (get_write_results_queue), shuts down and resets; ours reports through the
# AsyncRequest, so nothing here writes to it.
_results_queue = None
_results_queue_lock = threading.Lock()


def get_write_results_queue(mp_mode: str = "spawn") -> Any:
    """Megatron-Core's process-wide results queue (a ``multiprocessing`` queue of the
    ``mp_mode`` context, made on the first call), for callers that create it at start-up.
    Nothing here reports through it: async saves report through their
    :class:`AsyncRequest`, :class:`FileSystemWriterAsync` through the writer."""
    global _results_queue
    check_mp_mode(mp_mode)
    with _results_queue_lock:
        if _results_queue is None:
            _results_queue = multiprocessing.get_context(mp_mode).Queue()
        return _results_queue


__getattr__, __dir__ = lazy_exports(__name__,
                                    {"FileSystemWriterAsync": "dist_checkpointing.strategies.dcp.async_writer"})
