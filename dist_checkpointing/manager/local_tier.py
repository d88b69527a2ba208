"""The local tier of two-tier checkpointing: frequent per-rank checkpoints in node-local
directories, each replicated to partner ranks on other nodes over the process group.

Every rank writes its own shards only (no cross-rank planning): a snapshot of its
``sharded_state_dict`` — every tensor (ShardedTensors' local data, keyed by ``key`` and
global offset) copied into one flat byte buffer, reused from save to save; a header (the
buffer's layout, the other values — ShardedObjects' data by unique key, the rest by path
— and each entry's sharding, pickled: :mod:`.local_format`) — goes raw into ``{node dir}/local_{step:07d}/rank_{owner:05d}.pt``, then
a marker ``rank_{owner:05d}.done`` (step, world size, length, the header, xxh3-64
checksums of both) is written last, both atomically. The snapshot is taken while ``save``
blocks; checksumming, writing (the own copy while replicating) and replicating happen in a background thread, over a
process group of its own.
A step counts in the local tier once every rank has written its own copy and every
replica (agreed at :meth:`LocalTier.finalize`); a step that failed anywhere is removed
everywhere and not counted. Restoring is in :mod:`.local_restore`.
"""

from __future__ import annotations

import base64
import json
import logging
import mmap
import os
import pickle
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..bytes_view import as_bytes
from ..collectives import all_reduce_max_uint8, get_rank, get_world_size, run_agreed
from ..core import CheckpointingException
from ..integrity import checksum, new_hasher
from ..mapping import ShardedObject, ShardedStateDict
from ..sharded_tensor import ShardedTensor
from ..storage import PosixStorage, Storage, storage_for, url_scheme
from ..storage.base import byte_view
from ..strategies.async_utils import ForkedCall
from ..strategies.memory_maps import not_isolated_by_fork
from ..transport import PGTransport
from .crash import crash_point
from .local_format import Entry, encode_header, leaf_id, walk

logger = logging.getLogger(__name__)

#: test-only fault: a rank whose environment sets this to a step (or ``any``) fails while
#: storing a replica it received for that step (after the transfer).
FAIL_RECV_ENV = "DIST_CKPT_LOCAL_FAIL_RECV"
#: test-only fault: a rank whose environment sets this has its forked snapshot die.
FAIL_SNAPSHOT_ENV = "DIST_CKPT_LOCAL_FAIL_SNAPSHOT"
_STEP_DIR_RE = re.compile(r"^local_(\d{7,})$")
_MARKER_RE = re.compile(r"^rank_(\d{5,})\.done$")


def local_step_dir(step: int) -> str:
    """The name of ``step``'s directory in a node-local directory."""
    return f"local_{step:07d}"


def payload_name(owner: int) -> str:
    return f"rank_{owner:05d}.pt"


def marker_name(owner: int) -> str:
    return f"rank_{owner:05d}.done"


def nodes_from_env(world: int) -> List[int]:
    """Each rank's node from torchrun's ``LOCAL_WORLD_SIZE`` (ranks are numbered node by
    node, as torchrun does); without it, one node per rank."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return [r // per_node for r in range(world)]


def partners(node_of_rank: Sequence[int], rank: int, copies: int) -> List[int]:
    """The ``copies`` ranks that hold replicas of ``rank``'s shards: the ranks with the
    same index within their node on the next ``copies`` nodes (in node order, cyclically)."""
    nodes = sorted(set(node_of_rank))
    members = {n: [r for r, m in enumerate(node_of_rank) if m == n] for n in nodes}
    mine = node_of_rank[rank]
    index = members[mine].index(rank)
    out = []
    for k in range(1, copies + 1):
        other = members[nodes[(nodes.index(mine) + k) % len(nodes)]]
        out.append(other[index % len(other)])
    return out


# ----------------------------------------------------------------------------- payloads

_ALIGN = 64  # each tensor's offset in the flat buffer (a uint8 slice can be viewed as any dtype)

def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.rsplit(".", 1)[-1])


def _slot(flat: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The tensor ``entry`` describes, a view of ``flat``."""
    _, offset, nbytes, dtype, shape = entry
    return flat[offset:offset + nbytes].view(_dtype(dtype)).view(shape)


class Snapshot:
    """This rank's state as one flat uint8 buffer (every tensor, aligned) and a header: the
    layout of the buffer and the other values, pickled. The constructor plans the layout
    only; :meth:`take` copies the tensors in."""

    def __init__(self, sharded_state_dict: ShardedStateDict):
        self.tensors: List[torch.Tensor] = []
        values: Dict[str, Any] = {}
        self.layout: List[Entry] = []
        self.size = 0

        def visit(path: str, leaf: Any) -> None:
            ident = leaf_id(path, leaf)
            if isinstance(leaf, ShardedTensor):
                if leaf.data is None:
                    raise CheckpointingException(f"Local tier: ShardedTensor {leaf.key!r} has no data")
                self._add(ident, leaf.data.detach())
            elif isinstance(leaf, torch.Tensor):
                self._add(ident, leaf.detach())
            elif hasattr(leaf, "build") and hasattr(leaf, "merge_fn"):  # a ShardedTensorFactory
                raise CheckpointingException(f"Local tier: ShardedTensorFactory {getattr(leaf, 'key', path)!r} "
                                             f"at {path} is not supported; apply the factory first")
            else:
                values[ident] = leaf.data if isinstance(leaf, ShardedObject) else leaf

        walk(sharded_state_dict, "", visit)
        self.header = encode_header(sharded_state_dict, self.layout, values)
        self.flat: Optional[torch.Tensor] = None  # set by take()
        self.checksum: Optional[int] = None  # of the tensor bytes (set by take() when forked)

    def _add(self, ident: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.layout.append((ident, self.size, nbytes, str(t.dtype), tuple(t.shape)))
        self.tensors.append(t)
        self.size += -(-nbytes // _ALIGN) * _ALIGN

    def take(self, buffer: torch.Tensor, fork: bool) -> Optional[ForkedCall]:
        """Copy the tensors into ``buffer`` (at least :attr:`size` bytes). ``fork``: in a
        forked child, which sees the tensors as they are now (copy-on-write; ``buffer``
        must be shared memory), except tensors in memory a fork does not isolate (shared
        or file-backed mappings), copied here first: returns the child at once; its result
        is the checksum of the tensor bytes. Else all on this thread (e.g. a device-to-host
        copy); returns None."""
        self.flat = buffer[:self.size]
        here = not_isolated_by_fork(self.tensors) if fork else [True] * len(self.tensors)
        for entry, t, now in zip(self.layout, self.tensors, here):
            if now:
                _slot(self.flat, entry).copy_(t)
        tensors, self.tensors = self.tensors, []
        if not fork:
            return None
        pairs = [(self.flat.numpy()[offset:offset + nbytes], None if now else as_bytes(t).numpy())
                 for (_, offset, nbytes, _, _), t, now in zip(self.layout, tensors, here) if nbytes]

        def copy_and_hash() -> int:  # in the child: numpy copies (no torch thread pool after a fork)
            if os.environ.get(FAIL_SNAPSHOT_ENV):
                os._exit(3)
            hasher = new_hasher()
            for dst, src in pairs:
                for start in range(0, len(dst), _HASH_CHUNK):  # hashed while hot in the cache
                    if src is not None:
                        np.copyto(dst[start:start + _HASH_CHUNK], src[start:start + _HASH_CHUNK])
                    hasher.update(dst[start:start + _HASH_CHUNK])
            return hasher.intdigest()

        return ForkedCall(copy_and_hash, "Local tier snapshot")


_HASH_CHUNK = 1 << 20


def can_fork(snap: Snapshot) -> bool:
    """Whether ``snap`` can be taken in a forked child: every tensor a plain CPU tensor
    and ``os.fork`` available."""
    return hasattr(os, "fork") and all(t.device.type == "cpu" and type(t) is torch.Tensor for t in snap.tensors)


def shared_buffer(size: int) -> torch.Tensor:
    """A flat uint8 buffer of ``size`` bytes in anonymous shared memory (a forked child's
    writes reach this process; not limited by the size of ``/dev/shm``)."""
    return torch.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=torch.uint8)


def tensors_checksum(tensors: Sequence[torch.Tensor]) -> int:
    """xxh3-64 of the bytes of ``tensors`` (CPU), one after the other."""
    hasher = new_hasher()
    for t in tensors:
        hasher.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return hasher.intdigest()


def flat_checksum(flat: torch.Tensor, layout: List[Entry]) -> int:
    """xxh3-64 of the tensor bytes of ``flat`` in layout order (padding excluded)."""
    return tensors_checksum([flat[offset:offset + nbytes] for _, offset, nbytes, _, _ in layout])


def tensor_views(flat: torch.Tensor, layout: List[Entry]) -> Dict[str, torch.Tensor]:
    """The tensors of ``flat`` (views), by id."""
    return {e[0]: _slot(flat, e) for e in sorted(layout)}


def wire_state(flat: torch.Tensor, header: bytes, flat_sum: int) -> Dict[str, Any]:
    """What a holder sends to restore a rank: its tensors (views of ``flat``, by id), the
    header and the checksum."""
    return {"tensors": tensor_views(flat, pickle.loads(header)["layout"]), "header": header, "checksum": flat_sum}


def receiving_state(sharded_state_dict: ShardedStateDict) -> Dict[str, Any]:
    """The receiver's side of :func:`wire_state`: its own tensors, filled in place."""
    tensors = {i: (leaf.data if isinstance(leaf, ShardedTensor) else leaf)
               for i, leaf in sorted(_targets(sharded_state_dict).items())
               if isinstance(leaf, (ShardedTensor, torch.Tensor))}
    return {"tensors": tensors, "header": b"", "checksum": 0}


class LayoutMismatch(CheckpointingException):
    """The state to load into does not match the saved one (not a damaged copy)."""


def _targets(sharded_state_dict: ShardedStateDict) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    walk(sharded_state_dict, "", lambda path, leaf: out.__setitem__(leaf_id(path, leaf), leaf))
    return out


def _target_tensor(leaf: Any, entry: Entry, rank: int) -> torch.Tensor:
    ident, _, _, dtype, shape = entry
    tensor = leaf.data if isinstance(leaf, ShardedTensor) else leaf
    if not isinstance(tensor, torch.Tensor) or str(tensor.dtype) != dtype or tuple(tensor.shape) != tuple(shape):
        got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise LayoutMismatch(f"Local tier: rank {rank}: {ident[2:]!r} was saved as {tuple(shape)} {dtype}, "
                                     f"the state to load into has {got}")
    return tensor


def _result(sharded_state_dict: ShardedStateDict, values: Dict[str, Any], rank: int) -> Any:
    """``sharded_state_dict`` as ``dist_checkpointing.load`` returns it: tensors (filled in
    place) for ShardedTensors, saved values for the rest."""

    def visit(path: str, leaf: Any) -> Any:
        ident = leaf_id(path, leaf)
        if isinstance(leaf, ShardedTensor):
            return leaf.data
        if isinstance(leaf, torch.Tensor):
            return leaf
        if ident not in values:
            raise CheckpointingException(f"Local tier: rank {rank} saved no {ident[2:]!r} (at {path})")
        return values[ident]

    return walk(sharded_state_dict, "", visit)


def _check_ids(targets: Dict[str, Any], header: Dict[str, Any], rank: int) -> None:
    saved = {e[0] for e in header["layout"]} | set(header["values"])
    missing = sorted(i for i, leaf in targets.items() if i not in saved)
    if missing:
        raise LayoutMismatch(f"Local tier: rank {rank} saved no {missing[0][2:]!r}")


def fill_received(sharded_state_dict: ShardedStateDict, received: Dict[str, Any], rank: int, what: str) -> Any:
    """``sharded_state_dict`` loaded from a :func:`wire_state` received in place; its
    checksum verified."""
    header = pickle.loads(received["header"])
    _check_ids(_targets(sharded_state_dict), header, rank)
    if tensors_checksum([received["tensors"][e[0]] for e in header["layout"]]) != received["checksum"]:
        raise CheckpointingException(f"Local tier: {what} arrived damaged")
    return _result(sharded_state_dict, header["values"], rank)


# ----------------------------------------------------------------------------- files

def _step_storage(node_dir: str, step: int) -> Storage:
    """A step's directory. Its files are not ``fsync``ed: a copy serves a restart of the
    job (the page cache outlives the processes); after a crash of the node, each copy's
    checksum decides whether it is used (else a replica, else the persistent tier)."""
    return PosixStorage(os.path.join(node_dir, local_step_dir(step)), durable=False)


def write_copy(node_dir: str, step: int, owner: int, world: int, flat: torch.Tensor, header: bytes,
               flat_sum: int) -> None:
    """Write ``owner``'s flat buffer of ``step`` and then its marker (the header, the
    checksums), atomically."""
    storage = _step_storage(node_dir, step)
    marker = {"step": step, "owner": owner, "world": world, "length": flat.numel(), "algorithm": "xxh3_64",
              "checksum": f"{flat_sum:016x}", "header": base64.b64encode(header).decode(),
              "header_checksum": f"{checksum(header):016x}"}
    try:
        storage.make_root()
        storage.write_atomic(payload_name(owner), byte_view(flat.numpy()))
        storage.write_atomic(marker_name(owner), json.dumps(marker).encode())
    except OSError as e:
        raise CheckpointingException(
            f"Local tier: cannot write rank {owner}'s copy of step {step} to {storage.describe()}: {e}") from e


def read_header(node_dir: str, marker: Dict[str, Any]) -> Tuple[bytes, Dict[str, Any]]:
    """The pickled header a marker holds, and its content (checksum verified)."""
    header = base64.b64decode(marker["header"])
    if f"{checksum(header):016x}" != marker["header_checksum"]:
        raise CheckpointingException(f"Local tier: the marker of rank {marker['owner']}'s copy of step "
                                     f"{marker['step']} in {node_dir} fails its checksum")
    return header, pickle.loads(header)


def _read_all(reader: Any, buf: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(buf):
        n = reader.readinto(buf[done:], offset + done)
        if n <= 0:
            raise CheckpointingException(f"Local tier: {where} is shorter than its marker says")
        done += n


def map_copy(node_dir: str, marker: Dict[str, Any]) -> Tuple[torch.Tensor, bytes]:
    """The payload a marker describes, to send as it is (the receiver verifies the
    checksum): a private map of the file where the storage can map, else read into a new
    buffer; with the pickled header. :class:`CheckpointingException` if it is missing or
    of the wrong size."""
    storage = _step_storage(node_dir, marker["step"])
    name = payload_name(marker["owner"])
    header, _ = read_header(node_dir, marker)
    try:
        reader = storage.open_reader(name)
    except OSError as e:
        raise CheckpointingException(f"Local tier: cannot read {storage.describe(name)}: {e}") from e
    try:
        if reader.size != marker["length"]:
            raise CheckpointingException(f"Local tier: {storage.describe(name)} has {reader.size} bytes, "
                                         f"its marker says {marker['length']}")
        mapped = reader.map()
        if mapped is not None:
            return torch.frombuffer(mapped, dtype=torch.uint8), header
        out = torch.empty(marker["length"], dtype=torch.uint8)
        _read_all(reader, byte_view(out.numpy()), 0, storage.describe(name))
        return out, header
    except OSError as e:
        raise CheckpointingException(f"Local tier: cannot read {storage.describe(name)}: {e}") from e
    finally:
        reader.close()


def read_copy(node_dir: str, marker: Dict[str, Any], sharded_state_dict: ShardedStateDict,
              rank: int) -> Tuple[Any, bytes]:
    """Read the copy a marker describes into the tensors of ``sharded_state_dict``,
    verifying its checksum; returns its loaded form and the pickled header.
    :class:`CheckpointingException` if it is missing, short or damaged."""
    storage = _step_storage(node_dir, marker["step"])
    name = payload_name(marker["owner"])
    header, content = read_header(node_dir, marker)
    hasher = new_hasher()
    try:
        reader = storage.open_reader(name)
    except OSError as e:
        raise CheckpointingException(f"Local tier: cannot read {storage.describe(name)}: {e}") from e
    try:
        if reader.size != marker["length"]:
            raise CheckpointingException(f"Local tier: {storage.describe(name)} has {reader.size} bytes, "
                                         f"its marker says {marker['length']}")
        targets = _targets(sharded_state_dict)
        _check_ids(targets, content, rank)
        for entry in content["layout"]:
            if entry[0] not in targets:
                continue
            tensor = _target_tensor(targets[entry[0]], entry, rank)
            dest = tensor if tensor.is_contiguous() and tensor.device.type == "cpu" else torch.empty_like(
                tensor, device="cpu", memory_format=torch.contiguous_format)
            view = byte_view(dest.reshape(-1).view(torch.uint8).numpy()) if entry[2] else memoryview(b"")
            _read_all(reader, view, entry[1], storage.describe(name))
            hasher.update(view)
            if dest is not tensor:
                tensor.copy_(dest)
        out = _result(sharded_state_dict, content["values"], rank)
    except OSError as e:
        raise CheckpointingException(f"Local tier: cannot read {storage.describe(name)}: {e}") from e
    finally:
        reader.close()
    if f"{hasher.intdigest():016x}" != marker["checksum"]:
        raise CheckpointingException(f"Local tier: {storage.describe(name)} fails its checksum")
    return out, header


def scan(node_dir: str) -> List[Dict[str, Any]]:
    """The markers found in a node-local directory (unreadable ones are skipped)."""
    found: List[Dict[str, Any]] = []
    root = storage_for(node_dir)
    if root.kind() != "dir":
        return found
    for name in root.list():
        if not _STEP_DIR_RE.match(name.rstrip("/")):
            continue
        step_storage = storage_for(os.path.join(node_dir, name.rstrip("/")))
        for file in step_storage.list():
            if _MARKER_RE.match(file):
                try:
                    found.append(json.loads(step_storage.read_bytes(file)))
                except FileNotFoundError:  # deleted since the listing (an older step's cleanup)
                    continue
                except (OSError, ValueError) as e:
                    logger.warning("Local tier: skipping %s: %s", step_storage.describe(file), e)
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


# ----------------------------------------------------------------------------- exchange

def exchange(transport: PGTransport, sends: Dict[int, Any], sources: Sequence[int]) -> Dict[int, Any]:
    """Send ``sends[dst]`` to each ``dst`` (an exception: tell ``dst`` that nothing comes,
    and why) while receiving one state from each of ``sources`` (in a helper thread, so
    that pairs sending to each other do not wait on each other). Raises the first error of
    either side, after every send was tried."""
    received: Dict[int, Any] = {}
    errors: List[BaseException] = []

    def receive() -> None:
        for src in sources:  # every sender is answered, whatever the others do
            try:
                received[src] = transport.recv_checkpoint(src)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

    thread = threading.Thread(target=receive, name="local-tier-recv", daemon=True)
    thread.start()
    try:
        for dst, state in sends.items():  # every receiver gets its transfer (or its refusal), whatever the others do
            if isinstance(state, BaseException):
                transport.send_failure([dst], f"rank {get_rank()} has no state to send: {state}")
                errors.append(state)
                continue
            try:
                transport.send_checkpoint([dst], state)
            except CheckpointingException as e:
                errors.append(e)
    finally:
        thread.join()
    if errors:
        raise errors[0]
    return received


class LocalTier:
    """The local tier of one rank (collective constructor: creates a gloo group of its own).

    Args:
        local_dir: the node-local directory; ``{node}`` and ``{rank}`` are replaced.
        interval: save every that many steps.
        replication_factor: copies of each rank's shards (its own + partners on other nodes).
        node_of_rank: each rank's node (default: from torchrun's ``LOCAL_WORLD_SIZE``).
        timeout: the longest wait of a transfer.
        snapshot: ``"fork"`` (CPU tensors: :meth:`save` blocks for a fork, a child copies)
            or ``"copy"`` (:meth:`save` copies on the calling thread).
    """

    def __init__(self, local_dir: str, interval: int, replication_factor: int = 1,
                 node_of_rank: Optional[Sequence[int]] = None, timeout: timedelta = timedelta(minutes=5),
                 snapshot: str = "fork"):
        self.rank, self.world = get_rank(), get_world_size()
        self.interval = interval
        nodes = list(node_of_rank) if node_of_rank is not None else nodes_from_env(self.world)
        if len(nodes) != self.world:
            raise CheckpointingException(
                f"Local tier: node_of_rank has {len(nodes)} entries for a world of {self.world} ranks")
        if not 1 <= replication_factor <= len(set(nodes)):
            raise CheckpointingException(
                f"Local tier: replication_factor {replication_factor} needs as many nodes; there are {len(set(nodes))}")
        self.node_of_rank = nodes
        self.node_dir = str(local_dir).format(node=nodes[self.rank], rank=self.rank)
        if url_scheme(self.node_dir):
            raise CheckpointingException(f"Local tier: local_dir must be a node-local path, not {self.node_dir!r}")
        self.sends_to = partners(nodes, self.rank, replication_factor - 1)
        self.receives_from = [r for r in range(self.world) if self.rank in partners(nodes, r, replication_factor - 1)]
        run_agreed(self._check_writable, "Local tier")
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.timeout = timeout
        self.transport = PGTransport(self.group, timeout, torch.device("cpu"))
        self.complete: List[int] = []  # steps complete in the local tier (this run)
        self._pending: Optional[Tuple[int, threading.Thread, List[BaseException]]] = None
        self._buffer: Optional[torch.Tensor] = None  # the snapshot buffer (shared memory), reused once the save in flight is done
        if snapshot not in ("fork", "copy"):
            raise CheckpointingException(f"Local tier: snapshot must be 'fork' or 'copy', not {snapshot!r}")
        self.snapshot = snapshot

    def _check_writable(self) -> None:
        probe = f".probe_rank_{self.rank:05d}"
        storage: Storage = storage_for(self.node_dir)
        try:
            storage.make_root()
            storage.write_atomic(probe, b"ok")
            storage.delete(probe)
        except OSError as e:
            raise CheckpointingException(f"Local tier: the node-local directory {self.node_dir} "
                                         f"(rank {self.rank}) is not writable: {e}") from e

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0 and step > max(self.complete, default=-1)

    def save(self, step: int, sharded_state_dict: ShardedStateDict) -> None:
        """Snapshot this rank's state and write and replicate it in the background. The
        snapshot blocks for a fork (CPU tensors, ``snapshot="fork"``: a child copies them
        into the shared snapshot buffer as they were at the fork) or for one copy into
        that buffer on this thread (otherwise)."""

        def take() -> Tuple[Snapshot, Optional[ForkedCall]]:
            snap = Snapshot(sharded_state_dict)
            if self._buffer is None or self._buffer.numel() < snap.size:
                self._buffer = shared_buffer(snap.size)
            return snap, snap.take(self._buffer, self.snapshot == "fork" and can_fork(snap))

        snap, child = run_agreed(take, f"Local tier: saving step {step}")
        errors: List[BaseException] = []

        def work() -> None:
            try:
                crash_point("local", step)
                try:
                    flat_sum = child.result() if child is not None else flat_checksum(snap.flat, snap.layout)
                except BaseException as e:  # noqa: BLE001 - the partners are told, then it is reported
                    exchange(self.transport, {dst: e for dst in self.sends_to}, self.receives_from)
                    raise
                message = {"data": snap.flat, "header": snap.header, "checksum": flat_sum}
                with ThreadPoolExecutor(1, thread_name_prefix="local-tier-write") as pool:  # own copy while replicating
                    own = pool.submit(write_copy, self.node_dir, step, self.rank, self.world, snap.flat, snap.header,
                                      flat_sum)
                    received = exchange(self.transport, {dst: message for dst in self.sends_to}, self.receives_from)
                    own.result()
                for src, got in received.items():
                    if os.environ.get(FAIL_RECV_ENV) in (str(step), "any"):
                        raise CheckpointingException(f"Local tier: injected failure storing rank {src}'s replica")
                    layout = pickle.loads(got["header"])["layout"]
                    if flat_checksum(got["data"], layout) != got["checksum"]:
                        raise CheckpointingException(f"Local tier: rank {src}'s replica of step {step} arrived damaged")
                    write_copy(self.node_dir, step, src, self.world, got["data"], got["header"], got["checksum"])
            except BaseException as e:  # noqa: BLE001 - reported at finalize
                errors.append(e)

        thread = threading.Thread(target=work, name=f"local-tier-{step}", daemon=True)
        thread.start()
        self._pending = (step, thread, errors)

    def finalize(self, blocking: bool = True) -> Optional[int]:
        """Wait for the local save in flight (``blocking=False``: only if every rank has
        finished it; one 1-byte ``all_reduce``) and agree whether it succeeded on every
        rank (collective). A failed step is removed everywhere (a warning names the error);
        after a success the older local steps are removed. Returns the completed step."""
        if self._pending is None:
            return None
        step, thread, errors = self._pending
        if not blocking and all_reduce_max_uint8([int(thread.is_alive())], self.group)[0]:
            return None
        self._pending = None
        thread.join()
        mine = [self.rank, *self.receives_from]

        def check() -> None:
            if errors:
                raise errors[0]

        try:
            run_agreed(check, f"Local tier: step {step}")
        except CheckpointingException as e:
            logger.warning("Local tier: step %d is not counted: %s", step, e)
            remove_copies(self.node_dir, step, mine)
            return None
        for old in {m["step"] for m in scan(self.node_dir) if m["step"] < step}:
            remove_copies(self.node_dir, old, mine)
        self.complete.append(step)
        return step

    def close(self) -> None:
        """Finish the local save in flight (collective) and drop the group."""
        self.finalize()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
