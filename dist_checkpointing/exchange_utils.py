"""Which rank of a parallelization group writes or reads each shard, and how loaded shards
travel to the other ranks that need them.

Shards are identified by :func:`shard_id`; ranks in a :class:`ShardDistribution` are ranks
*within* the parallelization group (``0 .. group size - 1``). The distribution is computed
from one ``all_gather_object`` of per-shard summaries inside the group and a deterministic
greedy assignment (:func:`distribute_shards_to_ranks`) that every rank runs on the same
input, so no further communication is needed to agree on it.

Every exchange moves raw bytes (each tensor viewed as ``uint8``), so any dtype travels
bit-exact over any backend — gloo cannot carry int16, unsigned or float8 tensors, NCCL can
carry bytes of everything — and tensors are staged through the backend's device (CPU for
gloo, the current CUDA device for NCCL) only when they are not already there.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Any, Dict, Hashable, Iterable, List, NamedTuple, Optional, Set, Tuple, TypeVar

import torch
import torch.distributed as dist

from .bytes_view import as_bytes
from .collectives import all_gather_object, get_rank, get_world_size
from .core import CheckpointingException
from .dict_utils import nested_values
from .fp8 import dequantize, fill_float8_, is_float8tensor
from .mapping import ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica

T = TypeVar("T", bound=Hashable)

# (key, global offset, (flattened start, stop) or ())
ShardId = Tuple[str, Tuple[int, ...], Tuple[int, ...]]

EXCHANGE_ALGORITHMS = ("broadcast", "gather_rounds", "gather_object")
# Broadcast exchange: shards up to SMALL_SHARD_BYTES from one source travel together in
# buckets of at most BUCKET_BYTES (one collective per bucket instead of one per shard).
SMALL_SHARD_BYTES = 1 << 20
BUCKET_BYTES = 16 << 20
# Gather-rounds exchange: bytes each rank contributes per all_gather round.
ROUND_BYTES = 16 << 20


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


def local_tensor_summary(sharded_state_dict: ShardedStateDict) -> List[Tuple[ShardId, ShardInfo, bool]]:
    """``(shard id, info, holds the main replica)`` of each distinct shard of this rank.

    Raises :class:`CheckpointingException` (on this rank) when a shard id appears twice
    with different shapes or dtypes."""
    summary: Dict[ShardId, Tuple[ShardInfo, bool]] = {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
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


# ----------------------------------------------------------------------------- exchange helpers


def comm_device(group: Optional[Any] = None) -> torch.device:
    """The device the group's backend communicates from: the current CUDA device for
    NCCL, the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _source_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in row-major order (a view when ``t`` is contiguous); an FP8
    (Transformer Engine) tensor travels as its values in its nominal dtype."""
    t = dequantize(t) if is_float8tensor(t) else t.detach()
    return as_bytes(t)


def _destination(sh: ShardedTensor, info: ShardInfo) -> torch.Tensor:
    """The tensor an exchanged shard lands in: the request's own, or a new CPU tensor."""
    data = sh.data
    if data is None:
        return torch.empty(info.local_shape, dtype=info.dtype)
    if tuple(data.shape) != info.local_shape or data.dtype != info.dtype:
        raise CheckpointingException(
            f"ShardedTensor {sh.key!r}: the request's tensor has shape {tuple(data.shape)} dtype {data.dtype}, "
            f"the shard is {info.local_shape} {info.dtype}")
    return data


class _Landing:
    """Where received bytes go: straight into ``dest`` when it is contiguous and on the
    communication device, else into a staging tensor copied into ``dest`` at the end."""

    def __init__(self, dest: torch.Tensor, device: torch.device):
        self.dest = dest
        self.fp8 = is_float8tensor(dest)  # receives its values, quantized at the end
        writable = dest if self.fp8 else dest.detach()  # parameters are filled outside autograd
        self.direct = not self.fp8 and writable.is_contiguous() and writable.device == device
        self.stage = writable if self.direct else torch.empty(tuple(dest.shape), dtype=dest.dtype, device=device)
        self.bytes = as_bytes(self.stage)

    def finish(self) -> torch.Tensor:
        if self.fp8:
            fill_float8_(self.dest, self.stage)
        elif not self.direct:
            self.dest.detach().copy_(self.stage)
        return self.dest


class _Scratch:
    """One reusable uint8 buffer for bytes a rank receives but does not keep."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buf = torch.empty(0, dtype=torch.uint8, device=device)

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.buf[:nbytes]


def _exchanged(shard_distribution: ShardDistribution) -> List[Tuple[int, ShardId, int]]:
    """``(source rank, shard, nbytes)`` of the shards some rank other than their reader
    needs, in the order every rank of the group walks them."""
    out = []
    for sid, src in shard_distribution.main_rank_for_shard.items():
        ranks = shard_distribution.all_ranks_for_shard[sid]
        nbytes = shard_distribution.shard_to_metadata[sid].nbytes
        if nbytes and any(r != src for r in ranks):
            out.append((src, sid, nbytes))
    out.sort(key=lambda e: (e[0], e[1]))
    return out


def _check_inputs(loaded_tensors: Dict[ShardId, torch.Tensor], unloaded_shards: Dict[ShardId, ShardedTensor],
                  shard_distribution: ShardDistribution, me: int) -> None:
    for sid in unloaded_shards:
        if sid not in shard_distribution.main_rank_for_shard:
            raise CheckpointingException(f"Shard {_describe(sid)} is not in the distribution")
        if shard_distribution.main_rank_for_shard[sid] == me:
            raise CheckpointingException(f"Shard {_describe(sid)} was to be loaded by this rank ({me})")
    for sid, src in shard_distribution.main_rank_for_shard.items():
        if src == me and sid not in loaded_tensors and me in shard_distribution.all_ranks_for_shard[sid]:
            raise CheckpointingException(f"Shard {_describe(sid)} was to be loaded by this rank ({me}) but was not")


def _begin(loaded_tensors: Dict[ShardId, torch.Tensor], unloaded_shards: Dict[ShardId, ShardedTensor],
           shard_distribution: ShardDistribution, group: Optional[Any],
           device: torch.device) -> Tuple[int, Dict[ShardId, _Landing]]:
    """This rank's group rank and where each shard it receives lands (inputs checked)."""
    me = get_rank(group)
    _check_inputs(loaded_tensors, unloaded_shards, shard_distribution, me)
    infos = shard_distribution.shard_to_metadata
    return me, {sid: _Landing(_destination(sh, infos[sid]), device) for sid, sh in unloaded_shards.items()}


def _finish(loaded_tensors: Dict[ShardId, torch.Tensor], landings: Dict[ShardId, _Landing]) -> Dict[ShardId, torch.Tensor]:
    """Every shard this rank needs: the ones it read and the ones it received."""
    result = dict(loaded_tensors)
    result.update({sid: landing.finish() for sid, landing in landings.items()})
    return result


def _global_rank(group: Optional[Any], group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# ----------------------------------------------------------------------------- exchange algorithms


def exchange_loaded_tensors_broadcast(
    loaded_tensors: Dict[ShardId, torch.Tensor],
    unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[Any] = None,
) -> Dict[ShardId, torch.Tensor]:
    """Exchange by broadcasts from each shard's reader to the whole group.

    Shards larger than ``SMALL_SHARD_BYTES`` are broadcast one by one, straight from the
    reader's tensor into the needers' tensors; smaller ones from the same reader travel
    together in buckets of up to ``BUCKET_BYTES``. Ranks that do not need a shard receive
    it into one reused scratch buffer, so beyond the result each rank holds at most one
    shard (or one bucket) in flight. Returns every shard this rank needs (the loaded ones
    included).
    """
    group = parallelization_group
    device = comm_device(group)
    me, landings = _begin(loaded_tensors, unloaded_shards, shard_distribution, group, device)
    scratch = _Scratch(device)

    def send_bytes(sid: ShardId) -> torch.Tensor:
        return _source_bytes(loaded_tensors[sid])

    # Consecutive small shards of one source share a bucket; a large shard travels alone.
    batches: List[Tuple[int, List[Tuple[ShardId, int]]]] = []
    bucket_bytes = 0
    for src, sid, nbytes in _exchanged(shard_distribution):
        small = nbytes <= SMALL_SHARD_BYTES
        last = batches[-1] if batches else None
        if small and last is not None and last[0] == src and last[1][0][1] <= SMALL_SHARD_BYTES \
                and bucket_bytes + nbytes <= BUCKET_BYTES:
            last[1].append((sid, nbytes))
            bucket_bytes += nbytes
        else:
            batches.append((src, [(sid, nbytes)]))
            bucket_bytes = nbytes

    for src, items in batches:
        src_global = _global_rank(group, src)
        if len(items) == 1:
            sid, nbytes = items[0]
            if src == me:
                buf = send_bytes(sid)
                buf = buf if buf.device == device else buf.to(device)
            elif sid in landings:
                buf = landings[sid].bytes
            else:
                buf = scratch.get(nbytes)
            dist.broadcast(buf, src=src_global, group=group)
            continue
        total = sum(n for _, n in items)
        buf = scratch.get(total)
        if src == me:
            pos = 0
            for sid, nbytes in items:
                buf[pos:pos + nbytes].copy_(send_bytes(sid))
                pos += nbytes
        dist.broadcast(buf, src=src_global, group=group)
        if src != me:
            pos = 0
            for sid, nbytes in items:
                if sid in landings:
                    landings[sid].bytes.copy_(buf[pos:pos + nbytes])
                pos += nbytes
    return _finish(loaded_tensors, landings)


def exchange_loaded_tensors_gather_rounds(
    loaded_tensors: Dict[ShardId, torch.Tensor],
    unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[Any] = None,
) -> Dict[ShardId, torch.Tensor]:
    """Exchange by rounds of equal-sized ``all_gather`` calls.

    Each rank's exchanged shards form one byte stream (in shard order); every round, each
    rank contributes the next ``ROUND_BYTES`` of its stream, padded to the round's common
    size (the distribution balances the streams, so padding is small), and every rank
    copies the bytes it needs out of the gathered buffers. Equal sizes keep it independent
    of uneven all_gather support, which gloo lacks. Peak extra memory per rank:
    (group size + 1) x ``ROUND_BYTES``, plus what the backend stages (gloo: another group
    size x ``ROUND_BYTES``), staging for destinations that are not contiguous on the
    communication device and a contiguous copy of the one non-contiguous source shard
    being sent.
    """
    group = parallelization_group
    device = comm_device(group)
    me, landings = _begin(loaded_tensors, unloaded_shards, shard_distribution, group, device)
    size = get_world_size(group)

    streams: List[List[Tuple[int, ShardId, int]]] = [[] for _ in range(size)]  # (stream offset, sid, nbytes)
    totals = [0] * size
    for src, sid, nbytes in _exchanged(shard_distribution):
        streams[src].append((totals[src], sid, nbytes))
        totals[src] += nbytes
    starts = [[start for start, _, _ in stream] for stream in streams]
    longest = max(totals)
    scratch = _Scratch(device)
    source: Tuple[Any, Optional[torch.Tensor]] = (None, None)
    for lo in range(0, longest, ROUND_BYTES):
        n = min(ROUND_BYTES, longest - lo)
        buf = scratch.get((size + 1) * n)
        send, parts = buf[size * n:], [buf[r * n:(r + 1) * n] for r in range(size)]
        for start, sid, nbytes in _overlapping(streams[me], starts[me], lo, lo + n):
            if source[0] != sid:  # a shard spans consecutive rounds: make its bytes once
                source = (sid, _source_bytes(loaded_tensors[sid]))
            a, b = max(start, lo), min(start + nbytes, lo + n)
            send[a - lo:b - lo].copy_(source[1][a - start:b - start])
        dist.all_gather(parts, send, group=group)
        for src in range(size):
            if src == me:
                continue
            for start, sid, nbytes in _overlapping(streams[src], starts[src], lo, lo + n):
                landing = landings.get(sid)
                if landing is not None:
                    a, b = max(start, lo), min(start + nbytes, lo + n)
                    landing.bytes[a - start:b - start].copy_(parts[src][a - lo:b - lo])
    return _finish(loaded_tensors, landings)


def _overlapping(stream: List[Tuple[int, ShardId, int]], starts: List[int], lo: int,
                 hi: int) -> Iterable[Tuple[int, ShardId, int]]:
    """The entries of a stream (sorted by offset, ``starts`` their offsets) with bytes in
    ``[lo, hi)``."""
    for entry in stream[max(0, bisect.bisect_right(starts, lo) - 1):]:
        start, _, nbytes = entry
        if start >= hi:
            break
        if start + nbytes > lo:
            yield entry


def exchange_loaded_tensors_gather_object(
    loaded_tensors: Dict[ShardId, torch.Tensor],
    unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[Any] = None,
) -> Dict[ShardId, torch.Tensor]:
    """Exchange with one ``all_gather_object`` of every rank's shards that others need.

    Simple and slow (the tensors are pickled): for debugging and small states. Peak extra
    memory per rank: about three times the group's exchanged bytes (the pickles sent and
    gathered, then the tensors).
    """
    group = parallelization_group
    me, landings = _begin(loaded_tensors, unloaded_shards, shard_distribution, group, torch.device("cpu"))
    # As bytes: pickling float8 tensors is not supported, and bytes are bit-exact anyway.
    mine = {sid: _pickle_ready(_source_bytes(loaded_tensors[sid]).cpu())
            for src, sid, _ in _exchanged(shard_distribution) if src == me}
    gathered = all_gather_object(mine, group)
    for sid, landing in landings.items():
        if landing.bytes.numel():
            landing.bytes.copy_(gathered[shard_distribution.main_rank_for_shard[sid]][sid])
    return _finish(loaded_tensors, landings)


def _pickle_ready(b: torch.Tensor) -> torch.Tensor:
    """``b`` alone in its storage (pickling a view would send its whole base storage)."""
    return b if b.untyped_storage().nbytes() == b.numel() else b.clone()


def exchange_loaded_objects_gather_object(
    loaded_objects: Dict[str, Any], parallelization_group: Optional[Any] = None
) -> Dict[str, Any]:
    """Every object loaded by any rank of the group, by unique key (one
    ``all_gather_object`` inside the group)."""
    result: Dict[str, Any] = {}
    for objects in all_gather_object(loaded_objects, parallelization_group):
        result.update(objects)
    return result


_ALGORITHMS = {
    "broadcast": exchange_loaded_tensors_broadcast,
    "gather_rounds": exchange_loaded_tensors_gather_rounds,
    "gather_object": exchange_loaded_tensors_gather_object,
}


def check_exchange_algo(exchange_algo: str) -> None:
    """Raise :class:`CheckpointingException` for an unknown exchange algorithm."""
    if exchange_algo not in _ALGORITHMS:
        raise CheckpointingException(
            f"Unknown exchange_algo {exchange_algo!r}: choose one of {', '.join(EXCHANGE_ALGORITHMS)}")


def exchange_by_distribution(
    loaded_tensors: Dict[ShardId, torch.Tensor],
    unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[Any] = None,
    exchange_algo: str = "broadcast",
) -> Dict[ShardId, torch.Tensor]:
    """Exchange loaded tensors with ``exchange_algo`` (``'broadcast'``, ``'gather_rounds'``
    or ``'gather_object'``)."""
    check_exchange_algo(exchange_algo)
    return _ALGORITHMS[exchange_algo](loaded_tensors, unloaded_shards, shard_distribution, parallelization_group)


def object_loaders(per_rank_objects: List[List[str]]) -> Tuple[Dict[str, int], Dict[str, List[int]]]:
    """For ShardedObjects needed in a group: which group rank reads each (the needer with
    the fewest objects so far, deterministic), and every rank that needs it."""
    needers: Dict[str, List[int]] = {}
    for rank, keys in enumerate(per_rank_objects):
        for key in keys:
            needers.setdefault(key, []).append(rank)
    counts = [0] * len(per_rank_objects)
    loader: Dict[str, int] = {}
    for key in sorted(needers, key=lambda k: (len(needers[k]), k)):
        rank = min(needers[key], key=lambda r: (counts[r], r))
        counts[rank] += 1
        loader[key] = rank
    return loader, needers


def local_object_keys(sharded_state_dict: ShardedStateDict) -> List[str]:
    """Unique keys of the ShardedObjects in a state dict (each once)."""
    return sorted({sh.unique_key for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedObject)})
