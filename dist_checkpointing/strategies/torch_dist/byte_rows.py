"""Bytes of many similar records built from columns at once: each field of a record is an
``(n, width)`` ``uint8`` matrix (a constant, a pickled integer of fixed width, a decimal
number padded with spaces, a name from a table), and the records are the fields side by
side, one record per row. Used to write ``.metadata`` (:mod:`.metadata_writer`) and
``.metadata.index`` (:mod:`.key_index`) without a Python object per location.
"""

from __future__ import annotations

from typing import List, Sequence, Union

import numpy as np

Field = Union[bytes, np.ndarray, Sequence["Field"]]


def records(fields: Sequence[Field], n: int) -> np.ndarray:
    """The ``(n, width)`` records made of ``fields`` side by side: constants (``bytes``),
    ``(n, w)`` matrices, or sequences of fields (flattened; one copy of each byte)."""
    flat: List[Union[bytes, np.ndarray]] = []

    def add(field: Field) -> None:
        if isinstance(field, bytes):
            if flat and isinstance(flat[-1], bytes):
                flat[-1] += field
            else:
                flat.append(field)
        elif isinstance(field, np.ndarray):
            flat.append(field)
        else:
            for f in field:
                add(f)

    add(fields)
    widths = [len(f) if isinstance(f, bytes) else f.shape[1] for f in flat]
    out = np.empty((n, sum(widths)), dtype=np.uint8)
    at = 0
    for f, w in zip(flat, widths):
        out[:, at:at + w] = np.frombuffer(f, dtype=np.uint8) if isinstance(f, bytes) else f
        at += w
    return out


def _le(values: np.ndarray, dtype: str) -> np.ndarray:
    v = np.ascontiguousarray(values.astype(dtype))
    return v.view(np.uint8).reshape(len(values), v.itemsize)


def pickled_int(values: np.ndarray) -> List[Field]:
    """Each integer as a pickle opcode of one fixed width for the column: ``BININT1``,
    ``BININT2``, ``BININT`` or ``LONG1`` (8 or, for ``uint64`` values of 2**63 and more, 9
    bytes)."""
    n = len(values)
    lo = int(values.min()) if n else 0
    hi = int(values.max()) if n else 0
    if lo >= 0 and hi < 1 << 8:
        return [b"K", _le(values, "<u1")]
    if lo >= 0 and hi < 1 << 16:
        return [b"M", _le(values, "<u2")]
    if lo >= -(1 << 31) and hi < 1 << 31:
        return [b"J", _le(values, "<i4")]
    if hi < 1 << 63:
        return [b"\x8a\x08", _le(values, "<i8")]
    return [b"\x8a\x09", _le(values, "<u8"), b"\x00"]


def memo_ref(ids: np.ndarray) -> List[Field]:
    """``LONG_BINGET`` of each memo index."""
    return [b"j", _le(ids, "<u4")]


def pickled_tuple(matrix: np.ndarray) -> List[Field]:
    """Each row of an ``(n, d)`` integer matrix as a pickled tuple."""
    d = matrix.shape[1]
    ints = [pickled_int(matrix[:, i]) for i in range(d)]
    if d == 0:
        return [b")"]
    if d <= 3:
        return ints + [b"\x85\x86\x87"[d - 1:d]]
    return [b"("] + ints + [b"t"]


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


def decimal_list(matrix: np.ndarray) -> List[Field]:
    """Each row of an ``(n, d)`` non-negative integer matrix as a JSON list."""
    parts: List[Field] = [b"["]
    for i in range(matrix.shape[1]):
        parts += [decimal(matrix[:, i])] + ([b","] if i < matrix.shape[1] - 1 else [])
    return parts + [b"]"]


def from_table(table: List[bytes], ids: np.ndarray, pad: bytes = b" ") -> np.ndarray:
    """Each record's entry of ``table`` (byte strings), left-aligned in one width padded with
    ``pad`` (a byte that means nothing where it is used: JSON whitespace)."""
    width = max((len(t) for t in table), default=0)
    fixed = np.array([t.ljust(width, pad) for t in table], dtype=f"S{max(width, 1)}")
    return fixed[ids].view(np.uint8).reshape(len(ids), fixed.itemsize)[:, :width]
