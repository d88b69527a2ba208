"""Small collective helpers: rank/world with or without a process group, and agreement
on errors so that a problem found on one rank is raised on every rank (never a hang).

**One exception on every rank** (:func:`run_agreed`): every rank runs the step, catching any
``Exception`` and keeping its message; one 1-byte ``all_reduce`` (MAX) of a failure flag,
and only after a failure an ``all_gather_object`` of the messages; then every rank raises
the same ``CheckpointingException("<what> failed on N rank(s): rank r: ...")`` (ranks with
the same message listed together; a message every rank shares is raised unchanged, which
is how an error agreed inside a strategy passes through the ``run_agreed`` around it).
Without a process group (or in a group of one) a ``CheckpointingException`` propagates as
is and anything else is wrapped, with the original as its cause. Steps that are not
``run_agreed`` agree by hand (rank 0 broadcasts its outcome; validation and strict loads
agree on a flag, then gather the problems). Limits: ``BaseException`` (a
``KeyboardInterrupt``, a killed rank) is not caught, so the other ranks wait in the next
collective until the group's timeout; a custom strategy running collectives of its own
must agree on errors before each of them.

Owns: rank / world size with or without a process group, object collectives,
``exchange_objects`` (each rank receives only what is addressed to it:
``all_to_all_single``), ``run_agreed`` (errors agreed across ranks),
``all_reduce_max_uint8``.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist

from ..pickling.trusted import loads_trusted
from ..core import CheckpointingException, error_message  # noqa: F401 - error_message: imported from here too

T = TypeVar("T")


def is_distributed() -> bool:
    """True when a default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Optional[Any] = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Optional[Any] = None) -> int:
    """Size of ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_distributed() else 1


def check_whole_world(group: Optional[Any], what: str) -> None:
    """Refuse a ``group`` that is not every rank (``None`` is): ``what`` runs over all ranks."""
    if group is not None and is_distributed() and get_world_size(group) != get_world_size():
        raise CheckpointingException(
            f"{what}(process_group=...) with {get_world_size(group)} of {get_world_size()} ranks: this "
            "library runs it over every rank; pass process_group=None")


def all_gather_object(obj: Any, group: Optional[Any] = None) -> List[Any]:
    """Every rank's ``obj``, on every rank."""
    if get_world_size(group) == 1:
        return [obj]
    out: List[Any] = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: Any, group: Optional[Any] = None) -> Optional[List[Any]]:
    """Every rank's ``obj`` on the group's first rank; ``None`` elsewhere.

    The first rank receives exactly the pickled objects (one ``gather`` of their 8-byte
    sizes, then one message from each rank) — not ``torch.distributed.gather_object``'s
    world size × the largest object; the other ranks receive nothing."""
    world = get_world_size(group)
    if world == 1:
        return [obj]
    device = _device(group)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    payload = pickle.dumps(obj)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    if get_rank(group) != 0:
        dist.gather(size, None, dst=first, group=group)
        dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device), dst=first, group=group)
        return None
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.gather(size, sizes, dst=first, group=group)
    buffers = [torch.empty(int(n.item()), dtype=torch.uint8, device=device) for n in sizes[1:]]
    works = [dist.irecv(buf, src=dist.get_global_rank(group, r) if group is not None else r, group=group)
             for r, buf in enumerate(buffers, start=1)]
    for work in works:
        work.wait()
    return [obj] + [loads_trusted(buf.cpu().numpy().tobytes()) for buf in buffers]  # from the other ranks


def broadcast_object(obj: Any, group: Optional[Any] = None) -> Any:
    """The group's first rank's ``obj``, on every rank."""
    if get_world_size(group) == 1:
        return obj
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def scatter_object(objs: Optional[List[Any]], group: Optional[Any] = None) -> Any:
    """``objs[r]`` of the group's first rank, on each rank ``r`` (``objs`` is read on the
    first rank only): each rank receives only its own object."""
    if get_world_size(group) == 1:
        return objs[0]  # type: ignore[index]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box: List[Any] = [None]
    dist.scatter_object_list(box, objs if get_rank(group) == 0 else None, src=src, group=group)
    return box[0]


def raise_if_any(errors: List[Optional[str]], what: str) -> None:
    """Raise one CheckpointingException listing every rank's error, if there is any."""
    failed = [(rank, msg) for rank, msg in enumerate(errors) if msg is not None]
    if not failed:
        return
    if len(errors) > 1 and all(msg == failed[0][1] for _, msg in failed) and len(failed) == len(errors):
        raise CheckpointingException(failed[0][1])  # already agreed: same message everywhere
    by_message: dict = {}
    for rank, msg in failed:
        by_message.setdefault(msg, []).append(rank)
    details = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: {msg}" for msg, ranks in by_message.items()
    )
    raise CheckpointingException(f"{what} failed on {len(failed)} rank(s): {details}")


def run_agreed(fn: Callable[[], T], what: str, group: Optional[Any] = None) -> T:
    """Run ``fn`` on every rank; if it fails anywhere, raise on every rank.

    Costs one 1-byte ``all_reduce`` (nothing without a group); only when some rank failed,
    one ``all_gather_object`` of the error messages follows.
    """
    return run_agreed_with_flags(fn, lambda _: [], what, group)[0]


def run_agreed_with_flags(fn: Callable[[], T], flags: Callable[[T], List[int]], what: str,
                          group: Optional[Any] = None) -> Tuple[T, List[int]]:
    """:func:`run_agreed`, also agreeing on a few small flags (0..255) of its result: returns
    the result and the element-wise max of every rank's ``flags(result)`` (which must have
    the same length on every rank), in the same ``all_reduce``."""
    result: Optional[T] = None
    error: Optional[str] = None
    mine: List[int] = []
    try:
        result = fn()
        mine = list(flags(result))
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        if get_world_size(group) == 1:
            if isinstance(e, CheckpointingException):
                raise
            raise CheckpointingException(f"{what} failed: {error_message(e)}") from e
        error = error_message(e)
        mine = list(flags(None))  # type: ignore[arg-type]
    agreed = all_reduce_max_uint8([int(error is not None)] + mine, group)
    if agreed[0]:
        raise_if_any(all_gather_object(error, group), what)
    return result, agreed[1:]  # type: ignore[return-value]


def _device(group: Optional[Any]) -> torch.device:
    """Where the group's collectives take their tensors (the current CUDA device for NCCL)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def exchange_objects(per_destination: List[Any], group: Optional[Any] = None) -> List[Any]:
    """Send ``per_destination[r]`` to each rank ``r``; return what each rank sent to this one.

    Each rank receives only its own objects: one ``all_to_all_single`` of the byte counts
    (8 bytes per rank), then one of the pickled payloads; ``None`` travels as zero bytes,
    so sparse exchanges cost little more than the counts. A rank whose objects cannot be
    pickled sends count -1, so every rank raises (naming it) instead of waiting.
    """
    world = get_world_size(group)
    if world == 1:
        return [per_destination[0]]
    error = None
    try:
        payloads = [b"" if obj is None else pickle.dumps(obj) for obj in per_destination]
    except Exception as e:  # noqa: BLE001 - announced to every rank through the counts
        payloads, error = [b""] * world, error_message(e)
    device = _device(group)
    send_counts = torch.tensor([-1 if error else len(p) for p in payloads], dtype=torch.int64, device=device)
    recv_counts = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    counts = recv_counts.cpu().tolist()
    failed = [r for r, n in enumerate(counts) if n < 0]
    if failed:
        raise CheckpointingException(
            f"Exchanging objects failed: rank(s) {failed} could not pickle theirs" + (f" ({error})" if error else ""))
    joined = b"".join(payloads)  # (frombuffer refuses an empty buffer)
    send = (torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8))
    send = send.to(device)
    recv = torch.empty(sum(counts), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, output_split_sizes=counts, input_split_sizes=[len(p) for p in payloads],
                           group=group)
    data = recv.cpu().numpy().tobytes()
    ends = list(itertools.accumulate(counts))
    return [loads_trusted(data[end - n:end]) if n else None for end, n in zip(ends, counts)]  # from the other ranks


def all_reduce_max_uint8(flags: List[int], group: Optional[Any] = None) -> List[int]:
    """Element-wise max of a list of small ints (0..255) over the group's ranks."""
    if get_world_size(group) == 1 or not flags:
        return list(flags)
    t = torch.tensor(flags, dtype=torch.uint8, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()
