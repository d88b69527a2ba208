"""The local tier of two-tier checkpointing: frequent per-rank checkpoints in node-local
directories, each replicated to partner ranks on other nodes over the process group.

Every rank writes its own shards only (no cross-rank planning): a snapshot of its
``sharded_state_dict`` — each ShardedTensor's local data keyed by ``key`` and global
offset, each ShardedObject's data by its unique key, every other value by its path — is
serialized with ``torch.save`` into ``{node dir}/local_{step:07d}/rank_{owner:05d}.pt``,
then a marker ``rank_{owner:05d}.done`` (step, world size, length, xxh3-64 checksum) is
written last, both atomically. The snapshot is taken while ``save`` blocks; serializing,
writing and replicating happen in a background thread, over a process group of its own.
A step counts in the local tier once every rank has written its own copy and every
replica (agreed at :meth:`LocalTier.finalize`); a step that failed anywhere is removed
everywhere and not counted. Restoring is in :mod:`.local_restore`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..collectives import get_rank, get_world_size, run_agreed
from ..core import CheckpointingException
from ..integrity import checksum
from ..mapping import ShardedObject, ShardedStateDict
from ..sharded_tensor import ShardedTensor
from ..storage import Storage, storage_for
from ..transport import PGTransport

logger = logging.getLogger(__name__)

#: test-only fault: a rank whose environment sets this to a step (or ``any``) fails while
#: storing a replica it received for that step (after the transfer).
FAIL_RECV_ENV = "DIST_CKPT_LOCAL_FAIL_RECV"
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

def _walk(x: Any, path: str, visit: Callable[[str, Any], Any]) -> Any:
    """A copy of the nested dicts/lists ``x`` with each leaf replaced by ``visit(path, leaf)``."""
    if isinstance(x, dict):
        return {k: _walk(v, f"{path}/{k}", visit) for k, v in x.items()}
    if isinstance(x, list):
        return [_walk(v, f"{path}/{i}", visit) for i, v in enumerate(x)]
    return visit(path, x)


def _leaf_id(path: str, leaf: Any) -> str:
    if isinstance(leaf, ShardedTensor):
        return f"t:{leaf.key}@{','.join(map(str, leaf.global_offset))}"
    if isinstance(leaf, ShardedObject):
        return f"o:{leaf.unique_key}"
    return f"c:{path}"


def snapshot(sharded_state_dict: ShardedStateDict) -> Dict[str, Any]:
    """This rank's entries of ``sharded_state_dict``, tensors copied to CPU: id -> value."""
    out: Dict[str, Any] = {}

    def visit(path: str, leaf: Any) -> None:
        if isinstance(leaf, ShardedTensor):
            if leaf.data is None:
                raise CheckpointingException(f"Local tier: ShardedTensor {leaf.key!r} has no data")
            value: Any = leaf.data.detach().to("cpu", copy=True)
        elif isinstance(leaf, ShardedObject):
            value = leaf.data
        elif isinstance(leaf, torch.Tensor):
            value = leaf.detach().to("cpu", copy=True)
        elif hasattr(leaf, "build") and hasattr(leaf, "merge_fn"):  # a ShardedTensorFactory
            raise CheckpointingException(f"Local tier: ShardedTensorFactory {getattr(leaf, 'key', path)!r} at "
                                         f"{path} is not supported; apply the factory first")
        else:
            value = leaf
        out[_leaf_id(path, leaf)] = value

    _walk(sharded_state_dict, "", visit)
    return out


def serialize(entries: Dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(entries, buf)
    return buf.getvalue()


def deserialize(data: bytes, where: str) -> Dict[str, Any]:
    try:
        return torch.load(io.BytesIO(data), weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged copy
        raise CheckpointingException(f"Local tier: cannot read {where}: {e}") from e


def fill(sharded_state_dict: ShardedStateDict, entries: Dict[str, Any], rank: int) -> Any:
    """``sharded_state_dict`` with each leaf replaced by its saved value (ShardedTensors:
    their own ``data``, filled in place), as ``dist_checkpointing.load`` returns it."""

    def visit(path: str, leaf: Any) -> Any:
        ident = _leaf_id(path, leaf)
        if ident not in entries:
            raise CheckpointingException(f"Local tier: rank {rank} saved no {ident[2:]!r} (at {path})")
        value = entries[ident]
        if isinstance(leaf, ShardedTensor):
            if leaf.data is None or leaf.data.shape != value.shape or leaf.data.dtype != value.dtype:
                raise CheckpointingException(
                    f"Local tier: rank {rank}: {leaf.key!r} was saved as {tuple(value.shape)} {value.dtype}, "
                    f"expected {None if leaf.data is None else (tuple(leaf.data.shape), leaf.data.dtype)}")
            leaf.data.copy_(value)
            return leaf.data
        return value

    return _walk(sharded_state_dict, "", visit)


# ----------------------------------------------------------------------------- files

def write_copy(node_dir: str, step: int, owner: int, world: int, data: bytes) -> None:
    """Write ``owner``'s payload of ``step`` and then its marker, atomically."""
    storage = storage_for(os.path.join(node_dir, local_step_dir(step)))
    marker = {"step": step, "owner": owner, "world": world, "length": len(data),
              "algorithm": "xxh3_64", "checksum": f"{checksum(data):016x}"}
    try:
        storage.make_root()
        storage.write_atomic(payload_name(owner), data)
        storage.write_atomic(marker_name(owner), json.dumps(marker).encode())
    except OSError as e:
        raise CheckpointingException(
            f"Local tier: cannot write rank {owner}'s copy of step {step} to {storage.describe()}: {e}") from e


def read_copy(node_dir: str, marker: Dict[str, Any]) -> bytes:
    """The verified payload a marker describes; :class:`CheckpointingException` if it is
    missing, short or fails its checksum."""
    storage = storage_for(os.path.join(node_dir, local_step_dir(marker["step"])))
    name = payload_name(marker["owner"])
    try:
        data = storage.read_bytes(name)
    except OSError as e:
        raise CheckpointingException(f"Local tier: cannot read {storage.describe(name)}: {e}") from e
    if len(data) != marker["length"] or f"{checksum(data):016x}" != marker["checksum"]:
        raise CheckpointingException(f"Local tier: {storage.describe(name)} fails its checksum")
    return data


def scan(node_dir: str) -> List[Dict[str, Any]]:
    """The markers found in a node-local directory (unreadable ones are skipped)."""
    found = []
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
                except (OSError, ValueError) as e:
                    logger.warning("Local tier: skipping %s: %s", step_storage.describe(file), e)
    return found


def remove_copies(node_dir: str, step: int, owners: Sequence[int]) -> None:
    """Delete ``owners``' files of ``step`` (marker first), then the step's directory if
    it is empty; errors are logged."""
    storage = storage_for(os.path.join(node_dir, local_step_dir(step)))
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
    """Send ``sends[dst]`` to each ``dst`` while receiving one state from each of
    ``sources`` (in a helper thread, so that pairs sending to each other do not wait on
    each other). Raises the first error of either side."""
    received: Dict[int, Any] = {}
    errors: List[BaseException] = []

    def receive() -> None:
        try:
            for src in sources:
                received[src] = transport.recv_checkpoint(src)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    thread = threading.Thread(target=receive, name="local-tier-recv", daemon=True)
    thread.start()
    try:
        for dst, state in sends.items():
            transport.send_checkpoint([dst], state)
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
    """

    def __init__(self, local_dir: str, interval: int, replication_factor: int = 1,
                 node_of_rank: Optional[Sequence[int]] = None, timeout: timedelta = timedelta(minutes=5)):
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
        self.sends_to = partners(nodes, self.rank, replication_factor - 1)
        self.receives_from = [r for r in range(self.world) if self.rank in partners(nodes, r, replication_factor - 1)]
        run_agreed(self._check_writable, "Local tier")
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.transport = PGTransport(self.group, timeout, torch.device("cpu"))
        self.complete: List[int] = []  # steps complete in the local tier (this run)
        self._pending: Optional[Tuple[int, threading.Thread, List[BaseException]]] = None

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
        """Snapshot this rank's state (blocking) and write and replicate it in the background."""
        entries = run_agreed(lambda: snapshot(sharded_state_dict), f"Local tier: saving step {step}")
        errors: List[BaseException] = []

        def work() -> None:
            try:
                data = serialize(entries)
                write_copy(self.node_dir, step, self.rank, self.world, data)
                message = {"data": torch.frombuffer(bytearray(data), dtype=torch.uint8)}
                received = exchange(self.transport, {dst: message for dst in self.sends_to}, self.receives_from)
                for src, state in received.items():
                    if os.environ.get(FAIL_RECV_ENV) in (str(step), "any"):
                        raise CheckpointingException(f"Local tier: injected failure storing rank {src}'s replica")
                    write_copy(self.node_dir, step, src, self.world, state["data"].numpy().tobytes())
            except BaseException as e:  # noqa: BLE001 - reported at finalize
                errors.append(e)

        thread = threading.Thread(target=work, name=f"local-tier-{step}", daemon=True)
        thread.start()
        self._pending = (step, thread, errors)

    def finalize(self) -> Optional[int]:
        """Wait for the local save in flight and agree whether it succeeded on every rank
        (collective). A failed step is removed everywhere (a warning names the error);
        after a success the older local steps are removed. Returns the completed step."""
        if self._pending is None:
            return None
        step, thread, errors = self._pending
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
