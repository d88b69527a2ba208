"""Each rank's partial view of a checkpoint's metadata, from its per-key index
(:mod:`.key_index`): every bucket of the index is read by one rank (its reader), which
serves the keys requested from it to the ranks that request them, each key's record cut
to the chunks the requester's regions need.

A collective load costs each rank two ``exchange_objects`` (its requests to the readers,
their answers back) and three 1-byte agreements; the index bytes read by all ranks together
are the index once plus a 64-byte header per rank. Without a usable index (absent, or not
the index of the ``.metadata`` beside it) every rank agrees to return ``None`` and the
caller reads ``.metadata`` as before.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

from ...pickling.dcp_types import Metadata

from ...runtime.collectives import (
    all_reduce_max_uint8,
    broadcast_object,
    exchange_objects,
    gather_object,
    get_rank,
    get_world_size,
    run_agreed,
    run_agreed_with_flags,
)
from ...core import CheckpointingException
from ...integrity.checksums import read_file_verified, recorded_checksum
from ...storage import RangeReader, Storage
from .metadata_checks import check_dcp_metadata
from .format import INDEX_FNAME, METADATA_FNAME
from .key_index import IndexHeader, bucket_of, index_records, partial_metadata, read_buckets, read_header, \
    reader_buckets, reader_of, select_chunks

logger = logging.getLogger(__name__)

#: The index is used when the ranks together would read more than this many bytes of
#: ``.metadata`` (its size times the number of ranks loading); below that every rank reads
#: ``.metadata`` itself, which costs fewer collectives (benchmarks/README.md, "Scale").
INDEX_ABOVE_BYTES = 64 * 2**20

# key (tensor key or object unique key) -> the requested regions of a tensor (None: all of it / an object)
Requests = Dict[str, Optional[List[Tuple[tuple, tuple]]]]


@dataclass
class IndexedView:
    """What one rank learned from the index: the metadata of the keys it requested
    (``metadata``), the requested keys the checkpoint lacks (``absent``), and, when asked
    for, the keys no rank requested (``missing``: tensor keys and object base keys, the
    same on every rank)."""

    metadata: Metadata
    absent: Set[str] = field(default_factory=set)
    missing: Set[str] = field(default_factory=set)


def open_index(storage: Storage) -> Optional[Tuple[RangeReader, IndexHeader]]:
    """The open index of the checkpoint and its header, if it has one that indexes the
    ``.metadata`` beside it (its recorded checksum is the one of ``.metadata``'s sidecar);
    ``None`` otherwise (read ``.metadata``; also when ``.metadata`` is missing or not of
    the length its sidecar records, so that its damage is reported). A damaged header is a warning and ``None``."""
    if storage.info(INDEX_FNAME) is None:
        return None
    where = storage.describe(INDEX_FNAME)
    reader = storage.open_reader(INDEX_FNAME)
    try:
        header = read_header(reader, where)
        recorded, stored = recorded_checksum(storage, METADATA_FNAME), storage.info(METADATA_FNAME)
        if recorded is None or header.metadata_checksum != recorded[0] or stored is None or stored.size != recorded[1]:
            # another .metadata, or a damaged one: reading it reports the damage
            logger.info("%s does not index the .metadata beside it: reading .metadata", where)
            reader.close()
            return None
    except CheckpointingException as e:
        logger.warning("Not using %s: %s", where, e)
        reader.close()
        return None
    return reader, header


def indexed_view(storage: Storage, requests: Callable[[], Requests], need_missing: bool = False,
                 collective: bool = True) -> Optional[IndexedView]:
    """This rank's view of the requested keys, from the index (collective unless not
    ``collective``: then this process reads every bucket it needs itself). ``None`` on every
    rank when any rank finds no usable index, or when ``.metadata`` is small enough for
    every rank to read it (:data:`INDEX_ABOVE_BYTES`). Errors (a damaged bucket, a record that fails
    the checks of ``.metadata``) are raised on every rank, naming the file."""
    world, rank = (get_world_size(), get_rank()) if collective else (1, 0)
    where = storage.describe(INDEX_FNAME)

    def prepare():
        stored = storage.info(METADATA_FNAME)
        if stored is not None and stored.size * world <= INDEX_ABOVE_BYTES:
            return None, None  # a small .metadata: each rank reads it (fewer collectives)
        return open_index(storage), requests()

    if collective:
        (opened, wanted), (unusable,) = run_agreed_with_flags(
            prepare, lambda r: [int(r is None or r[0] is None)], "Opening the checkpoint index")
    else:
        opened, wanted = prepare()
        unusable = opened is None
    if unusable:
        if opened is not None:
            opened[0].close()
        return None
    reader, header = opened
    try:
        n = header.n_buckets
        outgoing: List[Optional[Requests]] = [None] * world
        for key, boxes in wanted.items():
            dst = reader_of(bucket_of(key, n), world, n)
            outgoing[dst] = outgoing[dst] or {}
            outgoing[dst][key] = boxes
        incoming = exchange_objects(outgoing) if collective else outgoing

        def serve():
            asked = {k for req in incoming if req for k in req}
            records = read_buckets(reader, header, reader_buckets(rank, world, n), where,
                                   None if need_missing else {bucket_of(k, n) for k in asked})
            replies = [None if not req else {k: select_chunks(records[k], boxes) if k in records else None
                                             for k, boxes in req.items()} for req in incoming]
            return replies, ({_base_key(k, records[k]) for k in set(records) - asked} if need_missing else set())

        replies, unrequested = run_agreed(serve, "Reading the checkpoint index") if collective else serve()
        answers = exchange_objects(replies) if collective else replies
    finally:
        reader.close()

    def view() -> IndexedView:
        found = {k: rec for ans in answers if ans for k, rec in ans.items() if rec is not None}
        metadata = partial_metadata(found, header, where)
        check_dcp_metadata(metadata, where)
        return IndexedView(metadata, {k for ans in answers if ans for k, rec in ans.items() if rec is None})

    result = run_agreed(view, "Reading the checkpoint index") if collective else view()
    if need_missing:
        result.missing = _agreed_missing(unrequested, wanted, collective)
    return result


def index_problems(storage: Storage, metadata: Metadata) -> Tuple[List[str], List[str]]:
    """``(problems, notes)`` of the checkpoint's index for a whole-checkpoint check (the
    ``validate`` tool), given the ``.metadata`` beside it: the whole file against its checksum
    sidecar; then, if a load would use it (:func:`open_index`), every bucket as a load reads
    it (checksum, parsing, the checks of ``.metadata``) and every key's record against
    ``.metadata``'s. An index that loads do not use (a damaged header without a sidecar,
    another ``.metadata``'s) is a note."""
    if storage.info(INDEX_FNAME) is None:
        return [], []
    where = storage.describe(INDEX_FNAME)
    try:
        read_file_verified(storage, INDEX_FNAME)
        opened = open_index(storage)
        if opened is None:
            return [], [f"{where} is not the index of the .metadata beside it (or its header is damaged): "
                        "loads do not use it"]
        reader, header = opened
        try:
            records = read_buckets(reader, header, range(header.n_buckets), where)
        finally:
            reader.close()
        check_dcp_metadata(partial_metadata(records, header, where), where)
    except CheckpointingException as e:
        return [str(e)], []
    expected = {k: json.loads(json.dumps(rec)) for k, rec in index_records(metadata).items()}
    differ = sorted(set(expected) ^ set(records)) + sorted(k for k in expected if k in records and expected[k] != records[k])
    if differ or header.n_keys != len(records):
        return [f"{where} does not match the .metadata it indexes: the records of {len(differ)} keys differ "
                f"(first {differ[:3]}), it holds {len(records)} keys and claims {header.n_keys}"], []
    return [], []


def _base_key(key: str, record: list) -> str:
    """The key a strict load names: a tensor's key, an object's key without its shard suffix."""
    return key.rsplit("/shard_", 1)[0] if record[0] == "b" and "/shard_" in key else key


def _agreed_missing(unrequested: Set[str], wanted: Requests, collective: bool) -> Set[str]:
    """Keys of the checkpoint no rank requests: the readers' unrequested entries (collected
    on rank 0 and broadcast, only when there are any), less the object keys some rank
    requests another shard of (one byte per candidate, ``all_reduce``)."""
    requested = set(wanted) | {_strip(k) for k in wanted}
    if not collective:
        return unrequested - requested
    if not all_reduce_max_uint8([int(bool(unrequested))])[0]:
        return set()
    gathered = gather_object(sorted(unrequested))
    candidates = broadcast_object(sorted(set().union(*gathered)) if gathered is not None else None)
    flags = all_reduce_max_uint8([int(k in requested) for k in candidates])
    return {k for k, flag in zip(candidates, flags) if not flag}


def _strip(key: str) -> str:
    return key.rsplit("/shard_", 1)[0] if "/shard_" in key else key
