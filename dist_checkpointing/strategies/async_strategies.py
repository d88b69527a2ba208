"""Megatron-Core >= 0.16's ``async_strategy`` names, and the async machinery each selects here.

Megatron-Core 0.16 added ``async_strategy``: ``"mcore"`` runs async saves with its own
queue and workers, ``"nvrx"`` with NVIDIA Resiliency Extension's. Megatron-LM's trainer
passes the name to ``save`` and to the strategies, and looks its queue classes up with
:func:`get_async_strategy`. An async save of this library always runs on this library's
machinery (:mod:`.async_utils`), so both names select it: a trainer gets the queue that
runs the requests ``save`` returns, whichever name it was configured with, and NVIDIA
Resiliency Extension is not needed. The table also holds the async save of plain DCP
checkpoints (Megatron-LM's ``--ckpt-format torch_dcp``): :mod:`.dcp.async_save`.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from ..core import CheckpointingException

#: the ``async_strategy`` values ``save`` and the strategies accept (``None``: the default)
ASYNC_STRATEGIES = ("nvrx", "mcore", None)

#: what NVIDIA Resiliency Extension's table holds that this library does not provide, and why
NOT_PROVIDED = {
    "CheckpointMetadataCache": "NVIDIA Resiliency Extension's cache of DCP save plans (not in Megatron-Core's "
                               "table; every DCP save here plans afresh)",
}


def check_async_strategy(async_strategy: Optional[str]) -> None:
    """Refuse a name Megatron-Core does not know (before anything is written)."""
    if async_strategy not in ASYNC_STRATEGIES:
        raise CheckpointingException(f"async_strategy must be one of {ASYNC_STRATEGIES}, got {async_strategy!r}")


class AsyncModules(dict):
    """Megatron-Core's table of async classes and functions; a name it holds that this
    library does not provide raises :class:`CheckpointingException` saying why."""

    def __missing__(self, name: str) -> Any:
        why = NOT_PROVIDED.get(name, "not a name of Megatron-Core's async strategies")
        raise CheckpointingException(f"{name!r} is not provided by dist_checkpointing: {why}")


def _modules() -> AsyncModules:
    from . import filesystem_async
    from .async_utils import AsyncCallsQueue, AsyncRequest
    from .dcp.async_writer import FileSystemWriterAsync
    from .dcp.async_save import save_state_dict_async_finalize, save_state_dict_async_plan
    from .dcp.cached_reader import CachedMetadataFileSystemReader

    return AsyncModules(
        AsyncCallsQueue=AsyncCallsQueue, AsyncRequest=AsyncRequest,
        CachedMetadataFileSystemReader=CachedMetadataFileSystemReader,
        FileSystemWriterAsync=FileSystemWriterAsync,
        _results_queue=filesystem_async._results_queue,
        get_write_results_queue=filesystem_async.get_write_results_queue,
        save_state_dict_async_finalize=save_state_dict_async_finalize,
        save_state_dict_async_plan=save_state_dict_async_plan,
    )


def get_async_strategy(async_strategy: str = "nvrx", module: Optional[str] = None) -> Tuple[str, Any]:
    """``(name, table)`` as Megatron-Core's: the table (or, with ``module``, its entry) of the
    async queue, request and helpers — this library's own for both ``"nvrx"`` and
    ``"mcore"`` (see the module's docstring). Another name raises, as in Megatron-Core."""
    if async_strategy not in ("nvrx", "mcore"):
        raise CheckpointingException(f"async_strategy {async_strategy!r} is not supported. "
                                     "Available strategies: nvrx, mcore.")
    modules = _modules()
    return async_strategy, (modules if module is None else modules[module])

