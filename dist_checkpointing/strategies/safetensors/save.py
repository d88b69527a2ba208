"""Saving straight to safetensors, in training: each global tensor written whole, from its
main-replica chunks on whichever ranks hold them, into Hugging Face's sharded layout.

The steps (each agreed: an error on any rank is raised on every rank):

1. **Plan** — every rank sends rank 0 a summary of its main-replica chunks (key, dtype,
   global shape, region, flat range); rank 0 checks each key (safetensors can hold its
   name and dtype, every rank agrees on its shape and dtype, its chunks cover it exactly
   once), cuts the keys into files (:func:`.format.file_groups`: at most
   ``max_file_bytes`` each, and at least one file per rank where there are enough keys),
   gives file ``i`` to rank ``i % world``, and sends each rank only its own part of the
   plan: the chunks it sends (to whom, under which tag) and the files it writes.
2. **Write** — each writer assembles one tensor at a time from its own chunks and the
   ones it receives, and streams it into its file
   (:class:`.file_writer.SafetensorsFileWriter`, ``__metadata__ = {"format": "pt"}``),
   then reads the header back. The transfers are numbered tensor by tensor across the
   writers (every writer's first tensor, then every writer's second, ...), and every rank
   runs its sends and receives in that order: the writers proceed side by side and no
   backend can deadlock (NCCL orders point-to-point operations per stream). A writer that
   fails keeps receiving what is sent to it (no rank is left waiting) and raises at the end.
3. **Index** — once every file is written, rank 0 writes ``model.safetensors.index.json``
   (``weight_map``, ``metadata.total_size``) last; ``save`` then commits ``metadata.json``.

Non-tensor items (ShardedObjects) are refused: safetensors holds tensors only (the common
state goes to ``common.pt`` as in every save).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ...core import CheckpointingException, open_storage
from ...dict_utils import nested_values
from ...exchange.distribution import comm_device
from ...mapping import KeyMap, ShardedObject, ShardedStateDict, ShardedTensor, apply_key_map, is_main_replica
from ...runtime.collectives import gather_object, get_rank, get_world_size, run_agreed, scatter_object
from ...storage import Storage
from ...tensors.values import plain_values
from ..base import SaveShardedStrategy
from ..resharding import Region
from ..torch_dist.coverage import coverage_faults, describe_faults
from .file_writer import SafetensorsFileWriter, read_back_header
from .format import INDEX_FNAME, dtype_name, file_groups, key_refusal, shard_names, write_index
from .source import BACKEND


class Chunk(NamedTuple):
    """A main-replica chunk as rank 0 plans it."""

    key: str
    dtype: torch.dtype
    global_shape: Tuple[int, ...]
    region: Region  # (offsets, sizes) in the global tensor (size 1 on prepended axes)
    flat: Optional[Tuple[int, int]]  # the flattened range of the region, if the chunk is one
    rank: int
    index: int  # the chunk's position in its rank's list


class Piece(NamedTuple):
    """One chunk of a tensor a writer assembles: from ``rank`` (``tag``), or its own ``index``."""

    rank: int
    tag: int
    index: int
    region: Region
    flat: Optional[Tuple[int, int]]


class FilePlan(NamedTuple):
    name: str
    tensors: List[Tuple[str, Tuple[int, ...], torch.dtype, List[Piece]]]


class RankPlan(NamedTuple):
    sends: List[Tuple[int, int, int]]  # (chunk index, destination rank, tag), in tag order
    files: List[FilePlan]


def _local_chunks(sharded_state_dict: ShardedStateDict) -> List[ShardedTensor]:
    chunks = []
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedObject):
            raise CheckpointingException(
                f"ShardedObject {sh.unique_key!r}: a safetensors checkpoint holds tensors only (save it with "
                "the torch_dist strategy, or leave it out of the state dict)")
        if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id) and not sh.is_empty_chunk():
            chunks.append(sh)
    return chunks


def _summary(chunks: List[ShardedTensor]) -> List[Tuple[Any, ...]]:
    return [(sh.key, sh.dtype, tuple(sh.global_shape), sh.global_region(),
             None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop))
            for sh in chunks]


def _check_key(key: str, chunks: List[Chunk], where: str) -> None:
    """Rank 0's check of one key's main chunks (all ranks together)."""
    first = chunks[0]
    refusal = key_refusal(key)
    if refusal is not None:
        raise CheckpointingException(f"Cannot save {where} as safetensors: {refusal}")
    dtype_name(key, first.dtype)
    for c in chunks[1:]:
        if (c.dtype, c.global_shape) != (first.dtype, first.global_shape):
            raise CheckpointingException(
                f"Key {key!r}: rank {first.rank} has a {first.dtype} tensor of global shape {first.global_shape}, "
                f"rank {c.rank} a {c.dtype} one of shape {c.global_shape}")
    whole: Region = ((0,) * len(first.global_shape), first.global_shape)
    flat = [c for c in chunks if c.flat is not None]
    if not flat:
        faults = coverage_faults(whole, [c.region for c in chunks])
        if faults:
            raise CheckpointingException(f"Key {key!r}: the main replicas do not store it exactly once: "
                                         f"{describe_faults(faults)}")
        return
    elements = sum(c.flat[1] - c.flat[0] for c in flat) + sum(math.prod(c.region[1]) for c in chunks if c.flat is None)
    if elements != math.prod(first.global_shape):
        raise CheckpointingException(f"Key {key!r}: its main replicas hold {elements} elements of its "
                                     f"{math.prod(first.global_shape)}")


def plan_save(per_rank: List[List[Tuple[Any, ...]]], world: int, max_file_bytes: int,
              where: str) -> Tuple[List[RankPlan], Dict[str, str], int]:
    """Rank 0's plan from every rank's summary: each rank's part, the weight map, the total bytes."""
    by_key: Dict[str, List[Chunk]] = {}
    for rank, summary in enumerate(per_rank):
        for index, (key, dtype, shape, region, flat) in enumerate(summary):
            by_key.setdefault(key, []).append(Chunk(key, dtype, shape, region, flat, rank, index))
    for key, chunks in by_key.items():
        _check_key(key, chunks, where)
    keys = sorted(by_key)
    sizes = {k: math.prod(by_key[k][0].global_shape) * by_key[k][0].dtype.itemsize for k in keys}
    groups = file_groups(keys, sizes, max_file_bytes, files_at_least=world)
    names = shard_names(len(groups)) if groups else []
    plans = [RankPlan([], []) for _ in range(world)]
    queues: List[List[Tuple[FilePlan, str]]] = [[] for _ in range(world)]  # each writer's tensors, in order
    for f, (name, group) in enumerate(zip(names, groups)):
        file = FilePlan(name, [])
        plans[f % world].files.append(file)
        queues[f % world] += [(file, key) for key in group]
    tag = 0  # tensor j of every writer, then tensor j + 1: the writers go on side by side
    for step in range(max((len(q) for q in queues), default=0)):
        for writer, queue in enumerate(queues):
            if step >= len(queue):
                continue
            file, key = queue[step]
            pieces = []
            for c in by_key[key]:
                if c.rank != writer:
                    plans[c.rank].sends.append((c.index, writer, tag))
                pieces.append(Piece(c.rank, tag, c.index, c.region, c.flat))
                tag += 1
            file.tensors.append((key, by_key[key][0].global_shape, by_key[key][0].dtype, pieces))
    weight_map = {k: name for name, group in zip(names, groups) for k in group}
    return plans, weight_map, sum(sizes.values())


def _place(whole: torch.Tensor, piece: Piece, data: torch.Tensor) -> None:
    """Copy one chunk's values into the whole tensor."""
    offsets, sizes = piece.region
    view = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    if piece.flat is None:
        view.copy_(data.reshape(view.shape))
        return
    lo, hi = piece.flat
    if view.is_contiguous():
        view.view(-1)[lo:hi].copy_(data.reshape(-1))
        return
    values = view.contiguous()
    values.view(-1)[lo:hi].copy_(data.reshape(-1))
    view.copy_(values)


class SafetensorsSaveShardedStrategy(SaveShardedStrategy):
    """Saves the sharded state as Hugging Face safetensors files (see the module).

    Args:
        max_file_bytes: the most tensor bytes of one file (Hugging Face's default shard size: 5 GiB).
        key_map: the stored name of each key (a dict, or a callable ``key -> name``), e.g.
            Megatron-style keys to a Hugging Face model's; load with the same ``key_map``.
    """

    def __init__(self, backend: str = BACKEND, version: int = 1, *, max_file_bytes: int = 5 << 30,
                 key_map: Optional[KeyMap] = None):
        super().__init__(backend, version)
        if not isinstance(max_file_bytes, int) or max_file_bytes <= 0:
            raise CheckpointingException(f"max_file_bytes must be a positive number of bytes, not {max_file_bytes!r}")
        self.max_file_bytes = max_file_bytes
        self.key_map = key_map

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def data_file_names(self, rank: int) -> List[str]:
        return [shard_names(2)[0], shard_names(1)[0], INDEX_FNAME]

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        """Collective: plan on rank 0, write each file on its rank, the index last (see the
        module). Every collective is reached by every rank: the steps that may fail are
        local and agreed before the next collective."""
        storage = open_storage(checkpoint_dir)
        rank, world = get_rank(), get_world_size()

        def summarize() -> Tuple[List[ShardedTensor], List[Tuple[Any, ...]]]:
            chunks = _local_chunks(apply_key_map(sharded_state_dict, self.key_map))
            return chunks, _summary(chunks)

        chunks, summary = run_agreed(summarize, "Planning the safetensors save")
        per_rank = gather_object(summary)
        planned = run_agreed(lambda: plan_save(per_rank, world, self.max_file_bytes, storage.describe())
                             if rank == 0 else None, "Planning the safetensors files")
        own: RankPlan = scatter_object(None if planned is None else planned[0])
        device = comm_device() if dist.is_available() and dist.is_initialized() else torch.device("cpu")
        outgoing = run_agreed(lambda: [(plain_values(chunks[index].data).contiguous().to(device), dest, tag)
                                       for index, dest, tag in own.sends], "Preparing the safetensors transfers")
        written = run_agreed(lambda: self._write(storage, chunks, own, outgoing, device),
                             "Writing the safetensors files")
        self.last_written_bytes = sum(math.prod(s) * d.itemsize for f in own.files for _, s, d, _ in f.tensors)
        all_written = gather_object(written)

        def index() -> Optional[Dict[str, int]]:
            if rank != 0:
                return None
            _, weight_map, total = planned
            files = {name: size for w in all_written for name, size in w.items()}
            write_index(storage, weight_map, total)
            info = storage.info(INDEX_FNAME)
            files[INDEX_FNAME] = info.size if info is not None else 0
            return files

        self.last_written_files = run_agreed(index, "Writing the safetensors index")

    def _write(self, storage: Storage, chunks: List[ShardedTensor], own: RankPlan,
               outgoing: List[Tuple[torch.Tensor, int, int]], device: torch.device) -> Dict[str, int]:
        """Send this rank's chunks and receive, assemble and write its files, every transfer
        in the plan's tag order (a send and its receive have the same place in both ranks'
        orders: no backend can deadlock, NCCL included); returns ``{file: size}``. A write
        that fails does not stop the transfers (the other ranks would wait): the first error
        is raised once they are all done."""
        steps: List[Tuple[int, int, Any]] = [(tag, 0, (data, dest)) for data, dest, tag in outgoing]
        for f, file in enumerate(own.files):
            for t, (_, _, _, pieces) in enumerate(file.tensors):
                steps.append((pieces[0].tag, 1, (f, t)))
        written: Dict[str, int] = {}
        errors: List[Exception] = []
        writers: Dict[int, Optional[SafetensorsFileWriter]] = {}

        def fail(e: Exception, f: int) -> None:
            errors.append(e)
            if writers.get(f) is not None:
                writers[f].abort()
            writers[f] = None

        for tag, kind, what in sorted(steps, key=lambda s: s[0]):
            if kind == 0:
                dist.send(what[0], what[1], tag=tag)
                continue
            f, t = what
            file = own.files[f]
            key, shape, dtype, pieces = file.tensors[t]
            received = [self._receive(piece, dtype, chunks, device) for piece in pieces]
            if f not in writers and not errors:
                try:
                    writers[f] = SafetensorsFileWriter(storage, file.name, [(k, s, d) for k, s, d, _ in file.tensors],
                                                       {"format": "pt"})
                except Exception as e:  # noqa: BLE001 - raised at the end
                    fail(e, f)
            if writers.get(f) is None:
                continue
            try:
                whole = torch.empty(shape, dtype=dtype)
                for piece, data in zip(pieces, received):
                    _place(whole, piece, data.cpu())
                writers[f].write(key, whole)
                if t == len(file.tensors) - 1:
                    writers.pop(f).close()
                    read_back_header(storage, file.name)
                    written[file.name] = storage.info(file.name).size
            except Exception as e:  # noqa: BLE001 - raised at the end
                fail(e, f)
        for f in [f for f, w in writers.items() if w is not None]:
            writers.pop(f).abort()
        if errors:
            raise errors[0]
        return written

    @staticmethod
    def _receive(piece: Piece, dtype: torch.dtype, chunks: List[ShardedTensor], device: torch.device) -> torch.Tensor:
        """One chunk's values: this rank's own, or received from its rank."""
        if piece.rank == get_rank():
            return plain_values(chunks[piece.index].data)
        n = (piece.flat[1] - piece.flat[0]) if piece.flat is not None else math.prod(piece.region[1])
        data = torch.empty(n, dtype=dtype, device=device)
        dist.recv(data, piece.rank, tag=piece.tag)
        return data
