"""Restoring from the local tier (:mod:`.local_tier`), collectively.

1. Every rank lists the markers in its node-local directory; one ``all_gather_object``
   tells every rank who holds which rank's copy of which step.
2. The newest step newer than the newest persistent checkpoint for which every rank's
   copy is held somewhere is tried. A step saved with another world size is an error
   naming the persistent step to load instead.
3. For each rank, the holder to read from is its own copy if it has one (read straight
   into the rank's tensors), else a partner's replica (read into a buffer); each holder
   verifies (checksum) what it reads; failures are agreed, and the next holder of that
   rank's copy is tried.
4. Holders send the replicas to their owners over the local tier's group, straight into
   the owners' tensors (the transport's in-place receive); each owner verifies the
   checksum again. If some rank's copy is nowhere valid, every rank gets
   ``None``: the caller falls back to the persistent tier.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..collectives import all_gather_object, raise_if_any, run_agreed
from ..core import CheckpointingException
from ..mapping import ShardedStateDict
from ..transport import PGTransport
from .local_tier import LayoutMismatch, LocalTier, exchange, fill_received, partners, read_copy, receiving_state, scan, wire_state

logger = logging.getLogger(__name__)


def _holders(gathered: List[List[Dict[str, Any]]], step: int, tier: LocalTier) -> Optional[Dict[int, List[int]]]:
    """owner -> the ranks holding its copy of ``step`` (the owner first, then its partners —
    so that the replicas are served by as many ranks as there are lost copies — then the
    others, e.g. the partner's node-mates), or ``None`` when some owner's copy is held
    nowhere."""
    world = tier.world
    holders: Dict[int, List[int]] = {o: [] for o in range(world)}
    for holder, markers in enumerate(gathered):
        for m in markers:
            if m["step"] == step and m["owner"] in holders:
                holders[m["owner"]].append(holder)
    if any(not h for h in holders.values()):
        return None
    copies = len(tier.sends_to)
    return {o: sorted(h, key=lambda r: (r != o, r not in partners(tier.node_of_rank, o, copies), r))
            for o, h in holders.items()}


def _check_world(gathered: List[List[Dict[str, Any]]], world: int, newer_than: int,
                 persistent_step: Optional[int]) -> None:
    other = sorted({(m["step"], m["world"]) for markers in gathered for m in markers
                    if m["step"] > newer_than and m["world"] != world})
    if other:
        step, saved = other[-1]
        instead = (f"load the persistent step {persistent_step} instead (CheckpointManager.load(step={persistent_step}))"
                   if persistent_step is not None else "there is no persistent checkpoint to load instead")
        raise CheckpointingException(
            f"Local tier: step {step} was saved by {saved} ranks, this run has {world}: a local-tier checkpoint "
            f"restores only at its own world size; {instead}")


def _fetch(tier: LocalTier, step: int, holders: Dict[int, List[int]], mine: Dict[int, Dict[str, Any]],
           sharded_state_dict: ShardedStateDict) -> Tuple[bool, Any]:
    """Load this rank's copy of ``step`` into ``sharded_state_dict`` (read from its own
    copy, or received from a holder of a replica): ``(True, state)``, or ``(False, None)``
    on every rank when some rank's copy is nowhere valid."""
    choice = {o: 0 for o in holders}
    loaded: Dict[int, Any] = {}  # owner -> what this rank read for it (itself: its state)
    while True:
        failed, mismatch = [], None
        for owner in [o for o, h in holders.items() if h[choice[o]] == tier.rank and o not in loaded]:
            try:
                if owner == tier.rank:
                    loaded[owner] = read_copy(tier.node_dir, mine[owner], sharded_state_dict, tier.rank)[0]
                else:
                    loaded[owner] = read_copy(tier.node_dir, mine[owner])
            except LayoutMismatch as e:  # the caller's state, not the copy: an error on every rank
                mismatch = str(e)
            except CheckpointingException as e:
                logger.warning("Local tier: %s", e)
                failed.append(owner)
        reports = all_gather_object((failed, mismatch))
        raise_if_any([m for _, m in reports], f"Local tier: restoring step {step}")
        all_failed = [o for f, _ in reports for o in f]
        if not all_failed:
            break
        for owner in all_failed:
            choice[owner] += 1
            if choice[owner] == len(holders[owner]):
                logger.warning("Local tier: no valid copy of rank %d's shards of step %d", owner, step)
                return False, None
    sends = {o: wire_state(*loaded[o], int(mine[o]["checksum"], 16)) for o in loaded if o != tier.rank}
    source = holders[tier.rank][choice[tier.rank]]

    def transfer_and_fill() -> Any:
        if source == tier.rank:
            exchange(tier.transport, sends, [])
            return loaded[tier.rank]
        into = receiving_state(sharded_state_dict)  # received straight into this rank's tensors
        transport = PGTransport(tier.group, tier.timeout, torch.device("cpu"), state_dict=lambda: into)
        received = exchange(transport, sends, [source])[source]
        return fill_received(sharded_state_dict, received, tier.rank,
                             f"rank {tier.rank}'s copy of step {step} from rank {source}")

    return True, run_agreed(transfer_and_fill, f"Local tier: restoring step {step}")


def restore(tier: LocalTier, sharded_state_dict: ShardedStateDict, newer_than: int,
            persistent_step: Optional[int]) -> Optional[Tuple[int, Any]]:
    """Load the newest local-tier step newer than ``newer_than`` into
    ``sharded_state_dict`` (collective): ``(step, state_dict)``, or ``None`` on every rank
    when no such step can be restored (the caller loads ``persistent_step``)."""
    markers = run_agreed(lambda: scan(tier.node_dir), "Local tier: listing the node-local directory")
    gathered = all_gather_object(markers)
    _check_world(gathered, tier.world, newer_than, persistent_step)
    steps = sorted({m["step"] for ms in gathered for m in ms if m["step"] > newer_than}, reverse=True)
    for step in steps:
        holders = _holders(gathered, step, tier)
        if holders is None:
            logger.warning("Local tier: step %d is incomplete (some rank's copy is held nowhere)", step)
            continue
        ok, state = _fetch(tier, step, holders, {m["owner"]: m for m in markers if m["step"] == step},
                           sharded_state_dict)
        if ok:
            return step, state
    return None
