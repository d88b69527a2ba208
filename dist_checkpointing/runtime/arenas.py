"""Host staging of async saves: every tensor copied into one shared host arena, from
accelerators without blocking the caller.

* :class:`StagingArena` — shared host memory (``memfd``: not bounded by ``/dev/shm``) that
  the persistent writer (:mod:`.persistent_worker`) maps once and reads in place, pinned
  (``cudaHostRegister``) once CUDA tensors are staged into it, so device-to-host copies
  run at full speed and asynchronously (CPU-only state never touches CUDA, even where it
  is available). Unpinned and its ``memfd`` closed exactly once, whatever drops it
  (:meth:`StagingArena.release`, or garbage collection).
* :class:`ArenaPool` — arenas reused across saves: :meth:`ArenaPool.take` gives one no
  write in flight uses, already held for the caller's write, so staging never waits for an
  earlier write and never allocates in steady state. The torch_dist strategies share
  one per process in :mod:`.torch_dist.save` (shared by every strategy: pinned memory stays
  bounded however many strategies a caller builds).
* :func:`stage` — copies tensors into an arena. CPU tensors are copied at once; accelerator
  tensors are copied on a side stream ordered after the work already queued on the current
  stream, and the call returns without waiting: the returned :class:`Staged` says when the
  copies are done. Tensors whose values need a device temporary first (non-contiguous,
  FP8, conjugate views: :func:`..tensors.values.plain_values`) are copied on the current
  stream instead, one temporary at a time, from the trainer's own memory pool. With
  ``ordered`` (the default), later work on the caller's current stream (the optimizer step)
  waits for the copies on the device, so the snapshot is the state at the call even if the
  caller never waits on the host. Nothing here synchronizes the host with a device.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core import CheckpointingException
from ..tensors.bytes_view import as_bytes
from ..tensors.values import is_plain_values, plain_values

logger = logging.getLogger(__name__)

ALIGN = 64  # each tensor's offset in an arena (a uint8 slice can be viewed as any dtype)
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_ids = itertools.count(1)
_warned = threading.Event()

#: the device types whose tensors make an arena worth pinning (page-locked memory is what
#: lets their device-to-host copies run asynchronously)
PINNED_DEVICES: Tuple[str, ...] = ("cuda",)

#: pinning calls of this process (tests count them): registrations that succeeded, and
#: unregistrations
PIN_COUNTS = {"registered": 0, "unregistered": 0, "failed": 0}


def _cudart() -> Any:
    return torch.cuda.cudart()


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error of this thread (a failed ``cudaHostRegister``
    leaves it set, and the next PyTorch kernel launch check would raise it as its own)."""
    get_last_error = getattr(_cudart(), "cudaGetLastError", None)
    if get_last_error is None:
        get_last_error = _runtime_symbol("cudaGetLastError")
    if get_last_error is not None:
        get_last_error()


def _runtime_symbol(name: str) -> Optional[Callable[[], int]]:
    """``name`` of the CUDA runtime library this process has loaded (``None`` if none)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
    return None


def _cuda_register(ptr: int, size: int) -> bool:
    """Pin ``size`` bytes at ``ptr`` with ``cudaHostRegister`` (page-locked, device-visible).
    A failure is not an error: the error state is cleared, a warning is logged once, and the
    copies into this memory are pageable (slower, and the caller waits for them)."""
    try:
        code = int(_cudart().cudaHostRegister(ptr, size, _PORTABLE))
    except Exception as e:  # noqa: BLE001 - a runtime that cannot register: pageable copies
        code, reason = -1, str(e)
    else:
        reason = f"cudaHostRegister returned {code}"
    if code == 0:
        PIN_COUNTS["registered"] += 1
        return True
    PIN_COUNTS["failed"] += 1
    try:
        _clear_cuda_error()
    except Exception:  # noqa: BLE001 - nothing more to clear
        pass
    if not _warned.is_set():
        _warned.set()
        logger.warning("Cannot pin %d bytes of staging memory (%s): async saves of accelerator state copy into "
                       "pageable memory (slower; the save waits for its copies)", size, reason)
    return False


def _cuda_unregister(ptr: int) -> None:
    """Unpin the memory pinned at ``ptr`` by :func:`_cuda_register`."""
    PIN_COUNTS["unregistered"] += 1
    try:
        _cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - nothing left to do: the memory is unmapped next
        pass


class _ArenaMemory:
    """What an arena owns outside Python objects: its ``memfd`` and its pinning (no
    reference to the arena, so that garbage collection can release it)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.pinned_at: Optional[int] = None
        self.pin_failed = False  # not tried again for this arena

    def close(self) -> None:
        if self.pinned_at is not None:
            _cuda_unregister(self.pinned_at)
            self.pinned_at = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class StagingArena:
    """``size`` bytes of shared host memory (a ``memfd``); :meth:`pin_for` pins it."""

    def __init__(self, size: int):
        self.id = next(_ids)
        self.size = max(int(size), 1)
        try:
            fd = os.memfd_create(f"dist_ckpt_staging_{self.id}", os.MFD_CLOEXEC)
        except (AttributeError, OSError) as e:
            raise CheckpointingException(f"Cannot allocate {self.size} bytes of shared staging memory: {e}") from e
        self._memory = _ArenaMemory(fd)
        # unpinned and closed exactly once: by release(), or when the arena is collected
        self._finalizer = weakref.finalize(self, _ArenaMemory.close, self._memory)
        self._finalizer.atexit = False  # the process's memory goes with it; no CUDA calls at exit
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size)
        except OSError as e:
            self._finalizer()
            raise CheckpointingException(f"Cannot allocate {self.size} bytes of shared staging memory: {e}") from e
        self.flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self.writes = 0  # writes in flight reading this arena (ArenaPool's lock)

    @property
    def fd(self) -> int:
        """The arena's ``memfd`` (``-1`` once released)."""
        return self._memory.fd

    @property
    def pinned(self) -> bool:
        """Whether the arena is page-locked (``cudaHostRegister``)."""
        return self._memory.pinned_at is not None

    def pin_for(self, tensors: Sequence[torch.Tensor]) -> None:
        """Pin the arena (once; not again after a failure) if any of ``tensors`` is on a
        device of :data:`PINNED_DEVICES`."""
        memory = self._memory
        if self.pinned or memory.pin_failed or self.flat is None:
            return
        if not any(t.device.type in PINNED_DEVICES for t in tensors):
            return
        if _cuda_register(self.flat.data_ptr(), self.flat.numel()):
            memory.pinned_at = self.flat.data_ptr()
        else:
            memory.pin_failed = True

    def view(self, offset: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` stored at ``offset``."""
        return flat_view(self.flat, offset, dtype, shape)

    def release(self) -> None:
        """Unpin the arena, close its ``memfd`` and drop this object's hold on it (once; later
        calls do nothing): the memory is unmapped once the last view of it (which keeps the
        mapping alive) is gone."""
        self._finalizer()
        self.flat = None
        self._map = None


class ArenaPool:
    """Arenas kept across saves: :meth:`take` gives one of at least the size asked that no
    write in flight uses (reusing the smallest that fits), held for the caller's write until
    the returned ``done`` is called. Idle arenas too small for the request are freed;
    ``on_release(arena)`` is told of each arena freed."""

    def __init__(self, on_release: Optional[Callable[[StagingArena], None]] = None):
        self.arenas: List[StagingArena] = []
        self._lock = threading.Lock()
        self._on_release = on_release

    def take(self, size: int) -> Tuple[StagingArena, Callable[[], None]]:
        """An arena of at least ``size`` bytes, held (taken and marked in use in one step, so
        two threads never get the same one), and the call that ends the hold (idempotent)."""
        with self._lock:
            idle = [a for a in self.arenas if not a.writes]
            fits = sorted((a for a in idle if a.size >= size), key=lambda a: a.size)
            chosen = fits[0] if fits else None
            doomed = [a for a in idle if a is not chosen and a.size < size]
            self.arenas = [a for a in self.arenas if a not in doomed]
            if chosen is not None:
                chosen.writes += 1
        for a in doomed:
            self._free(a)
        if chosen is None:
            chosen = StagingArena(size)
            with self._lock:
                chosen.writes += 1
                self.arenas.append(chosen)
        return chosen, self._ender(chosen)

    def _ender(self, arena: StagingArena) -> Callable[[], None]:
        ended = []

        def done() -> None:
            with self._lock:
                if not ended:
                    ended.append(True)
                    arena.writes -= 1
        return done

    def held(self) -> int:
        """How many arenas writes hold now."""
        with self._lock:
            return sum(1 for a in self.arenas if a.writes)

    def _free(self, arena: StagingArena) -> None:
        if self._on_release is not None:
            self._on_release(arena)
        arena.release()

    def release(self) -> None:
        """Free the arenas no write uses (the others stay until they are idle and released)."""
        with self._lock:
            idle = [a for a in self.arenas if not a.writes]
            self.arenas = [a for a in self.arenas if a.writes]
        for a in idle:
            self._free(a)


def flat_view(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    """The tensor of ``dtype`` and ``shape`` stored at ``offset`` of the uint8 buffer ``flat``."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    return flat[offset:offset + n].view(dtype).view(shape)


def arena_layout(tensors: Sequence[torch.Tensor]) -> Tuple[List[int], int]:
    """Each tensor's offset in an arena and the arena size they need."""
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN
    return offsets, size


class Staged:
    """The copies of one :func:`stage` call: :meth:`wait` until they are done. Keeps the
    sources and the destination buffer alive until then (nothing is freed, unpinned or
    unmapped under a copy in flight)."""

    def __init__(self, events: List[Any], sources: List[torch.Tensor], destination: Any = None):
        self._events = events
        self._keep: List[Any] = [sources, destination]

    def done(self) -> bool:
        """Whether every copy has completed (never blocks)."""
        if all(e.query() for e in self._events):
            self._keep = []
            return True
        return False

    def wait(self) -> None:
        """Block until every copy has completed."""
        for e in self._events:
            e.synchronize()
        self._keep = []


_side_streams: Dict[Any, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """One copy stream per device (created once)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.get_device_module(device.type).Stream(device=device)
    return stream


def stage(arena: StagingArena, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
          ordered: bool = True) -> Staged:
    """Copy ``tensors`` into ``arena`` at ``offsets`` (pinning it first where CUDA tensors
    are among them); accelerator tensors asynchronously (see the module's description;
    ``ordered``: the caller's current streams wait for the copies)."""
    arena.pin_for(tensors)
    return stage_into(arena.flat, arena.pinned, tensors, offsets, ordered, keep=arena)


def stage_into(flat: torch.Tensor, pinned: bool, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
               ordered: bool = True, keep: Any = None) -> Staged:
    """:func:`stage` into the uint8 host buffer ``flat`` (``pinned``: page-locked, so device
    copies into it run asynchronously; ``keep``: an owner of ``flat`` kept alive with the
    copies). If a copy cannot be queued, the copies already queued are waited for before
    the error is raised (so the caller may free ``flat``)."""
    queued: Dict[torch.device, Tuple[Any, Any, Any]] = {}  # device -> (module, current, side)
    sources: List[torch.Tensor] = []
    try:
        for t, offset in zip(tensors, offsets):
            _stage_one(flat, pinned, t, offset, queued, sources)
    except BaseException:
        for _, current, side in queued.values():
            side.synchronize()
            current.synchronize()
        raise
    events: List[Any] = []
    for module, current, side in queued.values():
        side_done, current_done = module.Event(), module.Event()
        side_done.record(side)
        current_done.record(current)  # after the copies that ran on the current stream
        if ordered:
            current.wait_event(side_done)
        events += [side_done, current_done]
    return Staged(events, sources, keep if keep is not None else flat)


def _stage_one(flat: torch.Tensor, pinned: bool, t: torch.Tensor, offset: int,
               queued: Dict[torch.device, Tuple[Any, Any, Any]], sources: List[torch.Tensor]) -> None:
    """Copy (or queue the copy of) one tensor's values into ``flat`` at ``offset``."""
    if t.device.type == "cpu":
        values = plain_values(t)
        as_bytes(flat_view(flat, offset, values.dtype, tuple(values.shape))).copy_(as_bytes(values))
        return
    if t.device not in queued:
        module = torch.get_device_module(t.device.type)
        current, side = module.current_stream(t.device), _side_stream(t.device)
        side.wait_stream(current)  # after whatever the caller queued on these tensors
        queued[t.device] = (module, current, side)
    module, current, side = queued[t.device]
    plain = t.detach()
    if type(plain) is torch.Tensor and plain.is_contiguous() and is_plain_values(plain):
        # its bytes as they lie: copied on the side stream, the source kept alive until done
        t = plain
        with module.stream(side):
            flat_view(flat, offset, t.dtype, tuple(t.shape)).copy_(t, non_blocking=pinned)
        sources.append(t)
        return
    # A device temporary first (FP8 values, resolved views, a contiguous copy): made and
    # copied on the current stream, so it comes from the trainer's pool and is reused by the
    # next one (stream order), one at a time.
    values = plain_values(t).contiguous()
    flat_view(flat, offset, values.dtype, tuple(values.shape)).copy_(values, non_blocking=pinned)
