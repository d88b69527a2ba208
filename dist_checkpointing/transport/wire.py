"""The transport's wire format: the header constants and message tags, the tuning sizes
(``BUCKET_BYTES``, ``ALONE_BYTES``, and ``HOST_STAGING`` / ``STAGING_BYTES`` for
accelerator tensors over a host-memory wire), and the metadata message (:class:`_Meta`), its
encoding, and the byte runs of a planned data message.

Owns: the wire format: magic, protocol version, message tags, the tuning sizes
``BUCKET_BYTES`` / ``ALONE_BYTES``, the fixed-size first message (``HEAD_BYTES``, ``_head``
/ ``_read_head``), the metadata message (``_Meta``) and its encoding, a message's dtype
runs.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree

from ..pickling.trusted import loads_trusted
from .leaves import _Columns, _Leaf, _LeafColumns, _wire_dtypes
from .plan import _plan_messages

PROTOCOL_VERSION = 3
BUCKET_BYTES = 16 << 20
ALONE_BYTES = 64 << 10  # tensors this large (or half a bucket) travel alone
# Accelerator tensors over a host-memory wire (CUDA state over gloo): False: each tensor is
# copied to (or from) pageable host memory where it is packed or sent, synchronously (the
# path measured first on a GPU); True: pipelined through pinned host buffers, buckets packed
# on the device (:mod:`.host_bounce`). Unmeasured on a GPU: to be chosen by bench_gpu_transport.py.
# (Published setting names, kept: these are host bounce buffers, not the staging arenas of
# async saves in runtime.arenas.)
HOST_STAGING = False
STAGING_BYTES = 64 << 20  # host bounce buffers in flight per side (at least two messages)
HEAD_BYTES = 256 << 10  # the first message's fixed size: the header and, when it fits, the metadata
_HEADER_BYTES = 24  # magic, version, length: three int64 at the start of the first message
_MAGIC = 0x44435054
_TAG_HEADER, _TAG_META, _TAG_ACK, _TAG_ACK_TEXT, _TAG_GO, _TAG_GO_TEXT, _TAG_DATA = range(1, 8)


def _head(length: int, payload: bytes) -> Tuple[torch.Tensor, bool]:
    """The first message of a transfer (``HEAD_BYTES``, a fixed size so that a receiver
    posts it before it knows anything): magic, protocol version, ``length`` (the
    metadata's, or minus the sender's error's), then ``payload`` when it fits; and
    whether it fits (if not, it follows as its own message)."""
    head = torch.zeros(HEAD_BYTES, dtype=torch.uint8)
    head[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor([_MAGIC, PROTOCOL_VERSION, length]))
    inline = len(payload) <= HEAD_BYTES - _HEADER_BYTES
    if inline and payload:
        head[_HEADER_BYTES:_HEADER_BYTES + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return head, inline


def _read_head(head: torch.Tensor) -> Tuple[int, int, int, Optional[bytes]]:
    """``(magic, version, length, payload)`` of a received first message; ``payload`` is
    ``None`` when it did not fit (or the peer speaks another version)."""
    magic, version, length = (int(v) for v in head[:_HEADER_BYTES].view(torch.int64).tolist())
    n = abs(length)
    if magic != _MAGIC or version != PROTOCOL_VERSION or n > HEAD_BYTES - _HEADER_BYTES:
        return magic, version, length, None
    return magic, version, length, bytes(head[_HEADER_BYTES:_HEADER_BYTES + n].numpy())


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

def _encode_meta(meta: _Meta) -> bytes:
    """The metadata as a pickle of plain columns (fast for thousands of leaves; dataclasses
    and pytree's JSON serialization are ten times slower to encode and decode)."""
    c = meta.columns
    return pickle.dumps((_pickle_treespec(meta.treespec), c.kinds, c.shapes, c.dtypes, c.nbytes, c.requires_grad,
                         c.fp8, c.values, meta.receivers, meta.bucket_bytes, meta.alone_bytes),
                        protocol=pickle.HIGHEST_PROTOCOL)


# torch >= 2.10 deprecates the class of pytree's shared leaf spec: creating one (as
# unpickling it does) warns. The leaf travels as a call of ``treespec_leaf()`` instead, so
# decoding needs no change of the process's warning filters (which other threads share).
_LEAF_SPEC_TYPE = type(getattr(_pytree, "_LEAF_SPEC", None))
_TREESPEC_LEAF = getattr(_pytree, "treespec_leaf", None)


class _SpecPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is _LEAF_SPEC_TYPE and _TREESPEC_LEAF is not None:
            return _TREESPEC_LEAF, ()
        return NotImplemented


def _pickle_treespec(treespec: Any) -> bytes:
    buf = io.BytesIO()
    _SpecPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(treespec)
    return buf.getvalue()


def _decode_meta(payload: bytes) -> _Meta:
    spec_pickle, *fields, receivers, bucket_bytes, alone_bytes = loads_trusted(payload)  # from the sending rank
    treespec = loads_trusted(spec_pickle)
    return _Meta(treespec, _Columns(*fields), receivers, bucket_bytes, alone_bytes, spec_pickle)

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
