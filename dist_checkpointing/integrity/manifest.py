"""Megatron-Core's integrity manifest ``integrity.json``: a SHA-256 of every file.

The format is Megatron-Core 0.19's (``dist_checkpointing.validation.save_integrity_manifest``):
``json.dumps({"algorithm": "sha256", "files": {name: hexdigest}}, indent=2)``, one entry per
regular file directly in the checkpoint directory (``metadata.json`` included; the
manifest itself and subdirectories not), sorted by name, lowercase hex digests.

Writing (``save(..., verify_integrity=True)``): at commit every rank hashes the files it
wrote (``*__{rank}_{n}.distcp``; rank 0 the rest) and only the digests travel to rank 0,
which writes the manifest, listing ``metadata.json`` with the digest of the bytes it is
about to write, *before* ``metadata.json``: a committed checkpoint always has its whole
manifest (Megatron-Core writes it after ``metadata.json``; the contents are the same).

Verifying (``load``, ``validate``): rank 0 reads the manifest and checks the directory's
listing against it (a listed file missing, or a regular file not listed, is an error);
then the listed files are hashed, split over the ranks by size, and every mismatch is
raised on every rank, naming the files. Megatron-Core ignores unlisted files; we refuse
them (the directory changed after the save).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Dict, List, Optional, Tuple

from ..runtime.collectives import (
    all_gather_object, all_reduce_max_uint8, error_message, gather_object, get_rank, get_world_size, raise_if_any,
    run_agreed, scatter_object,
)
from ..core import (
    CONFIG_FNAME, CheckpointingConfig, CheckpointingException, Location, config_bytes, load_config, open_storage,
    read_small_json,
)
from .save_claim import CLAIM_FNAME
from ..storage import Storage

MANIFEST_FNAME = "integrity.json"
ALGORITHM = "sha256"
_READ_CHUNK = 1 << 20
_MAX_MANIFEST_BYTES = 64 << 20
_MAX_REPORTED = 10
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_WRITER_RANK = re.compile(r"__(\d+)_\d+\.distcp$")

Share = List[str]


def file_sha256(storage: Storage, name: str) -> str:
    """The SHA-256 hex digest of the file ``name``, read 1 MiB at a time."""
    h = hashlib.sha256()
    file = storage.open_reader(name)
    try:
        file.will_read_ranges([(0, file.size)])
        for offset in range(0, file.size, _READ_CHUNK):
            h.update(file.read(offset, _READ_CHUNK))
    finally:
        file.close()
    return h.hexdigest()


def manifest_bytes(files: Dict[str, str]) -> bytes:
    """The bytes of ``integrity.json`` for ``{file name: SHA-256 hex digest}``, exactly as
    Megatron-Core writes them."""
    return json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, indent=2).encode()


def read_manifest(checkpoint_dir: Location) -> Optional[Dict[str, str]]:
    """The ``{file name: digest}`` of a checkpoint's manifest; ``None`` without one.

    A manifest that is not JSON, not of Megatron-Core's layout, of another algorithm,
    names anything but a plain file name in the directory, or holds anything but a
    SHA-256 hex digest is a :class:`CheckpointingException` naming the file."""
    storage = open_storage(checkpoint_dir)
    path = storage.describe(MANIFEST_FNAME)
    if storage.info(MANIFEST_FNAME) is None:
        return None
    raw = read_small_json(storage, MANIFEST_FNAME, _MAX_MANIFEST_BYTES, "Unreadable integrity manifest")

    def malformed(what: str) -> CheckpointingException:
        return CheckpointingException(f"Integrity manifest {path} is malformed: {what}")

    if not isinstance(raw, dict) or not isinstance(raw.get("files"), dict):
        raise malformed('a JSON object with a "files" object is expected')
    algorithm = raw.get("algorithm", ALGORITHM)
    if algorithm != ALGORITHM:
        raise CheckpointingException(
            f"Integrity manifest {path} uses hash algorithm {algorithm!r:.100}; only {ALGORITHM!r} is supported")
    files = raw["files"]
    for name, digest in files.items():
        if name in ("", ".", "..", MANIFEST_FNAME) or "/" in name or "\\" in name or "\0" in name:
            raise malformed(f"{name!r:.200} is not the name of a file of the checkpoint")
        if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
            raise malformed(f"the digest of {name!r:.200} is not a SHA-256 hex digest: {digest!r:.100}")
    return files


def listing_problems(storage: Storage, files: Dict[str, str]) -> Tuple[List[str], Dict[str, int]]:
    """Listed files that are missing (or not regular files) and regular files that are not
    listed; and the size of each listed file that is there."""
    manifest = storage.describe(MANIFEST_FNAME)
    problems, sizes = [], {}
    for name in sorted(files):
        info = storage.info(name)
        if info is not None:
            sizes[name] = info.size
        else:
            state = "is not a file" if storage.kind(name) is not None else "missing"
            problems.append(f"{storage.describe(name)} is listed in {manifest} but {state}")
    for name in storage.list():
        if name not in files and name != MANIFEST_FNAME and storage.info(name) is not None:
            problems.append(f"{storage.describe(name)} is not listed in {manifest}: the directory was changed after the save")
    return problems, sizes


def hash_problems(storage: Storage, files: Dict[str, str], names: Share) -> List[str]:
    """The files of ``names`` whose SHA-256 is not the one ``files`` lists."""
    problems = []
    for name in names:
        path = storage.describe(name)
        try:
            actual = file_sha256(storage, name)
        except OSError as e:
            problems.append(f"{path} cannot be read: {e}")
            continue
        if actual != files[name]:
            problems.append(f"{path} does not match its SHA-256 in {storage.describe(MANIFEST_FNAME)} (expected "
                            f"{files[name][:16]}…, got {actual[:16]}…): the file is damaged or was changed")
    return problems


def manifest_problems(checkpoint_dir: Location) -> List[str]:
    """Every way the checkpoint differs from its manifest (one process; ``[]`` without a
    manifest). Raises only for a malformed manifest."""
    storage = open_storage(checkpoint_dir)
    files = read_manifest(storage)
    if files is None:
        return []
    problems, sizes = listing_problems(storage, files)
    return problems + hash_problems(storage, files, sorted(sizes))


def _raise_problems(storage: Storage, problems: List[str]) -> None:
    if problems:
        more = len(problems) - _MAX_REPORTED
        raise CheckpointingException(
            f"Integrity check of {storage.describe()} failed for {len(problems)} file(s): "
            + "; ".join(problems[:_MAX_REPORTED]) + (f"; and {more} more" if more > 0 else ""))


def _balanced_shares(sizes: Dict[str, int], world: int) -> List[Share]:
    """Files split over ``world`` ranks: largest first, each to the least-loaded rank."""
    shares: List[Share] = [[] for _ in range(world)]
    loads = [0] * world
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = loads.index(min(loads))
        shares[r].append(name)
        loads[r] += sizes[name]
    return shares


def verify_manifest(checkpoint_dir: Location, required: bool = False) -> bool:
    """Verify a checkpoint against its ``integrity.json`` (collective over the default
    group; one process without one). Returns whether there was a manifest.

    Without a manifest: nothing to do, unless ``required`` (an error, as in Megatron-Core's
    ``load(..., verify_integrity=True)``). Rank 0 checks the listing; the listed files are
    then hashed once in all, split over the ranks by size. Any problem is raised on every
    rank as one :class:`CheckpointingException` naming the files."""
    storage = open_storage(checkpoint_dir)
    checkpoint_dir = storage.describe()
    world = get_world_size()
    try:
        if not required and storage.info(MANIFEST_FNAME) is None:
            # Every rank looks for itself, as every rank reads metadata.json itself: no collective
            # at all in the common case.
            return False
    except OSError as e:  # every rank gets the same answer from the storage: raised on every rank
        raise CheckpointingException(f"Cannot read {storage.describe(MANIFEST_FNAME)}: {e}") from e

    def plan() -> Optional[List[Optional[Tuple[Dict[str, str], Share]]]]:
        if get_rank() != 0:
            return None
        files = read_manifest(storage)
        if files is None and not required:
            return [None] * world  # the load reports a missing or incomplete checkpoint itself
        load_config(storage)  # a missing or incomplete checkpoint is reported as such
        if files is None:
            raise CheckpointingException(
                f"{checkpoint_dir} has no integrity manifest {MANIFEST_FNAME} (verify_integrity=True needs one: "
                "save with verify_integrity=True)")
        problems, sizes = listing_problems(storage, files)
        _raise_problems(storage, problems)
        shares = _balanced_shares(sizes, world)
        return [({n: files[n] for n in share}, share) for share in shares]

    # One 2-byte all_reduce says whether rank 0 failed and whether there is anything to verify;
    # the shares travel only when there is.
    shares, error = None, None
    try:
        shares = plan()
    except Exception as e:  # noqa: BLE001 - agreed on below
        error = error_message(e)
    failed, found = all_reduce_max_uint8([int(error is not None), int(shares is not None and shares[0] is not None)])
    if failed:
        raise_if_any(all_gather_object(error), f"Reading the integrity manifest of {checkpoint_dir}")
    if not found:
        return False
    mine = scatter_object(shares)
    run_agreed(lambda: _raise_problems(storage, hash_problems(storage, *mine)),
               f"Verifying {checkpoint_dir} against its {MANIFEST_FNAME}")
    return True


def hash_written_files(checkpoint_dir: Location) -> Optional[Dict[str, str]]:
    """At a save's commit: every file of the directory (but ``metadata.json``, the claim
    and the manifest) hashed by the rank that wrote it; the digests on rank 0, ``None``
    elsewhere (collective)."""
    storage = open_storage(checkpoint_dir)
    checkpoint_dir = storage.describe()
    world = get_world_size()
    skip = {CONFIG_FNAME, CLAIM_FNAME, MANIFEST_FNAME}

    def plan() -> Optional[List[Share]]:
        if get_rank() != 0:
            return None
        shares: List[Share] = [[] for _ in range(world)]
        for name in storage.list():
            if name in skip or storage.info(name) is None:
                continue
            writer = _WRITER_RANK.search(name)
            rank = int(writer.group(1)) if writer is not None else 0
            shares[rank if rank < world else 0].append(name)
        return shares

    mine = scatter_object(run_agreed(plan, f"Listing {checkpoint_dir} for its {MANIFEST_FNAME}"))
    digests = run_agreed(lambda: {name: file_sha256(storage, name) for name in mine},
                         f"Hashing the files of {checkpoint_dir} for its {MANIFEST_FNAME}")
    gathered = gather_object(digests)
    if gathered is None:
        return None
    return {name: digest for part in gathered for name, digest in part.items()}


def _write(storage: Storage, files: Dict[str, str]) -> None:
    try:
        storage.write_atomic(MANIFEST_FNAME, manifest_bytes(files))
    except OSError as e:
        raise CheckpointingException(f"Cannot write {storage.describe(MANIFEST_FNAME)}: {e}") from e


def write_manifest(checkpoint_dir: Location, digests: Dict[str, str], config: CheckpointingConfig) -> None:
    """Write ``integrity.json`` (atomically) from the digests of :func:`hash_written_files`
    and the ``metadata.json`` that ``config`` is about to be written as."""
    _write(open_storage(checkpoint_dir), {**digests, CONFIG_FNAME: hashlib.sha256(config_bytes(config)).hexdigest()})


def refresh_manifest(checkpoint_dir: Location, changed: List[str]) -> None:
    """After an offline edit of a checkpoint (one process): if it has a manifest, drop the
    files that are gone and re-hash the ``changed`` ones, so it keeps verifying."""
    storage = open_storage(checkpoint_dir)
    files = read_manifest(storage)
    if files is None:
        return
    files = {name: digest for name, digest in files.items() if storage.info(name) is not None}
    files.update({name: file_sha256(storage, name) for name in changed if storage.info(name) is not None})
    _write(storage, files)


# ----------------------------------------------------------------------------- Megatron-Core 0.19's names

def save_integrity_manifest(checkpoint_dir: Location) -> None:
    """Hash every file directly in ``checkpoint_dir`` (the manifest itself aside) and write
    ``integrity.json``, in this process alone (Megatron-Core 0.19's
    ``validation.save_integrity_manifest``; ``save(..., verify_integrity=True)`` writes the
    same manifest, hashing the files over the ranks)."""
    storage = open_storage(checkpoint_dir)
    try:
        names = [name for name in sorted(storage.list()) if name != MANIFEST_FNAME and storage.info(name) is not None]
    except OSError as e:
        raise CheckpointingException(f"Cannot list {storage.describe()}: {e}") from e
    _write(storage, {name: file_sha256(storage, name) for name in names})


def verify_integrity_manifest(checkpoint_dir: Location) -> None:
    """Verify ``checkpoint_dir`` against its ``integrity.json``, which must exist
    (Megatron-Core 0.19's ``validation.verify_integrity_manifest``; collective over the
    default group when there is one: the files are hashed once, split over the ranks, and
    a mismatch is raised on every rank)."""
    verify_manifest(checkpoint_dir, required=True)
