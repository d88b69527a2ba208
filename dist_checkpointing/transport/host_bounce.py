"""Accelerator tensors over a host-memory wire (CUDA state over gloo), when
``wire.HOST_STAGING`` is on: every data message that carries a device tensor bounces
through a host buffer (pinned when the device's accelerator can pin), with the device
copies issued without blocking and pipelined with the messages. (Not the staging arenas of
async saves, :mod:`dist_checkpointing.runtime.arenas`; the settings keep their published
names ``HOST_STAGING`` / ``STAGING_BYTES`` in :mod:`.wire`.)

Sender: a bucket of device tensors is packed on its device (one ``torch.cat`` per dtype run
into one reused device buffer) and copied to the host in one non-blocking copy; a tensor
travelling alone is copied in one non-blocking copy, whatever its layout. Messages are
copied out ahead of their sends while less than ``STAGING_BYTES`` of host buffers are held
or in flight: the copies of the next messages run while earlier ones are on the wire.
Each send is posted once its copies are done (an event on the stream that queued them).

Receiver (in place, into device tensors): receives into host buffers are posted ahead,
up to ``STAGING_BYTES`` (at least two messages); as each message arrives it goes to the
device in one non-blocking copy (a bucket into one reused device buffer, then one
``torch.split`` + ``_foreach_copy_`` per dtype run there; a tensor alone straight into its
destination, whatever its layout) and its host buffer is released at once (torch's pinned
memory cache reuses it only after that copy). The call returns once every copy is done.

Every copy is queued on the current stream of the tensor's device, after the work queued
there before the call (the state at the call is what travels, and what the receiver's
later work sees).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

import torch

from . import wire
from .copies import _copy_all, _pack, _pieces
from .plan import _alone
from .wire import _TAG_DATA, _Meta, _segments


def _pinnable(device: Optional[torch.device]) -> bool:
    """Whether host buffers for ``device``'s tensors can be pinned (its accelerator is the
    one torch's pinned-memory allocator serves)."""
    if device is None or device.type == "cpu" or not torch.accelerator.is_available():
        return False
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == device.type


def _host_buffer(nbytes: int, device: Optional[torch.device]) -> torch.Tensor:
    """A host buffer for a message of ``device``'s tensors (from torch's pinned-memory cache
    when it can be pinned, so repeated transfers reuse the same pinned blocks)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=_pinnable(device))


def _queued_done(device: Optional[torch.device]) -> Optional[torch.Event]:
    """An event after the work queued so far on ``device``'s current stream; ``None`` for
    host memory (copies there are done when they return)."""
    if device is None or device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    return event


def _one_device(tensors: Sequence[torch.Tensor]) -> Optional[torch.device]:
    """The device all of ``tensors`` are on; ``None`` when they are on several."""
    devices = {t.device for t in tensors}
    return devices.pop() if len(devices) == 1 else None


class _DeviceScratch:
    """One reused buffer per device for a bucket's bytes there. Reusing it needs no wait:
    every use is queued on the device's current stream, in order (a buffer that grows is
    freed the same way, stream-ordered)."""

    def __init__(self) -> None:
        self._buffers: Dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, nbytes: int) -> torch.Tensor:
        buffer = self._buffers.get(device)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer[:nbytes]


def send_bounced(tp: Any, dsts: List[int], meta: _Meta, sources: List[Optional[torch.Tensor]]) -> None:
    """Send every data message of ``meta`` to every destination through host bounce
    buffers (``tp``: the :class:`.protocol.PGTransport`, for its bounded sends and waits;
    ``tp._through_host(t)`` says which tensors need the bounce)."""
    c, scratch, limit = meta.columns, _DeviceScratch(), wire.STAGING_BYTES

    def bounce(m: int) -> Tuple[torch.Tensor, Optional[torch.Event], int]:
        """Message ``m``'s bytes in host memory: (the tensor to send, the event after its
        copies, the bytes of host buffer it holds)."""
        size, members = meta.messages[m]
        pieces = [sources[i] for i in members]
        alone = _alone(c, size, members)
        if not any(tp._through_host(t) for t in pieces):
            if alone and pieces[0].is_contiguous():
                return pieces[0], None, 0  # from its own memory
            device = None
        else:
            device = _one_device(pieces)
        host = _host_buffer(size, device)
        with torch.no_grad():
            if alone:
                t = pieces[0]
                host.view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            elif device is not None:
                packed = scratch.get(device, size)
                _pack(packed, _segments(meta, members), sources)
                host.copy_(packed, non_blocking=True)
            else:  # host tensors, or tensors on several devices: one copy each
                _pack(host, _segments(meta, members), sources)
        return host, _queued_done(device), size

    ahead: Deque[Tuple[torch.Tensor, Optional[torch.Event], int]] = collections.deque()
    flight: Deque[Tuple[List[Tuple[Any, int]], int, torch.Tensor]] = collections.deque()
    held = copied = 0
    count = len(meta.messages)
    for m in range(count):
        while copied < count and (copied == m or held < limit):  # this message, and more while under the limit
            ahead.append(bounce(copied))
            held += ahead[-1][2]
            copied += 1
        host, done, nbytes = ahead.popleft()
        if done is not None:
            done.synchronize()
        flight.append(([(tp._send(host, d, _TAG_DATA + m), d) for d in dsts], nbytes, host))
        while held > limit and len(flight) > 1:  # free the oldest buffers once their sends are done
            works, nbytes, _ = flight.popleft()
            for work, d in works:
                tp._wait([work], "sending tensor data", d)
            held -= nbytes
    for works, _, _ in flight:
        for work, d in works:
            tp._wait([work], "sending tensor data", d)


def receive_bounced(tp: Any, meta: _Meta, targets: List[Optional[torch.Tensor]], src: int,
                   ready: Callable[[], None]) -> None:
    """Receive every data message of ``meta`` into ``targets`` (each tensor leaf's
    destination, wire dtype, in place) through host bounce buffers; ``ready()`` is called
    right before the first receive is posted. Returns once every copy is done."""
    c, scratch, limit = meta.columns, _DeviceScratch(), wire.STAGING_BYTES
    what = "receiving tensor data"
    straight: List[Any] = []
    posted: Deque[Tuple[int, Any, torch.Tensor, Optional[torch.device]]] = collections.deque()
    devices: Set[torch.device] = set()

    def post(m: int) -> int:
        """Post message ``m``'s receive; the bytes of host buffer it holds."""
        size, members = meta.messages[m]
        ts = [targets[i] for i in members]
        through_host = any(tp._through_host(t) for t in ts)
        if _alone(c, size, members) and not through_host and ts[0].is_contiguous():
            straight.append(tp._post_recv(ts[0], src, _TAG_DATA + m, what))  # into its own memory
            return 0
        device = _one_device(ts) if through_host else None
        host = _host_buffer(size, device)
        posted.append((m, tp._post_recv(host, src, _TAG_DATA + m, what), host, device))
        return size

    def land(m: int, host: torch.Tensor, device: Optional[torch.device]) -> None:
        """Copy an arrived message's bytes into its leaves' destinations."""
        size, members = meta.messages[m]
        with torch.no_grad():
            if _alone(c, size, members):
                t = targets[members[0]]
                t.copy_(host.view(t.dtype).view(t.shape), non_blocking=True)
            else:
                data = host
                if device is not None:
                    data = scratch.get(device, size)
                    data.copy_(host, non_blocking=True)
                for dtype, start, end, leaves in _segments(meta, members):
                    _copy_all([targets[i] for i in leaves], _pieces(data[start:end].view(dtype), leaves, c))
        devices.update(targets[i].device for i in members)

    ready()
    held = sent = 0
    count = len(meta.messages)
    while sent < count or posted:
        while sent < count and (len(posted) < 2 or held < limit):
            held += post(sent)
            sent += 1
        if posted:
            m, work, host, device = posted.popleft()
            tp._wait([work], what, src)
            land(m, host, device)
            held -= host.numel()
    tp._wait(straight, what, src)
    for device in devices:
        done = _queued_done(device)
        if done is not None:
            done.synchronize()
