"""The local tier's files (:mod:`.tier`) in a node-local directory: per step
``local_{step:07d}/``, per owner rank the raw flat buffer ``rank_{owner:05d}.pt`` and then
its marker ``rank_{owner:05d}.done`` (step, world size, length, the header, xxh3-64 of
both, the job that wrote it: :mod:`.marker`), written atomically without ``fsync``;
reading them back (verified), listing (every marker validated), removing.

Owns: the files: ``local_{step:07d}/rank_{owner:05d}.pt`` raw, then the marker
``rank_{owner:05d}.done`` (step, world, length, header, xxh3-64 of the tensor bytes and of
the header, the job) — both ``write_atomic`` on a ``PosixStorage(durable=False)``, the
marker last, no ``fsync``: a restart of the job finds them in the page cache, and after a
crash of the node the checksums decide; reading (verified, or mapped to send; markers and
payloads only as regular files), listing (valid markers only), removing.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import stat
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ...core import CheckpointingException
from ...integrity.checksums import checksum, new_hasher
from ...mapping import ShardedStateDict
from ...storage import PosixStorage, RangeReader, Storage, storage_for
from ...storage.base import byte_view
from .format import decode_header, dtype_of
from .marker import MAX_MARKER_BYTES, Job, parse_marker
from .snapshot import check_ids, loaded_result, sharded_targets, target_tensor

logger = logging.getLogger(__name__)

_STEP_DIR_RE = re.compile(r"^local_(\d{7,})$")
_MARKER_RE = re.compile(r"^rank_(\d{5,})\.done$")


def local_step_dir(step: int) -> str:
    """The name of ``step``'s directory in a node-local directory."""
    return f"local_{step:07d}"


def payload_name(owner: int) -> str:
    return f"rank_{owner:05d}.pt"


def marker_name(owner: int) -> str:
    return f"rank_{owner:05d}.done"


def _step_storage(node_dir: str, step: int) -> Storage:
    """A step's directory. Its files are not ``fsync``ed: a copy serves a restart of the
    job (the page cache outlives the processes); after a crash of the node, each copy's
    checksum decides whether it is used (else a replica, else the persistent tier)."""
    return PosixStorage(os.path.join(node_dir, local_step_dir(step)), durable=False)


def write_copy(node_dir: str, step: int, owner: int, world: int, flat: torch.Tensor, header: bytes,
               flat_sum: int, job: Job) -> None:
    """Write ``owner``'s flat buffer of ``step`` and then its marker (the header, the
    checksums, ``job``), atomically."""
    storage = _step_storage(node_dir, step)
    marker = {"step": step, "owner": owner, "world": world, "length": flat.numel(), "algorithm": "xxh3_64",
              "checksum": f"{flat_sum:016x}", "header": base64.b64encode(header).decode(),
              "header_checksum": f"{checksum(header):016x}", "job": job}
    try:
        storage.make_root()
        storage.write_atomic(payload_name(owner), byte_view(flat.numpy()))
        storage.write_atomic(marker_name(owner), json.dumps(marker).encode())
    except OSError as e:
        raise CheckpointingException(
            f"Local tier: cannot write rank {owner}'s copy of step {step} to {storage.describe()}: {e}") from e


def read_header(node_dir: str, marker: Dict[str, Any]) -> Tuple[bytes, Dict[str, Any]]:
    """The encoded header a marker holds, and its content (checksum verified, decoded
    safely: :func:`.format.decode_header`)."""
    where = f"rank {marker['owner']}'s copy of step {marker['step']} in {node_dir}"
    try:
        header = base64.b64decode(marker["header"], validate=True)
    except ValueError as e:
        raise CheckpointingException(f"Local tier: the marker of {where} holds no base64 header: {e}") from e
    if f"{checksum(header):016x}" != marker["header_checksum"]:
        raise CheckpointingException(f"Local tier: the marker of {where} fails its checksum")
    return header, decode_header(header, where, marker["length"])


def _read_all(reader: Any, buf: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(buf):
        n = reader.readinto(buf[done:], offset + done)
        if n <= 0:
            raise CheckpointingException(f"Local tier: {where} is shorter than its marker says")
        done += n


@contextmanager
def _payload(node_dir: str, marker: Dict[str, Any]) -> Iterator[Tuple[RangeReader, str, bytes, Dict[str, Any]]]:
    """The payload a marker describes, open and of the size the marker says: ``(reader,
    its description, the pickled header, the header)``; storage errors inside the block
    become :class:`CheckpointingException` naming the file."""
    storage = _step_storage(node_dir, marker["step"])
    name = payload_name(marker["owner"])
    where = storage.describe(name)
    header, content = read_header(node_dir, marker)
    try:
        if not stat.S_ISREG(os.lstat(os.path.join(node_dir, local_step_dir(marker["step"]), name)).st_mode):
            raise CheckpointingException(f"Local tier: {where} is not a regular file")
        reader = storage.open_reader(name)
    except OSError as e:
        raise CheckpointingException(f"Local tier: cannot read {where}: {e}") from e
    try:
        if reader.size != marker["length"]:
            raise CheckpointingException(f"Local tier: {where} has {reader.size} bytes, "
                                         f"its marker says {marker['length']}")
        yield reader, where, header, content
    except OSError as e:
        raise CheckpointingException(f"Local tier: cannot read {where}: {e}") from e
    finally:
        reader.close()


def map_copy(node_dir: str, marker: Dict[str, Any]) -> Tuple[torch.Tensor, bytes, Dict[str, Any]]:
    """The payload a marker describes, to send as it is (the receiver verifies the
    checksum): a private map of the file where the storage can map, else read into a new
    buffer; with the encoded header and its content. :class:`CheckpointingException` if it
    is missing or of the wrong size."""
    with _payload(node_dir, marker) as (reader, where, header, content):
        mapped = reader.map()
        if mapped is not None:
            return torch.frombuffer(mapped, dtype=torch.uint8), header, content
        out = torch.empty(marker["length"], dtype=torch.uint8)
        _read_all(reader, byte_view(out.numpy()), 0, where)
        return out, header, content


def read_copy(node_dir: str, marker: Dict[str, Any], sharded_state_dict: ShardedStateDict,
              rank: int) -> Tuple[Any, bytes]:
    """Read the copy a marker describes, verifying its checksum: the requested
    ShardedTensors into their own tensors, the saved plain tensors (common state) into new
    ones, the other tensors only hashed. Returns what ``dist_checkpointing.load`` returns
    for the request (:func:`.snapshot.loaded_result`) and the pickled header.
    :class:`CheckpointingException` if the copy is missing, short or damaged."""
    hasher = new_hasher()
    with _payload(node_dir, marker) as (reader, where, header, content):
        targets = sharded_targets(sharded_state_dict)
        check_ids(targets, content, rank)
        common: Dict[str, torch.Tensor] = {}
        scratch = torch.empty(0, dtype=torch.uint8)
        for entry in content["layout"]:
            ident, offset, nbytes = entry[0], entry[1], entry[2]
            if ident not in targets and not ident.startswith("c:"):  # not requested: only hashed
                scratch = scratch if scratch.numel() else torch.empty(min(nbytes, _SCRATCH), dtype=torch.uint8)
                for start in range(0, nbytes, _SCRATCH):
                    view = byte_view(scratch[:min(_SCRATCH, nbytes - start)].numpy())
                    _read_all(reader, view, offset + start, where)
                    hasher.update(view)
                continue
            tensor = target_tensor(targets[ident], entry, rank) if ident in targets else torch.empty(
                tuple(entry[4]), dtype=dtype_of(entry[3]))
            dest = tensor if tensor.is_contiguous() and tensor.device.type == "cpu" else torch.empty_like(
                tensor, device="cpu", memory_format=torch.contiguous_format)
            view = byte_view(dest.reshape(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
            _read_all(reader, view, offset, where)
            hasher.update(view)
            if dest is not tensor:
                tensor.copy_(dest)
            if ident not in targets:
                common[ident] = tensor
    if f"{hasher.intdigest():016x}" != marker["checksum"]:
        raise CheckpointingException(f"Local tier: {where} fails its checksum")
    return loaded_result(sharded_state_dict, content, common, rank), header


_SCRATCH = 16 << 20  # bytes read at a time of a tensor that is only hashed


def _read_marker(path: str) -> bytes:
    """A marker's bytes: a regular file (never a link, a FIFO or a device) of at most
    :data:`.marker.MAX_MARKER_BYTES`."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointingException(f"Local tier: the marker {path} is not a regular file")
        if st.st_size > MAX_MARKER_BYTES:
            raise CheckpointingException(f"Local tier: the marker {path} has {st.st_size} bytes "
                                         f"(more than {MAX_MARKER_BYTES})")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_MARKER_BYTES + 1)
    finally:
        os.close(fd)


def scan(node_dir: str, damaged: Optional[List[Tuple[int, int]]] = None) -> List[Dict[str, Any]]:
    """The valid markers found in a node-local directory. A marker that cannot be read or
    is not valid (:func:`.marker.parse_marker`) is a damaged copy: skipped (logged),
    its ``(step, owner)`` appended to ``damaged`` when given."""
    found: List[Dict[str, Any]] = []
    root = storage_for(node_dir)
    if root.kind() != "dir":
        return found
    for name in root.list():
        match = _STEP_DIR_RE.match(name.rstrip("/"))
        if not match:
            continue
        step = int(match.group(1))
        step_storage = storage_for(os.path.join(node_dir, name.rstrip("/")))
        for file in step_storage.list():
            file_match = _MARKER_RE.match(file)
            if not file_match:
                continue
            owner = int(file_match.group(1))
            try:
                found.append(parse_marker(_read_marker(os.path.join(node_dir, name.rstrip("/"), file)), step, owner,
                                          step_storage.describe(file)))
            except FileNotFoundError:  # deleted since the listing (an older step's cleanup)
                continue
            except (OSError, CheckpointingException) as e:
                logger.warning("Local tier: skipping %s (a damaged copy): %s", step_storage.describe(file), e)
                if damaged is not None:
                    damaged.append((step, owner))
    return found


def remove_copies(node_dir: str, step: int, owners: Sequence[int]) -> None:
    """Delete ``owners``' files of ``step`` (marker first), then the step's directory if
    it is empty; errors are logged."""
    storage = _step_storage(node_dir, step)
    for owner in owners:
        for name in (marker_name(owner), payload_name(owner)):
            try:
                storage.delete(name)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("Local tier: cannot delete %s: %s", storage.describe(name), e)
    try:
        os.rmdir(os.path.join(node_dir, local_step_dir(step)))
    except OSError:
        pass  # other ranks' files are still there
