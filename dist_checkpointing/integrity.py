"""Checksums of stored bytes: computed at save, verified at load.

Every stored item (a tensor chunk's data bytes, an object's blob) gets an xxh3-64 checksum
recorded in the checkpoint metadata, so a rank that reads part of a checkpoint verifies
exactly what it reads. Whole files written by one rank (``common.pt``, ``.metadata``) get
a small JSON sidecar ``{name}.checksum``. Files without checksums (e.g. written by
Megatron-Core) load unverified.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import xxhash

from .core import CheckpointingException, atomic_write_bytes
from .save_claim import current_save_id

ALGORITHM = "xxh3_64"
SIDECAR_SUFFIX = ".checksum"


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


def write_file_with_checksum(path: Union[str, Path], data) -> None:
    """Write ``data`` atomically to ``path`` and its checksum to ``path.checksum``.

    Safe to use on an existing checkpoint: the old sidecar is removed first, then the file
    replaced, then the new sidecar written, so a crash at any point leaves a file that
    matches its sidecar or has none (read unverified) — never a false mismatch. While a
    save holds the directory (:mod:`~dist_checkpointing.save_claim`), the sidecar records
    that save's id, which the save checks before it commits.
    """
    path = Path(path)
    sidecar_path = path.with_name(path.name + SIDECAR_SUFFIX)
    sidecar_path.unlink(missing_ok=True)
    atomic_write_bytes(path, data)
    sidecar = {"algorithm": ALGORITHM, "checksum": f"{checksum(data):016x}", "length": len(data)}
    save_id = current_save_id(path.parent)
    if save_id is not None:
        sidecar["save_id"] = save_id
    atomic_write_bytes(sidecar_path, json.dumps(sidecar).encode())


def recorded_save_id(path: Union[str, Path]) -> Optional[str]:
    """The save id recorded in ``path``'s checksum sidecar (``None`` without one)."""
    sidecar = Path(path).with_name(Path(path).name + SIDECAR_SUFFIX)
    try:
        raw = json.loads(sidecar.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointingException(f"Checksum file {sidecar} is damaged: {e}") from e
    return raw.get("save_id") if isinstance(raw, dict) else None


def read_file_verified(path: Union[str, Path], verify: bool = True) -> bytes:
    """Read ``path``; when a checksum sidecar exists (and ``verify``), check the bytes."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise CheckpointingException(f"Checkpoint file {path} is missing") from e
    except OSError as e:
        raise CheckpointingException(f"Cannot read checkpoint file {path}: {e}") from e
    if verify:
        expected = _read_sidecar(path)
        if expected is not None and (len(data) != expected[1] or checksum(data) != expected[0]):
            raise mismatch_error(f"file {path.name}", str(path))
    return data


def _read_sidecar(path: Path) -> Optional[tuple]:
    sidecar = path.with_name(path.name + SIDECAR_SUFFIX)
    if not sidecar.is_file():
        return None
    try:
        raw = json.loads(sidecar.read_text())
        if raw.get("algorithm") != ALGORITHM:
            raise CheckpointingException(f"{sidecar}: unknown checksum algorithm {raw.get('algorithm')!r}")
        return int(raw["checksum"], 16), int(raw["length"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointingException(f"Checksum file {sidecar} is damaged: {e}") from e

