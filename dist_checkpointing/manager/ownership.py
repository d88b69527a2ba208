"""Which entries of a step directory this library wrote: all that the manager ever deletes.

Decided by what the files say, never by their names alone. A save records its id
(:mod:`~dist_checkpointing.integrity.save_claim`) in ``.save_claim`` (from before its first byte
until its commit), in the checksum sidecars of ``common.pt`` and ``.metadata``
(:mod:`~dist_checkpointing.integrity.checksums`) and in ``.metadata``'s ``storage_meta.save_id``;
``.metadata`` names the data files.

- A committed checkpoint being retired (its ``metadata.json`` deleted first, by the
  caller): the files its records name — ``metadata.json``, ``integrity.json``,
  ``common.pt``, ``.metadata``, their sidecars, the data files ``.metadata`` names, the
  claim if it names the same save. A link among them is removed itself, never its target.
- An incomplete directory (a leftover of an interrupted save or deletion): ours only when
  its records name exactly one save and that save is not running (a claim of another
  process of this host that still runs is a save in progress; one of another host is a
  dead run's: the manager holds the root's lock). Then the records naming that save, the
  files whose sidecar names it, the data files its ``.metadata`` names; while its claim is
  there (the directory was empty when it was claimed), also what it writes before recording
  it: data files ``*__{rank}_{n}.distcp``, ``common.pt``, ``.metadata``, sidecars,
  ``integrity.json``, write temporaries. Regular files only: a record is never read
  through a link.
- An empty step directory: a deletion interrupted after its last file (or a save before
  its first); removed.

Everything else — a user's file or directory (whatever its name), a link, a FIFO — is
kept, and so is the directory that holds it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from ..core import CONFIG_FNAME, CheckpointingException
from ..integrity.checksums import SIDECAR_SUFFIX
from ..integrity.liveness import on_this_host, runs
from ..integrity.manifest import MANIFEST_FNAME
from ..integrity.save_claim import CLAIM_FNAME
from ..storage import Storage
from ..strategies.common import COMMON_STATE_FNAME
from ..strategies.torch_dist.format import INDEX_FNAME, METADATA_FNAME, checked_data_file_name
from ..strategies.torch_dist.metadata import read_metadata

_MAX_RECORD_BYTES = 4096
_SIDECARS = {name + SIDECAR_SUFFIX: name for name in (COMMON_STATE_FNAME, METADATA_FNAME, INDEX_FNAME)}
_CHECKPOINT_FILES = {CONFIG_FNAME, MANIFEST_FNAME, COMMON_STATE_FNAME, METADATA_FNAME, INDEX_FNAME, *_SIDECARS}
# what a claimed save writes before a record names it
_UNRECORDED = re.compile(r"^(common\.pt|\.metadata|\.metadata\.index|integrity\.json|metadata\.json|"
                         r"(common\.pt|\.metadata|\.metadata\.index)\.checksum|"
                         r".*__\d+_\d+\.distcp|\..+\.[0-9a-f]{12,32}\.tmp)$")
# deleted last, in this order: the records that identify the save
_LAST = (INDEX_FNAME, COMMON_STATE_FNAME, METADATA_FNAME, *_SIDECARS, CLAIM_FNAME)


@dataclass
class StepFiles:
    """The entries of a step directory: ``ours`` (in deletion order, the records that
    identify the save last, so an interrupted deletion leaves a recognisable leftover) and
    ``kept``; ``why`` says why nothing is ours."""

    ours: List[str] = field(default_factory=list)
    kept: List[str] = field(default_factory=list)
    why: str = ""

    @property
    def removable(self) -> bool:
        """Whether the manager may delete something here: files of ours, or an empty directory."""
        return bool(self.ours) or not self.kept


def _record(directory: Storage, name: str) -> Optional[Dict[str, Any]]:
    """The small JSON object in the file ``name`` (``None`` if it is not one)."""
    try:
        raw = json.loads(directory.read_bytes(name, _MAX_RECORD_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    return raw if isinstance(raw, dict) else None


def _save_id(record: Optional[Dict[str, Any]]) -> Optional[str]:
    save_id = (record or {}).get("save_id")
    return save_id if isinstance(save_id, str) and save_id else None


def _metadata(directory: Storage) -> Tuple[Optional[str], Set[str]]:
    """The save id ``.metadata`` records and the data files it names (none when unreadable)."""
    try:
        metadata = read_metadata(directory)
        files = {checked_data_file_name(directory.describe(), si.relative_path)
                 for si in metadata.storage_data.values()}
    except (CheckpointingException, OSError, AttributeError, TypeError):
        return None, set()
    return _save_id({"save_id": getattr(getattr(metadata, "storage_meta", None), "save_id", None)}), files


def _ordered(ours: Set[str], entries: Dict[str, Optional[str]]) -> StepFiles:
    last = {name: i + 1 for i, name in enumerate(_LAST)}
    return StepFiles(sorted(ours, key=lambda n: (last.get(n, 0), n)), sorted(set(entries) - ours))


def checkpoint_files(directory: Storage) -> StepFiles:
    """The files of a committed checkpoint being retired (its records name them)."""
    entries = directory.entries()
    files = {n for n, kind in entries.items() if kind in ("file", "link")}
    save_id, data_files = _metadata(directory) if METADATA_FNAME in files else (None, set())
    ours = files & (_CHECKPOINT_FILES | data_files)
    if CLAIM_FNAME in files and entries[CLAIM_FNAME] == "file" and save_id is not None \
            and _save_id(_record(directory, CLAIM_FNAME)) == save_id:
        ours.add(CLAIM_FNAME)
    return _ordered(ours, entries)


def leftover_files(directory: Storage) -> StepFiles:
    """The files of an incomplete step directory that a save of this library wrote, if
    that save is over (see the module docstring)."""
    entries = directory.entries()
    if not entries:
        return StepFiles()  # empty: removable
    regular = {n for n, kind in entries.items() if kind == "file"}
    claim = _record(directory, CLAIM_FNAME) if CLAIM_FNAME in regular else None
    ids: Dict[str, str] = {}  # record -> the save id it holds
    if _save_id(claim):
        ids[CLAIM_FNAME] = _save_id(claim)  # type: ignore[assignment]
    for sidecar in _SIDECARS:
        if sidecar in regular and _save_id(_record(directory, sidecar)):
            ids[sidecar] = _save_id(_record(directory, sidecar))  # type: ignore[assignment]
    meta_id, data_files = _metadata(directory) if METADATA_FNAME in regular else (None, set())
    if meta_id is not None:
        ids[METADATA_FNAME] = meta_id
    saves = set(ids.values())
    if len(saves) != 1:
        why = "no record of a save of this library" if not saves else f"records of several saves {sorted(saves)}"
        return StepFiles([], sorted(entries), why)
    save_id = saves.pop()
    if claim is not None and CLAIM_FNAME in ids and on_this_host(claim) and claim.get("pid") != os.getpid() \
            and runs(claim):
        return StepFiles([], sorted(entries), f"save {save_id} (pid {claim.get('pid')}) is still running")
    ours = set(ids)
    ours.update(_SIDECARS[s] for s in ids if s in _SIDECARS)
    if METADATA_FNAME in ids:
        ours.update(data_files)
    if CLAIM_FNAME in ids:
        ours.update(n for n in regular if _UNRECORDED.match(n))
    return _ordered(ours & regular, entries)
