"""How loaded shards travel to the other ranks of a group that need them: the collective
algorithms (``broadcast``, ``gather_rounds``, ``gather_object``) for shards the whole
group needs, and the point-to-point exchange of a :class:`~.plan.ShardPlan` for the others.

Every exchange moves raw bytes (each tensor viewed as ``uint8``), so any dtype travels
bit-exact over any backend — gloo cannot carry int16, unsigned or float8 tensors, NCCL can
carry bytes of everything — and tensors are staged through the backend's device (CPU for
gloo, the current CUDA device for NCCL) only when they are not already there.

A received shard lands straight in the request's tensor when that is contiguous and on the
communication device, else in a landing tensor copied into it. The algorithms:

* ``broadcast`` (default): one ``broadcast`` per shard above 1 MiB from its reader; smaller
  shards of one reader packed into buckets of up to 16 MiB, one ``broadcast`` each. Peak
  extra memory: one shard or bucket (ranks that do not need it receive into one reused
  scratch buffer).
* ``gather_rounds``: each member's exchanged shards form one byte stream of known length;
  round ``k`` covers bytes ``[k, k+1) x ROUND_BYTES`` of every stream, padded to the round's
  common size, in one ``all_gather`` of equal-sized ``uint8`` tensors (gloo has no uneven
  ``all_gather``); ``ceil(L / 16 MiB)`` calls for the longest stream ``L``.
* ``gather_object``: one ``all_gather_object``, about 3x the exchanged bytes in memory --
  for debugging and small states.
"""

from __future__ import annotations

import bisect
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..tensors.bytes_view import as_bytes
from ..runtime.collectives import all_gather_object, get_rank, get_world_size
from ..core import CheckpointingException
from ..tensors.fp8 import dequantize, fill_float8_, is_float8tensor
from ..mapping import ShardedTensor
from .distribution import ShardDistribution, ShardId, ShardInfo, _describe, _global_rank, comm_device
from .plan import ShardPlan

EXCHANGE_ALGORITHMS = ("broadcast", "gather_rounds", "gather_object")
# Broadcast exchange: shards up to SMALL_SHARD_BYTES from one source travel together in
# buckets of at most BUCKET_BYTES (one collective per bucket instead of one per shard).
SMALL_SHARD_BYTES = 1 << 20
BUCKET_BYTES = 16 << 20
# Gather-rounds exchange: bytes each rank contributes per all_gather round.
ROUND_BYTES = 16 << 20


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
    communication device, else into a landing tensor copied into ``dest`` at the end."""

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
    size x ``ROUND_BYTES``), landing tensors for destinations that are not contiguous on the
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

_ALGORITHMS = {
    "broadcast": exchange_loaded_tensors_broadcast,
    "gather_rounds": exchange_loaded_tensors_gather_rounds,
    "gather_object": exchange_loaded_tensors_gather_object,
}


def empty_tensor_for_exchange(sid: ShardId, needed_shards: Dict[ShardId, ShardedTensor],
                              unneeded_shards: Dict[ShardId, ShardedTensor], loaded_tensors: Dict[ShardId, torch.Tensor],
                              device: Optional[torch.device] = None) -> Tuple[torch.Tensor, Optional[torch.device]]:
    """Megatron-Core's ``exchange_utils._get_empty_tensor_for_exchange``: the tensor that
    receives shard ``sid`` in an exchange, on ``device`` (default: the default group's
    communication device), and the device of the request's own tensor (``None`` for a
    shard this rank does not need, whose tensor is discarded after the exchange). A needed
    shard's tensor is also put in ``loaded_tensors``."""
    device = comm_device() if device is None else device
    needed = needed_shards.get(sid)
    sh = needed if needed is not None else unneeded_shards[sid]
    had_data = sh.data is not None
    sh.init_data(device)
    tensor = sh.data if sh.data.device == device else torch.empty_like(sh.data, device=device)
    if needed is None:
        if not had_data:
            sh.data = None  # allocated only to be exchanged into
        return tensor, None
    loaded_tensors[sid] = tensor
    return tensor, needed.data.device


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

def exchange_point_to_point(loaded_tensors: Dict[ShardId, torch.Tensor],
                            unloaded_shards: Dict[ShardId, ShardedTensor], plan: ShardPlan,
                            group: Optional[Any] = None) -> Dict[ShardId, torch.Tensor]:
    """Send each shard of ``plan.send_to`` to the ranks that requested it and receive each
    of ``unloaded_shards`` from its reader, straight between the tensors (one batch of
    ``isend``/``irecv``; messages between two ranks go in shard order on both sides).
    Returns the received shards (by id), in the requests' own tensors where they have one.
    """
    device = comm_device(group)
    ops: List[dist.P2POp] = []
    keep: List[torch.Tensor] = []
    for sid in sorted(plan.send_to):
        if not plan.infos[sid].nbytes:
            continue
        buf = _source_bytes(loaded_tensors[sid])
        buf = buf if buf.device == device and buf.is_contiguous() else buf.contiguous().to(device)
        keep.append(buf)
        ops += [dist.P2POp(dist.isend, buf, _global_rank(group, dst), group) for dst in plan.send_to[sid]]
    landings: Dict[ShardId, _Landing] = {}
    for sid in sorted(unloaded_shards):
        landing = _Landing(_destination(unloaded_shards[sid], plan.infos[sid]), device)
        landings[sid] = landing
        if plan.infos[sid].nbytes:
            ops.append(dist.P2POp(dist.irecv, landing.bytes, _global_rank(group, plan.reader[sid]), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return {sid: landing.finish() for sid, landing in landings.items()}
