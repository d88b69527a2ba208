"""Converting a local-tier checkpoint (:mod:`.local_tier`) into a normal one, offline: one
process, no process group (``dist-ckpt convert-local``).

Every rank's copy of the step is looked for in the given node-local directories, in their
order; the first copy whose checksums hold is used (own copy or replica alike), mapped
from its file rather than read into memory (:func:`.local_tier.map_copy`). Each copy's
header describes its rank's sharded state dict (:mod:`.local_format`); their main
replicas together, with rank 0's common state, are saved as one ``torch_dist`` checkpoint
by :func:`dist_checkpointing.save` (which checks that they cover every global tensor
exactly once), so it loads under any layout and world size, and the manager takes it as
a step of its root when written as ``{root}/iter_{step:07d}``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import serialization
from ..collectives import get_world_size
from ..core import CheckpointingException, Location, checkpoint_location, malformed, open_storage
from ..dict_utils import nested_values
from ..mapping import ShardedObject, ShardedStateDict, is_main_replica
from ..path_overlap import refuse_overlap
from ..sharded_tensor import ShardedTensor
from ..storage import StorageOptions, url_scheme
from .layout import CONTENT_KEY
from .local_format import rebuild
from .local_files import local_step_dir, map_copy, payload_name, scan
from .local_snapshot import flat_checksum, tensor_views

logger = logging.getLogger(__name__)

#: the key under which the other ranks' shards join rank 0's state dict (sharded items
#: only: nothing of it enters the common state).
_OTHER_RANKS = "__local_tier_other_ranks__"
Copy = Tuple[str, Dict[str, Any]]  # (node directory, marker)


@dataclass
class LocalConversion:
    """What :func:`convert_local_checkpoint` wrote."""

    step: int
    world: int  # ranks that saved the step
    tensors: int  # ShardedTensor chunks written (main replicas)
    objects: int  # ShardedObjects written (main replicas)
    nbytes: int  # tensor bytes written
    sources: Dict[int, str] = field(default_factory=dict)  # rank -> the file its shards were read from


def convert_local_checkpoint(node_dirs: Sequence[Union[str, "os.PathLike[str]"]], output: Location,
                             step: Optional[int] = None,
                             storage_options: StorageOptions = None) -> LocalConversion:
    """Write ``step`` of a local-tier checkpoint (default: the newest step complete in
    ``node_dirs``) as a normal ``torch_dist`` checkpoint into ``output``, which must be
    empty or missing (a directory or a URL; ``storage_options`` configure its client).

    ``node_dirs``: the node-local directories (local paths) holding the ranks' copies; each
    rank's shards are read from its first intact copy in this order. Runs in one process
    without a process group. Raises :class:`CheckpointingException` naming the directory,
    file or rank at fault: a step not found, ranks with no copy, copies saved by different
    world sizes, a rank whose copies are all damaged or unreadable (a header of an earlier
    version's encoding included), an output that is not empty.
    """
    if get_world_size() > 1:
        raise CheckpointingException("convert_local_checkpoint runs in one process, not collectively: call it "
                                     "where torch.distributed is not initialized (e.g. dist-ckpt convert-local)")
    dirs = [os.fspath(d) for d in node_dirs]
    if not dirs:
        raise CheckpointingException("Converting a local-tier checkpoint needs at least one node directory")
    for d in dirs:
        if url_scheme(d) or not os.path.isdir(d):
            raise CheckpointingException(f"Local tier: {d} is not a local directory (a node directory must be one)")
        refuse_overlap(d, output, "convert a local-tier checkpoint from")
    out = open_storage(output, storage_options)
    if out.kind() == "file" or (out.kind() == "dir" and out.list()):
        raise CheckpointingException(f"Cannot convert a local-tier checkpoint to {out.describe()}: it is not empty")
    with malformed(f"Converting the local-tier checkpoint in {', '.join(dirs)}"):
        found = [(d, m) for d in dirs for m in scan(d)]
        step = _pick_step(found, step, dirs)
        copies = _copies_of(found, step, dirs)
        state, result = _combined(step, copies)
        serialization.save(state, checkpoint_location(output, storage_options),
                           content_metadata={CONTENT_KEY: {"step": step, "metrics": None}})
    logger.info("Local tier: step %d of %d ranks written to %s", step, result.world, out.describe())
    return result


def _world_of(copies: List[Copy], step: int) -> int:
    """The world size that saved ``copies`` (of ``step``); an error if they disagree."""
    worlds: Dict[int, str] = {}
    for d, m in copies:
        worlds.setdefault(m["world"], d)
    if len(worlds) > 1:
        saved = "; ".join(f"by {w} ranks in {d}" for w, d in sorted(worlds.items()))
        raise CheckpointingException(f"Local tier: the copies of step {step} were saved by different world sizes "
                                     f"({saved}): they are not one checkpoint")
    return next(iter(worlds))


def _pick_step(found: List[Copy], step: Optional[int], dirs: List[str]) -> int:
    """``step`` if some copy of it is found, else the newest step found complete."""
    steps = sorted({m["step"] for _, m in found})
    if step is not None:
        if step not in steps:
            raise CheckpointingException(f"Local tier: step {step} is not in {', '.join(dirs)} (steps found: {steps})")
        return step
    for candidate in reversed(steps):
        copies = [(d, m) for d, m in found if m["step"] == candidate]
        if set(range(_world_of(copies, candidate))) <= {m["owner"] for _, m in copies}:
            return candidate
    raise CheckpointingException(f"Local tier: no step is complete in {', '.join(dirs)} (steps found: {steps}; "
                                 "pass the step to convert to see what it lacks)")


def _copies_of(found: List[Copy], step: int, dirs: List[str]) -> Dict[int, List[Copy]]:
    """Each rank's copies of ``step``, in the order of the node directories."""
    mine = [(d, m) for d, m in found if m["step"] == step]
    copies: Dict[int, List[Copy]] = {r: [] for r in range(_world_of(mine, step))}
    for d, m in mine:
        if m["owner"] in copies:
            copies[m["owner"]].append((d, m))
    missing = [r for r, held in copies.items() if not held]
    if missing:
        raise CheckpointingException(f"Local tier: no copy of rank {missing[0]}'s shards of step {step} "
                                     f"(ranks missing: {missing}) in {', '.join(dirs)}")
    return copies


def _open_copy(node_dir: str, marker: Dict[str, Any]) -> Tuple[Dict[str, Any], torch.Tensor, str]:
    """The header and the flat buffer (a private map of its file) of the copy a marker
    describes, its checksums verified; with the file's path."""
    path = os.path.join(node_dir, local_step_dir(marker["step"]), payload_name(marker["owner"]))
    flat, _, header = map_copy(node_dir, marker)
    if f"{flat_checksum(flat, header['layout']):016x}" != marker["checksum"]:
        raise CheckpointingException(f"Local tier: {path} fails its checksum")
    return header, flat, path


def _first_intact(owner: int, step: int, copies: List[Copy]) -> Tuple[Dict[str, Any], torch.Tensor, str]:
    """The first copy of ``owner``'s shards whose checksums hold."""
    problems = []
    for node_dir, marker in copies:
        try:
            return _open_copy(node_dir, marker)
        except CheckpointingException as e:
            logger.warning("%s", e)
            problems.append(str(e))
    raise CheckpointingException(f"Local tier: every copy of rank {owner}'s shards of step {step} is damaged: "
                                 + "; ".join(problems))


def _combined(step: int, copies: Dict[int, List[Copy]]) -> Tuple[ShardedStateDict, LocalConversion]:
    """Rank 0's sharded state dict with every other rank's main replicas added: the state
    dict one process saves as the whole checkpoint."""
    result = LocalConversion(step=step, world=len(copies), tensors=0, objects=0, nbytes=0)
    state: ShardedStateDict = {}
    others: List[Any] = []
    for owner in range(len(copies)):
        header, flat, result.sources[owner] = _first_intact(owner, step, copies[owner])
        rank_state = rebuild(header, tensor_views(flat, header["layout"]))
        mains = [leaf for leaf in nested_values(rank_state)
                 if isinstance(leaf, (ShardedTensor, ShardedObject)) and is_main_replica(leaf.replica_id)]
        for leaf in mains:
            if isinstance(leaf, ShardedTensor):
                result.tensors += 1
                result.nbytes += leaf.data.numel() * leaf.data.element_size()
            else:
                result.objects += 1
        if owner == 0:
            state = rank_state
        else:
            others.extend(mains)
    key = _OTHER_RANKS
    while key in state:  # (a key of the saved state)
        key += "_"
    state[key] = others
    return state, result
