"""The per-key index ``.metadata.index`` of a ``torch_dist`` checkpoint (``docs/format.md``
§ "The per-key index"): the contents of ``.metadata`` split into hash buckets of keys, so
that a reader fetches the records of some keys with a few ranged reads instead of
unpickling the whole ``.metadata``.

Layout: a 64-byte header (:data:`_HEADER`: magic, version, bucket count, key count, table
offset, the checksum of the ``.metadata`` it indexes, the checksum scope, the header's own
checksum), a table of ``(offset, length, checksum)`` per bucket, then the buckets: each a
JSON list ``[[key, record], ...]`` (records: :data:`Record`). No pickle: nothing in the file can run code. Every bucket is
verified against its table entry before it is parsed, its range checked against the
file's size before anything is read.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...pickling.dcp_types import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo as _StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
)

from ...core import CheckpointingException, key_problem
from ...integrity.checksums import ALGORITHM, SCOPE_DATA, SCOPE_RECORD, checksum, item_checksum_table, mismatch_error
from ...storage import RangeReader
from ..resharding import grid_chunks_overlapping, intersect
from . import byte_rows as br
from .location_table import ChecksumColumns, LocationTable

_MAGIC = b"DCKIDX\x00\x01"
_VERSION = 1
# magic, version, buckets, keys, table offset, checksum of .metadata, has checksums, scope; then its own checksum
_HEADER = struct.Struct("<8sIIQQQBB14x")
HEADER_BYTES = _HEADER.size + 8
_ENTRY = struct.Struct("<QQQ")  # a bucket's offset, length, checksum
_SCOPES = {None: 0, SCOPE_RECORD: 1, SCOPE_DATA: 2}
MAX_BUCKET_BYTES = 1 << 30  # a bucket claiming more is refused before it is read

# A key's record: ["t", dtype, size, orig shape or None, chunks] with chunks
# [offsets, sizes, file, offset, length, checksum or None]; ["b", file, offset, length, checksum or None]
Record = List[Any]


def bucket_of(key: str, n_buckets: int) -> int:
    """The bucket of ``key`` (a stable hash: the same in every process)."""
    return checksum(key.encode()) % n_buckets  # (keys are UTF-8 text: core.key_problem)


def reader_buckets(rank: int, world: int, n_buckets: int) -> range:
    """The contiguous range of buckets that ``rank`` of ``world`` reads."""
    return range(rank * n_buckets // world, (rank + 1) * n_buckets // world)


def reader_of(bucket: int, world: int, n_buckets: int) -> int:
    """The rank whose :func:`reader_buckets` hold ``bucket``."""
    rank = bucket * world // n_buckets
    while bucket >= (rank + 1) * n_buckets // world:
        rank += 1
    while bucket < rank * n_buckets // world:
        rank -= 1
    return rank


# ----------------------------------------------------------------------------- writing (rank 0)


def index_rows(metadata: Metadata) -> Dict[str, List[Any]]:
    """Each stored key's located pieces ``[offsets | None, sizes | None, file, offset, length,
    checksum | None]``, from a whole ``metadata`` (:func:`encode_index`'s input)."""
    table = getattr(metadata, "checksums", None)
    items = table["items"] if table is not None else {}
    sizes: Dict[Tuple[str, tuple], list] = {}
    for key, md in metadata.state_dict_metadata.items():
        for c in getattr(md, "chunks", ()):
            sizes[(key, tuple(c.offsets))] = list(c.sizes)
    rows: Dict[str, List[Any]] = {}
    for index, info in metadata.storage_data.items():
        offsets = tuple(index.offset) if index.offset is not None else None
        rows.setdefault(index.fqn, []).append(
            [offsets, sizes.get((index.fqn, offsets)), info.relative_path, info.offset, info.length,
             items.get((info.relative_path, info.offset))])
    return rows


def index_records(metadata: Metadata) -> Dict[str, Record]:
    """Each key's record as the index of ``metadata`` holds it (in ``.metadata``'s order;
    each key's chunks in offset order)."""
    rows = index_rows(metadata)
    mcore = getattr(metadata, "mcore_data", None) or {}
    records: Dict[str, Record] = {}
    for key, md in metadata.state_dict_metadata.items():
        located = rows.get(key, ())
        if isinstance(md, BytesStorageMetadata):
            records[key] = ["b"] + (located[0][2:] if located else [])
        else:
            orig = (mcore.get(key) or {}).get("nd_reformulated_orig_global_shape")
            records[key] = ["t", str(md.properties.dtype)[6:], list(md.size), list(orig) if orig is not None else None,
                            sorted(located, key=lambda c: tuple(c[0]))]
    return records


def encode_index(metadata: Metadata, metadata_checksum: int) -> bytes:
    """The index of ``metadata`` (whose pickled bytes have checksum ``metadata_checksum``)."""
    table = getattr(metadata, "checksums", None)
    records = {key: json.dumps([key, record], separators=(",", ":")).encode()
               for key, record in index_records(metadata).items()}
    scope = table.get("scope", SCOPE_DATA) if table is not None else None
    return _index_file(records, metadata_checksum, scope if table is not None else None, table is not None)


def encode_table_index(table: LocationTable, checks: ChecksumColumns, metadata_checksum: int) -> bytes:
    """The index of the ``.metadata`` streamed from ``table`` with this save's item checksums
    ``checks`` (one per location of ``table``, in its order): what :func:`encode_index` makes of
    that ``Metadata``, built from columns (each chunk record a fixed-width line of JSON,
    :mod:`.byte_rows`)."""
    nulls = ~checks.has
    file_json = [json.dumps(f).encode() for f in table.files]
    lines = [br.records([
        b"[", br.decimal_list(table.column(rows, d, 1)), b",", br.decimal_list(table.column(rows, d, 2)), b",",
        br.from_table(file_json, table.file[rows]), b",", br.decimal(table.offset[rows]), b",",
        br.decimal(table.length[rows]), b",", br.decimal(checks.cs[rows], nulls[rows]), b"],"], len(rows))
        for d, rows in table.chunk_groups]
    records: Dict[str, bytes] = {}
    for k, (key, kind, dtype, shape, orig) in enumerate(table.key_records()):
        if not kind:
            i = int(table.first_of[k])
            records[key] = json.dumps([key, ["b", table.files[table.file[i]], int(table.offset[i]),
                                             int(table.length[i]), int(checks.cs[i]) if checks.has[i] else None]],
                                      separators=(",", ":")).encode()
            continue
        head = json.dumps([key, ["t", dtype[6:], list(shape), list(orig) if orig is not None else None]],
                          separators=(",", ":")).encode()
        g, lo, hi = (int(x) for x in table.chunk_span[k])
        records[key] = b"".join([head[:-2], b",[", lines[g][lo:hi].tobytes()[:-1], b"]]]"])
    return _index_file(records, metadata_checksum, SCOPE_RECORD, True)


def _index_file(records: Dict[str, bytes], metadata_checksum: int, scope: Optional[str], has_checksums: bool) -> bytes:
    """The index file of the JSON ``[key, record]`` of each key (in ``.metadata``'s order)."""
    n_buckets = max(1, len(records))
    buckets: List[List[bytes]] = [[] for _ in range(n_buckets)]
    for key, record in records.items():
        buckets[bucket_of(key, n_buckets)].append(record)
    entries, parts, at = [], [], HEADER_BYTES + n_buckets * _ENTRY.size
    for bucket in buckets:
        part = b"[" + b",".join(bucket) + b"]"
        entries.append(_ENTRY.pack(at, len(part), checksum(part)))
        parts.append(part)
        at += len(part)
    head = _HEADER.pack(_MAGIC, _VERSION, n_buckets, len(records), HEADER_BYTES, metadata_checksum,
                        int(has_checksums), _SCOPES.get(scope, 1))
    return b"".join([head, struct.pack("<Q", checksum(head))] + entries + parts)


# ----------------------------------------------------------------------------- reading


class IndexHeader:
    """The header of an index: bucket count, key count, table offset, the checksum of the
    ``.metadata`` it indexes and how the item checksums were recorded."""

    def __init__(self, raw: bytes, where: str, file_size: int):
        if len(raw) < HEADER_BYTES or raw[:8] != _MAGIC:
            raise CheckpointingException(f"{where} is not a checkpoint index")
        if struct.unpack("<Q", raw[_HEADER.size:HEADER_BYTES])[0] != checksum(raw[:_HEADER.size]):
            raise mismatch_error("the header", where)
        _, version, self.n_buckets, self.n_keys, self.table_offset, self.metadata_checksum, has_cs, scope = \
            _HEADER.unpack(raw[:_HEADER.size])
        if version != _VERSION:
            raise CheckpointingException(f"{where} has index version {version}, this library reads {_VERSION}")
        if self.n_buckets < 1 or self.table_offset + self.n_buckets * _ENTRY.size > file_size:
            raise CheckpointingException(f"{where} is malformed: {self.n_buckets} buckets do not fit its "
                                         f"{file_size} bytes")
        self.scope = {v: k for k, v in _SCOPES.items()}.get(scope) if has_cs else None
        self.has_checksums = bool(has_cs)


def read_header(reader: RangeReader, where: str) -> IndexHeader:
    """The header of the open index ``reader`` (``where``: its name in messages)."""
    return IndexHeader(reader.read(0, min(HEADER_BYTES, reader.size)), where, reader.size)


def read_buckets(reader: RangeReader, header: IndexHeader, buckets: range, where: str,
                 wanted: Optional[set] = None) -> Dict[str, Record]:
    """The records of the keys in ``buckets`` (only those of the buckets in ``wanted``, when
    given): one read of their table entries, one of each run of nearby buckets (:func:`_runs`);
    each bucket's range checked against the file's size before anything is read, and its
    bytes against its checksum before they are parsed."""
    if not buckets:
        return {}
    raw = reader.read(header.table_offset + buckets.start * _ENTRY.size, len(buckets) * _ENTRY.size)
    if len(raw) != len(buckets) * _ENTRY.size:
        raise CheckpointingException(f"{where} is truncated (bucket table)")
    claimed = []
    for i, b in enumerate(buckets):
        if wanted is not None and b not in wanted:
            continue
        offset, length, expected = _ENTRY.unpack_from(raw, i * _ENTRY.size)
        if length > MAX_BUCKET_BYTES or offset + length > reader.size:
            raise CheckpointingException(f"{where}: bucket {b} claims bytes {offset}..{offset + length} of a "
                                         f"{reader.size}-byte file")
        claimed.append((b, offset, length, expected))
    records: Dict[str, Record] = {}
    for run in _runs(claimed):  # one read per run of nearby buckets
        start = run[0][1]
        span = reader.read(start, max(o + n for _, o, n, _ in run) - start)
        for b, offset, length, expected in run:
            data = span[offset - start:offset - start + length]
            if len(data) != length or checksum(data) != expected:
                raise mismatch_error(f"bucket {b}", where)
            records.update(_parse_bucket(data, b, header.n_buckets, where))
    return records


_GAP = 64 << 10  # buckets closer than this are read together


def _runs(claimed: List[Tuple[int, int, int, int]]) -> List[List[Tuple[int, int, int, int]]]:
    """``claimed`` buckets ``(bucket, offset, length, checksum)`` grouped into runs that are
    read in one piece: in file order, each starting within :data:`_GAP` of the run's end and
    a run at most :data:`MAX_BUCKET_BYTES` long."""
    runs: List[List[Tuple[int, int, int, int]]] = []
    end = 0
    for item in sorted(claimed, key=lambda c: c[1]):
        _, offset, length, _ = item
        if runs and runs[-1][0][1] <= offset <= end + _GAP and offset + length - runs[-1][0][1] <= MAX_BUCKET_BYTES:
            runs[-1].append(item)
            end = max(end, offset + length)
        else:
            runs.append([item])
            end = offset + length
    return runs


def _parse_bucket(data: bytes, b: int, n_buckets: int, where: str) -> Dict[str, Record]:
    try:
        out = {}
        for key, rec in json.loads(data):
            problem = key_problem(key)
            if problem is not None:
                raise ValueError(problem)
            if bucket_of(key, n_buckets) != b:
                raise ValueError(f"key {key!r:.100} does not belong in this bucket")
            if rec[0] not in ("b", "t"):
                raise ValueError(f"the record of {key!r:.100} is of unknown kind {rec[0]!r:.20}")
            out[key] = rec
        return out
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as e:
        raise CheckpointingException(f"{where}: bucket {b} is malformed: {e}") from e


# ----------------------------------------------------------------------------- selecting and viewing


def select_chunks(record: Record, boxes: Optional[List[Tuple[tuple, tuple]]]) -> Record:
    """``record`` with only the chunks that the requested regions ``boxes`` (in the original
    global coordinates) may need: those overlapping a box, or for a key stored flattened,
    those in the rows of the grid cells a box touches. Every chunk when it cannot tell."""
    if record[0] != "t" or boxes is None:
        return record
    size, orig, chunks = record[2], record[3], record[4]
    try:
        if orig is None:
            keep = [c for c in chunks if any(len(b[0]) == len(size) and intersect(b, (tuple(c[0]), tuple(c[1])))
                                             for b in boxes)]
        else:
            cell = tuple(o // f for o, f in zip(orig, size[:-1]))
            rows = {idx for b in boxes if len(b[0]) == len(orig) for idx in grid_chunks_overlapping(b, cell)}
            keep = [c for c in chunks if tuple(c[0][:-1]) in rows]
    except (TypeError, ValueError, ZeroDivisionError, IndexError):
        return record
    return record[:4] + [keep]


def partial_metadata(records: Dict[str, Record], header: IndexHeader, where: str) -> Metadata:
    """A DCP ``Metadata`` holding only ``records`` (as :func:`read_buckets` returns them), with
    the original shapes and the item checksums of those records, for the load planner."""
    sdm: Dict[str, Any] = {}
    storage: Dict[MetadataIndex, _StorageInfo] = {}
    mcore: Dict[str, Dict[str, Any]] = {}
    items: Dict[Tuple[str, int], int] = {}
    try:
        for key, rec in records.items():
            if rec[0] == "b":
                sdm[key] = BytesStorageMetadata()
                if len(rec) > 1:
                    storage[MetadataIndex(key)] = _StorageInfo(rec[1], rec[2], rec[3])
                    if rec[4] is not None:
                        items[(rec[1], rec[2])] = rec[4]
                continue
            dtype = getattr(torch, rec[1], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {rec[1]!r:.50}")
            chunks = []
            for offsets, sizes, name, offset, length, cs in rec[4]:
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                if name is not None:
                    storage[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(name, offset, length)
                    if cs is not None:
                        items[(name, offset)] = cs
            sdm[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(rec[2]), chunks)
            mcore[key] = {"nd_reformulated_orig_global_shape": tuple(rec[3])} if rec[3] is not None else {}
    except (ValueError, TypeError, IndexError, OverflowError) as e:
        raise CheckpointingException(f"{where} is malformed: {e}") from e
    metadata = Metadata(state_dict_metadata=sdm, storage_data=storage)
    metadata.mcore_data = mcore
    if header.has_checksums:
        metadata.checksums = item_checksum_table(items)
        metadata.checksums["scope"] = header.scope
        metadata.checksums["algorithm"] = ALGORITHM
    return metadata
