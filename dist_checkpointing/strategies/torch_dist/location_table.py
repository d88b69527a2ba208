"""Every rank's item locations as columns: what a rank sends rank 0 after writing (a few
strings and two byte strings of ``int64`` columns instead of a list of tuples, O(its items)),
and what rank 0 makes of them (:class:`LocationTable`): one table of every stored location
with the consistency checks of :func:`.metadata.build_metadata` done on whole columns, the
order of ``.metadata``'s entries, and the data file sizes — no Python object per location.
:mod:`.metadata_writer` streams ``.metadata`` and :func:`.key_index.encode_table_index` the
index straight from it.

Owns: item locations as columns: what a rank sends rank 0 (``encode_locations``,
``encode_checksums``), rank 0's ``LocationTable`` (every location, the consistency checks on
whole columns, ``.metadata``'s order, data file sizes).
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ...core import CheckpointingException

# One location: (key, tensor_meta or None, file, offset, length, checksum or None)
ItemLocation = Tuple[str, Optional[tuple], str, int, int, Optional[int]]

_TAG = "dcloc1"
_CS_TAG = "dccs1"
# a sent location's small columns (int16) and large ones (uint64)
_KIND, _DTYPE, _FILE, _NDIM, _ORIG, _HAS_CS = range(6)
_OFFSET, _LENGTH, _CS = range(3)


def in_file_order(locations: List[ItemLocation]) -> List[ItemLocation]:
    """``locations`` by file, then offset: the order a rank sends them in (the same at every
    save of the same layout)."""
    return sorted(locations, key=lambda loc: (loc[2], loc[3]))


def encode_locations(locations: List[ItemLocation]) -> tuple:
    """What a rank sends rank 0: its keys, file names and dtype names, then per location its
    small columns (``int16``: kind, dtype, file, ndim, original ndim + 1 or 0, checksum
    recorded), its large ones (``uint64``: offset, length, checksum) and its dimensions
    (global shape, offsets, sizes, original global shape; ``int32`` when they all fit, else
    ``int64``) back to back. A location whose offsets, sizes and shape differ in length is an
    error naming its key."""
    files: Dict[str, int] = {}
    dtypes: Dict[str, int] = {}
    small, large, dims = [], [], []
    for key, meta, fname, offset, length, cs in locations:
        f = files.setdefault(fname, len(files))
        large.append((offset, length, cs or 0))
        if meta is None:
            small.append((0, 0, f, 0, 0, cs is not None))
            continue
        shape, dtype, offsets, sizes, orig = meta
        if not len(shape) == len(offsets) == len(sizes):
            raise CheckpointingException(f"ShardedTensor {key!r}: offsets {tuple(offsets)}, sizes {tuple(sizes)} "
                                         f"and global shape {tuple(shape)} differ in length")
        small.append((1, dtypes.setdefault(str(dtype), len(dtypes)), f, len(shape),
                      0 if orig is None else len(orig) + 1, cs is not None))
        dims += [*shape, *offsets, *sizes, *(orig or ())]
    if len(files) >= 1 << 15 or len(dtypes) >= 1 << 15:
        raise CheckpointingException(f"Too many data files ({len(files)}) on one rank")
    wide = np.asarray(dims, dtype=np.int64)
    narrow = len(wide) == 0 or (wide.min() >= -(1 << 31) and wide.max() < 1 << 31)
    return (_TAG, [loc[0] for loc in locations], list(files), list(dtypes),
            np.asarray(small, dtype=np.int16).tobytes(), np.asarray(large, dtype=np.uint64).tobytes(),
            (wide.astype(np.int32) if narrow else wide).tobytes(), 4 if narrow else 8)


def encode_checksums(locations: List[ItemLocation]) -> tuple:
    """What a rank sends rank 0 when its layout is unchanged (``cached_metadata``): its file
    names and per location (file, offset, checksum recorded, checksum)."""
    files: Dict[str, int] = {}
    cols = [(files.setdefault(fname, len(files)), offset, cs is not None, cs or 0)
            for _, _, fname, offset, _, cs in locations]
    return (_CS_TAG, list(files), np.asarray(cols, dtype=np.uint64).reshape(-1, 4).tobytes())


def _global_ids(per_rank: List[List[str]], local: Optional[np.ndarray] = None,
                counts: Optional[np.ndarray] = None) -> Tuple[List[str], np.ndarray]:
    """The unique names of the lists ``per_rank`` sent, in order of first use, and the index
    into them of each name sent or, given ``local`` (each location's index into its rank's
    list; ranks' locations back to back, ``counts`` per rank), of each location's name."""
    every = list(chain.from_iterable(per_rank))
    ids: Dict[str, Any] = dict.fromkeys(every)
    for i, name in enumerate(ids):
        ids[name] = i
    flat = np.fromiter(map(ids.__getitem__, every), np.int64, len(every))
    if local is None:
        return list(ids), flat
    if not len(flat):  # (no dtypes: every location an object)
        return list(ids), np.zeros(len(local), dtype=np.int64)
    base = np.zeros(len(per_rank), dtype=np.int64)
    np.cumsum([len(names) for names in per_rank[:-1]], out=base[1:])
    # (an object's dtype index, 0, may point past its rank's empty list: clipped, unused)
    return list(ids), flat[np.minimum(local + np.repeat(base, counts), len(flat) - 1)]


def _unpack(sent: Any, tag: str, rank: int) -> tuple:
    if not (isinstance(sent, tuple) and sent and sent[0] == tag):
        raise CheckpointingException(f"Rank {rank} sent item locations in an unknown form")
    return sent


class ChecksumColumns:
    """The item checksums of a save: per located item its file id (into ``files``), offset,
    whether a checksum is recorded and the checksum (``uint64``), in the order received."""

    def __init__(self, files: List[str], file: np.ndarray, offset: np.ndarray, has: np.ndarray, cs: np.ndarray):
        self.files, self.file, self.offset, self.has, self.cs = files, file, offset, has, cs

    @classmethod
    def gather(cls, per_rank: List[tuple]) -> "ChecksumColumns":
        """From every rank's :func:`encode_checksums`."""
        sent = [_unpack(s, _CS_TAG, r) for r, s in enumerate(per_rank)]
        cols = np.frombuffer(b"".join(s[2] for s in sent), dtype=np.uint64).reshape(-1, 4)
        counts = np.array([len(s[2]) // 32 for s in sent], dtype=np.int64)
        files, file = _global_ids([s[1] for s in sent], cols[:, 0].astype(np.int64), counts)
        return cls(files, file, cols[:, 1].astype(np.int64), cols[:, 2].astype(bool), cols[:, 3].copy())


class LocationTable:
    """Every rank's item locations, checked, in the order ``.metadata`` holds them.

    ``keys``: stored keys in order of first appearance (``.metadata``'s order); per key its
    kind, dtype name, global shape and original global shape (flattened keys). Per location
    (ranks' lists back to back): ``rank``, ``key``, ``kind`` (1 tensor, 0 object), ``file``,
    ``offset``, ``length``, ``ndim`` and its ``shape`` / ``offsets`` / ``sizes`` (from
    ``dims``); ``stored``: the locations recorded in ``.metadata`` (all but the repeated
    empty chunks of an empty tensor); ``chunk_groups``: per number of dimensions ``d``, the
    stored tensor locations with ``d`` dimensions by key, then offsets (each key's chunks in
    ``.metadata``), and ``chunk_span``: per tensor key, its group and the range of its rows
    there."""

    def __init__(self, per_rank: List[tuple]):
        sent = [_unpack(s, _TAG, r) for r, s in enumerate(per_rank)]
        self.world = len(sent)
        small = np.frombuffer(b"".join(s[4] for s in sent), dtype=np.int16).reshape(-1, 6).astype(np.int64)
        large = np.frombuffer(b"".join(s[5] for s in sent), dtype=np.uint64).reshape(-1, 3)
        counts = np.array([len(s[1]) for s in sent], dtype=np.int64)
        self.dims = np.concatenate([np.zeros(0, np.int64)] + [np.frombuffer(s[6], dtype=f"<i{s[7]}") for s in sent])
        self.rank = np.repeat(np.arange(self.world, dtype=np.int64), counts)
        self.keys, self.key = _global_ids([s[1] for s in sent])
        self.files, self.file = _global_ids([s[2] for s in sent], small[:, _FILE], counts)
        self.dtypes, self.dtype = _global_ids([s[3] for s in sent], small[:, _DTYPE], counts)
        self.kind, self.ndim, self.orig_ndim = small[:, _KIND], small[:, _NDIM], small[:, _ORIG] - 1
        self.offset, self.length = large[:, _OFFSET].astype(np.int64), large[:, _LENGTH].astype(np.int64)
        self.checksums = ChecksumColumns(self.files, self.file, self.offset, small[:, _HAS_CS].astype(bool),
                                         large[:, _CS].copy())
        self.start = np.zeros(len(small), dtype=np.int64)  # where each location's dims begin
        np.cumsum((3 * self.ndim + np.maximum(self.orig_ndim, 0))[:-1], out=self.start[1:])
        self.problem = self._check()
        self.storage_meta: Any = None  # DCP's StorageMeta of the last .metadata written from this table

    def column(self, rows: np.ndarray, d: int, which: int) -> np.ndarray:
        """The ``(len(rows), d)`` matrix of the shapes (``which`` 0), offsets (1), sizes (2) or
        original shapes (3) of ``rows`` (locations with ``d`` dimensions there)."""
        return self.dims[(self.start[rows] + which * self.ndim[rows])[:, None] + np.arange(d)]

    def _check(self) -> bool:
        """Whether :func:`.metadata.build_metadata` would refuse these locations (a key stored
        both as tensor and object or with different shapes, dtypes or flattening; an item saved
        twice); sets up the key records and orders when it would not."""
        n_keys = len(self.keys)
        key_ids, first = np.unique(self.key, return_index=True)
        first_of = np.empty(n_keys, dtype=np.int64)
        first_of[key_ids] = first
        ref = first_of[self.key]
        if np.any(self.kind != self.kind[ref]):
            return True
        tensor = self.kind == 1
        for col in (self.dtype, self.ndim, self.orig_ndim):
            if np.any(col[tensor] != col[ref][tensor]):
                return True
        stored = np.ones(len(self.key), dtype=bool)
        chunk_parts = []
        for d in np.unique(self.ndim[tensor]):
            rows = np.flatnonzero(tensor & (self.ndim == d))
            shape = self.column(rows, d, 0)
            if np.any(shape != self.column(ref[rows], d, 0)):
                return True
            for od in np.unique(self.orig_ndim[rows]):
                if od >= 0:
                    sub = rows[self.orig_ndim[rows] == od]
                    orig = self.dims[(self.start[sub] + 3 * d)[:, None] + np.arange(od)]
                    if np.any(orig != self.dims[(self.start[ref[sub]] + 3 * d)[:, None] + np.arange(od)]):
                        return True
            offsets = self.column(rows, d, 1)
            order = np.lexsort(tuple(offsets[:, i] for i in range(d - 1, -1, -1)) + (self.key[rows],))
            ranked = rows[order]
            repeat = np.zeros(len(rows), dtype=bool)
            repeat[1:] = (self.key[ranked][1:] == self.key[ranked][:-1]) & np.all(
                offsets[order][1:] == offsets[order][:-1], axis=1)
            if repeat.any():  # the same chunk twice: only the empty chunks of an empty tensor may
                again = ranked[repeat]
                if not (np.all(np.any(self.column(again, d, 2) == 0, axis=1))
                        and np.all(np.any(self.column(again, d, 0) == 0, axis=1))):
                    return True
                stored[again] = False
            chunk_parts.append((int(d), ranked[~repeat]))
        objects = np.flatnonzero(~tensor)
        if len(np.unique(self.key[objects])) != len(objects):
            return True
        self.stored = stored
        self.chunk_groups = chunk_parts
        self.chunk_span = np.zeros((n_keys, 3), dtype=np.int64)
        for g, (_, rows) in enumerate(chunk_parts):
            keys, lo = np.unique(self.key[rows], return_index=True)
            self.chunk_span[keys] = np.stack([np.full(len(keys), g), lo, np.append(lo[1:], len(rows))], axis=1)
        self.first_of = first_of
        return False

    def check_same_items(self, checks: ChecksumColumns) -> None:
        """Make ``checks`` (of a save whose every rank reported an unchanged layout) this
        table's item checksums; they must name the same items in the same order."""
        same = len(checks.offset) == len(self.offset) and np.array_equal(checks.offset, self.offset)
        if same and len(self.file):
            names = np.array(checks.files, dtype=object)[checks.file]
            same = bool(np.all(names == np.array(self.files, dtype=object)[self.file]))
        if not same:
            raise CheckpointingException("The ranks report an unchanged layout, but the items they wrote differ "
                                         "from the previous save's")
        self.checksums = checks

    def key_records(self) -> List[Tuple[str, int, Optional[str], Optional[tuple], Optional[tuple]]]:
        """Per key in order: (key, kind, dtype name, global shape, original global shape)."""
        out = []
        for k, name in enumerate(self.keys):
            i = int(self.first_of[k])
            if self.kind[i] == 0:
                out.append((name, 0, None, None, None))
                continue
            s, d, od = int(self.start[i]), int(self.ndim[i]), int(self.orig_ndim[i])
            orig = tuple(int(x) for x in self.dims[s + 3 * d:s + 3 * d + od]) if od >= 0 else None
            out.append((name, 1, self.dtypes[self.dtype[i]], tuple(int(x) for x in self.dims[s:s + d]), orig))
        return out

    def per_rank_locations(self) -> List[List[ItemLocation]]:
        """The locations as the ranks had them (the input of :func:`.metadata.build_metadata`)."""
        out: List[List[ItemLocation]] = [[] for _ in range(self.world)]
        cs = self.checksums
        for i in range(len(self.key)):
            s, d, od = int(self.start[i]), int(self.ndim[i]), int(self.orig_ndim[i])
            meta = None
            if self.kind[i]:
                dim = [int(x) for x in self.dims[s:s + 3 * d + max(od, 0)]]
                meta = (tuple(dim[:d]), getattr(torch, self.dtypes[self.dtype[i]][len("torch."):]),
                        tuple(dim[d:2 * d]), tuple(dim[2 * d:3 * d]), tuple(dim[3 * d:]) if od >= 0 else None)
            out[int(self.rank[i])].append((self.keys[self.key[i]], meta, self.files[self.file[i]], int(self.offset[i]),
                                           int(self.length[i]), int(cs.cs[i]) if cs.has[i] else None))
        return out

    def data_file_sizes(self) -> Dict[str, int]:
        """The size of each data file: where its last written item ends (every location
        written counts, also the repeated empty chunks ``.metadata`` leaves out)."""
        ends = np.zeros(len(self.files), dtype=np.int64)
        np.maximum.at(ends, self.file, self.offset + self.length)
        used = np.zeros(len(self.files), dtype=bool)
        used[self.file] = True
        return {self.files[f]: int(ends[f]) for f in np.flatnonzero(used)}
