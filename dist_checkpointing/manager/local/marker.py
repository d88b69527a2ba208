"""A local-tier copy's marker (:mod:`.files`) and the job that owns it.

The marker (``rank_{owner:05d}.done``, JSON) describes one copy: its step, owner rank,
world size, payload length, checksums, the encoded header — and the **job** that wrote
it: ``{"root": the persistent root, normalised, "run": the run id}``. The run id is kept
in the persistent root (:data:`RUN_FNAME`, created by the first two-tier manager opening
the root): a restarted job of the same training run (same root) finds the same id and
restores its own copies; a job with another root, or a new run in a root that was
emptied, has another identity, and its copies are not this job's.

:func:`parse_marker` validates every field before anything uses it: a marker of the
wrong shape is a damaged copy (never an error raised on one rank alone).

Owns: the marker's fields, each validated before use (``parse_marker``: types, ranges, the
step and owner its path names; anything else is a damaged copy), and the job that owns a
copy: the persistent root, normalised, and the run id kept in
``root/dist_checkpointing_local_run.json``.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import uuid
from typing import Any, Dict, Optional

from ...core import CheckpointingException, read_small_json
from ...storage import Storage, url_scheme

#: the file in the persistent root holding the run id of its local tier
RUN_FNAME = "dist_checkpointing_local_run.json"
_RUN_RE = re.compile(r"^[0-9a-f]{32}$")
_HEX16_RE = re.compile(r"^[0-9a-f]{16}$")
_MAX_RUN_BYTES = 4096
MAX_MARKER_BYTES = 64 << 20  # the header (base64) holds the common values: generous, but bounded
MAX_WORLD = 1 << 24  # ranks
MAX_STEP = (1 << 63) - 1
_MAX_ROOT_CHARS = 4096

Job = Dict[str, str]  # {"root": ..., "run": ...}


def normalise_root(root: str) -> str:
    """``root`` spelled one way: a local path absolute with links and ``..`` resolved; a URL
    with its scheme in lower case, ``.``/``..`` segments and repeated or trailing slashes
    removed."""
    scheme = url_scheme(root)
    if not scheme:
        return os.path.realpath(os.path.abspath(root))
    rest = root.split("://", 1)[1] if "://" in root else root[len(scheme) + 1:]
    path = posixpath.normpath("/" + rest).lstrip("/")
    return f"{scheme.lower()}://{'' if path == '.' else path}"


def load_run_id(storage: Storage) -> str:
    """The run id kept in the persistent root ``storage`` (created if missing). Called by
    the process that holds the root's lock (rank 0)."""
    what = "Local tier: the run id file"
    if storage.info(RUN_FNAME) is None:
        run = uuid.uuid4().hex
        try:
            storage.write_atomic(RUN_FNAME, json.dumps({"run": run}).encode())
        except OSError as e:
            raise CheckpointingException(f"{what} {storage.describe(RUN_FNAME)} cannot be written: {e}") from e
        return run
    doc = read_small_json(storage, RUN_FNAME, _MAX_RUN_BYTES, what)
    run = doc.get("run") if isinstance(doc, dict) else None
    if not isinstance(run, str) or not _RUN_RE.match(run):
        raise CheckpointingException(f"{what} {storage.describe(RUN_FNAME)} is damaged (no 32-hex-digit run id); "
                                     "delete it to start a new run (the local copies of the old one then belong "
                                     "to another job)")
    return run


def describe_job(job: Job) -> str:
    return f"root {job['root']} (run {job['run'][:8]})"


def _is_int(v: Any, low: int, high: int) -> bool:
    return type(v) is int and low <= v <= high


def _problem(raw: Any, step: int, owner: int) -> Optional[str]:
    """What is wrong with a marker's content (``None``: nothing); ``step`` and ``owner``
    are those its file name and directory say."""
    if not isinstance(raw, dict):
        return f"not a JSON object but {type(raw).__name__}"
    hex16 = {name: isinstance(raw.get(name), str) and bool(_HEX16_RE.match(raw[name]))
             for name in ("checksum", "header_checksum")}
    checks = (
        ("step", _is_int(raw.get("step"), 0, MAX_STEP) and raw.get("step") == step,
         f"the step {step} of its directory"),
        ("owner", _is_int(raw.get("owner"), 0, MAX_WORLD - 1) and raw.get("owner") == owner,
         f"the owner {owner} of its name"),
        ("world", _is_int(raw.get("world"), 1, MAX_WORLD), f"an integer in 1..{MAX_WORLD}"),
        ("length", _is_int(raw.get("length"), 0, MAX_STEP), "a non-negative integer"),
        ("algorithm", raw.get("algorithm") == "xxh3_64", "'xxh3_64'"),
        ("checksum", hex16["checksum"], "16 hex digits"),
        ("header_checksum", hex16["header_checksum"], "16 hex digits"),
        ("header", isinstance(raw.get("header"), str), "a base64 string"),
        ("job", _is_job(raw.get("job")), "an object with a root and a 32-hex-digit run id"),
    )
    for name, ok, expected in checks:
        if not ok:
            return f"its {name!r} is {_short(raw.get(name))}, expected {expected}"
    if raw["owner"] >= raw["world"]:
        return f"its owner {raw['owner']} is not a rank of its world of {raw['world']}"
    return None


def _is_job(job: Any) -> bool:
    return (isinstance(job, dict) and isinstance(job.get("root"), str) and 0 < len(job["root"]) <= _MAX_ROOT_CHARS
            and isinstance(job.get("run"), str) and bool(_RUN_RE.match(job["run"])))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_marker(data: bytes, step: int, owner: int, where: str) -> Dict[str, Any]:
    """The marker ``data`` of ``owner``'s copy of ``step`` (found at ``where``), every
    field checked; :class:`CheckpointingException` naming the field otherwise."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointingException(f"Local tier: the marker {where} is not JSON: {e}") from e
    problem = _problem(raw, step, owner)
    if problem is not None:
        raise CheckpointingException(f"Local tier: the marker {where} is damaged: {problem}")
    return {k: raw[k] for k in ("step", "owner", "world", "length", "algorithm", "checksum", "header",
                                "header_checksum")} | {"job": {"root": raw["job"]["root"], "run": raw["job"]["run"]}}
