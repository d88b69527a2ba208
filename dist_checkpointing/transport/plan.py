"""The data messages of a transfer, planned from the metadata alone (both sides compute
the same plan, so it is never sent): which leaves each message carries, at which offsets."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from .leaves import _Columns, _wire_dtypes


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

def _alone(c: _Columns, size: int, members: List[int]) -> bool:
    """Whether a data message carries exactly one tensor's bytes (no bucket around them)."""
    return len(members) == 1 and c.nbytes[members[0]] == size
