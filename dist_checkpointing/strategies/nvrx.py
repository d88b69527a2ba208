"""Megatron-Core's helpers about NVIDIA Resiliency Extension's async checkpointing (NVRx).

Megatron-LM (>= 0.16) asks :func:`has_nvrx_async_support` whether NVRx's async classes
can be imported, and builds requests for a queue's class with
:func:`make_nvrx_async_request`. Both are answered as Megatron-Core answers them; this
library's own async saves do not need NVRx (see :mod:`.async_strategies`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Dict, List, Optional

logger = logging.getLogger(__name__)

NVRX_MIN_VERSION = "0.6.0"

# module of NVRx's async_ckpt package -> the names Megatron-Core's async path uses from it
_REQUIRED = {
    "core": ("AsyncCallsQueue", "AsyncRequest"),
    "cached_metadata_filesystem_reader": ("CachedMetadataFileSystemReader",),
    "filesystem_async": ("FileSystemWriterAsync", "get_write_results_queue", "_results_queue"),
    "state_dict_saver": ("CheckpointMetadataCache", "save_state_dict_async_finalize", "save_state_dict_async_plan"),
}


def is_nvrx_min_version(version: str = NVRX_MIN_VERSION) -> bool:
    """Whether the installed NVRx is at least ``version`` (``False`` when not installed).
    Needs the ``packaging`` package, as Megatron-Core does."""
    from packaging.version import Version

    try:
        import nvidia_resiliency_ext as nvrx
    except ImportError:
        return False
    return Version(str(getattr(nvrx, "__version__", "0.0.0"))) >= Version(version)


def has_nvrx_async_support() -> bool:
    """Whether NVRx's async checkpointing classes that Megatron-Core uses can be imported
    (an NVRx older than :data:`NVRX_MIN_VERSION` counts as without them)."""
    try:
        modules = {name: importlib.import_module(f"nvidia_resiliency_ext.checkpointing.async_ckpt.{name}")
                   for name in _REQUIRED}
    except ImportError:
        return False
    if not is_nvrx_min_version():
        logger.warning("nvidia-resiliency-ext is older than %s: its async checkpointing is not used",
                       NVRX_MIN_VERSION)
        return False
    return all(hasattr(modules[mod], name) for mod, names in _REQUIRED.items() for name in names)


def make_nvrx_async_request(async_request_cls: type, async_fn: Optional[Callable[..., Any]], async_fn_args: Any,
                            finalize_fns: List[Callable[..., Any]], async_fn_kwargs: Optional[Dict[str, Any]] = None,
                            preload_fn: Optional[Callable[..., Any]] = None) -> Any:
    """An ``async_request_cls`` (an AsyncRequest class: NVRx's or this library's) of these
    parts, built by keyword as NVRx's API expects."""
    return async_request_cls(async_fn, async_fn_args, finalize_fns, async_fn_kwargs=async_fn_kwargs or {},
                             preload_fn=preload_fn)
