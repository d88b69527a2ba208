"""Host staging of async saves: every tensor copied into one shared host arena, from
accelerators without blocking the caller.

* :class:`StagingArena` — shared host memory (``memfd``: not bounded by ``/dev/shm``) that
  the persistent writer (:mod:`.persistent_worker`) maps once and reads in place, pinned
  (``cudaHostRegister``) once CUDA tensors are staged into it, so device-to-host copies
  run at full speed and asynchronously (CPU-only state never touches CUDA, even where it
  is available).
* :class:`ArenaPool` — arenas reused across saves: a save takes one not in use by a write
  in flight, so staging never waits for an earlier write, and never allocates in steady
  state.
* :func:`stage` — copies tensors into an arena. CPU tensors are copied at once; accelerator
  tensors are copied on a side stream ordered after the work already queued on the current
  stream, and the call returns without waiting: the returned :class:`Staged` says when the
  copies are done. With ``ordered`` (the default), later work on the caller's current
  stream (the optimizer step) waits for the copies on the device, so the snapshot is the
  state at the call even if the caller never waits on the host.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..core import CheckpointingException
from ..tensors.bytes_view import as_bytes

ALIGN = 64  # each tensor's offset in an arena (a uint8 slice can be viewed as any dtype)
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
_ids = itertools.count(1)


def _cuda_register(flat: torch.Tensor) -> bool:
    """Pin ``flat``'s memory with ``cudaHostRegister`` (page-locked, device-visible)."""
    try:
        return int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), _PORTABLE)) == 0
    except Exception:  # noqa: BLE001 - a runtime that cannot register: pageable copies
        return False


class StagingArena:
    """``size`` bytes of shared host memory (a ``memfd``); :meth:`pin_for` pins it."""

    def __init__(self, size: int):
        self.id = next(_ids)
        self.size = max(int(size), 1)
        try:
            self.fd = os.memfd_create(f"dist_ckpt_staging_{self.id}", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size)
        except (AttributeError, OSError) as e:
            raise CheckpointingException(f"Cannot allocate {self.size} bytes of shared staging memory: {e}") from e
        self.flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        self.writes = 0  # writes in flight reading this arena

    def pin_for(self, tensors: Sequence[torch.Tensor]) -> None:
        """Pin the arena (once) if any of ``tensors`` is a CUDA tensor."""
        if not self.pinned and any(t.device.type == "cuda" for t in tensors):
            self.pinned = _cuda_register(self.flat)

    def view(self, offset: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` stored at ``offset``."""
        return flat_view(self.flat, offset, dtype, shape)

    def release(self) -> None:
        """Unpin the arena and drop this object's hold on it: the memory is unmapped once
        the last view of it (which keeps the mapping alive) is gone."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            self.pinned = False
        self.flat = None
        self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ArenaPool:
    """Arenas kept across saves: :meth:`take` gives one of at least the size asked that no
    write in flight uses (reusing the smallest that fits), :meth:`hold` marks it in use
    until the write's ``done`` is called. Idle arenas too small for the last request are
    freed; ``on_release(arena)`` is told of each arena freed."""

    def __init__(self, on_release: Any = None):
        self.arenas: List[StagingArena] = []
        self._lock = threading.Lock()
        self._on_release = on_release

    def take(self, size: int) -> StagingArena:
        with self._lock:
            idle = [a for a in self.arenas if not a.writes]
            fits = sorted((a for a in idle if a.size >= size), key=lambda a: a.size)
            chosen = fits[0] if fits else None
            doomed = [a for a in idle if a is not chosen and a.size < size]
            self.arenas = [a for a in self.arenas if a not in doomed]
        for a in doomed:
            self._free(a)
        if chosen is None:
            chosen = StagingArena(size)
            with self._lock:
                self.arenas.append(chosen)
        return chosen

    def hold(self, arena: StagingArena) -> Any:
        """Mark ``arena`` in use by a write; returns the call that ends it."""
        with self._lock:
            arena.writes += 1
        ended = []

        def done() -> None:
            with self._lock:
                if not ended:
                    ended.append(True)
                    arena.writes -= 1
        return done

    def _free(self, arena: StagingArena) -> None:
        if self._on_release is not None:
            self._on_release(arena)
        arena.release()

    def release(self) -> None:
        """Free the arenas no write uses (the others stay until the pool is collected)."""
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
    """The copies of one :func:`stage` call: :meth:`wait` until they are done."""

    def __init__(self, events: List[Any], sources: List[torch.Tensor]):
        self._events = events
        self._sources = sources  # kept alive until the copies are done

    def done(self) -> bool:
        """Whether every copy has completed (never blocks)."""
        if all(e.query() for e in self._events):
            self._sources = []
            return True
        return False

    def wait(self) -> None:
        """Block until every copy has completed."""
        for e in self._events:
            e.synchronize()
        self._sources = []


_side_streams: Dict[Any, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """One copy stream per device (created once)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.get_device_module(device.type).Stream(device=device)
    return stream


def stage(arena: StagingArena, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
          ordered: bool = True) -> Staged:
    """Copy ``tensors`` into ``arena`` at ``offsets``; accelerator tensors asynchronously
    (see the module's description; ``ordered``: the caller's current streams wait for the
    copies). Non-contiguous accelerator tensors are made contiguous on their device first
    (one tensor's size of device memory at a time)."""
    arena.pin_for(tensors)
    return stage_into(arena.flat, arena.pinned, tensors, offsets, ordered)


def stage_into(flat: torch.Tensor, pinned: bool, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
               ordered: bool = True) -> Staged:
    """:func:`stage` into the uint8 host buffer ``flat`` (``pinned``: page-locked, so device
    copies into it run asynchronously)."""
    by_device: Dict[torch.device, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    for t, offset in zip(tensors, offsets):
        t = t.detach()
        if type(t) is not torch.Tensor:
            t = t.as_subclass(torch.Tensor)
        dst = flat_view(flat, offset, t.dtype, tuple(t.shape))
        if t.device.type == "cpu":
            as_bytes(dst).copy_(as_bytes(t))
        else:
            by_device.setdefault(t.device, []).append((dst, t))
    events: List[Any] = []
    sources: List[torch.Tensor] = []
    for device, pairs in by_device.items():
        module = torch.get_device_module(device.type)
        current = module.current_stream(device)
        side = _side_stream(device)
        side.wait_stream(current)  # after whatever the caller queued on these tensors
        with module.stream(side):
            for dst, t in pairs:
                dst.copy_(t, non_blocking=pinned)
                sources.append(t)
        event = module.Event()
        event.record(side)
        if ordered:
            current.wait_event(event)
        events.append(event)
    return Staged(events, sources)
