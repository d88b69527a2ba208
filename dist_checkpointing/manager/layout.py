"""The Megatron-LM layout of a checkpoint root, read and written through the storage protocol.

::

    root/iter_0000100/                     one checkpoint per step (complete once it has
    root/iter_0000200/                     metadata.json, written last by ``save``)
    root/latest_checkpointed_iteration.txt the tracker: the bare step number (Megatron-LM's
                                           format; ``release`` is also recognised)
    root/dist_checkpointing_manager.json   the index: the metrics of each step (a cache,
                                           rebuilt from the checkpoints when lost or damaged)
    root/.manager_lock                     held by the manager using the root (lock.py)

The directories are the truth: a step is complete iff ``iter_{step:07d}/metadata.json``
exists. The tracker is kept for Megatron-LM; the manager itself never trusts it.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..core import CONFIG_FNAME, CheckpointingException, read_small_json
from ..storage import Storage
from .ownership import leftover_files

logger = logging.getLogger(__name__)

TRACKER_FNAME = "latest_checkpointed_iteration.txt"
INDEX_FNAME = "dist_checkpointing_manager.json"
RELEASE = "release"
#: the key of the manager's record in each checkpoint's ``content_metadata``
CONTENT_KEY = "dist_checkpointing_manager"
_INDEX_FORMAT = "dist_checkpointing.manager"
_MAX_INDEX_BYTES = 16 << 20
_MAX_TRACKER_BYTES = 64
_STEP_DIR = re.compile(r"^iter_(\d{7,})$")

Metrics = Optional[Dict[str, Any]]


def step_dir(step: int) -> str:
    """The directory name of ``step`` (Megatron-LM's ``iter_{step:07d}``)."""
    return f"iter_{step:07d}"


def parse_step_dir(name: str) -> Optional[int]:
    """The step of a checkpoint directory name, or ``None`` if ``name`` is not one."""
    match = _STEP_DIR.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir(step) == name else None


def config_name(step: int) -> str:
    """The name (relative to the root) of the file whose presence makes ``step`` complete."""
    return f"{step_dir(step)}/{CONFIG_FNAME}"


@dataclass
class RootScan:
    """What a checkpoint root holds: complete steps with their metrics, leftovers of
    interrupted saves or deletions (:mod:`.ownership`), and incomplete step directories
    that are not ours (or a save still running in them, or links)."""

    complete: Dict[int, Metrics] = field(default_factory=dict)
    leftovers: List[str] = field(default_factory=list)
    foreign: List[str] = field(default_factory=list)
    tracker: Optional[str] = None


def read_tracker(storage: Storage) -> Optional[str]:
    """The tracker's content: a step number as a string, ``"release"``, or ``None`` when
    it is missing or damaged (logged)."""
    if storage.info(TRACKER_FNAME) is None:
        return None
    try:
        text = storage.read_bytes(TRACKER_FNAME, _MAX_TRACKER_BYTES).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        logger.warning("Ignoring unreadable tracker %s: %s", storage.describe(TRACKER_FNAME), e)
        return None
    if text == RELEASE or (text.isdigit() and len(text) < 20):
        return text
    logger.warning("Ignoring damaged tracker %s (%r): scanning the checkpoints instead",
                   storage.describe(TRACKER_FNAME), text[:32])
    return None


def write_tracker(storage: Storage, step: int) -> None:
    """Replace the tracker atomically by ``step`` (Megatron-LM's format: the bare number)."""
    try:
        storage.write_atomic(TRACKER_FNAME, str(step).encode())
    except OSError as e:
        raise CheckpointingException(f"Cannot write the tracker {storage.describe(TRACKER_FNAME)}: {e}") from e


def scan_root(storage: Storage, child: Any) -> RootScan:
    """Classify the entries of the root (one listing and a stat per step directory).
    ``child(name)`` opens the storage of a directory under the root."""
    scan = RootScan(tracker=read_tracker(storage))
    for name in storage.list():
        step = parse_step_dir(name)
        if step is None or storage.info(name) is not None:  # unrelated, or a file
            continue
        if storage.info(config_name(step)) is not None:
            scan.complete[step] = None
        elif storage.kind(name) is None:  # an object store listing a prefix whose objects are gone
            continue
        elif storage.entry_kind(name) == "dir" and leftover_files(child(name)).removable:
            scan.leftovers.append(name)
        else:
            scan.foreign.append(name)
    if scan.foreign:
        logger.warning("Checkpoint root %s: incomplete directories not written by this library are ignored "
                       "(never loaded nor deleted): %s", storage.describe(), ", ".join(scan.foreign))
    return scan


def read_index(storage: Storage) -> Optional[Dict[int, Metrics]]:
    """The metrics recorded in the index, or ``None`` when it is missing or damaged (logged)."""
    if storage.info(INDEX_FNAME) is None:
        return None
    try:
        raw = read_small_json(storage, INDEX_FNAME, _MAX_INDEX_BYTES, "Invalid manager index")
        if not isinstance(raw, dict) or raw.get("format") != _INDEX_FORMAT or not isinstance(raw.get("steps"), dict):
            raise CheckpointingException(f"Invalid manager index {storage.describe(INDEX_FNAME)}: not an index")
        steps: Dict[int, Metrics] = {}
        for key, entry in raw["steps"].items():
            metrics = entry.get("metrics") if isinstance(entry, dict) else None
            if parse_step_dir(step_dir(int(key))) is None or not (metrics is None or isinstance(metrics, dict)):
                raise CheckpointingException(f"Invalid manager index {storage.describe(INDEX_FNAME)}: entry {key!r}")
            steps[int(key)] = metrics
        return steps
    except (CheckpointingException, ValueError, TypeError) as e:
        logger.warning("%s: rebuilding it from the checkpoints", e)
        return None


def write_index(storage: Storage, steps: Dict[int, Metrics]) -> None:
    """Replace the index atomically by the metrics of ``steps``."""
    doc = {"format": _INDEX_FORMAT, "version": 1,
           "steps": {str(s): {"metrics": m} for s, m in sorted(steps.items())}}
    try:
        storage.write_atomic(INDEX_FNAME, json.dumps(doc).encode())
    except OSError as e:
        raise CheckpointingException(f"Cannot write the manager index {storage.describe(INDEX_FNAME)}: {e}") from e


def recorded_metrics(content_metadata: Any) -> Metrics:
    """The metrics the manager recorded in a checkpoint's ``content_metadata`` (or ``None``)."""
    record = content_metadata.get(CONTENT_KEY) if isinstance(content_metadata, dict) else None
    metrics = record.get("metrics") if isinstance(record, dict) else None
    return metrics if isinstance(metrics, dict) else None
