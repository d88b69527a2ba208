"""Claiming a checkpoint directory for one save, so that concurrent saves cannot mix.

Two jobs pointed at one directory (or a restarted job while the old one still runs) would
both find it empty and write into it. A save therefore *claims* the directory first: it
creates the marker file ``.save_claim`` with ``O_CREAT | O_EXCL`` (atomic on POSIX file
systems, NFSv3+ included), holding a fresh save id, and only then checks that nothing else
is in the directory. Of several saves racing for one directory exactly one creates the
marker; the others fail before writing anything. The save id is recorded in the files the
claiming save writes (the checksum sidecars of ``common.pt`` and ``.metadata``, and the DCP
``.metadata``'s ``storage_meta.save_id``); at commit the marker and those records are
checked to still name this save, then ``metadata.json`` is written and the marker removed.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Optional, Union

from .core import CheckpointingException, fsync_dir

CLAIM_FNAME = ".save_claim"


def _claim_path(checkpoint_dir: Union[str, Path]) -> Path:
    return Path(checkpoint_dir) / CLAIM_FNAME


def claim_save_dir(checkpoint_dir: Union[str, Path]) -> str:
    """Make ``checkpoint_dir`` (created if missing) this save's own; returns the save id.

    Raises :class:`CheckpointingException` if the path is not a directory, if another save
    holds the directory, or if it is not empty — without touching anything in it.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if checkpoint_dir.exists() and not checkpoint_dir.is_dir():
        raise CheckpointingException(f"Checkpoint path {checkpoint_dir} exists and is not a directory")
    _refuse_if_occupied(checkpoint_dir, ignore_claim=False)
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointingException(f"Cannot create checkpoint directory {checkpoint_dir}: {e}") from e
    save_id = uuid.uuid4().hex
    record = {"save_id": save_id, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    path = _claim_path(checkpoint_dir)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError as e:
        raise CheckpointingException(
            f"Checkpoint directory {checkpoint_dir} is being written by another save "
            f"({describe_claim(checkpoint_dir)}): refusing to save into it"
        ) from e
    except OSError as e:
        raise CheckpointingException(f"Cannot claim checkpoint directory {checkpoint_dir}: {e}") from e
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(checkpoint_dir)
        # A save that found the directory empty before another one committed into it (and
        # removed its claim) sees the other's files now.
        _refuse_if_occupied(checkpoint_dir, ignore_claim=True)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return save_id


def _refuse_if_occupied(checkpoint_dir: Path, ignore_claim: bool) -> None:
    if not checkpoint_dir.is_dir():
        return
    others = [p.name for p in checkpoint_dir.iterdir() if not (ignore_claim and p.name == CLAIM_FNAME)]
    if CLAIM_FNAME in others:
        raise CheckpointingException(
            f"Checkpoint directory {checkpoint_dir} is not empty: it is being written by another save "
            f"({describe_claim(checkpoint_dir)}), or holds what a failed save left; refusing to save into it"
        )
    if others:
        raise CheckpointingException(f"Checkpoint directory {checkpoint_dir} is not empty: refusing to save into it")


def current_save_id(checkpoint_dir: Union[str, Path]) -> Optional[str]:
    """The id of the save that holds ``checkpoint_dir`` (``None`` if it is not claimed)."""
    path = _claim_path(checkpoint_dir)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointingException(f"Save claim {path} is unreadable: {e}") from e
    save_id = raw.get("save_id") if isinstance(raw, dict) else None
    if not isinstance(save_id, str):
        raise CheckpointingException(f"Save claim {path} holds no save id")
    return save_id


def describe_claim(checkpoint_dir: Union[str, Path]) -> str:
    """Who holds the directory, for error messages."""
    try:
        raw = json.loads(_claim_path(checkpoint_dir).read_text())
        return f"save {raw['save_id']} by pid {raw['pid']} on {raw['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"claimed by {CLAIM_FNAME}"


def check_claim(checkpoint_dir: Union[str, Path], save_id: str) -> None:
    """Raise unless ``checkpoint_dir`` is still claimed by the save ``save_id``."""
    holder = current_save_id(checkpoint_dir)
    if holder != save_id:
        found = "no claim" if holder is None else f"the claim of save {holder}"
        raise CheckpointingException(
            f"Checkpoint directory {checkpoint_dir} was taken from save {save_id} while it was writing "
            f"(found {found}): not committing it"
        )


def release_claim(checkpoint_dir: Union[str, Path], save_id: str) -> None:
    """Remove the claim of the save ``save_id`` (after its commit)."""
    if current_save_id(checkpoint_dir) == save_id:
        _claim_path(checkpoint_dir).unlink(missing_ok=True)
        fsync_dir(checkpoint_dir)
