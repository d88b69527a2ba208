"""Restoring from the local tier (:mod:`.local_tier`), collectively.

1. Every rank lists the markers in its node-local directory; one ``all_gather_object``
   tells every rank who holds which rank's copy of which step.
2. The newest step newer than the newest persistent checkpoint for which every rank's
   copy is held somewhere is tried. A step saved with another world size is an error
   naming the persistent step to load instead.
3. For each rank, the holder to read from is its own copy if it has one, else a partner's
   replica; each holder reads and verifies (checksum) what it must serve; failures are
   agreed, and the next holder of that rank's copy is tried.
4. Holders send the copies to their owners over the local tier's group; each rank fills
   its ``sharded_state_dict``. If some rank's copy is nowhere valid, every rank gets
   ``None``: the caller falls back to the persistent tier.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..collectives import all_gather_object, run_agreed
from ..core import CheckpointingException
from ..mapping import ShardedStateDict
from .local_tier import LocalTier, deserialize, exchange, fill, read_copy, scan

logger = logging.getLogger(__name__)


def _holders(gathered: List[List[Dict[str, Any]]], step: int, world: int) -> Optional[Dict[int, List[int]]]:
    """owner -> the ranks holding its copy of ``step`` (the owner first), or ``None`` when
    some owner's copy is held nowhere."""
    holders: Dict[int, List[int]] = {o: [] for o in range(world)}
    for holder, markers in enumerate(gathered):
        for m in markers:
            if m["step"] == step and m["owner"] in holders:
                holders[m["owner"]].append(holder)
    if any(not h for h in holders.values()):
        return None
    return {o: sorted(h, key=lambda r: (r != o, r)) for o, h in holders.items()}


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


def _fetch(tier: LocalTier, step: int, holders: Dict[int, List[int]],
           mine: Dict[int, Dict[str, Any]]) -> Optional[bytes]:
    """This rank's verified payload of ``step`` (read, or received from its holder), or
    ``None`` on every rank when some rank's copy is nowhere valid."""
    choice = {o: 0 for o in holders}
    while True:
        serving = [o for o, h in holders.items() if h[choice[o]] == tier.rank]
        loaded: Dict[int, bytes] = {}
        failed = []
        for owner in serving:
            try:
                loaded[owner] = read_copy(tier.node_dir, mine[owner])
            except CheckpointingException as e:
                logger.warning("Local tier: %s", e)
                failed.append(owner)
        all_failed = [o for f in all_gather_object(failed) for o in f]
        if not all_failed:
            break
        for owner in all_failed:
            choice[owner] += 1
            if choice[owner] == len(holders[owner]):
                logger.warning("Local tier: no valid copy of rank %d's shards of step %d", owner, step)
                return None
    sends = {o: {"data": torch.frombuffer(bytearray(data), dtype=torch.uint8)}
             for o, data in loaded.items() if o != tier.rank}
    source = holders[tier.rank][choice[tier.rank]]
    received = run_agreed(lambda: exchange(tier.transport, sends, [source] if source != tier.rank else []),
                          f"Local tier: restoring step {step}")
    if source == tier.rank:
        return loaded[tier.rank]
    return received[source]["data"].numpy().tobytes()


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
        holders = _holders(gathered, step, tier.world)
        if holders is None:
            logger.warning("Local tier: step %d is incomplete (some rank's copy is held nowhere)", step)
            continue
        mine = {m["owner"]: m for m in markers if m["step"] == step}
        data = _fetch(tier, step, holders, mine)
        if data is None:
            continue
        state = run_agreed(lambda: fill(sharded_state_dict, deserialize(data, f"rank {tier.rank}'s copy of step "
                                                                              f"{step}"), tier.rank),
                           f"Local tier: restoring step {step}")
        return step, state
    return None
