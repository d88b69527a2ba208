"""Bytes of many similar records built from columns at once: each field of a record is an
``(n, width)`` ``uint8`` matrix (a constant, a pickled integer of fixed width, a decimal
number padded with spaces, a name from a table), the records are the fields side by side,
and records of different widths are interleaved into one buffer in a given order. Used to
write ``.metadata`` (:mod:`.metadata_writer`) and ``.metadata.index`` (:mod:`.key_index`)
without a Python object per location.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

_BATCH = 1 << 15  # records placed per step of :func:`interleave` (bounds its index arrays)


def const(data: bytes, n: int) -> np.ndarray:
    """``data`` in each of ``n`` records."""
    return np.broadcast_to(np.frombuffer(data, dtype=np.uint8), (n, len(data)))


def records(fields: Sequence[np.ndarray], n: int) -> np.ndarray:
    """The ``(n, width)`` records made of ``fields`` side by side."""
    return np.hstack(list(fields)) if fields else np.zeros((n, 0), dtype=np.uint8)


def _le(values: np.ndarray, dtype: str) -> np.ndarray:
    v = np.ascontiguousarray(values.astype(dtype))
    return v.view(np.uint8).reshape(len(values), -1)


def pickled_int(values: np.ndarray) -> np.ndarray:
    """Each integer as a pickle opcode of one fixed width for the column: ``BININT1``,
    ``BININT2``, ``BININT`` or ``LONG1`` (8 or, for ``uint64`` values of 2**63 and more, 9
    bytes)."""
    n = len(values)
    lo = int(values.min()) if n else 0
    hi = int(values.max()) if n else 0
    if lo >= 0 and hi < 1 << 8:
        return np.hstack([const(b"K", n), _le(values, "<u1")])
    if lo >= 0 and hi < 1 << 16:
        return np.hstack([const(b"M", n), _le(values, "<u2")])
    if lo >= -(1 << 31) and hi < 1 << 31:
        return np.hstack([const(b"J", n), _le(values, "<i4")])
    if hi < 1 << 63:
        return np.hstack([const(b"\x8a\x08", n), _le(values, "<i8")])
    return np.hstack([const(b"\x8a\x09", n), _le(values, "<u8"), const(b"\x00", n)])


def memo_ref(ids: np.ndarray) -> np.ndarray:
    """``LONG_BINGET`` of each memo index."""
    return np.hstack([const(b"j", len(ids)), _le(ids, "<u4")])


def pickled_tuple(matrix: np.ndarray) -> np.ndarray:
    """Each row of an ``(n, d)`` integer matrix as a pickled tuple."""
    n, d = matrix.shape
    ints = [pickled_int(matrix[:, i]) for i in range(d)]
    if d == 0:
        return const(b")", n)
    if d <= 3:
        return records(ints + [const(b"\x85\x86\x87"[d - 1:d], n)], n)
    return records([const(b"(", n)] + ints + [const(b"t", n)], n)


def decimal(values: np.ndarray, nulls: np.ndarray = None) -> np.ndarray:
    """Each non-negative integer in decimal, right-aligned in one width padded with spaces
    (JSON whitespace); ``null`` where ``nulls`` is true."""
    v = values.astype(np.uint64)
    n = len(v)
    live = v if nulls is None else v[~nulls]
    width = max(len(str(int(live.max()))) if len(live) else 1, 4 if nulls is not None and nulls.any() else 1)
    out = np.empty((n, width), dtype=np.uint8)
    rest = v.copy()
    for i in range(width - 1, -1, -1):
        out[:, i] = 48 + (rest % np.uint64(10)).astype(np.uint8)
        rest //= np.uint64(10)
    for i in range(width - 1):  # leading zeros: spaces
        out[v < np.uint64(10 ** (width - 1 - i)), i] = 32
    if nulls is not None and nulls.any():
        out[nulls] = np.frombuffer(b"null".rjust(width), dtype=np.uint8)
    return out


def decimal_list(matrix: np.ndarray) -> np.ndarray:
    """Each row of an ``(n, d)`` non-negative integer matrix as a JSON list."""
    n, d = matrix.shape
    parts: List[np.ndarray] = [const(b"[", n)]
    for i in range(d):
        parts += [decimal(matrix[:, i])] + ([const(b",", n)] if i < d - 1 else [])
    return records(parts + [const(b"]", n)], n)


def from_table(table: List[bytes], ids: np.ndarray, pad: bytes = b" ") -> np.ndarray:
    """Each record's entry of ``table`` (byte strings), left-aligned in one width padded with
    ``pad`` (a byte that means nothing where it is used: JSON whitespace)."""
    width = max((len(t) for t in table), default=0)
    fixed = np.array([t.ljust(width, pad) for t in table], dtype=f"S{max(width, 1)}")
    return fixed[ids].view(np.uint8).reshape(len(ids), -1)[:, :width]


def interleave(groups: Sequence[Tuple[np.ndarray, np.ndarray]], n: int) -> Tuple[np.ndarray, np.ndarray]:
    """One buffer of ``n`` records, record ``i`` at position ``i``, from ``groups`` of
    ``(positions, records)``; also where each record begins (``n + 1`` offsets)."""
    width = np.zeros(n, dtype=np.int64)
    for pos, rec in groups:
        width[pos] = rec.shape[1]
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(width, out=starts[1:])
    out = np.empty(int(starts[-1]), dtype=np.uint8)
    for pos, rec in groups:
        span = np.arange(rec.shape[1])
        for b in range(0, len(pos), _BATCH):
            out[starts[pos[b:b + _BATCH]][:, None] + span] = rec[b:b + _BATCH]
    return out, starts
