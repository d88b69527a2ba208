"""Live peer-to-peer transfer of training state over a process group, without storage.

When a data-parallel replica dies, its replacement can fetch the current state from a
healthy replica: :class:`PGTransport` sends any nested state (dicts, lists, tuples of
tensors of any dtype, ``ShardedTensor`` / ``ShardedObject`` leaves, DTensors, other
picklable values) from one rank to one or more others; :func:`recover_from_peer` wraps it
for a trainer.

Protocol, between the sender and each receiver (point-to-point messages of the group):

1. header (magic, version, metadata length) and the pickled metadata — the structure,
   every leaf's kind, shape, dtype and where its bytes travel — serialized once for all
   receivers;
2. each receiver checks the metadata against its own state (same structure, same shapes
   and dtypes) *before any tensor byte arrives* and answers ok or its error; the sender
   then tells every receiver to go on or to abort (so one receiver's mismatch stops the
   transfer on every rank, with the reason);
3. the tensor bytes: tensors of ``BUCKET_BYTES / 2`` or more travel alone, straight from
   and into their own memory when they are contiguous; smaller ones are packed into
   buckets of up to ``BUCKET_BYTES`` (a few messages instead of one per tensor). Two
   bucket buffers per side are reused, so memory stays bounded whatever the state size.

A view travels as its own elements only (never its whole base storage); non-contiguous
tensors arrive with the right values. Every wait is bounded by the transport's timeout: a
peer that dies or stops answering raises :class:`CheckpointingException` on the surviving
side. (After a timeout the process group may be unusable: recreate it.)
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import pickle
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from .bytes_view import as_bytes
from .core import CheckpointingException
from .fp8 import _float8_dtype, _per_tensor_layout, fill_float8_, is_float8tensor
from .mapping import ShardedTensor

try:  # DTensor is optional (older or stripped-down torch builds)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
BUCKET_BYTES = 16 << 20
_MAGIC = 0x44435054
_TAG_HEADER, _TAG_META, _TAG_ACK, _TAG_ACK_TEXT, _TAG_GO, _TAG_GO_TEXT, _TAG_DATA = range(1, 8)


@dataclass
class _TensorMeta:
    shape: Tuple[int, ...]
    dtype: torch.dtype  # the leaf's dtype (nominal dtype for FP8 tensors)
    nbytes: int  # bytes on the wire
    requires_grad: bool
    fp8: Optional[Tuple[torch.dtype, float]] = None  # (float8 format, scale_inv) of an FP8 tensor
    message: int = -1  # which data message carries it
    offset: int = 0  # its offset in that message


@dataclass
class _Leaf:
    kind: str  # "tensor", "sharded_tensor", "dtensor" or "value"
    tensor: Optional[_TensorMeta] = None
    value: Any = None  # a ShardedTensor without data, a DTensor spec, or the value itself


@dataclass
class _Meta:
    treespec: Any  # the state's structure (a pytree TreeSpec)
    paths: List[str]
    leaves: List[_Leaf]
    messages: List[Tuple[int, List[int]]]  # (nbytes, indices of the leaves it carries)


def _local_tensor(kind: str, value: Any) -> Optional[torch.Tensor]:
    if kind == "tensor":
        return value
    if kind == "sharded_tensor":
        return value.data
    if kind == "dtensor":
        return value._local_tensor
    return None


def _kind(value: Any) -> str:
    if isinstance(value, ShardedTensor) and isinstance(value.data, torch.Tensor):
        return "sharded_tensor"
    if DTensor is not None and isinstance(value, DTensor):
        return "dtensor"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "value"


def _wire_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes that travel for tensor ``t``: its own elements in row-major order (an FP8
    tensor's ``_data``), as a 1-D uint8 tensor (a view when ``t`` is contiguous)."""
    if is_float8tensor(t):
        t = _per_tensor_layout(t)[0]
    return as_bytes(t.detach())


def _tensor_meta(t: torch.Tensor) -> _TensorMeta:
    fp8 = None
    if is_float8tensor(t):
        data, scale_inv = _per_tensor_layout(t)
        fp8 = (_float8_dtype(t), float(scale_inv.item()))
        nbytes = data.numel()
    else:
        nbytes = t.numel() * t.element_size()
    return _TensorMeta(tuple(t.shape), t.dtype, nbytes, bool(t.requires_grad), fp8)


def _encode_meta(meta: _Meta) -> bytes:
    """The metadata as a pickle of plain tuples (fast for thousands of leaves; dataclasses
    and pytree's JSON serialization are ten times slower)."""
    leaves = [(leaf.kind, None if leaf.tensor is None else (
        leaf.tensor.shape, str(leaf.tensor.dtype), leaf.tensor.nbytes, leaf.tensor.requires_grad,
        None if leaf.tensor.fp8 is None else (str(leaf.tensor.fp8[0]), leaf.tensor.fp8[1]),
        leaf.tensor.message, leaf.tensor.offset), leaf.value) for leaf in meta.leaves]
    return pickle.dumps((meta.treespec, meta.paths, leaves, meta.messages), protocol=pickle.HIGHEST_PROTOCOL)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.rpartition(".")[2])


def _decode_meta(payload: bytes) -> _Meta:
    with warnings.catch_warnings():  # pickled TreeSpecs warn about a deprecated leaf class
        warnings.simplefilter("ignore", FutureWarning)
        treespec, paths, rows, messages = pickle.loads(payload)
    leaves = []
    for kind, tm, value in rows:
        tensor = None
        if tm is not None:
            shape, dtype, nbytes, requires_grad, fp8, message, offset = tm
            tensor = _TensorMeta(tuple(shape), _dtype(dtype), nbytes, requires_grad,
                                 None if fp8 is None else (_dtype(fp8[0]), fp8[1]), message, offset)
        leaves.append(_Leaf(kind, tensor, value))
    return _Meta(treespec, paths, leaves, messages)


_ALIGN = 64  # bucket offsets, so that every piece can be viewed as its dtype


def _plan_messages(leaves: List[_Leaf]) -> List[Tuple[int, List[int]]]:
    """Group tensor leaves into data messages: large ones alone, small ones in buckets."""
    messages: List[Tuple[int, List[int]]] = []
    open_bucket: Optional[int] = None
    for i, leaf in enumerate(leaves):
        tm = leaf.tensor
        if tm is None or tm.nbytes == 0:
            continue
        if tm.nbytes >= BUCKET_BYTES // 2:
            tm.message, tm.offset = len(messages), 0
            messages.append((tm.nbytes, [i]))
            continue
        if open_bucket is None or messages[open_bucket][0] + _ALIGN + tm.nbytes > BUCKET_BYTES:
            open_bucket = len(messages)
            messages.append((0, []))
        size, members = messages[open_bucket]
        start = -(-size // _ALIGN) * _ALIGN
        tm.message, tm.offset = open_bucket, start
        members.append(i)
        messages[open_bucket] = (start + tm.nbytes, members)
    return messages


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """No cyclic garbage collection during a transfer: the thousands of small objects it
    creates would trigger full collections (100 ms each with a large heap)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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

    def _send_text(self, dsts: Sequence[int], status: int, text: str, tags: Tuple[int, int], what: str) -> None:
        body = text.encode()
        head = torch.tensor([status, len(body)], dtype=torch.int64, device=self._device)
        works = [(self._send(head, d, tags[0]), d) for d in dsts]
        if body:
            payload = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(self._device)
            works += [(self._send(payload, d, tags[1]), d) for d in dsts]
        for work, d in works:
            self._wait([work], what, d)

    def _recv_text(self, src: int, tags: Tuple[int, int], what: str) -> Tuple[int, str]:
        head = torch.zeros(2, dtype=torch.int64, device=self._device)
        self._recv(head, src, tags[0], what)
        status, length = (int(v) for v in head.tolist())
        text = ""
        if length:
            payload = torch.empty(length, dtype=torch.uint8, device=self._device)
            self._recv(payload, src, tags[1], what)
            text = bytes(payload.cpu().numpy()).decode(errors="replace")
        return status, text

    # ------------------------------------------------------------------------- send

    def send_checkpoint(self, dst_ranks: Sequence[int], state_dict: Any) -> None:
        """Send ``state_dict`` to every rank in ``dst_ranks`` (each must call
        :meth:`recv_checkpoint` with this rank). Raises :class:`CheckpointingException` if a
        receiver refuses the state (its reason included), or on a failure or timeout."""
        with _no_gc():
            self._send_checkpoint(dst_ranks, state_dict)

    def _send_checkpoint(self, dst_ranks: Sequence[int], state_dict: Any) -> None:
        dsts = list(dst_ranks)
        start = time.perf_counter()
        flat, treespec = tree_flatten_with_path(state_dict)
        leaves: List[_Leaf] = []
        tensors: List[Optional[torch.Tensor]] = []
        for _, value in flat:
            kind = _kind(value)
            local = _local_tensor(kind, value)
            if local is None:
                leaves.append(_Leaf("value", value=value))
            elif kind == "sharded_tensor":
                leaves.append(_Leaf(kind, _tensor_meta(local), value.without_data()))
            elif kind == "dtensor":
                leaves.append(_Leaf(kind, _tensor_meta(local), value._spec))
            else:
                leaves.append(_Leaf(kind, _tensor_meta(local)))
            tensors.append(local)
        messages = _plan_messages(leaves)
        meta = _Meta(treespec, [keystr(p) for p, _ in flat], leaves, messages)
        try:
            payload = _encode_meta(meta)  # once, for every receiver
        except Exception as e:  # noqa: BLE001 - an unpicklable leaf
            raise CheckpointingException(f"Peer transfer: the state cannot be serialized: {e}") from e

        header = torch.tensor([_MAGIC, PROTOCOL_VERSION, len(payload)], dtype=torch.int64, device=self._device)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._device)
        works = [(w, d) for d in dsts for w in (self._send(header, d, _TAG_HEADER), self._send(body, d, _TAG_META))]
        for work, d in works:
            self._wait([work], "sending the metadata", d)
        refusals, accepted = [], []
        for d in dsts:
            status, text = self._recv_text(d, (_TAG_ACK, _TAG_ACK_TEXT), "receiving the metadata check")
            if status:
                refusals.append(f"rank {d}: {text}")
            else:
                accepted.append(d)
        if refusals:
            reason = "receiver refused the state: " + "; ".join(refusals)
            # The refusing receivers have raised already; the others wait for a word.
            self._send_text(accepted, 1, reason, (_TAG_GO, _TAG_GO_TEXT), "sending the abort")
            raise CheckpointingException(f"Peer transfer aborted: {reason}")
        self._send_text(dsts, 0, "", (_TAG_GO, _TAG_GO_TEXT), "sending the go-ahead")

        buffers = [torch.empty(0, dtype=torch.uint8, device=self._device) for _ in range(2)]
        in_flight: List[List[Tuple[Any, int]]] = [[], []]
        for m, (size, members) in enumerate(messages):
            slot = m % 2
            for work, d in in_flight[slot]:  # the buffer is free once its last sends are done
                self._wait([work], "sending tensor data", d)
            in_flight[slot] = []  # drop the finished sends: they keep the old buffer alive
            work = None
            if len(members) == 1 and leaves[members[0]].tensor.nbytes == size:
                data = _wire_bytes(tensors[members[0]])  # alone: straight from its memory
                if data.device != self._device:
                    data = data.to(self._device)
            else:
                if buffers[slot].numel() < size:
                    buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self._device)
                data = buffers[slot][:size]
                _pack(data, [leaves[i].tensor for i in members], [_wire_bytes(tensors[i]) for i in members])
            in_flight[slot] = [(self._send(data, d, _TAG_DATA + m), d) for d in dsts]
        for slot in in_flight:
            for work, d in slot:
                self._wait([work], "sending tensor data", d)
        total = sum(size for size, _ in messages)
        logger.info("Peer transfer: sent %d leaves, %.1f MiB in %d messages to ranks %s in %.3f s",
                    len(leaves), total / 2**20, len(messages), dsts, time.perf_counter() - start)

    # ------------------------------------------------------------------------- receive

    def recv_checkpoint(self, src_rank: int) -> Any:
        """Receive the state sent by ``src_rank``; returns it with the sender's structure.

        With ``state_dict`` given at construction, tensors are filled in place (the
        returned tensors are the receiver's own) and a structure, shape or dtype mismatch
        raises :class:`CheckpointingException` on this rank and the sender before any byte
        is written. Without it, new tensors are allocated on the transport's device."""
        with _no_gc():
            return self._recv_checkpoint(src_rank)

    def _recv_checkpoint(self, src_rank: int) -> Any:
        start = time.perf_counter()
        header = torch.zeros(3, dtype=torch.int64, device=self._device)
        self._recv(header, src_rank, _TAG_HEADER, "receiving the header")
        magic, version, length = (int(v) for v in header.tolist())
        if magic != _MAGIC or version != PROTOCOL_VERSION:
            raise CheckpointingException(
                f"Peer transfer: rank {src_rank} speaks another protocol (magic {magic:#x}, version {version}; "
                f"expected {_MAGIC:#x}, {PROTOCOL_VERSION})")
        body = torch.empty(length, dtype=torch.uint8, device=self._device)
        self._recv(body, src_rank, _TAG_META, "receiving the metadata")
        meta = _decode_meta(bytes(body.cpu().numpy()))

        error = None
        try:
            dests = self._destinations(meta)
        except CheckpointingException as e:
            error = str(e)
        self._send_text([src_rank], int(error is not None), error or "", (_TAG_ACK, _TAG_ACK_TEXT),
                        "answering the metadata check")
        if error is not None:
            raise CheckpointingException(f"Peer transfer from rank {src_rank} refused: {error}")
        status, reason = self._recv_text(src_rank, (_TAG_GO, _TAG_GO_TEXT), "receiving the go-ahead")
        if status:
            raise CheckpointingException(f"Peer transfer from rank {src_rank} aborted by the sender: {reason}")

        results = self._receive_data(meta, dests, src_rank)
        values = []
        for leaf, result in zip(meta.leaves, results):
            if leaf.kind == "value":
                values.append(leaf.value)
            elif leaf.kind == "sharded_tensor":
                sh = copy.copy(leaf.value)
                sh.data = result
                values.append(sh)
            elif leaf.kind == "dtensor":
                spec = leaf.value
                values.append(DTensor.from_local(result, spec.mesh, spec.placements, run_check=False,
                                                 shape=spec.shape, stride=spec.stride))
            else:
                values.append(result)
        total = sum(size for size, _ in meta.messages)
        logger.info("Peer transfer: received %d leaves, %.1f MiB in %d messages from rank %d in %.3f s",
                    len(meta.leaves), total / 2**20, len(meta.messages), src_rank, time.perf_counter() - start)
        return tree_unflatten(values, meta.treespec)

    def _destinations(self, meta: _Meta) -> List[Optional[torch.Tensor]]:
        """The receiver's own tensor for every tensor leaf (``None``: allocate), checked
        against the sender's metadata."""
        if self._state_dict is None:
            return [None] * len(meta.leaves)
        flat, _ = tree_flatten_with_path(self._state_dict())
        paths = [keystr(p) for p, _ in flat]
        if paths != meta.paths:
            only_sender = sorted(set(meta.paths) - set(paths))[:5]
            only_here = sorted(set(paths) - set(meta.paths))[:5]
            raise CheckpointingException(
                "the receiver's state has a different structure than the sender's "
                f"({len(meta.paths)} leaves sent, {len(paths)} here; only sent: {only_sender}; only here: {only_here})")
        dests: List[Optional[torch.Tensor]] = []
        for path, leaf, (_, mine) in zip(paths, meta.leaves, flat):
            if leaf.tensor is None:
                dests.append(None)
                continue
            kind = _kind(mine)
            local = _local_tensor(kind, mine)
            if kind != leaf.kind or local is None:
                raise CheckpointingException(
                    f"leaf {path}: the sender has a {leaf.kind}, the receiver a {type(mine).__name__}")
            tm = leaf.tensor
            if tuple(local.shape) != tm.shape or local.dtype != tm.dtype:
                raise CheckpointingException(
                    f"leaf {path}: the sender's tensor is {tm.shape} {tm.dtype}, the receiver's is "
                    f"{tuple(local.shape)} {local.dtype}")
            if tm.fp8 is not None and is_float8tensor(local) and _float8_dtype(local) != tm.fp8[0]:
                raise CheckpointingException(
                    f"leaf {path}: the sender's FP8 format is {tm.fp8[0]}, the receiver's {_float8_dtype(local)}")
            dests.append(local)
        return dests

    def _receive_data(self, meta: _Meta, dests: List[Optional[torch.Tensor]], src: int) -> List[Optional[torch.Tensor]]:
        """Receive every data message; returns the tensor of each leaf (``None`` for values)."""
        count = len(meta.leaves)
        results: List[Optional[torch.Tensor]] = [None] * count
        wire: List[Optional[torch.Tensor]] = [None] * count  # bytes a leaf's wire bytes can land in directly
        for i, (leaf, dest) in enumerate(zip(meta.leaves, dests)):
            tm = leaf.tensor
            if tm is None:
                continue
            if dest is None:
                dest = torch.empty(tm.shape, dtype=tm.fp8[0] if tm.fp8 else tm.dtype, device=self._device)
            results[i] = dest
            target = _wire_view(tm, dest)
            if target is not None and target.is_contiguous() and target.device == self._device:
                wire[i] = as_bytes(target)

        buffers = [torch.empty(0, dtype=torch.uint8, device=self._device) for _ in range(2)]

        def post(m: int) -> Tuple[Any, torch.Tensor]:
            size, members = meta.messages[m]
            if len(members) == 1 and wire[members[0]] is not None:
                buf = wire[members[0]]  # alone and contiguous: straight into the tensor
            else:
                slot = m % 2
                if buffers[slot].numel() < size:
                    buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self._device)
                buf = buffers[slot][:size]
            return self._post_recv(buf, src, _TAG_DATA + m, "receiving tensor data"), buf

        posted = post(0) if meta.messages else None
        for m, (_, members) in enumerate(meta.messages):
            work, buf = posted
            self._wait([work], "receiving tensor data", src)
            if m + 1 < len(meta.messages):
                posted = post(m + 1)  # into the other buffer, while this one is unpacked
            direct_dsts, direct_srcs = [], []
            for i in members:
                if wire[i] is not None and buf.data_ptr() == wire[i].data_ptr():
                    continue
                tm = meta.leaves[i].tensor
                piece = buf[tm.offset:tm.offset + tm.nbytes]
                if wire[i] is not None:
                    direct_dsts.append(wire[i])
                    direct_srcs.append(piece)
                else:
                    _unpack(piece, tm, results[i])
            _copy_all(direct_dsts, direct_srcs)
        for i, (leaf, dest) in enumerate(zip(meta.leaves, dests)):
            tm = leaf.tensor
            if tm is None:
                continue
            if tm.fp8 is not None:
                results[i] = _finish_fp8(tm, results[i])
            if dest is None and tm.requires_grad and results[i].is_floating_point():
                results[i].requires_grad_(True)
        return results


_PAD = torch.zeros(_ALIGN, dtype=torch.uint8)


def _pack(bucket: torch.Tensor, metas: List[_TensorMeta], pieces: List[torch.Tensor]) -> None:
    """Lay ``pieces`` (wire bytes) into ``bucket`` at their offsets: one ``torch.cat`` with
    the alignment padding in between (a per-piece copy loop costs 5x more in Python)."""
    parts: List[torch.Tensor] = []
    pos = 0
    for tm, piece in zip(metas, pieces):
        if tm.offset > pos:
            parts.append(_PAD[:tm.offset - pos].to(bucket.device))
        parts.append(piece)
        pos = tm.offset + tm.nbytes
    if all(p.device == bucket.device for p in parts):
        torch.cat(parts, out=bucket)
        return
    for tm, piece in zip(metas, pieces):  # pieces on another device: copy one by one
        bucket[tm.offset:tm.offset + tm.nbytes].copy_(piece)


def _copy_all(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair, in one call where torch offers it."""
    if not dsts:
        return
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None:
        foreach_copy(dsts, srcs)
        return
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


def _wire_view(tm: _TensorMeta, dest: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor whose bytes are exactly a leaf's wire bytes, or ``None`` when the
    destination needs a conversion (FP8 bytes into a plain high-precision tensor, plain
    values into an FP8 tensor)."""
    if tm.fp8 is None:
        return None if is_float8tensor(dest) else dest.detach()
    if is_float8tensor(dest):
        return _per_tensor_layout(dest)[0].detach()
    return dest.detach() if dest.dtype == tm.fp8[0] else None


def _unpack(piece: torch.Tensor, tm: _TensorMeta, dest: torch.Tensor) -> None:
    """Copy a leaf's wire bytes into a destination that could not receive them directly
    (not contiguous, on another device, or needing a conversion)."""
    if tm.fp8 is None:
        values = piece.view(tm.dtype).reshape(tm.shape)
        if is_float8tensor(dest):  # plain values into an FP8 tensor: quantize with its own scale
            fill_float8_(dest, values)
        else:
            dest.detach().copy_(values)
        return
    raw = piece.view(tm.fp8[0]).reshape(tm.shape)
    target = _wire_view(tm, dest)
    if target is None:
        dest.detach().copy_((raw.float() * tm.fp8[1]).to(tm.dtype))
    else:
        target.copy_(raw.view(torch.uint8) if target.dtype == torch.uint8 else raw)


def _finish_fp8(tm: _TensorMeta, dest: torch.Tensor) -> torch.Tensor:
    """An FP8 leaf: give the receiver's FP8 tensor the sender's scale, or turn newly
    received raw float8 values into the nominal dtype."""
    fmt, scale_inv = tm.fp8
    if is_float8tensor(dest):
        with torch.no_grad():
            _per_tensor_layout(dest)[1].fill_(scale_inv)
        return dest
    if dest.dtype == fmt:
        return (dest.float() * scale_inv).to(tm.dtype)
    return dest


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
