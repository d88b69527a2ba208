"""Which rank of a parallelization group writes or reads each shard, computed from
summaries every rank of the group shares.

Shards are identified by :func:`shard_id`; ranks in a :class:`ShardDistribution` are ranks
*within* the parallelization group (``0 .. group size - 1``). The distribution is computed
from one ``all_gather_object`` of per-shard summaries inside the group and a deterministic
greedy assignment (:func:`distribute_shards_to_ranks`) that every rank runs on the same
input, so no further communication is needed to agree on it.

The greedy rule: shards are ordered -- those whose main replica lies outside the group
last (cross-group loads), then fewest holders first, then largest first, then shard id --
and each goes to its least-loaded holder (bytes so far; lowest group rank on a tie).
Holders with the same set of ranks share one heap of ``(load, rank)`` whose out-of-date
entries are refreshed when they reach the top, so an assignment is ``O(log holders)``:
8,192 ranks x 100,000 shards take 0.3-1 s on one core (``benchmarks/bench_distribution.py``).
Holder lists that are the same Python list are read once (the planner shares them).

Owns: shard identity (``shard_id``, ``ShardInfo``), ``distribute_shards_to_ranks`` (greedy
balanced assignment), ``local_tensor_summary``, ``collect_holders``,
``distribution_from_summaries``, ``ShardDistribution`` and
``determine_main_replica_uniform_distribution``; the group's device and global ranks.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Dict, Hashable, Iterable, List, NamedTuple, Optional, Set, Tuple, TypeVar

import torch
import torch.distributed as dist

from ..runtime.collectives import all_gather_object, get_rank, get_world_size
from ..core import CheckpointingException
from ..dict_utils import nested_values
from ..mapping import ShardedStateDict, ShardedTensor, is_main_replica

T = TypeVar("T", bound=Hashable)

# (key, global offset, (flattened start, stop) or ())
ShardId = Tuple[str, Tuple[int, ...], Tuple[int, ...]]


class ShardInfo(NamedTuple):
    """What every rank of a group knows about a shard it may not hold."""

    local_shape: Tuple[int, ...]  # the shape of ``data`` (1-D slice length for flattened shards)
    dtype: torch.dtype
    nbytes: int


class ShardDistribution(NamedTuple):
    """An assignment of shards to the ranks of one parallelization group.

    Attributes:
        main_rank_for_shard: the group rank that writes (save) or reads (load) each shard.
        shards_in_this_group: shards whose main replica is held in this group (on save, the
            only ones this group writes); on load, every shard the group needs.
        shard_to_metadata: shape, dtype and size of every shard held in the group.
        all_ranks_for_shard: the group ranks that hold (save) or need (load) each shard.
    """

    main_rank_for_shard: Dict[ShardId, int]
    shards_in_this_group: Set[ShardId]
    shard_to_metadata: Dict[ShardId, ShardInfo]
    all_ranks_for_shard: Dict[ShardId, List[int]]

    def with_megatron_ids(self) -> "ShardDistribution":
        """The same with shard ids as Megatron-Core writes them (``None``, not ``()``, for
        shards without a flattened range: ``utils._sharded_tensor_shard_id``)."""
        def ids(d: Any) -> Any:
            if isinstance(d, set):
                return {_megatron_id(s) for s in d}
            return {_megatron_id(s): v for s, v in d.items()}

        return ShardDistribution(*(ids(field) for field in self))


def _megatron_id(sid: ShardId) -> Tuple[Any, ...]:
    return sid[0], sid[1], sid[2] or None


def shard_id(sh: ShardedTensor) -> ShardId:
    """The identity of a shard: its key, global offset and flattened range."""
    rng = sh.flattened_range
    return sh.key, tuple(sh.global_offset), (() if rng is None else (rng.start, rng.stop))


def _shard_info(sh: ShardedTensor) -> ShardInfo:
    rng = sh.flattened_range
    shape = tuple(sh.local_shape) if rng is None else (rng.stop - rng.start,)
    return ShardInfo(shape, sh.dtype, math.prod(shape) * sh.dtype.itemsize)


def _describe(sid: ShardId) -> str:
    key, offset, rng = sid
    return f"{key!r} (global offset {offset}{f', flattened range {rng}' if rng else ''})"


# ----------------------------------------------------------------------------- distribution


def distribute_shards_to_ranks(
    shard_to_ranks: Dict[T, List[int]],
    shard_to_size: Dict[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: Iterable[T] = (),
    loads: Optional[List[int]] = None,
) -> Dict[T, int]:
    """Assign every shard to one of its holders so that the bytes per rank are even.

    Greedy and deterministic (the same input gives the same output on every rank): shards
    are taken in the order (cross-parallelization-group loads last, fewest holders first,
    largest first, shard id) and each goes to its least-loaded holder (lowest rank on a
    tie). Shards are the keys of ``shard_to_ranks`` and must be mutually comparable.
    Holder lists that are the same list object are read once, so callers with many shards
    on the same ranks should share the list (8,192 ranks x 100,000 shards take about a
    second). ``loads``, when given, holds the bytes each rank already has and is updated
    in place.
    """
    cross = set(cross_parallelization_group_loads)
    set_of_list: Dict[int, int] = {}  # id(holder list) -> index of its holder set
    set_index: Dict[Tuple[int, ...], int] = {}
    holder_sets: List[Tuple[int, ...]] = []
    order = []
    for sid, ranks in shard_to_ranks.items():
        index = set_of_list.get(id(ranks))
        if index is None:
            holders = tuple(sorted(set(ranks)))
            if not holders:
                raise CheckpointingException(f"Shard {sid!r} has no rank that can hold it")
            if holders[0] < 0 or holders[-1] >= num_ranks:
                raise CheckpointingException(
                    f"Shard {sid!r} is assigned to ranks {list(holders)} outside 0..{num_ranks - 1}")
            index = set_index.setdefault(holders, len(holder_sets))
            if index == len(holder_sets):
                holder_sets.append(holders)
            set_of_list[id(ranks)] = index
        size = shard_to_size[sid]
        order.append((sid in cross, len(holder_sets[index]), -size, sid, size, index))
    order.sort(key=lambda e: e[:4])

    loads = [0] * num_ranks if loads is None else loads
    heaps: List[Optional[List[Tuple[int, int]]]] = [None] * len(holder_sets)
    assignment: Dict[T, int] = {}
    for _, _, _, sid, size, index in order:
        heap = heaps[index]
        if heap is None:
            heap = [(loads[r], r) for r in holder_sets[index]]
            heapq.heapify(heap)
            heaps[index] = heap
        # Loads only grow: an entry older than its rank's load is refreshed and pushed back.
        while heap[0][0] != loads[heap[0][1]]:
            heapq.heapreplace(heap, (loads[heap[0][1]], heap[0][1]))
        rank = heap[0][1]
        loads[rank] += size
        heapq.heapreplace(heap, (loads[rank], rank))
        assignment[sid] = rank
    return assignment


def _group_rank_or_raise(group: Optional[Any]) -> int:
    rank = get_rank(group)
    if rank < 0:
        raise CheckpointingException(
            f"Rank {dist.get_rank()} is not a member of the parallelization group it was given")
    return rank


def local_tensor_summary(sharded_state_dict: ShardedStateDict,
                         skip_empty: bool = False) -> List[Tuple[ShardId, ShardInfo, bool]]:
    """``(shard id, info, holds the main replica)`` of each distinct shard of this rank.
    ``skip_empty`` leaves out empty chunks (the fully parallel wrappers: nothing of them
    is written, read or sent, and several ranks may hold one at the same offset, uneven
    sharding, without being replicas).

    Raises :class:`CheckpointingException` (on this rank) when a shard id appears twice
    with different shapes or dtypes."""
    summary: Dict[ShardId, Tuple[ShardInfo, bool]] = {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor) and not (skip_empty and sh.is_empty_chunk()):
            sid = shard_id(sh)
            info = _shard_info(sh)
            main = is_main_replica(sh.replica_id)
            if sid in summary:
                if summary[sid][0] != info:
                    raise CheckpointingException(
                        f"ShardedTensor {_describe(sid)} appears twice in this rank's state dict with different "
                        f"shapes or dtypes ({summary[sid][0].local_shape} {summary[sid][0].dtype} and "
                        f"{info.local_shape} {info.dtype}): fully parallel save/load needs one shard per key and "
                        "offset on each rank")
                main = main or summary[sid][1]
            summary[sid] = (info, main)
    return [(sid, info, main) for sid, (info, main) in summary.items()]


def collect_holders(per_rank: Iterable[Optional[Iterable[Tuple[ShardId, ShardInfo, bool]]]]
                    ) -> Tuple[Dict[ShardId, List[int]], Dict[ShardId, ShardInfo], Set[ShardId]]:
    """From the summaries of the group ranks (``None`` for a rank with none): each shard's
    holders (group ranks, ascending), its info, and the shards with a main replica. A shard
    held with different shapes or dtypes raises :class:`CheckpointingException` naming it
    and two of the ranks."""
    holders: Dict[ShardId, List[int]] = {}
    infos: Dict[ShardId, ShardInfo] = {}
    first_holder: Dict[ShardId, int] = {}
    with_main: Set[ShardId] = set()
    for rank, summary in enumerate(per_rank):
        for sid, info, main in summary or ():
            known = infos.get(sid)
            if known is None:
                infos[sid] = info
                first_holder[sid] = rank
                holders[sid] = [rank]
            else:
                if known[:2] != info[:2]:
                    raise CheckpointingException(
                        f"ShardedTensor {_describe(sid)} differs between ranks of the parallelization group: "
                        f"group rank {first_holder[sid]} has shape {known.local_shape} dtype {known.dtype}, "
                        f"group rank {rank} has shape {info.local_shape} dtype {info.dtype}")
                holders[sid].append(rank)
            if main:
                with_main.add(sid)
    return holders, infos, with_main


def distribution_from_summaries(
    per_rank: List[List[Tuple[ShardId, ShardInfo, bool]]], ignore_groups: bool = False
) -> ShardDistribution:
    """The distribution for a group whose ranks hold the given shards (see
    :func:`determine_main_replica_uniform_distribution`)."""
    holders, infos, with_main = collect_holders(per_rank)
    # Share identical holder lists (most shards are held by the same few rank sets).
    canonical: Dict[Tuple[int, ...], List[int]] = {}
    for sid, ranks in holders.items():
        holders[sid] = canonical.setdefault(tuple(ranks), ranks)
    cross = set(holders) - with_main
    assignment = distribute_shards_to_ranks(
        holders, {sid: info.nbytes for sid, info in infos.items()}, len(per_rank), cross)
    in_group = set(holders) if ignore_groups else with_main
    return ShardDistribution(assignment, in_group, infos, holders)


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict, parallelization_group: Optional[Any], ignore_groups: bool = False
) -> Optional[ShardDistribution]:
    """Compute, collectively within ``parallelization_group``, which rank handles each shard.

    Each rank contributes a summary of its ShardedTensors (one ``all_gather_object`` inside
    the group, nothing outside it); the assignment is then computed identically on every
    rank. Shards whose main replica lies outside the group are assigned last, so that a
    load with ``ignore_groups=True`` (every needed shard, main replica or not) gives each
    shard the same rank as a save of the same layout did: the rank that wrote a shard reads
    it back. A shard held with different shapes or dtypes by two ranks raises
    :class:`CheckpointingException` on every rank of the group. Returns ``None`` for a
    group of one rank.
    """
    _group_rank_or_raise(parallelization_group)
    if get_world_size(parallelization_group) <= 1:
        return None
    per_rank = all_gather_object(local_tensor_summary(sharded_state_dict), parallelization_group)
    return distribution_from_summaries(per_rank, ignore_groups)

def comm_device(group: Optional[Any] = None) -> torch.device:
    """The device the group's backend communicates from: the current CUDA device for
    NCCL, the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_rank(group: Optional[Any], group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
