"""An asynchronous request: a function to run in the background and the steps that complete it
(Megatron-Core's :class:`AsyncRequest`, re-exported by :mod:`.async_utils`)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core import CheckpointingException
from .collectives import (
    all_gather_object, all_reduce_max_uint8, error_message, is_distributed, raise_if_any, run_agreed)

logger = logging.getLogger(__name__)


@dataclass
class AsyncRequest:
    """A background function and the steps that complete it.

    Args:
        async_fn: run in the background with ``async_fn_args`` / ``async_fn_kwargs``
            (``None``: nothing to run).
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: run in order on every rank, in the caller's thread, once every
            rank's ``async_fn`` has finished without error. They may be collective.
        async_fn_kwargs: keyword arguments of ``async_fn``.
        resources: objects with a ``release()`` method kept alive across calls (e.g. reused
            staging arenas); :meth:`AsyncCallsQueue.close` releases them.
        preload_fn: called when the request is scheduled (in the caller's thread); its result
            replaces ``async_fn_args[1]`` (Megatron-Core's device-to-host staging hook).
        call_idx: the index the queue gave the request (set when it is scheduled).
        staged: the host copies of the snapshot when they may still be in progress after the
            save returned (``async_snapshot="stream"``): :meth:`wait_for_staging` waits for them.
    """

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...] = ()
    finalize_fns: List[Callable[[], Any]] = field(default_factory=list)
    async_fn_kwargs: Dict[str, Any] = field(default_factory=dict)
    preload_fn: Optional[Callable[[], Any]] = None
    is_frozen: bool = False
    call_idx: int = 0
    resources: List[Any] = field(default_factory=list)
    staged: Optional[Any] = None

    def wait_for_staging(self) -> None:
        """Block until the snapshot's host copies are done: after this the saved tensors may
        be changed from any stream (without it, only later work on the streams that were
        current at the save is ordered after the copies). Not collective; cheap when done."""
        if self.staged is not None:
            self.staged.wait()

    def _check_not_frozen(self) -> None:
        if self.is_frozen:
            raise CheckpointingException("This AsyncRequest is already scheduled and cannot be changed")

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` after the current finalize steps."""
        self._check_not_frozen()
        self.finalize_fns.append(fn)

    def add_pre_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` before the current finalize steps."""
        self._check_not_frozen()
        self.finalize_fns.insert(0, fn)

    def add_async_step(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in the background before ``async_fn``; ``async_fn`` runs even if
        ``fn`` fails (the call then fails with ``fn``'s error)."""
        self._check_not_frozen()
        self.async_fn, self.async_fn_args, self.async_fn_kwargs = (
            _Chained(fn, self.async_fn, self.async_fn_args, self.async_fn_kwargs), (), {})

    def execute_sync(self) -> None:
        """Run everything now, in this thread: ``async_fn``, then (if it succeeded on every
        rank) the finalize steps. Collective like finalization: errors are raised on every
        rank."""
        call = _Call(-1, _preloaded(self))
        call.run()
        _finalize(call, is_distributed(), "Async request")

    def freeze(self) -> "AsyncRequest":
        """A frozen copy (what a queue keeps once the request is scheduled)."""
        return replace(self, finalize_fns=list(self.finalize_fns), resources=list(self.resources), is_frozen=True)


class _Chained:
    """``step()`` then ``fn(*args, **kwargs)`` (always run); ``step``'s error wins."""

    def __init__(self, step: Callable[[], Any], fn: Optional[Callable[..., Any]], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]):
        self.step, self.fn, self.args, self.kwargs = step, fn, args, kwargs

    def __call__(self) -> None:
        error: Optional[BaseException] = None
        try:
            self.step()
        except BaseException as e:  # noqa: BLE001 - re-raised once fn has run
            error = e
        if self.fn is not None:
            try:
                self.fn(*self.args, **self.kwargs)
            except BaseException:
                if error is None:
                    raise
        if error is not None:
            raise error


class _Call:
    def __init__(self, idx: int, request: AsyncRequest):
        self.idx = idx
        self.request = request
        self.done = threading.Event()
        self.error: Optional[str] = None

    def run(self) -> None:
        try:
            if self.request.async_fn is not None:
                self.request.async_fn(*self.request.async_fn_args, **self.request.async_fn_kwargs)
        except BaseException as e:  # noqa: BLE001 - reported at finalization
            self.error = error_message(e)
        finally:
            self.done.set()


def step_counts(call: _Call) -> List[int]:
    """Flags whose max over the ranks tells whether every rank has as many finalize steps
    (:func:`same_step_counts`): two bytes for ``all_reduce_max_uint8``."""
    n = min(len(call.request.finalize_fns), 255)
    return [n, 255 - n]


def same_step_counts(flags: List[int]) -> bool:
    """From :func:`step_counts` flags reduced with max: whether the counts are equal."""
    return flags[0] == 255 - flags[1]


def _finalize(call: _Call, collective: bool, what: str, failed: Optional[bool] = None,
              same_steps: Optional[bool] = None) -> None:
    """Raise on every rank if ``call`` failed on any rank; else run its finalize steps.
    Where every rank has as many steps, each is agreed over all ranks (a step that fails on
    one rank raises on every rank before the next starts); where ranks have different
    steps (Megatron-LM adds some on rank 0 only), each rank runs its own, then they agree
    once. ``failed`` / ``same_steps``: already agreed, if given."""
    if collective:
        if failed is None or failed:
            raise_if_any(all_gather_object(call.error), what)
        if same_steps is None:
            same_steps = same_step_counts(all_reduce_max_uint8(step_counts(call)))
        if not same_steps:
            run_agreed(lambda: [fn() for fn in call.request.finalize_fns], f"Finalizing: {what}")
            return
        for fn in call.request.finalize_fns:
            run_agreed(fn, f"Finalizing: {what}")
        return
    if call.error is not None:
        raise CheckpointingException(f"{what} failed: {call.error}")
    for fn in call.request.finalize_fns:
        fn()


def _preloaded(request: AsyncRequest) -> AsyncRequest:
    """``request`` with ``preload_fn`` run now and its result as ``async_fn_args[1]``."""
    if request.preload_fn is None:
        return request
    args = list(request.async_fn_args)
    if len(args) < 2:
        raise CheckpointingException(
            f"preload_fn replaces async_fn_args[1], but the request has {len(args)} args")
    args[1] = request.preload_fn()
    return replace(request, async_fn_args=tuple(args), preload_fn=None)
