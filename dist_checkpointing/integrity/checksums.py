"""Checksums of stored bytes: computed at save, verified at load.

Every stored item gets an xxh3-64 checksum of its whole record (every byte of its blob)
recorded in the checkpoint metadata, so a rank that reads part of a checkpoint verifies
exactly what it reads. Whole files written by one rank (``common.pt``, ``.metadata``) get
a small JSON sidecar ``{name}.checksum``. Files without checksums (e.g. written by
Megatron-Core) load unverified.

Off the critical path. **Save**: :func:`..strategies.torch_dist.records.write_records`
hashes each record between ``WriteStream.start_checksum`` and ``take_checksum`` -- every
``write`` (blob prefix, tensor data, suffix; an object's blob) right after it is copied
into the file's write buffer, while still in the CPU cache, on the thread that serializes
the file while its I/O thread writes the previous buffer (``scope: "record"``). The
checksum rides in the item location already sent to rank 0 (8 bytes, no extra collective)
and is stored in ``.metadata`` (``checksums``). A sidecar is written by
:func:`write_file_with_checksum`: old sidecar removed, file replaced atomically, new
sidecar written atomically, so a file never sits next to a sidecar that does not describe it.

**Load**: a :class:`RecordVerifier` hashes the blob's bytes before the data (one read),
each 1 MiB piece of the data as it arrives (``RangeReader.readinto``), then the bytes after
it, and compares (no extra pass, no collective). A request for part of a chunk reads and
verifies the whole chunk (``verify_checksums=False`` reads only the needed span). Object
blobs, blobs that need ``torch.load`` and whole files are hashed before unpickling, so
damaged bytes never reach an unpickler. Tables without ``scope`` (earlier versions) are
verified on the data bytes alone.

Switches: ``TorchDistSaveShardedStrategy(checksums=False)``;
``TorchDistLoadShardedStrategy(verify_checksums=False)`` and
``TorchCommonLoadStrategy(verify_checksums=False)``. ``.metadata`` is always verified when
its sidecar exists. Checksums detect damage; they do not establish trust.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional, Tuple

import xxhash

from ..core import CheckpointingException, Location, open_storage
from .save_claim import current_save_id
from ..storage import RangeReader

ALGORITHM = "xxh3_64"
SIDECAR_SUFFIX = ".checksum"
#: ``scope`` of an item checksum table whose checksums cover each item's whole record.
SCOPE_RECORD = "record"
#: the meaning of a table without ``scope`` (older checkpoints): a tensor item's checksum
#: covers only its data bytes (an object's covers its whole record in both scopes).
SCOPE_DATA = "data"
_PIECE = 1 << 20  # bytes hashed per read of a record's framing


def checksum(data) -> int:
    """The xxh3-64 checksum of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(data)


def new_hasher() -> "xxhash.xxh3_64":
    """An incremental xxh3-64 hasher (``update(bytes)``, ``intdigest()``)."""
    return xxhash.xxh3_64()


def mismatch_error(what: str, where: str) -> CheckpointingException:
    """The error for bytes that do not match their recorded checksum."""
    return CheckpointingException(
        f"Checksum mismatch for {what} in {where}: the stored bytes are corrupted"
    )


def item_checksum_table(items: Dict[Tuple[str, int], int]) -> Dict[str, Any]:
    """The table of item checksums stored in ``.metadata``: ``(file, offset) -> checksum``
    of each item's whole record."""
    return {"algorithm": ALGORITHM, "scope": SCOPE_RECORD, "items": items}


def item_checksum_scope(table: Dict[str, Any], where: str) -> str:
    """The scope of an item checksum table (:data:`SCOPE_RECORD` or :data:`SCOPE_DATA`);
    a table this version cannot verify is refused."""
    scope = table.get("scope", SCOPE_DATA)
    if table.get("algorithm") != ALGORITHM or scope not in (SCOPE_RECORD, SCOPE_DATA):
        raise CheckpointingException(
            f"Checkpoint {where} uses checksum algorithm {table.get('algorithm')!r} with scope {scope!r}, which "
            "this version cannot verify (load with verify_checksums=False to skip verification)"
        )
    return scope


class RecordVerifier:
    """Checks a stored record ``[offset, offset + length)`` of a file open for reading
    (a :class:`~.storage.RangeReader`) against its checksum while the caller reads the part of it at ``span`` (e.g. a tensor's data).

    The caller feeds the span's bytes to :meth:`update` in order, as it reads them. With
    ``whole_record`` the record's bytes before the span are hashed first (here) and those
    after it in :meth:`finish`, so the digest is the one-shot digest of the whole record;
    without it, of the span alone (the data-only checksums of older checkpoints).
    """

    def __init__(self, file: RangeReader, record: Tuple[int, int], span: Tuple[int, int], expected: int,
                 whole_record: bool, what: str, where: str):
        self._file, self._expected, self._what, self._where = file, expected, what, where
        self._hasher = new_hasher()
        self._suffix = (span[0] + span[1], record[0] + record[1]) if whole_record else (0, 0)
        if whole_record:
            self._hash_range(record[0], span[0])

    def update(self, data) -> None:
        """Hash the next bytes of the span."""
        self._hasher.update(data)

    def finish(self) -> None:
        """Hash the rest of the record and compare; raises on a mismatch."""
        self._hash_range(*self._suffix)
        if self._hasher.intdigest() != self._expected:
            raise mismatch_error(self._what, self._where)

    def _hash_range(self, start: int, end: int) -> None:
        while start < end:
            try:
                data = self._file.read(start, min(_PIECE, end - start))
            except OSError as e:
                raise CheckpointingException(f"Reading {self._what} at {self._where} failed: {e}") from e
            if not data:
                raise CheckpointingException(f"Unexpected end of file reading {self._what} at {self._where}")
            self._hasher.update(data)
            start += len(data)


def sidecar_name(name: str) -> str:
    return name + SIDECAR_SUFFIX


def write_file_with_checksum(checkpoint_dir: Location, name: str, data) -> None:
    """Write ``data`` atomically to the file ``name`` of ``checkpoint_dir`` and its
    checksum to ``{name}.checksum``.

    Safe to use on an existing checkpoint: the old sidecar is removed first, then the file
    replaced, then the new sidecar written, so a crash at any point leaves a file that
    matches its sidecar or has none (read unverified) — never a false mismatch. While a
    save holds the directory (:mod:`~dist_checkpointing.integrity.save_claim`), the sidecar records
    that save's id, which the save checks before it commits.
    """
    storage = open_storage(checkpoint_dir)
    sidecar = {"algorithm": ALGORITHM, "checksum": f"{checksum(data):016x}", "length": len(data)}
    save_id = current_save_id(storage)
    if save_id is not None:
        sidecar["save_id"] = save_id
    written = name
    try:
        storage.delete(sidecar_name(name))
        storage.write_atomic(name, data)
        written = sidecar_name(name)
        storage.write_atomic(written, json.dumps(sidecar).encode())
    except OSError as e:
        raise CheckpointingException(f"Cannot write checkpoint file {storage.describe(written)}: {e}") from e


def sidecar_record(checkpoint_dir: Location, name: str) -> Optional[Dict[str, Any]]:
    """The checksum sidecar of the file ``name`` as written (``None`` without one; ``{}``
    for one that is not a JSON object)."""
    storage = open_storage(checkpoint_dir)
    try:
        raw = json.loads(storage.read_bytes(sidecar_name(name)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointingException(f"Checksum file {storage.describe(sidecar_name(name))} is damaged: {e}") from e
    return raw if isinstance(raw, dict) else {}


def read_file_verified(checkpoint_dir: Location, name: str, verify: bool = True) -> bytes:
    """Read the file ``name``; when a checksum sidecar exists (and ``verify``), check the bytes."""
    storage = open_storage(checkpoint_dir)
    path = storage.describe(name)
    try:
        data = storage.read_bytes(name)
    except FileNotFoundError as e:
        raise CheckpointingException(f"Checkpoint file {path} is missing") from e
    except OSError as e:
        raise CheckpointingException(f"Cannot read checkpoint file {path}: {e}") from e
    if verify:
        expected = _read_sidecar(storage, name)
        if expected is not None and (len(data) != expected[1] or checksum(data) != expected[0]):
            raise mismatch_error(f"file {name}", path)
    return data


def recorded_checksum(checkpoint_dir: Location, name: str) -> Optional[Tuple[int, int]]:
    """The checksum and length that the sidecar of the file ``name`` records (``None`` without one)."""
    return _read_sidecar(open_storage(checkpoint_dir), name)


def _read_sidecar(storage, name: str) -> Optional[tuple]:
    sidecar = sidecar_name(name)
    if storage.info(sidecar) is None:
        return None
    where = storage.describe(sidecar)
    try:
        raw = json.loads(storage.read_bytes(sidecar))
        if raw.get("algorithm") != ALGORITHM:
            raise CheckpointingException(f"{where}: unknown checksum algorithm {raw.get('algorithm')!r}")
        return int(raw["checksum"], 16), int(raw["length"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointingException(f"Checksum file {where} is damaged: {e}") from e
