"""Restoring from the local tier (:mod:`.tier`), collectively, with per-rank
collectives of fixed size (a few integers, or one integer per rank — never a rank's list of
markers):

1. Every rank lists the valid markers in its node-local directory (a marker of the wrong
   shape is a damaged copy: skipped). Only this job's copies saved with this world size
   are candidates. One ``all_reduce`` (max) of four integers finds a listing error on any
   rank, another job's copies (refused on every rank unless ``takeover``), the newest step
   of this job saved with another world size (skipped, with a warning) and the newest
   candidate step anyone holds (after a step is given up, one more finds the next older
   candidate).
2. For that step, one ``all_reduce`` (min) over one integer per rank picks, for each
   rank's copy, the holder to read it from: its own copy if it has one (read straight into
   its tensors), else a partner's replica, else any other holder (e.g. the partner's
   node-mates). If some rank's copy is held nowhere, the next older step is tried.
3. In rounds: holders map the replicas they serve from their files (one ``all_reduce`` of
   one flag per rank says whether some copy cannot be opened: then the choice is made
   again without it), send each one's header, then its tensors over the local tier's
   group (unverified): the tensors the owner requests straight into its own (the
   transport's in-place receive), the others (common values, sharded items it does not
   request) into new ones; then owners holding their own copy read it into their tensors.
   Each owner verifies its checksum. One ``all_reduce`` of one flag per rank says whose
   copy failed: its holder drops it and the choice is made again for those owners only;
   if some rank's copy is nowhere valid, every rank gets ``None``: the caller falls back
   to the persistent tier.

The state returned is what ``dist_checkpointing.load`` returns for the request: its
sharded items loaded and the saved common state merged in.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...runtime.collectives import all_gather_object, error_message, raise_if_any, run_agreed_with_flags
from ...core import CheckpointingException
from ...mapping import LocalNonpersistentObject, ShardedObject, ShardedStateDict
from ...tensors.sharded import ShardedTensor
from ...transport import PGTransport
from .files import map_copy, read_copy, scan
from .format import decode_header
from .snapshot import LayoutMismatch, fill_received, receiving_state, restore_header, wire_state
from .tier import LocalTier, exchange, partners

logger = logging.getLogger(__name__)


def _reduce(values: List[int], op: "dist.ReduceOp", tier: LocalTier) -> List[int]:
    """The element-wise ``op`` of every rank's ``values`` (same length everywhere)."""
    if tier.group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=op, group=tier.group)
    return t.tolist()


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
    owner verifies), by owner: each its header (:func:`.snapshot.restore_header`) and
    its tensors; and one flag per owner (1: the copy this rank was to serve cannot be
    opened — missing, short, a bad marker or header)."""
    sends: Dict[int, Any] = {}
    failed = [0] * tier.world
    for owner in held:
        if source[owner] == tier.rank and owner != tier.rank and not done[owner]:
            marker = held[owner]
            try:
                flat, header, content = map_copy(tier.node_dir, marker)
                sends[owner] = (restore_header(header, marker["length"], int(marker["checksum"], 16)),
                                wire_state(flat, content))
            except CheckpointingException as e:
                logger.warning("Local tier: %s", e)
                failed[owner] = 1
    return sends, failed


def _serve_and_read(tier: LocalTier, step: int, held: Dict[int, Dict[str, Any]], sends: Dict[int, Any],
                    source: List[int], done: List[bool], sharded_state_dict: ShardedStateDict) -> Tuple[List[int], Any]:
    """One round: holders send ``sends`` — first each copy's header, then its tensors —,
    owners without a copy of their own receive theirs (the tensors they request straight
    into their own, the others into new ones), then owners with one read it. Returns one
    flag per owner (1: the copy used for it failed its checksum, or its header is damaged)
    and this rank's loaded state (``None`` if not loaded)."""
    failed = [0] * tier.world
    state = None
    src = source[tier.rank]
    receiving = not done[tier.rank] and src != tier.rank
    what = f"rank {tier.rank}'s copy of step {step} from rank {src}"
    heads = exchange(tier.transport, {dst: sent[0] for dst, sent in sends.items()}, [src] if receiving else [])
    into: Optional[Dict[str, Any]] = None
    mismatch: Optional[LayoutMismatch] = None
    if receiving:
        try:
            header = decode_header(heads[src]["header"], what, heads[src]["length"])
            into = receiving_state(sharded_state_dict, header, tier.rank)
        except LayoutMismatch as e:  # the caller's state, not the copy: an error on every rank (after the transfer)
            mismatch = e
        except CheckpointingException as e:  # received into new tensors, then dropped
            logger.warning("Local tier: %s", e)
            failed[tier.rank] = 1
    transport = PGTransport(tier.group, tier.timeout, torch.device("cpu"),
                            state_dict=None if into is None else (lambda: into))
    received = exchange(transport, {dst: sent[1] for dst, sent in sends.items()}, [src] if receiving else [])
    if mismatch is not None:
        raise CheckpointingException(str(mismatch)) from mismatch
    if into is not None:
        try:
            state = fill_received(sharded_state_dict, received[src], header, heads[src]["checksum"], tier.rank, what)
        except LayoutMismatch as e:
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


def restore(tier: LocalTier, sharded_state_dict: ShardedStateDict, newer_than: int) -> Optional[Tuple[int, Any]]:
    """Load the newest local-tier step newer than ``newer_than`` that this job can restore
    (its own copies, saved with this world size) into ``sharded_state_dict``
    (collective): ``(step, what dist_checkpointing.load returns)``, or ``None`` on every
    rank when no such step can be restored (the caller loads the persistent tier)."""
    error: Optional[str] = None
    try:
        markers = scan(tier.node_dir)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        markers, error = [], error_message(e)
    foreign = [m for m in markers if m["job"] != tier.job]
    refused = tier.foreign_message(foreign) if foreign and not tier.takeover else None
    own = [m for m in markers if m["job"] == tier.job]
    usable = [m for m in own if m["world"] == tier.world]
    other_world = max((m["step"] for m in own if m["world"] != tier.world and m["step"] > newer_than), default=-1)
    below = None  # steps at or above this one were tried

    def newest() -> int:
        return max((m["step"] for m in usable if m["step"] > newer_than and (below is None or m["step"] < below)),
                   default=-1)

    # one all_reduce: a listing error anywhere, another job's copies, a step of another world size, the newest step
    failed, foreign_found, other, step = _reduce(
        [int(error is not None), int(refused is not None), other_world, newest()], dist.ReduceOp.MAX, tier)
    if failed:
        raise_if_any(all_gather_object(error, tier.group), "Local tier: listing the node-local directory")
    if foreign_found:
        raise_if_any(all_gather_object(refused, tier.group), "Local tier: restoring")
    if other > step and tier.rank == 0:
        logger.warning("Local tier: local steps up to %d were saved with another world size: this run of %d ranks "
                       "cannot restore them (skipped; removed once this run's first local step counts; "
                       "dist-ckpt convert-local turns one into a normal checkpoint)", other, tier.world)
    while True:
        if step < 0:
            return None
        ok, state = _fetch(tier, step, {m["owner"]: m for m in usable if m["step"] == step}, sharded_state_dict)
        if ok:
            return step, state
        below = step
        step = _reduce([newest()], dist.ReduceOp.MAX, tier)[0]


def restored_state(sharded_state_dict: ShardedStateDict, restored: Any) -> ShardedStateDict:
    """The restored step as a sharded state dict, ready to be saved: what :func:`restore`
    returned (``restored``, the saved common state included) with the request's sharded
    items in their places — ShardedTensors as they are (filled in place), ShardedObjects
    with the restored objects — and its LocalNonpersistentObjects as they are."""
    if isinstance(sharded_state_dict, dict) and isinstance(restored, dict):
        return {k: restored_state(sharded_state_dict[k], v) if k in sharded_state_dict else v
                for k, v in restored.items()}
    if isinstance(sharded_state_dict, list) and isinstance(restored, list) and len(sharded_state_dict) == len(restored):
        return [restored_state(v, r) for v, r in zip(sharded_state_dict, restored)]
    if isinstance(sharded_state_dict, ShardedObject):
        return replace(sharded_state_dict, data=restored)
    if isinstance(sharded_state_dict, (ShardedTensor, LocalNonpersistentObject)):
        return sharded_state_dict
    return restored
