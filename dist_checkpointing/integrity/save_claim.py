"""Claiming a checkpoint directory for one save, so that concurrent saves cannot mix.

Two jobs pointed at one directory (or a restarted job while the old one still runs) would
both find it empty and write into it. A save therefore *claims* the directory first: it
creates the marker file ``.save_claim`` with the storage's exclusive create
(:meth:`~.storage.Storage.create_exclusive`; ``O_CREAT | O_EXCL`` on POSIX file systems,
NFSv3+ included), holding a fresh save id, and only then checks that nothing else
is in the directory. Of several saves racing for one directory exactly one creates the
marker; the others fail before writing anything. The save id is recorded in the files the
claiming save writes (the checksum sidecars of ``common.pt`` and ``.metadata``, and the DCP
``.metadata``'s ``storage_meta.save_id``); at commit the marker and those records are
checked to still name this save, then ``metadata.json`` is written and the marker removed.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

from ..core import CheckpointingException, Location, open_storage
from .liveness import this_process
from ..storage import Storage

CLAIM_FNAME = ".save_claim"


def claim_save_dir(checkpoint_dir: Location) -> str:
    """Make ``checkpoint_dir`` (created if missing) this save's own; returns the save id.

    Raises :class:`CheckpointingException` if the path is not a directory, if another save
    holds the directory, or if it is not empty — without touching anything in it.
    """
    storage = open_storage(checkpoint_dir)
    where = storage.describe()
    if storage.kind() == "file":
        raise CheckpointingException(f"Checkpoint path {where} exists and is not a directory")
    _refuse_if_occupied(storage, ignore_claim=False)
    try:
        storage.make_root()
    except OSError as e:
        raise CheckpointingException(f"Cannot create checkpoint directory {where}: {e}") from e
    save_id = uuid.uuid4().hex
    record = {"save_id": save_id, **this_process(), "time": time.time()}
    try:
        storage.create_exclusive(CLAIM_FNAME, json.dumps(record).encode())
    except FileExistsError as e:
        raise CheckpointingException(
            f"Checkpoint directory {where} is being written by another save "
            f"({describe_claim(storage)}): refusing to save into it"
        ) from e
    except OSError as e:
        raise CheckpointingException(f"Cannot claim checkpoint directory {where}: {e}") from e
    try:
        # A save that found the directory empty before another one committed into it (and
        # removed its claim) sees the other's files now.
        _refuse_if_occupied(storage, ignore_claim=True)
    except BaseException:
        storage.delete(CLAIM_FNAME)
        raise
    return save_id


def _refuse_if_occupied(storage: Storage, ignore_claim: bool) -> None:
    if storage.kind() != "dir":
        return
    where = storage.describe()
    others = [name for name in storage.list() if not (ignore_claim and name == CLAIM_FNAME)]
    if CLAIM_FNAME in others:
        raise CheckpointingException(
            f"Checkpoint directory {where} is not empty: it is being written by another save "
            f"({describe_claim(storage)}), or holds what a failed save left; refusing to save into it"
        )
    if others:
        raise CheckpointingException(f"Checkpoint directory {where} is not empty: refusing to save into it")


def _read_claim(storage: Storage) -> dict:
    raw = json.loads(storage.read_bytes(CLAIM_FNAME))
    return raw if isinstance(raw, dict) else {}


def current_save_id(checkpoint_dir: Location) -> Optional[str]:
    """The id of the save that holds ``checkpoint_dir`` (``None`` if it is not claimed)."""
    storage = open_storage(checkpoint_dir)
    try:
        raw = _read_claim(storage)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointingException(f"Save claim {storage.describe(CLAIM_FNAME)} is unreadable: {e}") from e
    save_id = raw.get("save_id")
    if not isinstance(save_id, str):
        raise CheckpointingException(f"Save claim {storage.describe(CLAIM_FNAME)} holds no save id")
    return save_id


def describe_claim(checkpoint_dir: Location) -> str:
    """Who holds the directory, for error messages."""
    try:
        raw = _read_claim(open_storage(checkpoint_dir))
        return f"save {raw['save_id']} by pid {raw['pid']} on {raw['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"claimed by {CLAIM_FNAME}"


def check_claim(checkpoint_dir: Location, save_id: str) -> None:
    """Raise unless ``checkpoint_dir`` is still claimed by the save ``save_id``."""
    holder = current_save_id(checkpoint_dir)
    if holder != save_id:
        found = "no claim" if holder is None else f"the claim of save {holder}"
        raise CheckpointingException(
            f"Checkpoint directory {open_storage(checkpoint_dir).describe()} was taken from save {save_id} while "
            f"it was writing (found {found}): not committing it"
        )


def release_claim(checkpoint_dir: Location, save_id: str) -> None:
    """Remove the claim of the save ``save_id`` (after its commit)."""
    storage = open_storage(checkpoint_dir)
    if current_save_id(storage) == save_id:
        storage.delete(CLAIM_FNAME)
