"""Converting a local-tier checkpoint (:mod:`.tier`) into a normal one, offline: one
process, no process group (``dist-ckpt convert-local``).

Only the copies of one job (:mod:`.marker`) are ever combined: the node directories
may hold copies of several jobs, and a step held by more than one is refused unless the
job is named by its persistent root. Every marker is validated before use (an invalid one
is a damaged copy); nothing is allocated from a marker's numbers. Every rank's copy of
the step is looked for in the given node-local directories, in their
order; the first copy whose checksums hold is used (own copy or replica alike), mapped
from its file rather than read into memory (:func:`.tier.map_copy`). Each copy's
header describes its rank's sharded state dict (:mod:`.format`); their main
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

from ... import serialization
from ...runtime.collectives import get_world_size
from ...core import CheckpointingException, Location, checkpoint_location, malformed, open_storage
from ...dict_utils import nested_values
from ...mapping import ShardedObject, ShardedStateDict, is_main_replica
from ...integrity.overlap import refuse_overlap
from ...tensors.sharded import ShardedTensor
from ...storage import StorageOptions, url_scheme
from ..layout import CONTENT_KEY
from .format import rebuild
from .files import local_step_dir, map_copy, payload_name, scan
from .marker import describe_job, normalise_root
from .snapshot import flat_checksum, tensor_views

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
    job: Dict[str, str] = field(default_factory=dict)  # the job that saved it: {"root": ..., "run": ...}


def convert_local_checkpoint(node_dirs: Sequence[Union[str, "os.PathLike[str]"]], output: Location,
                             step: Optional[int] = None,
                             storage_options: StorageOptions = None, root: Optional[str] = None) -> LocalConversion:
    """Write ``step`` of a local-tier checkpoint (default: the newest step complete in
    ``node_dirs``) as a normal ``torch_dist`` checkpoint into ``output``, which must be
    empty or missing (a directory or a URL; ``storage_options`` configure its client).

    ``node_dirs``: the node-local directories (local paths) holding the ranks' copies; each
    rank's shards are read from its first intact copy in this order. ``root``: convert the
    copies of the job with this persistent root only (needed when copies of the step
    belong to several jobs). Runs in one process without a process group. Raises
    :class:`CheckpointingException` naming the directory, file or rank at fault: a step
    not found, ranks with no copy, copies of several jobs, copies saved by different world
    sizes, a rank whose copies are all damaged or unreadable (an invalid marker, a header
    of an earlier version's encoding included), an output that is not empty.
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
        if root is not None:
            wanted = normalise_root(root)
            found = [(d, m) for d, m in found if m["job"]["root"] == wanted]
        step = _pick_step(found, step, dirs)
        job = _job_of([(d, m) for d, m in found if m["step"] == step], step, dirs)
        copies = _copies_of([(d, m) for d, m in found if m["job"] == job], step, dirs)
        state, result = _combined(step, copies)
        result.job = job
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
        for job in _jobs([(d, m) for d, m in found if m["step"] == candidate]).values():
            if len({m["owner"] for _, m in job}) == _world_of(job, candidate):  # (every owner < its world)
                return candidate
    raise CheckpointingException(f"Local tier: no step is complete in {', '.join(dirs)} (steps found: {steps}; "
                                 "pass the step to convert to see what it lacks)")


def _jobs(copies: List[Copy]) -> Dict[Tuple[str, str], List[Copy]]:
    """``copies`` by the job that wrote them."""
    out: Dict[Tuple[str, str], List[Copy]] = {}
    for d, m in copies:
        out.setdefault((m["job"]["root"], m["job"]["run"]), []).append((d, m))
    return out


def _job_of(copies: List[Copy], step: int, dirs: List[str]) -> Dict[str, str]:
    """The one job whose ``copies`` of ``step`` these are; an error naming them if several."""
    jobs = _jobs(copies)
    if len(jobs) > 1:
        named = "; ".join(f"{describe_job({'root': root, 'run': run})} in "
                          f"{', '.join(sorted({d for d, _ in held}))}" for (root, run), held in sorted(jobs.items()))
        raise CheckpointingException(f"Local tier: the copies of step {step} belong to {len(jobs)} jobs ({named}): "
                                     "they are not one checkpoint; name the job by its persistent root "
                                     "(root=, dist-ckpt convert-local --root)")
    root, run = next(iter(jobs))
    return {"root": root, "run": run}


def _copies_of(found: List[Copy], step: int, dirs: List[str]) -> Dict[int, List[Copy]]:
    """Each rank's copies of ``step`` (of one job), in the order of the node directories."""
    mine = [(d, m) for d, m in found if m["step"] == step]
    world = _world_of(mine, step)
    copies: Dict[int, List[Copy]] = {}
    for d, m in mine:
        copies.setdefault(m["owner"], []).append((d, m))
    if len(copies) < world:  # the first missing ranks, found without counting up to the world size
        missing = [r for r in range(min(world, len(copies) + 5)) if r not in copies][:5]
        more = "" if world - len(copies) <= len(missing) else f" ... {world - len(copies)} in all"
        raise CheckpointingException(f"Local tier: no copy of rank {missing[0]}'s shards of step {step} "
                                     f"(ranks missing: {missing}{more}) in {', '.join(dirs)}")
    return dict(sorted(copies.items()))


def _open_copy(node_dir: str, marker: Dict[str, Any]) -> Tuple[ShardedStateDict, str]:
    """The sharded state dict of the copy a marker describes (rebuilt from its header, its
    tensors views of a private map of its file), its checksums verified; with the file's
    path."""
    path = os.path.join(node_dir, local_step_dir(marker["step"]), payload_name(marker["owner"]))
    flat, _, header = map_copy(node_dir, marker)
    if f"{flat_checksum(flat, header['layout']):016x}" != marker["checksum"]:
        raise CheckpointingException(f"Local tier: {path} fails its checksum")
    with malformed(f"Local tier: the header of {path}"):  # a header of the wrong shape: a damaged copy
        state = rebuild(header, tensor_views(flat, header["layout"]))
        if not isinstance(state, dict):
            raise CheckpointingException(f"Local tier: the header of {path} does not describe a state dict")
    return state, path


def _first_intact(owner: int, step: int, copies: List[Copy]) -> Tuple[ShardedStateDict, str]:
    """The state of the first copy of ``owner``'s shards whose checksums hold."""
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
        rank_state, result.sources[owner] = _first_intact(owner, step, copies[owner])
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
