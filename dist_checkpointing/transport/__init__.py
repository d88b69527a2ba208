"""Live peer-to-peer transfer of training state over a process group, without storage.

When a data-parallel replica dies, its replacement can fetch the current state from a
healthy replica: :class:`PGTransport` sends any nested state (dicts, lists, tuples of
tensors of any dtype, ``ShardedTensor`` / ``ShardedObject`` leaves, DTensors, other
picklable values) from one rank to one or more others; :func:`recover_from_peer` wraps it
for a trainer.

Protocol, between the sender and each receiver (point-to-point messages of the group):

1. a first message of a fixed size (``wire.HEAD_BYTES``, posted by every receiver before
   anything else): magic, version, metadata length, and the metadata when it fits (else it
   follows) — the structure and, one column per field, every leaf's kind, shape, dtype
   and size, and the sender's bucket sizes — pickled once for all receivers (each side
   plans the data messages from it: the plan is not sent). A sender that cannot describe its state (a leaf it cannot send,
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
   entry). Two bucket buffers per side are reused, so memory stays bounded
   whatever the state size.

A view travels as its own elements only (never its whole base storage); non-contiguous
tensors arrive with the right values. Every wait is bounded by the transport's timeout: a
peer that dies or stops answering raises :class:`CheckpointingException` on the surviving
side. (After a timeout the process group may be unusable: recreate it.)

Accelerator tensors over a host-memory wire (CUDA state over gloo): with ``HOST_STAGING``
on they travel through pinned host buffers, packed and unpacked on the device, the copies
pipelined with the messages (:mod:`.host_bounce`); off (the default until measured on a GPU),
each is copied to or from pageable host memory where it is packed or sent.

The package: :mod:`.leaves` (describing leaves), :mod:`.plan` (the data messages),
:mod:`.wire` (header, tags, tuning sizes, the metadata message), :mod:`.copies` (packing
and unpacking tensor bytes), :mod:`.own_state` (a receiver's own state), :mod:`.host_bounce` (device tensors through
host buffers),
:mod:`.protocol` (:class:`PGTransport`,
:func:`recover_from_peer`). The tuning settings live in :mod:`.wire`, where they are read
(``dist_checkpointing.transport.wire.BUCKET_BYTES = ...``, also ``ALONE_BYTES``,
``HOST_STAGING``, ``STAGING_BYTES``).

Why so: on gloo a message that arrives before its receive is posted can wait far longer
than its transfer (~10-15 ms against ~0.1 ms measured here), so a receiver posts every
receive it can early (the first message has a fixed size; its check is answered only once
it has planned and prepared everything, right before it posts the data receives). Why
64 KiB for ``ALONE_BYTES``: each message costs ~20-40 us of CPU per side and packing
~0.17 ms per MiB, and 32-128 KiB give the same time within the noise
(``bench_transport.py --sweep-alone-kib``). With ``HOST_STAGING`` off, the sender packs a
bucket on the host with one synchronous copy per device tensor and copies a tensor alone
with ``.to("cpu")``; the receiver receives every message into one of two host buffers and
unpacks it with one host-to-device copy per tensor (measured on an H200: 0.9x PyTorch's
``PGTransport``).
"""

from . import wire
from .leaves import _Columns, _LeafColumns
from .plan import _plan_messages
from .protocol import PGTransport, recover_from_peer
from .wire import _TAG_DATA, _TAG_GO, _TAG_HEADER, PROTOCOL_VERSION, _decode_meta, _encode_meta, _Meta, _segments

__all__ = ["PROTOCOL_VERSION", "PGTransport", "recover_from_peer", "wire"]
