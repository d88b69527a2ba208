"""Restoring from the local tier (:mod:`.local_tier`), collectively, with per-rank
collectives of fixed size (a few integers, or one integer per rank — never a rank's list of
markers):

1. Every rank lists the markers in its node-local directory. One ``all_reduce`` (max) of
   three integers finds a listing error on any rank, a step newer than the newest
   persistent checkpoint saved with another world size (an error naming the persistent
   step to load instead), and the newest step anyone holds (after a step is given up, one
   more finds the next older candidate).
2. For that step, one ``all_reduce`` (min) over one integer per rank picks, for each
   rank's copy, the holder to read it from: its own copy if it has one (read straight into
   its tensors), else a partner's replica, else any other holder (e.g. the partner's
   node-mates). If some rank's copy is held nowhere, the next older step is tried.
3. In rounds: holders map the replicas they serve from their files (one ``all_reduce`` of
   one flag per rank says whether some copy cannot be opened: then the choice is made
   again without it), send them over the local tier's group (unverified) straight into
   the owners' tensors (the transport's in-place receive); then owners holding their own
   copy read it into their tensors. Each owner verifies its checksum. One ``all_reduce`` of
   one flag per rank says whose copy failed: its holder drops it and the choice is made again for those owners only; if some
   rank's copy is nowhere valid, every rank gets ``None``: the caller falls back to the
   persistent tier.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..collectives import all_gather_object, error_message, raise_if_any, run_agreed_with_flags
from ..core import CheckpointingException
from ..mapping import ShardedObject, ShardedStateDict
from ..sharded_tensor import ShardedTensor
from ..transport import PGTransport
from .local_files import map_copy, read_copy, scan
from .local_snapshot import LayoutMismatch, fill_received, receiving_state, wire_state
from .local_tier import LocalTier, exchange, partners

logger = logging.getLogger(__name__)


def _reduce(values: List[int], op: "dist.ReduceOp", tier: LocalTier) -> List[int]:
    """The element-wise ``op`` of every rank's ``values`` (same length everywhere)."""
    if tier.group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=op, group=tier.group)
    return t.tolist()


def _world_mismatch(markers: List[Dict[str, Any]], tier: LocalTier, newer_than: int) -> int:
    """The newest step newer than ``newer_than`` this rank holds saved with another world
    size, packed with that world size in one integer (-1: none)."""
    return max((m["step"] << 24 | min(m["world"], (1 << 24) - 1) for m in markers
                if m["step"] > newer_than and m["world"] != tier.world), default=-1)


def _raise_world_mismatch(other: int, tier: LocalTier, persistent_step: Optional[int]) -> None:
    step, saved = other >> 24, other & ((1 << 24) - 1)
    instead = (f"load the persistent step {persistent_step} instead (CheckpointManager.load(step={persistent_step}))"
               if persistent_step is not None else "there is no persistent checkpoint to load instead")
    raise CheckpointingException(
        f"Local tier: step {step} was saved by {saved} ranks, this run has {tier.world}: a local-tier checkpoint "
        f"restores only at its own world size; {instead}")


def _choose(held: Dict[int, Dict[str, Any]], tier: LocalTier) -> Optional[List[int]]:
    """For each owner, the rank to read its copy from among the ranks holding it (``held``:
    this rank's copies, by owner): the owner first, then its partners, then the others, by
    rank; ``None`` on every rank when some owner's copy is held nowhere."""
    world, copies = tier.world, len(tier.sends_to)
    nowhere = 3 * world
    keys = [nowhere] * world
    for owner in held:
        if 0 <= owner < world:
            rank = tier.rank
            priority = 0 if rank == owner else 1 if rank in partners(tier.node_of_rank, owner, copies) else 2
            keys[owner] = priority * world + rank
    keys = _reduce(keys, dist.ReduceOp.MIN, tier)
    if any(k == nowhere for k in keys):
        return None
    return [k % world for k in keys]


def _prepare_sends(tier: LocalTier, held: Dict[int, Dict[str, Any]], source: List[int],
                   done: List[bool]) -> Tuple[Dict[int, Any], List[int]]:
    """The replicas this rank serves this round, mapped from their files (not hashed: the
    owner verifies), by owner; and one flag per owner (1: the copy this rank was to serve
    cannot be opened — missing, short, a bad marker)."""
    sends: Dict[int, Any] = {}
    failed = [0] * tier.world
    for owner in held:
        if source[owner] == tier.rank and owner != tier.rank and not done[owner]:
            try:
                sends[owner] = wire_state(*map_copy(tier.node_dir, held[owner]), int(held[owner]["checksum"], 16))
            except CheckpointingException as e:
                logger.warning("Local tier: %s", e)
                failed[owner] = 1
    return sends, failed


def _serve_and_read(tier: LocalTier, step: int, held: Dict[int, Dict[str, Any]], sends: Dict[int, Any],
                    source: List[int], done: List[bool], sharded_state_dict: ShardedStateDict) -> Tuple[List[int], Any]:
    """One round: holders send ``sends``, owners without a copy of their own receive theirs
    straight into their tensors, then owners with one read it. Returns one flag per owner
    (1: the copy used for it failed its checksum) and this rank's loaded state (``None``
    if not loaded)."""
    failed = [0] * tier.world
    state = None
    src = source[tier.rank]
    if done[tier.rank] or src == tier.rank:
        exchange(tier.transport, sends, [])
    else:
        into = receiving_state(sharded_state_dict)  # received straight into this rank's tensors
        transport = PGTransport(tier.group, tier.timeout, torch.device("cpu"), state_dict=lambda: into)
        received = exchange(transport, sends, [src])[src]
        try:
            state = fill_received(sharded_state_dict, received, tier.rank,
                                  f"rank {tier.rank}'s copy of step {step} from rank {src}")
        except LayoutMismatch as e:  # the caller's state, not the copy: an error on every rank
            raise CheckpointingException(str(e)) from e
        except CheckpointingException as e:
            logger.warning("Local tier: %s", e)
            failed[tier.rank] = 1
    if not done[tier.rank] and src == tier.rank:
        try:
            state = read_copy(tier.node_dir, held[tier.rank], sharded_state_dict, tier.rank)[0]
        except LayoutMismatch as e:
            raise CheckpointingException(str(e)) from e
        except CheckpointingException as e:
            logger.warning("Local tier: %s", e)
            failed[tier.rank] = 1
    return failed, state


def _drop_failed(agreed: List[int], held: Dict[int, Dict[str, Any]], source: List[int], rank: int) -> None:
    """Forget the copies this rank served whose flag is set in ``agreed``."""
    for owner, bad in enumerate(agreed):
        if bad and source[owner] == rank:
            held.pop(owner, None)


def _fetch(tier: LocalTier, step: int, mine: Dict[int, Dict[str, Any]],
           sharded_state_dict: ShardedStateDict) -> Tuple[bool, Any]:
    """Load this rank's copy of ``step`` into ``sharded_state_dict`` (read from its own
    copy, or received from a holder of a replica): ``(True, state)``; ``(False, None)`` on
    every rank when some rank's copy is held nowhere, or nowhere valid."""
    held = dict(mine)  # the copies of this step this rank may still serve, by owner
    done = [False] * tier.world  # owners whose copy is loaded (the same on every rank)
    state = None
    what = f"Local tier: restoring step {step}"
    while True:
        source = _choose(held, tier)
        if source is None:
            logger.warning("Local tier: no valid copy of some rank's shards of step %d", step)
            return False, None
        prepared, agreed = run_agreed_with_flags(lambda: _prepare_sends(tier, held, source, done),
                                                 lambda result: result[1] if result is not None else [0] * tier.world,
                                                 what)
        if any(agreed):  # a holder cannot open a copy it was to serve: choose again without it
            _drop_failed(agreed, held, source, tier.rank)
            continue
        (failed, loaded), agreed = run_agreed_with_flags(
            lambda: _serve_and_read(tier, step, held, prepared[0], source, done, sharded_state_dict),
            lambda result: result[0] if result is not None else [0] * tier.world, what)
        if loaded is not None and not failed[tier.rank]:
            state = loaded
        _drop_failed(agreed, held, source, tier.rank)
        for owner, bad in enumerate(agreed):
            done[owner] = done[owner] or not bad
        if all(done):
            return True, state


def restore(tier: LocalTier, sharded_state_dict: ShardedStateDict, newer_than: int,
            persistent_step: Optional[int]) -> Optional[Tuple[int, Any]]:
    """Load the newest local-tier step newer than ``newer_than`` into
    ``sharded_state_dict`` (collective): ``(step, state_dict)``, or ``None`` on every rank
    when no such step can be restored (the caller loads ``persistent_step``)."""
    error: Optional[str] = None
    try:
        markers = scan(tier.node_dir)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        markers, error = [], error_message(e)
    below = None  # steps at or above this one were tried

    def newest() -> int:
        return max((m["step"] for m in markers if m["step"] > newer_than and (below is None or m["step"] < below)),
                   default=-1)

    # one all_reduce: a listing error anywhere, a step of another world size, the newest step held
    failed, other, step = _reduce([int(error is not None), _world_mismatch(markers, tier, newer_than), newest()],
                                  dist.ReduceOp.MAX, tier)
    if failed:
        raise_if_any(all_gather_object(error, tier.group), "Local tier: listing the node-local directory")
    if other >= 0:
        _raise_world_mismatch(other, tier, persistent_step)
    while True:
        if step < 0:
            return None
        ok, state = _fetch(tier, step, {m["owner"]: m for m in markers if m["step"] == step}, sharded_state_dict)
        if ok:
            return step, state
        below = step
        step = _reduce([newest()], dist.ReduceOp.MAX, tier)[0]


def restored_state(sharded_state_dict: ShardedStateDict, restored: Any) -> ShardedStateDict:
    """``sharded_state_dict`` holding what :func:`restore` returned for it (``restored``):
    its ShardedTensors as they are (filled in place), its ShardedObjects with the restored
    objects, the restored values for the rest — the restored step, ready to be saved."""
    if isinstance(sharded_state_dict, dict):
        return {k: restored_state(v, restored[k]) for k, v in sharded_state_dict.items()}
    if isinstance(sharded_state_dict, list):
        return [restored_state(v, r) for v, r in zip(sharded_state_dict, restored)]
    if isinstance(sharded_state_dict, ShardedObject):
        return replace(sharded_state_dict, data=restored)
    if isinstance(sharded_state_dict, ShardedTensor):
        return sharded_state_dict
    return restored
