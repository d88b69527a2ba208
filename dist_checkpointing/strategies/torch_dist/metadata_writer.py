"""``.metadata`` written straight from a :class:`.location_table.LocationTable`: the pickle
opcode stream that unpickles (with the stock ``pickle``, DCP's ``FileSystemReader`` or our
safe reader) to the ``Metadata`` that :func:`.metadata.build_metadata` builds, made from
columns without a Python object per location (``docs/format.md`` §4).

The stream: protocol 4; first the classes, field names, data file names and keys, each
memoized and popped (memo indices 0, 1, ...); then ``Metadata``'s state with every
per-location record (``storage_data`` entries, chunks, item checksums) a fixed-width run of
opcodes referring to the memo (:mod:`.byte_rows`), and the few per-key and per-save values
(tensor properties, global shapes, ``mcore_data``, ``storage_meta``) pickled normally
without memo. No frames (optional in protocol 4).
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


def _size(m: _Memo, matrix: np.ndarray) -> np.ndarray:
    n = len(matrix)
    return br.records([br.const(m[torch.Size], n), br.pickled_tuple(matrix), br.const(b"\x85R", n)], n)


def _chunks(table: LocationTable, m: _Memo) -> tuple:
    """Every stored chunk as a pickled ``ChunkStorageMetadata`` (in ``table.chunk_order``),
    and where each begins in the buffer."""
    order = table.chunk_order
    groups = []
    for d in np.unique(table.ndim[order]):
        pos = np.flatnonzero(table.ndim[order] == d)
        rows = order[pos]
        n = len(rows)
        groups.append((pos, br.records([
            br.const(m[ChunkStorageMetadata] + b")\x81}(" + m["offsets"], n), _size(m, table.column(rows, d, 1)),
            br.const(m["sizes"], n), _size(m, table.column(rows, d, 2)), br.const(b"ub", n)], n)))
    return br.interleave(groups, len(order))


def _storage_data(table: LocationTable, m: _Memo, file_memo: np.ndarray) -> bytes:
    """Each stored location as ``MetadataIndex: _StorageInfo`` ``SETITEM``, in order
    (``file_memo``: the memo index of each of ``table.files``)."""
    stored = np.flatnonzero(table.stored)
    groups = []
    kinds = [(0, None)] + [(1, d) for d in np.unique(table.ndim[stored[table.kind[stored] == 1]])]
    for kind, d in kinds:
        pos = np.flatnonzero((table.kind[stored] == kind) & ((table.ndim[stored] == d) if kind else True))
        rows = stored[pos]
        n = len(rows)
        if not n:
            continue
        index = [br.const(m[MetadataIndex] + b")\x81}(" + m["fqn"], n), br.memo_ref(m.keys + table.key[rows]),
                 br.const(m["index"] + b"N", n)]
        if kind:
            index += [br.const(m["offset"], n), _size(m, table.column(rows, d, 1))]
        groups.append((pos, br.records(index + [
            br.const(b"ub" + m[_StorageInfo] + b")\x81}(" + m["relative_path"], n),
            br.memo_ref(file_memo[table.file[rows]]), br.const(m["offset"], n), br.pickled_int(table.offset[rows]),
            br.const(m["length"], n), br.pickled_int(table.length[rows]), br.const(b"ubs", n)], n)))
    return br.interleave(groups, len(stored))[0].tobytes()


def _checksum_items(checks: ChecksumColumns, file_memo: np.ndarray) -> bytes:
    """``(file, offset): checksum`` ``SETITEM`` of each recorded item checksum, in order."""
    rows = np.flatnonzero(checks.has)
    n = len(rows)
    return br.records([br.memo_ref(file_memo[checks.file[rows]]), br.pickled_int(checks.offset[rows]),
                       br.const(b"\x86", n), br.pickled_int(checks.cs[rows]), br.const(b"s", n)], n).tobytes()


def metadata_bytes(table: LocationTable, checks: ChecksumColumns, storage_meta: StorageMeta) -> bytes:
    """The pickled ``Metadata`` of ``table`` with item checksums ``checks`` (of this save) and
    ``storage_meta``: what ``pickle.dumps(build_metadata(...))`` unpickles to."""
    files = list(dict.fromkeys(table.files + checks.files))
    file_ids: Dict[str, int] = {f: i for i, f in enumerate(files)}
    m = _Memo(table, files)
    table_files = m.files + np.array([file_ids[f] for f in table.files], dtype=np.int64)
    check_files = m.files + np.array([file_ids[f] for f in checks.files], dtype=np.int64)
    chunks, starts = _chunks(table, m)
    chunk_keys = table.key[table.chunk_order]
    bounds = np.searchsorted(chunk_keys, np.arange(len(table.keys) + 1))
    out: List[bytes] = [b"\x80\x04", m.prefix, fragment(Metadata), b")\x81}(", fragment("state_dict_metadata"), b"}"]
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
                chunks[starts[bounds[k]]:starts[bounds[k + 1]]].tobytes(), b"eubs"]
        mcore[name] = {"nd_reformulated_orig_global_shape": orig} if orig is not None else {}
    del chunks
    out += [fragment("planner_data"), b"N", fragment("storage_data"), b"}", _storage_data(table, m, table_files)]
    out += [fragment("storage_meta"), fragment(storage_meta), fragment("version"), fragment(DCP_VERSION),
            fragment("mcore_data"), fragment(mcore), fragment("checksums"),
            b"}", fragment("algorithm"), fragment(ALGORITHM), b"s", fragment("scope"), fragment(SCOPE_RECORD), b"s",
            fragment("items"), b"}", _checksum_items(checks, check_files), b"s", b"ub."]
    return b"".join(out)
