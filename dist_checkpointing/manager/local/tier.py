"""The local tier of two-tier checkpointing: frequent per-rank checkpoints in node-local
directories, each replicated to partner ranks on other nodes over the process group.

Every rank writes its own shards only (no cross-rank planning): a snapshot of its
``sharded_state_dict`` (:mod:`.snapshot`: every tensor in one flat byte buffer
reused from save to save, and a header, :mod:`.format`) goes into its node-local
directory as a raw file and a marker written last (:mod:`.files`). The snapshot is
taken while ``save`` blocks (a fork, or a copy); checksumming, writing (the own copy while
replicating) and replicating happen in a background thread, over a process group of its
own.
A step counts in the local tier once every rank has written its own copy and every
replica (agreed at :meth:`LocalTier.finalize`); a step that failed anywhere is removed
everywhere and not counted; once a step counts, every other copy of this job in the
node-local directory is removed (older steps, and those a restart can no longer use:
newer steps of an abandoned history, steps of another world size). Restoring is in
:mod:`.restore`.

Every copy belongs to a job (:mod:`.marker`): a node-local directory holding copies
of another job is refused when the tier is set up, unless ``takeover`` (then those copies
are removed); restore and cleanup only ever use this job's copies.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ...runtime.collectives import all_reduce_max_uint8, get_rank, get_world_size, run_agreed
from ...core import CheckpointingException
from ...mapping import ShardedStateDict
from ...storage import Storage, storage_for, url_scheme
from ...runtime.forked_call import ForkedCall
from ...transport import PGTransport
from ..crash import crash_point
from .files import remove_copies, scan, write_copy
from .marker import Job, describe_job
from .format import decode_header
from ...runtime.arenas import Staged, StagingArena
from .snapshot import Snapshot, can_fork, flat_checksum

logger = logging.getLogger(__name__)

#: test-only fault: a rank whose environment sets this to a step (or ``any``) fails while
#: storing a replica it received for that step (after the transfer).
FAIL_RECV_ENV = "DIST_CKPT_LOCAL_FAIL_RECV"


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
        job: the identity this job's copies carry (the same on every rank:
            :mod:`.marker`).
        takeover: remove the copies of other jobs (and damaged ones) found in the node-local
            directories instead of refusing them.
    """

    def __init__(self, local_dir: str, interval: int, replication_factor: int = 1,
                 node_of_rank: Optional[Sequence[int]] = None, timeout: timedelta = timedelta(minutes=5),
                 snapshot: str = "fork", *, job: Job, takeover: bool = False):
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
        if url_scheme(str(local_dir)):
            raise CheckpointingException(f"Local tier: local_dir must be a node-local path, not {str(local_dir)!r}")

        def node_dir(r: int) -> str:  # absolute once: a later os.chdir never moves the copies
            return os.path.abspath(str(local_dir).format(node=nodes[r], rank=r))

        self.node_dir = node_dir(self.rank)
        self.sends_to = partners(nodes, self.rank, replication_factor - 1)
        self.receives_from = [r for r in range(self.world) if self.rank in partners(nodes, r, replication_factor - 1)]
        self.job, self.takeover = job, takeover
        # the first rank of those sharing this node-local directory cleans it up
        self.cleaner = next(r for r in range(self.world) if nodes[r] == nodes[self.rank]
                            and node_dir(r) == self.node_dir) == self.rank
        run_agreed(self._check_writable, "Local tier")
        run_agreed(self._claim, "Local tier")
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.timeout = timeout
        self.transport = PGTransport(self.group, timeout, torch.device("cpu"))
        self.complete: List[int] = []  # steps complete in the local tier (this run)
        self._pending: Optional[Tuple[int, threading.Thread, List[BaseException]]] = None
        # the snapshot buffer (shared memory, pinned where CUDA is), reused once the save in flight is done
        self._arena: Optional[StagingArena] = None
        self._staged: Optional[Staged] = None  # the device-to-host copies of the save in flight
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

    def _claim(self) -> None:
        """Refuse a node-local directory holding copies of another job (every rank raises),
        or, with ``takeover``, remove them and the damaged ones (the directory's cleaner)."""
        damaged: List[Tuple[int, int]] = []
        markers = scan(self.node_dir, damaged)
        foreign = [m for m in markers if m["job"] != self.job]
        if foreign and not self.takeover:
            raise CheckpointingException(self.foreign_message(foreign))
        if self.takeover and self.cleaner:
            doomed = {(m["step"], m["owner"]) for m in foreign} | set(damaged)
            if doomed:
                logger.warning("Local tier: taking %s over: removing %d copies of other jobs or damaged",
                               self.node_dir, len(doomed))
            for step, owner in sorted(doomed):
                remove_copies(self.node_dir, step, [owner])

    def foreign_message(self, foreign: List[Dict[str, Any]]) -> str:
        """Why the markers ``foreign`` (of other jobs) in this rank's directory are refused."""
        steps = sorted({m["step"] for m in foreign})
        return (f"Local tier: {self.node_dir} (rank {self.rank}) holds local checkpoints of another job "
                f"({describe_job(foreign[0]['job'])}; steps {steps[:5]}{' ...' if len(steps) > 5 else ''}); this job "
                f"is {describe_job(self.job)}: they are not restored, overwritten nor deleted. Use another local_dir, "
                "remove them, or pass local_takeover=True to take the directory over (their copies are deleted)")

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0 and step > max(self.complete, default=-1)

    def save(self, step: int, sharded_state_dict: ShardedStateDict) -> None:
        """Snapshot this rank's state and write and replicate it in the background. The
        snapshot blocks for a fork (CPU tensors, ``snapshot="fork"``: a child copies them
        into the shared snapshot buffer as they were at the fork), or for one copy into
        that buffer on this thread (CPU tensors otherwise); accelerator tensors are copied
        into it (pinned where CUDA is) on a side stream without blocking, and later work on
        the current stream waits for the copies (:mod:`...runtime.arenas`)."""

        if self._pending is not None:  # its write still reads the snapshot buffer: finish it first
            self.finalize()

        def plan() -> Tuple[Snapshot, bool]:
            snap = Snapshot(sharded_state_dict)
            if self._arena is None or self._arena.size < snap.size:
                if self._arena is not None:
                    self._arena.release()
                    self._arena = None
                self._arena = StagingArena(snap.size)
            fork = self.snapshot == "fork" and can_fork(snap)
            if not fork:
                self._arena.pin_for(snap.tensors)
            return snap, fork

        # Agreed over this tier's own (gloo) group, before any copy is queued: nothing after
        # the copies waits for them (a collective on an NCCL group would).
        snap, fork = run_agreed(plan, f"Local tier: saving step {step}", self.group)
        child: Union[ForkedCall, Staged, BaseException]
        try:
            child = snap.take(self._arena.flat, fork, self._arena.pinned)
        except Exception as e:  # noqa: BLE001 - the partners are told and it is reported at finalize
            child = e
        self._staged = child if isinstance(child, Staged) else None
        errors: List[BaseException] = []

        def work() -> None:
            try:
                crash_point("local", step)
                try:
                    if isinstance(child, BaseException):
                        raise child
                    if isinstance(child, ForkedCall):
                        flat_sum = child.result()
                    else:
                        child.wait()  # the device-to-host copies
                        flat_sum = flat_checksum(snap.flat, snap.layout)
                except BaseException as e:  # noqa: BLE001 - the partners are told, then it is reported
                    exchange(self.transport, {dst: e for dst in self.sends_to}, self.receives_from)
                    raise
                message = {"data": snap.flat, "header": snap.header, "checksum": flat_sum}
                with ThreadPoolExecutor(1, thread_name_prefix="local-tier-write") as pool:  # own copy while replicating
                    own = pool.submit(write_copy, self.node_dir, step, self.rank, self.world, snap.flat, snap.header,
                                      flat_sum, self.job)
                    received = exchange(self.transport, {dst: message for dst in self.sends_to}, self.receives_from)
                    own.result()
                for src, got in received.items():
                    if os.environ.get(FAIL_RECV_ENV) in (str(step), "any"):
                        raise CheckpointingException(f"Local tier: injected failure storing rank {src}'s replica")
                    layout = decode_header(got["header"], f"rank {src}'s replica of step {step}",
                                           got["data"].numel())["layout"]
                    if flat_checksum(got["data"], layout) != got["checksum"]:
                        raise CheckpointingException(f"Local tier: rank {src}'s replica of step {step} arrived damaged")
                    write_copy(self.node_dir, step, src, self.world, got["data"], got["header"], got["checksum"],
                               self.job)
            except BaseException as e:  # noqa: BLE001 - reported at finalize
                errors.append(e)

        thread = threading.Thread(target=work, name=f"local-tier-{step}", daemon=True)
        thread.start()
        self._pending = (step, thread, errors)

    def wait_for_staging(self) -> None:
        """Block until the snapshot of the save in flight is in the snapshot buffer."""
        if self._staged is not None:
            self._staged.wait()
            self._staged = None

    def finalize(self, blocking: bool = True) -> Optional[int]:
        """Wait for the local save in flight (``blocking=False``: only if every rank has
        finished it; one 1-byte ``all_reduce``) and agree whether it succeeded on every
        rank (collective). A failed step is removed everywhere (a warning names the error);
        after a success every other copy of this job is removed (:meth:`_remove_others`).
        Returns the completed step."""
        if self._pending is None:
            return None
        step, thread, errors = self._pending
        if not blocking and all_reduce_max_uint8([int(thread.is_alive())], self.group)[0]:
            return None
        self._pending = None
        thread.join()
        mine = [self.rank, *self.receives_from]  # the copies of this step this rank wrote

        def check() -> None:
            if errors:
                raise errors[0]

        try:
            run_agreed(check, f"Local tier: step {step}")
        except CheckpointingException as e:
            logger.warning("Local tier: step %d is not counted: %s", step, e)
            remove_copies(self.node_dir, step, mine)
            return None
        if self.cleaner:
            self._remove_others(step)
        self.complete.append(step)
        return step

    def _remove_others(self, step: int) -> None:
        """Remove this job's copies but those of ``step`` at this world size from this
        node-local directory: older steps, and those no restart of this job may use any
        more — newer steps (a history abandoned when an older step was loaded) and copies
        saved with another world size. Copies of other jobs are never touched."""
        others: Dict[int, List[int]] = {}
        for m in scan(self.node_dir):
            if m["job"] == self.job and (m["step"] != step or m["world"] != self.world):
                others.setdefault(m["step"], []).append(m["owner"])
        for old, owners in sorted(others.items()):
            remove_copies(self.node_dir, old, owners)

    def close(self) -> None:
        """Finish the local save in flight (collective), free the snapshot buffer and drop the group."""
        self.finalize()
        if self._arena is not None:
            self._arena.release()
            self._arena = None
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
