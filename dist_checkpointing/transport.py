"""Live peer-to-peer transfer of training state over a process group, without storage.

When a data-parallel replica dies, its replacement can fetch the current state from a
healthy replica: :class:`PGTransport` sends any nested state (dicts, lists, tuples of
tensors of any dtype, ``ShardedTensor`` / ``ShardedObject`` leaves, DTensors, other
picklable values) from one rank to one or more others; :func:`recover_from_peer` wraps it
for a trainer.

Protocol, between the sender and each receiver (point-to-point messages of the group):

1. header (magic, version, metadata length) and the metadata — the structure and, one
   column per field, every leaf's kind, shape, dtype and size, and the sender's bucket
   sizes — pickled once for all receivers (each side plans the data messages from it:
   the plan is not sent). A sender that cannot describe its state (a leaf it cannot send,
   e.g. an FP8 layout that is not per-tensor scaled, or an unpicklable value) sends a
   negative length and its reason instead, so every receiver raises at once;
2. each receiver checks the metadata against its own state (same structure, same shapes
   and dtypes) *before any tensor byte arrives* and answers ok or its error; with several
   receivers, the sender then tells every receiver to go on or to abort (so one
   receiver's mismatch stops the transfer on every rank, with the reason); a single
   receiver's ok is its own go-ahead;
3. the tensor bytes. Every tensor of ``ALONE_BYTES`` (or half a bucket) or more travels
   alone, straight from the sender's memory into the receiver's (when both are
   contiguous); these messages are all posted at once, so they stream back to back. The
   smaller tensors are packed into buckets of up to ``BUCKET_BYTES`` (a few messages
   instead of one per tensor), spread evenly among the large ones: the sender packs and
   the receiver unpacks a bucket while large tensors stream. In a bucket the tensors are
   grouped by dtype, each dtype's run packed with one ``torch.cat`` and unpacked with one
   ``torch.split`` and one ``_foreach_copy_`` (no per-tensor Python work beyond a list
   entry). Two bucket buffers per side are reused, so memory stays bounded whatever the
   state size.

A view travels as its own elements only (never its whole base storage); non-contiguous
tensors arrive with the right values. Every wait is bounded by the transport's timeout: a
peer that dies or stops answering raises :class:`CheckpointingException` on the surviving
side. (After a timeout the process group may be unusable: recreate it.)
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import pickle
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Deque, Dict, List, NoReturn, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from .core import CheckpointingException, gc_paused
from .fp8 import _float8_dtype, _per_tensor_layout, fill_float8_, is_float8tensor
from .mapping import ShardedTensor

try:  # DTensor is optional (older or stripped-down torch builds)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 2
BUCKET_BYTES = 16 << 20
ALONE_BYTES = 64 << 10  # tensors this large (or half a bucket) travel alone
_MAGIC = 0x44435054
_TAG_HEADER, _TAG_META, _TAG_ACK, _TAG_ACK_TEXT, _TAG_GO, _TAG_GO_TEXT, _TAG_DATA = range(1, 8)


@dataclass
class _TensorMeta:
    shape: Tuple[int, ...]
    dtype: torch.dtype  # the leaf's dtype (nominal dtype for FP8 tensors)
    nbytes: int  # bytes on the wire
    requires_grad: bool
    fp8: Optional[Tuple[torch.dtype, float]] = None  # (float8 format, scale_inv) of an FP8 tensor


@dataclass
class _Leaf:
    kind: str  # "tensor", "sharded_tensor", "dtensor" or "value"
    tensor: Optional[_TensorMeta] = None
    value: Any = None  # a ShardedTensor without data, a DTensor spec, or the value itself


@dataclass
class _Columns:
    """Every leaf's metadata, one list per field (what travels: pickling and unpickling
    lists is fast, thousands of objects are not). Value leaves: kind "value", shape and
    dtype ``None``, 0 bytes."""

    kinds: List[str]
    shapes: List[Optional[Tuple[int, ...]]]
    dtypes: List[Optional[torch.dtype]]
    nbytes: List[int]
    requires_grad: List[bool]
    fp8: List[Optional[Tuple[torch.dtype, float]]]
    values: List[Any]

    @classmethod
    def describe(cls, values: Sequence[Any]) -> Tuple["_Columns", List[Optional[torch.Tensor]]]:
        """The columns of a flattened state, and each leaf's wire source (see
        :func:`_wire_source`; ``None`` for values)."""
        c = cls([], [], [], [], [], [], [])
        tensors: List[Optional[torch.Tensor]] = []
        kinds, shapes, dtypes, nbytes = c.kinds.append, c.shapes.append, c.dtypes.append, c.nbytes.append
        grads, fp8s, extras, locals_ = c.requires_grad.append, c.fp8.append, c.values.append, tensors.append
        for value in values:
            if type(value) is torch.Tensor:  # the common case, inline
                kinds("tensor"), shapes(tuple(value.shape)), dtypes(value.dtype), nbytes(value.nbytes)
                grads(value.requires_grad), fp8s(None), extras(None), locals_(value)
                continue
            kind = _kind(value)
            local = _local_tensor(kind, value)
            kinds(kind if local is not None else "value")
            locals_(local)
            if local is None:
                shapes(None), dtypes(None), nbytes(0), grads(False), fp8s(None), extras(value)
                continue
            try:
                tensors[-1] = _wire_source(local)
                tm = _tensor_meta(local)
            except Exception as e:  # noqa: BLE001 - e.g. an FP8 layout that is not per-tensor scaled
                raise _LeafError(len(tensors) - 1, e) from e
            shapes(tm.shape), dtypes(tm.dtype), nbytes(tm.nbytes), grads(tm.requires_grad), fp8s(tm.fp8)
            extras(value.without_data() if kind == "sharded_tensor" else value._spec if kind == "dtensor" else None)
        return c, tensors


class _LeafError(Exception):
    """A leaf that cannot be described: its index in the flattened state, and why."""

    def __init__(self, index: int, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.index = index


@dataclass
class _Meta:
    """What the sender says about a transfer. The data messages are not part of it: each
    side plans them from the columns and the sender's two sizes (:meth:`plan`), the
    receiver after its check, while the sender plans its own."""

    treespec: Any  # the state's structure (a pytree TreeSpec)
    columns: _Columns
    receivers: int = 1  # how many ranks the sender sends to (one: no go-ahead round)
    bucket_bytes: Optional[int] = None  # the sender's bucket size (None: this process's BUCKET_BYTES)
    alone_bytes: Optional[int] = None  # the sender's size for travelling alone (None: ALONE_BYTES)
    treespec_pickle: bytes = b""  # the structure as sent (equal bytes: equal structures)

    def __post_init__(self) -> None:
        self.bucket_bytes = BUCKET_BYTES if self.bucket_bytes is None else self.bucket_bytes
        self.alone_bytes = ALONE_BYTES if self.alone_bytes is None else self.alone_bytes
        self.leaves: Sequence[_Leaf] = _LeafColumns(self.columns)  # objects for the rarer paths
        self.wire = _wire_dtypes(self.columns)  # each leaf's dtype on the wire
        self.messages: List[Tuple[int, List[int]]] = []  # (nbytes, indices of the leaves it carries)
        self.offsets: List[int] = []  # each leaf's offset in its message

    def plan(self) -> None:
        """Plan the data messages (see :func:`_plan_messages`)."""
        self.messages, self.offsets = _plan_messages(self.columns, self.bucket_bytes, self.alone_bytes)

    @property
    def fp8_leaves(self) -> List[int]:
        """The leaves that are FP8 tensors."""
        return [i for i, f in enumerate(self.columns.fp8) if f is not None]


class _LeafColumns(Sequence[_Leaf]):
    """Decoded metadata as leaf objects, each built on first access (the receiver's common
    paths read the columns directly)."""

    def __init__(self, columns: _Columns):
        self._c = columns
        self._leaves: List[Optional[_Leaf]] = [None] * len(columns.kinds)

    def __len__(self) -> int:
        return len(self._leaves)

    def __getitem__(self, i):  # type: ignore[override]
        leaf = self._leaves[i]
        if leaf is None:
            c = self._c
            tm = None if c.kinds[i] == "value" else _TensorMeta(
                c.shapes[i], c.dtypes[i], c.nbytes[i], c.requires_grad[i], c.fp8[i])
            leaf = self._leaves[i] = _Leaf(c.kinds[i], tm, c.values[i])
        return leaf


def _local_tensor(kind: str, value: Any) -> Optional[torch.Tensor]:
    if kind == "tensor":
        return value
    if kind == "sharded_tensor":
        return value.data
    if kind == "dtensor":
        return value._local_tensor
    return None


def _kind(value: Any) -> str:
    if type(value) is torch.Tensor:  # the common case first
        return "tensor"
    if isinstance(value, ShardedTensor) and isinstance(value.data, torch.Tensor):
        return "sharded_tensor"
    if DTensor is not None and isinstance(value, DTensor):
        return "dtensor"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "value"


def _wire_source(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose elements travel for a non-plain leaf tensor ``t``: an FP8
    tensor's raw data viewed as its float8 format, or ``t`` detached. (A plain tensor is
    its own wire source.)"""
    if is_float8tensor(t):
        return _per_tensor_layout(t)[0].detach().view(_float8_dtype(t))
    return t.detach()


def _wire_dtypes(c: "_Columns") -> List[Optional[torch.dtype]]:
    """Each leaf's dtype on the wire: its dtype, or an FP8 tensor's float8 format."""
    return [f[0] if f else d for d, f in zip(c.dtypes, c.fp8)]


def _tensor_meta(t: torch.Tensor) -> _TensorMeta:
    """A non-plain tensor's metadata (plain tensors are described inline, see
    :meth:`_Columns.describe`)."""
    fp8 = None
    if is_float8tensor(t):
        data, scale_inv = _per_tensor_layout(t)
        fp8 = (_float8_dtype(t), float(scale_inv.item()))
        nbytes = data.numel()
    else:
        nbytes = t.numel() * t.element_size()
    return _TensorMeta(tuple(t.shape), t.dtype, nbytes, bool(t.requires_grad), fp8)


def _encode_meta(meta: _Meta) -> bytes:
    """The metadata as a pickle of plain columns (fast for thousands of leaves; dataclasses
    and pytree's JSON serialization are ten times slower to encode and decode)."""
    c = meta.columns
    return pickle.dumps((_pickle_treespec(meta.treespec), c.kinds, c.shapes, c.dtypes, c.nbytes, c.requires_grad,
                         c.fp8, c.values, meta.receivers, meta.bucket_bytes, meta.alone_bytes),
                        protocol=pickle.HIGHEST_PROTOCOL)


def _pickle_treespec(treespec: Any) -> bytes:
    return pickle.dumps(treespec, protocol=pickle.HIGHEST_PROTOCOL)


def _decode_meta(payload: bytes) -> _Meta:
    with warnings.catch_warnings():  # pickled TreeSpecs warn about a deprecated leaf class
        warnings.simplefilter("ignore", FutureWarning)
        spec_pickle, *fields, receivers, bucket_bytes, alone_bytes = pickle.loads(payload)
        treespec = pickle.loads(spec_pickle)
    return _Meta(treespec, _Columns(*fields), receivers, bucket_bytes, alone_bytes, spec_pickle)


_ALIGN = 64  # where each dtype's run starts in a bucket


def _plan_messages(c: _Columns, bucket_bytes: int, alone_bytes: int) -> Tuple[List[Tuple[int, List[int]]], List[int]]:
    """Group tensor leaves into data messages: ``(messages, offsets)``, each message
    ``(nbytes, leaves)`` and each leaf's offset in its message. Every tensor of
    ``alone_bytes`` or half a bucket travels alone (in leaf order); the smaller ones are
    packed into buckets of up to ``bucket_bytes``, spread evenly through the large ones
    (so the sender packs and the receiver unpacks a bucket while large tensors stream).
    In a bucket, the small tensors are grouped by dtype: each dtype's run starts
    ``_ALIGN``-aligned and its tensors follow each other without gaps, so a run is copied
    in and out as one typed tensor (see :func:`_segments`). A function of the columns and
    the two sizes only: both sides compute the same plan."""
    bucket, alone = bucket_bytes, min(alone_bytes, bucket_bytes // 2)
    offsets = [0] * len(c.nbytes)
    sizes = [(i, n) for i, n in enumerate(c.nbytes) if n]
    wire = _wire_dtypes(c)
    runs: Dict[Any, int] = {}  # each dtype's place among the buckets' runs: the order of first appearance
    small = sorted(((i, n) for i, n in sizes if n < alone), key=lambda p: runs.setdefault(wire[p[0]], len(runs)))
    buckets: List[Tuple[int, List[int]]] = []
    size, members = 0, []
    for i, n in small:
        start = size if members and wire[members[-1]] == wire[i] else -(-size // _ALIGN) * _ALIGN
        if members and start + n > bucket:
            buckets.append((size, members))
            size, members, start = 0, [], 0
        offsets[i] = start
        members.append(i)
        size = start + n
    if members:
        buckets.append((size, members))
    large = [(n, [i]) for i, n in sizes if n >= alone]
    # bucket k goes after the large message that completes (k + 1) / (len(buckets) + 1) of the large bytes
    total, done, k = sum(n for n, _ in large), 0, 0
    messages: List[Tuple[int, List[int]]] = []
    for message in large:
        messages.append(message)
        done += message[0]
        while k < len(buckets) and done * (len(buckets) + 1) >= total * (k + 1):
            messages.append(buckets[k])
            k += 1
    messages += buckets[k:]
    return messages, offsets


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
            columns, sources = _Columns.describe(values)
            meta = _Meta(treespec, columns, len(dsts))
            payload = _encode_meta(meta)  # once, for every receiver
        except _LeafError as e:
            self._fail_before_header(dsts, f"leaf {_paths(state_dict)[e.index]} cannot be sent: {e}", e)
        except Exception as e:  # noqa: BLE001 - an unpicklable leaf
            self._fail_before_header(dsts, f"the state cannot be serialized: {e}", e)

        header = torch.tensor([_MAGIC, PROTOCOL_VERSION, len(payload)], dtype=torch.int64, device=self._device)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self._device)
        works = [(w, d) for d in dsts for w in (self._send(header, d, _TAG_HEADER), self._send(body, d, _TAG_META))]
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
        logger.info("Peer transfer: sent %d leaves, %.1f MiB in %d messages to ranks %s in %.3f s",
                    len(values), total / 2**20, len(meta.messages), dsts, time.perf_counter() - start)

    def _fail_before_header(self, dsts: List[int], reason: str, error: Exception) -> NoReturn:
        """Tell every receiver that this state cannot be sent (a header with a negative
        length, the reason in place of the metadata), so each raises at once instead of
        waiting for its timeout; then raise here."""
        body = reason.encode()
        header = torch.tensor([_MAGIC, PROTOCOL_VERSION, -len(body)], dtype=torch.int64, device=self._device)
        payload = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(self._device)
        with contextlib.suppress(CheckpointingException):  # a dead receiver: the reason still raises here
            works = [(w, d) for d in dsts
                     for w in (self._send(header, d, _TAG_HEADER), self._send(payload, d, _TAG_META))]
            for work, d in works:
                self._wait([work], "sending the error", d)
        raise CheckpointingException(f"Peer transfer: {reason}") from error

    def _send_data(self, dsts: List[int], meta: _Meta, sources: List[Optional[torch.Tensor]]) -> None:
        """Send every data message to every destination. Tensors travelling alone go from
        their own memory when it is contiguous and on the transport's device (all posted
        at once, so they stream back to back; copies of the others are bounded to two
        buckets' worth in flight). Buckets are packed into two reused buffers, one
        ``torch.cat`` per dtype run."""
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
            while copied > 2 * BUCKET_BYTES and len(copies) > 1:
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
        # prepared while the sender flattens its state and encodes the metadata
        own = None if self._state_dict is None else _OwnState(self._state_dict())
        header = torch.zeros(3, dtype=torch.int64, device=self._device)
        self._recv(header, src_rank, _TAG_HEADER, "receiving the header")
        magic, version, length = (int(v) for v in header.tolist())
        if magic != _MAGIC or version != PROTOCOL_VERSION:
            raise CheckpointingException(
                f"Peer transfer: rank {src_rank} speaks another protocol (magic {magic:#x}, version {version}; "
                f"expected {_MAGIC:#x}, {PROTOCOL_VERSION})")
        if length < 0:  # the sender cannot send its state: the reason follows
            reason = self._recv_body(src_rank, -length, _TAG_META, "receiving the sender's error")
            raise CheckpointingException(f"Peer transfer from rank {src_rank} failed on the sender: {reason}")
        body = torch.empty(length, dtype=torch.uint8, device=self._device)
        self._recv(body, src_rank, _TAG_META, "receiving the metadata")
        meta = _decode_meta(bytes(body.cpu().numpy()))

        error = None
        try:
            dests = self._destinations(meta, own)
        except CheckpointingException as e:
            error = str(e)
        self._send_text([src_rank], int(error is not None), error or "", (_TAG_ACK, _TAG_ACK_TEXT),
                        "answering the metadata check")
        if error is not None:
            raise CheckpointingException(f"Peer transfer from rank {src_rank} refused: {error}")
        meta.plan()  # the sender's plan, made here too
        if meta.receivers > 1:  # another receiver may refuse: the sender says whether to go on
            go = torch.zeros(2, dtype=torch.int64, device=self._device)
            self._recv(go, src_rank, _TAG_GO, "receiving the go-ahead")
            status, length = (int(v) for v in go.tolist())
            reason = self._recv_body(src_rank, length, _TAG_GO_TEXT, "receiving the go-ahead")
            if status:
                raise CheckpointingException(f"Peer transfer from rank {src_rank} aborted by the sender: {reason}")

        out = self._receive_data(meta, dests, src_rank, lambda results: _assemble(meta, results))
        total = sum(size for size, _ in meta.messages)
        logger.info("Peer transfer: received %d leaves, %.1f MiB in %d messages from rank %d in %.3f s",
                    len(meta.leaves), total / 2**20, len(meta.messages), src_rank, time.perf_counter() - start)
        return out

    def _destinations(self, meta: _Meta, own: Optional["_OwnState"]) -> List[Optional[torch.Tensor]]:
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
                elif tm.fp8 is not None and is_float8tensor(local) and _float8_dtype(local) != tm.fp8[0]:
                    mismatch = f"the sender's FP8 format is {tm.fp8[0]}, the receiver's {_float8_dtype(local)}"
            if mismatch is not None:
                raise CheckpointingException(f"leaf {_paths(own.state)[n]}: {mismatch}")
            dests.append(local)
        return dests

    def _receive_data(self, meta: _Meta, dests: List[Optional[torch.Tensor]], src: int,
                      assemble: Callable[[List[Optional[torch.Tensor]]], Any]) -> Any:
        """Receive every data message; returns ``assemble(tensor of each leaf)`` (``None``
        for values), computed while the last messages arrive unless FP8 leaves need their
        data first.

        A tensor travelling alone lands straight in its destination when that is
        contiguous; all those messages are posted at once. The others (buckets, and tensors
        that need a copy or a conversion) go through two reused buffers, each unpacked
        before it is posted again: one typed copy call per dtype run of a bucket."""
        c = meta.columns
        count, device, wire = len(c.kinds), self._device, meta.wire
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
                    results[i] = targets[i] = torch.empty(c.shapes[i], dtype=wire[i], device=device)

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

        what = "receiving tensor data"
        buffers = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]
        pending: List[Optional[Tuple[Any, int, torch.Tensor]]] = [None, None]  # (work, message, buffer) per buffer
        straight: List[Any] = []
        buffered = 0
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


class _OwnState:
    """A receiver's own state, flattened (while the sender encodes its metadata): the local
    tensor of every leaf, and the kinds, shapes and dtypes to compare with the sender's."""

    def __init__(self, state: Any):
        self.state = state
        self.values, self.spec = tree_flatten(state)
        self.kinds = [_kind(v) for v in self.values]
        self.locals = [_local_tensor(k, v) for k, v in zip(self.kinds, self.values)]
        try:
            self.spec_pickle: Optional[bytes] = _pickle_treespec(self.spec)
        except Exception:  # noqa: BLE001 - e.g. a local class in the structure: compared as objects
            self.spec_pickle = None
        self.shapes = [None if t is None else tuple(t.shape) for t in self.locals]
        self.dtypes = [None if t is None else t.dtype for t in self.locals]


def _is_on(t: torch.Tensor, device: torch.device) -> bool:
    return t.is_cpu if device.type == "cpu" else t.device == device


def _paths(state: Any) -> List[str]:
    """The key path of every leaf of ``state`` (for messages)."""
    return [keystr(p) for p, _ in tree_flatten_with_path(state)[0]]


def _alone(c: _Columns, size: int, members: List[int]) -> bool:
    """Whether a data message carries exactly one tensor's bytes (no bucket around them)."""
    return len(members) == 1 and c.nbytes[members[0]] == size


def _segments(meta: _Meta, members: List[int]) -> List[Tuple[torch.dtype, int, int, List[int]]]:
    """A data message's runs: ``(dtype, start, end, leaves)`` for each stretch of bytes
    that holds consecutive leaves of one wire dtype without gaps (a tensor travelling
    alone is one run)."""
    runs: List[Tuple[torch.dtype, int, int, List[int]]] = []
    dtype, start, end, leaves = None, 0, -1, []
    offsets, nbytes, wire = meta.offsets, meta.columns.nbytes, meta.wire
    for i in members:
        offset = offsets[i]
        if offset != end or wire[i] != dtype:
            if leaves:
                runs.append((dtype, start, end, leaves))
            dtype, start, end, leaves = wire[i], offset, offset, []
        leaves.append(i)
        end += nbytes[i]
    if leaves:
        runs.append((dtype, start, end, leaves))
    return runs


def _pieces(run: torch.Tensor, leaves: List[int], c: _Columns) -> List[torch.Tensor]:
    """Each leaf's values in ``run`` (a bucket's bytes of one dtype run, viewed as that
    dtype), shaped as the leaf (one ``torch.split`` for the run; only the pieces of
    tensors that are not 1-D get a second view)."""
    size = run.element_size()
    pieces = torch.split(run, [c.nbytes[i] // size for i in leaves])
    return [p if len(c.shapes[i]) == 1 else p.view(c.shapes[i]) for i, p in zip(leaves, pieces)]


def _pack(bucket: torch.Tensor, runs: List[Tuple[torch.dtype, int, int, List[int]]],
          sources: List[Optional[torch.Tensor]]) -> None:
    """Copy the wire sources of every run's leaves into ``bucket``: one ``torch.cat`` per
    run (the alignment gaps are zeroed)."""
    pos = 0
    with torch.no_grad():
        for dtype, start, end, leaves in runs:
            if start > pos:
                bucket[pos:start].zero_()
            pos = end
            pieces = [sources[i] for i in leaves]
            run = bucket[start:end].view(dtype)
            try:
                torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in pieces], out=run)
            except RuntimeError:  # e.g. pieces on another device: one copy each
                for piece, t in zip(torch.split(run, [t.numel() for t in pieces]), pieces):
                    piece.copy_(t.reshape(-1))


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
    """The tensor (wire dtype, leaf shape) that a leaf's wire values can be copied into
    as they are, or ``None`` when the destination needs a conversion (FP8 values into a
    plain high-precision tensor, plain values into an FP8 tensor)."""
    if tm.fp8 is None:
        return None if is_float8tensor(dest) else dest.detach()
    if is_float8tensor(dest):
        return _per_tensor_layout(dest)[0].detach().view(tm.fp8[0])
    return dest.detach() if dest.dtype == tm.fp8[0] else None


def _convert(values: torch.Tensor, tm: _TensorMeta, dest: torch.Tensor) -> None:
    """Put a leaf's wire values into a destination of another kind: plain values into an
    FP8 tensor (quantized with its own scale), FP8 values into a plain tensor
    (dequantized with the sender's scale)."""
    if tm.fp8 is None:
        fill_float8_(dest, values)
    else:
        dest.detach().copy_((values.float() * tm.fp8[1]).to(tm.dtype))


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
