"""The transport protocol: :class:`PGTransport`, which sends a state to one or more
receivers (header, metadata, the receivers' check, the data messages) and receives it, and
:func:`recover_from_peer`, its entry point for a trainer."""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import time
from datetime import timedelta
from typing import Any, Callable, Deque, List, NoReturn, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from ..core import CheckpointingException, gc_paused
from ..tensors.fp8 import float8_dtype, is_float8tensor
from . import wire
from .copies import _convert, _copy_all, _finish_fp8, _is_on, _pack, _pieces, _wire_view
from .leaves import DTensor, _Columns, _LeafError, check_state_keys
from .own_state import _OwnState
from .plan import _alone
from .host_bounce import receive_bounced, send_bounced
from .wire import (
    _MAGIC,
    _TAG_ACK,
    _TAG_ACK_TEXT,
    _TAG_DATA,
    _TAG_GO,
    _TAG_GO_TEXT,
    _TAG_HEADER,
    _TAG_META,
    PROTOCOL_VERSION,
    _decode_meta,
    _encode_meta,
    _head,
    _read_head,
    _Meta,
    _segments,
)

logger = logging.getLogger(__package__)  # (the package's name, as before the split)


class PGTransport:
    """Send and receive nested training state over ``pg`` with point-to-point messages.

    Args:
        pg: the process group (``None``: the default group); ranks are ranks in it.
        timeout: the longest any single wait may take.
        device: where tensors travel from (``cpu`` for gloo, a CUDA device for NCCL).
        state_dict: on a receiver, a callable returning its current state: received bytes
            then land directly in those tensors (same storage), after a check that the
            structure, shapes and dtypes match the sender's.
    """

    def __init__(self, pg: Optional[Any], timeout: timedelta, device: torch.device,
                 state_dict: Optional[Callable[[], Any]] = None):
        self._pg = pg if pg is not None else dist.group.WORLD
        self._timeout = timeout
        self._device = torch.device(device)
        self._state_dict = state_dict

    # ------------------------------------------------------------------------- plumbing

    def _wait(self, works: Sequence[Any], what: str, peer: int) -> None:
        for work in works:
            try:
                if not work.wait(self._timeout):
                    raise RuntimeError(f"timed out after {self._timeout}")
            except CheckpointingException:
                raise
            except Exception as e:  # noqa: BLE001 - a dead peer, a timeout, a broken connection
                raise CheckpointingException(f"Peer transfer: {what} with rank {peer} failed: {e}") from e

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, what: str = "sending") -> Any:
        try:
            return self._pg.send([tensor], dst, tag)
        except Exception as e:  # noqa: BLE001 - e.g. the connection to a dead peer is closed
            raise CheckpointingException(f"Peer transfer: {what} to rank {dst} failed: {e}") from e

    def _post_recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> Any:
        try:
            return self._pg.recv([tensor], src, tag)
        except Exception as e:  # noqa: BLE001 - e.g. the connection to a dead peer is closed
            raise CheckpointingException(f"Peer transfer: {what} from rank {src} failed: {e}") from e

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> None:
        self._wait([self._post_recv(tensor, src, tag, what)], what, src)

    def _through_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a wire source or destination) is an accelerator tensor while the
        wire is host memory (gloo): with ``HOST_STAGING`` its messages go through host
        bounce buffers (:mod:`.host_bounce`)."""
        return self._device.type == "cpu" and not t.is_cpu

    def _send_text(self, dsts: Sequence[int], status: int, text: str, tags: Tuple[int, int], what: str) -> None:
        body = text.encode()
        head = torch.tensor([status, len(body)], dtype=torch.int64, device=self._device)
        works = [(self._send(head, d, tags[0]), d) for d in dsts]
        if body:
            payload = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(self._device)
            works += [(self._send(payload, d, tags[1]), d) for d in dsts]
        for work, d in works:
            self._wait([work], what, d)

    def _recv_body(self, src: int, length: int, tag: int, what: str) -> str:
        if not length:
            return ""
        payload = torch.empty(length, dtype=torch.uint8, device=self._device)
        self._recv(payload, src, tag, what)
        return bytes(payload.cpu().numpy()).decode(errors="replace")

    # ------------------------------------------------------------------------- send

    def send_checkpoint(self, dst_ranks: Sequence[int], state_dict: Any) -> None:
        """Send ``state_dict`` to every rank in ``dst_ranks`` (each must call
        :meth:`recv_checkpoint` with this rank). Raises :class:`CheckpointingException` if a
        receiver refuses the state (its reason included), or on a failure or timeout."""
        with gc_paused():  # thousands of small objects per transfer
            self._send_checkpoint(dst_ranks, state_dict)

    def _send_checkpoint(self, dst_ranks: Sequence[int], state_dict: Any) -> None:
        dsts = list(dst_ranks)
        start = time.perf_counter()
        values, treespec = tree_flatten(state_dict)
        try:
            check_state_keys(state_dict)
            columns, sources = _Columns.describe(values)
            meta = _Meta(treespec, columns, len(dsts))
            payload = _encode_meta(meta)  # once, for every receiver
        except _LeafError as e:
            self._fail_before_header(dsts, f"leaf {_paths(state_dict)[e.index]} cannot be sent: {e}", e)
        except Exception as e:  # noqa: BLE001 - an unpicklable leaf
            self._fail_before_header(dsts, f"the state cannot be serialized: {e}", e)

        works = self._send_head(dsts, len(payload), payload)
        heads = [torch.zeros(2, dtype=torch.int64, device=self._device) for _ in dsts]
        answers = [(self._post_recv(h, d, _TAG_ACK, "receiving the metadata check"), h, d) for h, d in zip(heads, dsts)]
        meta.plan()  # while the receivers check the metadata
        for work, d in works:
            self._wait([work], "sending the metadata", d)
        refusals, accepted = [], []
        for work, head, d in answers:
            self._wait([work], "receiving the metadata check", d)
            status, length = (int(v) for v in head.tolist())
            if status:
                refusals.append(f"rank {d}: {self._recv_body(d, length, _TAG_ACK_TEXT, 'receiving the metadata check')}")
            else:
                accepted.append(d)
        if refusals:
            reason = "receiver refused the state: " + "; ".join(refusals)
            # The refusing receivers have raised already; the others wait for a word.
            self._send_text(accepted, 1, reason, (_TAG_GO, _TAG_GO_TEXT), "sending the abort")
            raise CheckpointingException(f"Peer transfer aborted: {reason}")
        if len(dsts) > 1:  # (a single receiver's own acceptance is its go-ahead)
            self._send_text(dsts, 0, "", (_TAG_GO, _TAG_GO_TEXT), "sending the go-ahead")
        self._send_data(dsts, meta, sources)
        total = sum(size for size, _ in meta.messages)
        logger.debug("Peer transfer: sent %d leaves, %.1f MiB in %d messages to ranks %s in %.3f s",
                    len(values), total / 2**20, len(meta.messages), dsts, time.perf_counter() - start)

    def send_failure(self, dst_ranks: Sequence[int], reason: str) -> None:
        """Tell every rank in ``dst_ranks`` (each calling :meth:`recv_checkpoint` with this
        rank) that no state comes: each raises :class:`CheckpointingException` with
        ``reason`` at once instead of waiting for its timeout."""
        with contextlib.suppress(CheckpointingException):
            self._fail_before_header(list(dst_ranks), reason, CheckpointingException(reason))

    def _fail_before_header(self, dsts: List[int], reason: str, error: Exception) -> NoReturn:
        """Tell every receiver that this state cannot be sent (a header with a negative
        length, the reason in place of the metadata), so each raises at once instead of
        waiting for its timeout; then raise here."""
        body = reason.encode()
        with contextlib.suppress(CheckpointingException):  # a dead receiver: the reason still raises here
            for work, d in self._send_head(dsts, -len(body), body):
                self._wait([work], "sending the error", d)
        raise CheckpointingException(f"Peer transfer: {reason}") from error

    def _send_head(self, dsts: List[int], length: int, payload: bytes) -> List[Tuple[Any, int]]:
        """Post the first message to every receiver, and the payload after it when it does
        not fit in it (:func:`.wire._head`); returns the sends."""
        head, inline = _head(length, payload)
        messages = [(head.to(self._device), _TAG_HEADER)]
        if not inline:
            messages.append((torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._device), _TAG_META))
        return [(self._send(t, d, tag), d) for d in dsts for t, tag in messages]

    def _send_data(self, dsts: List[int], meta: _Meta, sources: List[Optional[torch.Tensor]]) -> None:
        """Send every data message to every destination. Tensors travelling alone go from
        their own memory when it is contiguous and on the transport's device (all posted
        at once, so they stream back to back; copies of the others are bounded to two
        buckets' worth in flight). Buckets are packed into two reused buffers, one
        ``torch.cat`` per dtype run. (Accelerator tensors on a host wire with
        ``HOST_STAGING``: :func:`.host_bounce.send_bounced`.)"""
        if wire.HOST_STAGING and any(s is not None and self._through_host(s) for s in sources):
            send_bounced(self, dsts, meta, sources)
            return
        device, c = self._device, meta.columns

        def wait_all(works: List[Tuple[Any, int]]) -> None:
            for work, d in works:
                self._wait([work], "sending tensor data", d)

        own: List[Tuple[Any, int]] = []  # sends from the tensors' own memory
        buffers = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]
        in_buffer: List[List[Tuple[Any, int]]] = [[], []]  # the sends of each bucket buffer
        copies: Deque[Tuple[List[Tuple[Any, int]], int]] = collections.deque()  # sends from temporary copies
        copied = buckets = 0
        for m, (size, members) in enumerate(meta.messages):
            if not _alone(c, size, members):
                slot = buckets % 2
                buckets += 1
                wait_all(in_buffer[slot])  # the buffer is free once its last sends are done
                if buffers[slot].numel() < size:
                    buffers[slot] = torch.empty(size, dtype=torch.uint8, device=device)
                data = buffers[slot][:size]
                _pack(data, _segments(meta, members), sources)
                in_buffer[slot] = [(self._send(data, d, _TAG_DATA + m), d) for d in dsts]
                continue
            data = sources[members[0]]
            if data.is_contiguous() and _is_on(data, device):
                own += [(self._send(data, d, _TAG_DATA + m), d) for d in dsts]
                continue
            data = (data if _is_on(data, device) else data.to(device)).contiguous()
            copies.append(([(self._send(data, d, _TAG_DATA + m), d) for d in dsts], size))
            copied += size
            while copied > 2 * wire.BUCKET_BYTES and len(copies) > 1:
                works, size = copies.popleft()
                wait_all(works)
                copied -= size
        for works, _ in copies:
            wait_all(works)
        wait_all(in_buffer[0] + in_buffer[1] + own)

    # ------------------------------------------------------------------------- receive

    def recv_checkpoint(self, src_rank: int) -> Any:
        """Receive the state sent by ``src_rank``; returns it with the sender's structure.

        With ``state_dict`` given at construction, tensors are filled in place (the
        returned tensors are the receiver's own) and a structure, shape or dtype mismatch
        raises :class:`CheckpointingException` on this rank and the sender before any byte
        is written. Without it, new tensors are allocated on the transport's device."""
        with gc_paused():  # thousands of small objects per transfer
            return self._recv_checkpoint(src_rank)

    def _recv_checkpoint(self, src_rank: int) -> Any:
        start = time.perf_counter()
        # posted first (a fixed size), so that it is waiting when the sender's arrives
        head = torch.empty(wire.HEAD_BYTES, dtype=torch.uint8, device=self._device)
        head_work = self._post_recv(head, src_rank, _TAG_HEADER, "receiving the header")
        # prepared while the sender flattens its state and encodes the metadata
        own = None if self._state_dict is None else _OwnState(self._state_dict())
        self._wait([head_work], "receiving the header", src_rank)
        magic, version, length, payload = _read_head(head.cpu())
        if magic != _MAGIC or version != PROTOCOL_VERSION:
            raise CheckpointingException(
                f"Peer transfer: rank {src_rank} speaks another protocol (magic {magic:#x}, version {version}; "
                f"expected {_MAGIC:#x}, {PROTOCOL_VERSION})")
        if payload is None:  # too large for the first message: it follows
            body = torch.empty(abs(length), dtype=torch.uint8, device=self._device)
            self._recv(body, src_rank, _TAG_META,
                       "receiving the sender's error" if length < 0 else "receiving the metadata")
            payload = bytes(body.cpu().numpy())
        if length < 0:  # the sender cannot send its state: its reason instead of the metadata
            reason = payload.decode(errors="replace")
            raise CheckpointingException(f"Peer transfer from rank {src_rank} failed on the sender: {reason}")
        meta = _decode_meta(payload)

        error = None
        try:
            dests = self._destinations(meta, own)
        except CheckpointingException as e:
            error = str(e)
        if error is not None:
            self._send_text([src_rank], 1, error, (_TAG_ACK, _TAG_ACK_TEXT), "answering the metadata check")
            raise CheckpointingException(f"Peer transfer from rank {src_rank} refused: {error}")
        if own is None or not own.plan_into(meta):
            meta.plan()  # the sender's plan, made here too

        def ready() -> None:
            """Accept, once the data receives can be posted at once (so they are waiting
            when the data arrives); with several receivers, wait for the go-ahead."""
            self._send_text([src_rank], 0, "", (_TAG_ACK, _TAG_ACK_TEXT), "answering the metadata check")
            if meta.receivers > 1:  # another receiver may refuse: the sender says whether to go on
                go = torch.zeros(2, dtype=torch.int64, device=self._device)
                self._recv(go, src_rank, _TAG_GO, "receiving the go-ahead")
                status, length = (int(v) for v in go.tolist())
                reason = self._recv_body(src_rank, length, _TAG_GO_TEXT, "receiving the go-ahead")
                if status:
                    raise CheckpointingException(f"Peer transfer from rank {src_rank} aborted by the sender: {reason}")

        out = self._receive_data(meta, dests, src_rank, lambda results: _assemble(meta, results), ready)
        total = sum(size for size, _ in meta.messages)
        logger.debug("Peer transfer: received %d leaves, %.1f MiB in %d messages from rank %d in %.3f s",
                    len(meta.leaves), total / 2**20, len(meta.messages), src_rank, time.perf_counter() - start)
        return out

    def _destinations(self, meta: _Meta, own: Optional[_OwnState]) -> List[Optional[torch.Tensor]]:
        """The receiver's own tensor for every tensor leaf (``None``: allocate), checked
        against the sender's metadata."""
        if own is None:
            return [None] * len(meta.leaves)
        if own.spec_pickle != meta.treespec_pickle and own.spec != meta.treespec:
            sent = _paths(tree_unflatten([0] * meta.treespec.num_leaves, meta.treespec))
            here = _paths(own.state)
            only_sender = sorted(set(sent) - set(here))[:5]
            only_here = sorted(set(here) - set(sent))[:5]
            raise CheckpointingException(
                "the receiver's state has a different structure than the sender's "
                f"({len(sent)} leaves sent, {len(here)} here; only sent: {only_sender}; only here: {only_here})")
        c = meta.columns
        if ((c.kinds, c.shapes, c.dtypes) == (own.kinds, own.shapes, own.dtypes)
                and not meta.fp8_leaves):  # (FP8 formats need the leaf-by-leaf check below)
            return [None if kind == "value" else local for kind, local in zip(own.kinds, own.locals)]
        dests: List[Optional[torch.Tensor]] = []
        for n, (leaf, mine, kind, local) in enumerate(zip(meta.leaves, own.values, own.kinds, own.locals)):
            if leaf.tensor is None:
                dests.append(None)
                continue
            mismatch = None
            if kind != leaf.kind or local is None:
                mismatch = f"the sender has a {leaf.kind}, the receiver a {type(mine).__name__}"
            else:
                tm = leaf.tensor
                if tuple(local.shape) != tm.shape or local.dtype != tm.dtype:
                    mismatch = (f"the sender's tensor is {tm.shape} {tm.dtype}, the receiver's is "
                                f"{tuple(local.shape)} {local.dtype}")
                elif tm.fp8 is not None and is_float8tensor(local) and float8_dtype(local) != tm.fp8[0]:
                    mismatch = f"the sender's FP8 format is {tm.fp8[0]}, the receiver's {float8_dtype(local)}"
            if mismatch is not None:
                raise CheckpointingException(f"leaf {_paths(own.state)[n]}: {mismatch}")
            dests.append(local)
        return dests

    def _receive_data(self, meta: _Meta, dests: List[Optional[torch.Tensor]], src: int,
                      assemble: Callable[[List[Optional[torch.Tensor]]], Any], ready: Callable[[], None]) -> Any:
        """Receive every data message; returns ``assemble(tensor of each leaf)`` (``None``
        for values), computed while the last messages arrive unless FP8 leaves need their
        data first. ``ready()`` (the answer to the sender) is called once everything is
        prepared, right before the receives are posted.

        A tensor travelling alone lands straight in its destination when that is
        contiguous; all those messages are posted at once. The others (buckets, and tensors
        that need a copy or a conversion) go through two reused buffers, each unpacked
        before it is posted again: one typed copy call per dtype run of a bucket. (In place
        into accelerator tensors on a host wire with ``HOST_STAGING``:
        :func:`.host_bounce.receive_bounced`.)"""
        c = meta.columns
        count, device, wire_dtypes = len(c.kinds), self._device, meta.wire
        inplace = self._state_dict is not None
        results: List[Optional[torch.Tensor]] = list(dests)
        # targets[i]: the tensor that leaf i's wire values are copied into (its dtype and
        # shape); None: not allocated yet (new tensors), or a conversion (in place)
        if not inplace:
            targets: List[Optional[torch.Tensor]] = [None] * count
        elif not meta.fp8_leaves:  # the common case: the receiver's own plain tensors
            targets = [d if d is None or type(d) is torch.Tensor else _wire_view(meta.leaves[i].tensor, d)
                       for i, d in enumerate(dests)]
        else:
            targets = [None if d is None else _wire_view(meta.leaves[i].tensor, d) for i, d in enumerate(dests)]
        converted = inplace and any(t is None and d is not None for t, d in zip(targets, dests))

        def allocate(leaves: List[int]) -> None:
            for i in leaves:
                if results[i] is None:
                    results[i] = targets[i] = torch.empty(c.shapes[i], dtype=wire_dtypes[i], device=device)

        def unpack(m: int, buf: torch.Tensor) -> None:
            with torch.no_grad():
                for dtype, start, end, leaves in _segments(meta, meta.messages[m][1]):
                    if not inplace:
                        allocate(leaves)
                    ts = [targets[i] for i in leaves]
                    pieces = _pieces(buf[start:end].view(dtype), leaves, c)
                    if not converted:
                        _copy_all(ts, pieces)
                        continue
                    _copy_all([t for t in ts if t is not None], [p for t, p in zip(ts, pieces) if t is not None])
                    for i, t, p in zip(leaves, ts, pieces):
                        if t is None:
                            _convert(p, meta.leaves[i].tensor, results[i])

        if wire.HOST_STAGING and inplace and not converted and any(
                t is not None and self._through_host(t) for t in targets):
            receive_bounced(self, meta, targets, src, ready)
            for i in meta.fp8_leaves:
                results[i] = _finish_fp8(meta.leaves[i].tensor, results[i])
            return assemble(results)
        what = "receiving tensor data"
        buffers = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]
        pending: List[Optional[Tuple[Any, int, torch.Tensor]]] = [None, None]  # (work, message, buffer) per buffer
        straight: List[Any] = []
        buffered = 0
        ready()
        for m, (size, members) in enumerate(meta.messages):
            if _alone(c, size, members):
                if not inplace:
                    allocate(members)
                t = targets[members[0]]
                if t is not None and t.is_contiguous() and _is_on(t, device):
                    straight.append(self._post_recv(t, src, _TAG_DATA + m, what))
                    continue
            slot = buffered % 2
            buffered += 1
            if pending[slot] is not None:  # the buffer's last message first
                work, prev, buf = pending[slot]
                self._wait([work], what, src)
                unpack(prev, buf)
            if buffers[slot].numel() < size:
                buffers[slot] = torch.empty(size, dtype=torch.uint8, device=device)
            buf = buffers[slot][:size]
            pending[slot] = (self._post_recv(buf, src, _TAG_DATA + m, what), m, buf)
        if not inplace:  # while data streams: the tensors still in a bucket, and empty ones
            tensors = [i for i in range(count) if c.kinds[i] != "value"]
            allocate(tensors)
            for i in tensors:
                if c.requires_grad[i] and results[i].is_floating_point():
                    results[i].requires_grad_(True)
        fp8_leaves = meta.fp8_leaves
        out = None if fp8_leaves else assemble(results)
        for entry in sorted((e for e in pending if e is not None), key=lambda e: e[1]):
            work, m, buf = entry  # (the last buckets are unpacked while the last large tensors stream)
            self._wait([work], what, src)
            unpack(m, buf)
        self._wait(straight, what, src)
        if not fp8_leaves:
            return out
        for i in fp8_leaves:
            results[i] = _finish_fp8(meta.leaves[i].tensor, results[i])
        return assemble(results)

def _assemble(meta: _Meta, results: List[Optional[torch.Tensor]]) -> Any:
    """The received state: the sender's structure with the received tensors (wrapped back
    into ShardedTensors and DTensors) and the sender's other values."""
    c = meta.columns
    values = []
    for kind, value, result in zip(c.kinds, c.values, results):
        if kind == "value":
            values.append(value)
        elif kind == "sharded_tensor":
            sh = copy.copy(value)
            sh.data = result
            values.append(sh)
        elif kind == "dtensor":
            values.append(DTensor.from_local(result, value.mesh, value.placements, run_check=False,
                                             shape=value.shape, stride=value.stride))
        else:
            values.append(result)
    return tree_unflatten(values, meta.treespec)


def _paths(state: Any) -> List[str]:
    """The key path of every leaf of ``state`` (for messages)."""
    return [keystr(p) for p, _ in tree_flatten_with_path(state)[0]]

def recover_from_peer(
    state: Callable[[], Any],
    healthy_rank: int,
    recovering_ranks: Sequence[int],
    pg: Optional[Any] = None,
    timeout: timedelta = timedelta(minutes=5),
    device: Optional[torch.device] = None,
) -> Optional[Any]:
    """Copy the training state of ``healthy_rank`` into ``recovering_ranks`` (call it on
    all of them; other ranks need not call it).

    ``state`` returns this rank's current state (e.g. ``lambda: {"model":
    model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}``). The healthy
    rank sends it; each recovering rank receives it in place into its own tensors and gets
    the state back (non-tensor values, such as the step, come from the healthy rank). Any
    mismatch or failure raises :class:`CheckpointingException` on the ranks involved.
    ``device`` defaults to the CPU for gloo and the current CUDA device for NCCL.
    """
    group = pg if pg is not None else dist.group.WORLD
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    me = dist.get_rank(group)
    if me == healthy_rank:
        PGTransport(group, timeout, device).send_checkpoint(list(recovering_ranks), state())
        return None
    if me in recovering_ranks:
        return PGTransport(group, timeout, device, state_dict=state).recv_checkpoint(healthy_rank)
    raise CheckpointingException(
        f"recover_from_peer: rank {me} is neither the healthy rank {healthy_rank} nor recovering ({list(recovering_ranks)})")
