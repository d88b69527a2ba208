"""``.metadata`` written straight from a :class:`.location_table.LocationTable`: the pickle
opcode stream that unpickles (with the stock ``pickle``, DCP's ``FileSystemReader`` or our
safe reader) to the ``Metadata`` that :func:`.metadata.build_metadata` builds, made from
columns without a Python object per location (``docs/format.md`` §4).

The stream: protocol 4; first the classes, field names, data file names and keys, each
memoized and popped (memo indices 0, 1, ...); then ``Metadata``'s state with every
per-location record (``storage_data`` entries, chunks, item checksums) a fixed-width run of
opcodes referring to the memo (:mod:`.byte_rows`), and the few per-key and per-save values
(tensor properties, global shapes, ``mcore_data``, ``storage_meta``) pickled normally
without memo. All of it after the protocol header is one frame, so that an unpickler reading
from a stream reads it in one piece, not opcode by opcode.
"""

from __future__ import annotations

import io
import pickle
from typing import Dict, List

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...integrity.checksums import ALGORITHM, SCOPE_RECORD
from . import byte_rows as br
from .format import DCP_VERSION
from .location_table import ChecksumColumns, LocationTable

_CLASSES = (torch.Size, MetadataIndex, _StorageInfo, ChunkStorageMetadata, TensorStorageMetadata, BytesStorageMetadata)
_NAMES = ("fqn", "index", "offset", "relative_path", "length", "offsets", "sizes", "properties", "size", "chunks")
_MEMOIZE_POP = b"\x94" + b"0"


def fragment(obj: object) -> bytes:
    """``obj`` pickled without memo, protocol header or ``STOP``: a value to embed."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=3)
    pickler.fast = True  # no memo: indices of its own would clash with the stream's
    pickler.dump(obj)
    return buf.getvalue()[2:-1]


def _ref(i: int) -> bytes:
    return b"j" + int(i).to_bytes(4, "little")


class _Memo:
    """The memo prefix: every class, field name, file name and key, memoized in order."""

    def __init__(self, table: LocationTable, files: List[str]):
        parts: List[bytes] = []
        for obj in _CLASSES + _NAMES:
            parts.append(fragment(obj) + _MEMOIZE_POP)
        self.base = {obj: i for i, obj in enumerate(_CLASSES + _NAMES)}
        self.files = len(parts)
        for name in files:
            parts.append(_unicode(name) + _MEMOIZE_POP)
        self.keys = len(parts)
        for key in table.keys:
            parts.append(_unicode(key) + _MEMOIZE_POP)
        self.prefix = b"".join(parts)

    def __getitem__(self, obj: object) -> bytes:
        return _ref(self.base[obj])


def _unicode(s: str) -> bytes:
    data = s.encode("utf-8", "surrogatepass")
    return b"X" + len(data).to_bytes(4, "little") + data


def _size(m: _Memo, matrix: np.ndarray) -> list:
    return [m[torch.Size], br.pickled_tuple(matrix), b"\x85R"]


def _chunks(table: LocationTable, m: _Memo) -> List[np.ndarray]:
    """Every stored chunk as a pickled ``ChunkStorageMetadata``: per group of
    ``table.chunk_groups`` a matrix with one chunk per row."""
    return [br.records([m[ChunkStorageMetadata] + b")\x81}(" + m["offsets"], _size(m, table.column(rows, d, 1)),
                        m["sizes"], _size(m, table.column(rows, d, 2)), b"ub"], len(rows))
            for d, rows in table.chunk_groups]


def _storage_data(table: LocationTable, m: _Memo, file_memo: np.ndarray) -> List[bytes]:
    """Each stored location as ``MetadataIndex: _StorageInfo`` ``SETITEM``: objects, then
    tensors by number of dimensions, each in the order received (``file_memo``: the memo
    index of each of ``table.files``)."""
    stored = np.flatnonzero(table.stored)
    out = []
    tensor = table.kind[stored] == 1
    for d in [None] + list(np.unique(table.ndim[stored[tensor]])):
        rows = stored[~tensor] if d is None else stored[tensor & (table.ndim[stored] == d)]
        if not len(rows):
            continue
        index = [m[MetadataIndex] + b")\x81}(" + m["fqn"], br.memo_ref(m.keys + table.key[rows]), m["index"] + b"N"]
        if d is not None:
            index += [m["offset"], _size(m, table.column(rows, d, 1))]
        out.append(br.records(index + [
            b"ub" + m[_StorageInfo] + b")\x81}(" + m["relative_path"],
            br.memo_ref(file_memo[table.file[rows]]), m["offset"], br.pickled_int(table.offset[rows]),
            m["length"], br.pickled_int(table.length[rows]), b"ubs"], len(rows)).tobytes())
    return out


def _checksum_items(checks: ChecksumColumns, file_memo: np.ndarray) -> bytes:
    """``(file, offset): checksum`` ``SETITEM`` of each recorded item checksum, in order."""
    rows = np.flatnonzero(checks.has)
    n = len(rows)
    return br.records([br.memo_ref(file_memo[checks.file[rows]]), br.pickled_int(checks.offset[rows]),
                       b"\x86", br.pickled_int(checks.cs[rows]), b"s"], n).tobytes()


def _rows(groups: List[np.ndarray], span: np.ndarray) -> bytes:
    """The records ``span`` (group, first row, end row) of ``groups``, as bytes."""
    g, lo, hi = (int(x) for x in span)
    return groups[g][lo:hi].tobytes()


def metadata_bytes(table: LocationTable, checks: ChecksumColumns, storage_meta: StorageMeta) -> bytes:
    """The pickled ``Metadata`` of ``table`` with item checksums ``checks`` (of this save) and
    ``storage_meta``: what ``pickle.dumps(build_metadata(...))`` unpickles to."""
    files = list(dict.fromkeys(table.files + checks.files))
    file_ids: Dict[str, int] = {f: i for i, f in enumerate(files)}
    m = _Memo(table, files)
    table_files = m.files + np.array([file_ids[f] for f in table.files], dtype=np.int64)
    check_files = m.files + np.array([file_ids[f] for f in checks.files], dtype=np.int64)
    chunks = _chunks(table, m)
    out: List[bytes] = [m.prefix, fragment(Metadata), b")\x81}(", fragment("state_dict_metadata"), b"}"]
    properties: Dict[str, bytes] = {}
    mcore = {}
    for k, (name, kind, dtype, shape, orig) in enumerate(table.key_records()):
        out.append(_ref(m.keys + k))
        if not kind:
            out.append(m[BytesStorageMetadata] + b")\x81s")
            continue
        if dtype not in properties:
            properties[dtype] = fragment(TensorProperties(dtype=getattr(torch, dtype[len("torch."):])))
        out += [m[TensorStorageMetadata], b")\x81}(", m["properties"], properties[dtype], m["size"],
                fragment(torch.Size(shape)), m["chunks"], b"](",
                _rows(chunks, table.chunk_span[k]), b"eubs"]
        mcore[name] = {"nd_reformulated_orig_global_shape": orig} if orig is not None else {}
    del chunks
    out += [fragment("planner_data"), b"N", fragment("storage_data"), b"}", *_storage_data(table, m, table_files)]
    out += [fragment("storage_meta"), fragment(storage_meta), fragment("version"), fragment(DCP_VERSION),
            fragment("mcore_data"), fragment(mcore), fragment("checksums"),
            b"}", fragment("algorithm"), fragment(ALGORITHM), b"s", fragment("scope"), fragment(SCOPE_RECORD), b"s",
            fragment("items"), b"}", _checksum_items(checks, check_files), b"s", b"ub."]
    frame = b"\x95" + sum(len(part) for part in out).to_bytes(8, "little")
    return b"".join([b"\x80\x04", frame] + out)
