"""Save planning of the ``torch_dist`` strategy: which items this rank writes (main replicas
only; FP8 tensors as their high-precision values; flattened slices in the N-D reformulated
layout) and how they are split into data files.

Owns: the items a rank writes (main replicas; FP8 as high-precision values; flattened slices
N-D reformulated; objects as ``torch.save([data])`` bytes; empty chunks of uneven sharding
are not written unless the whole tensor is empty, and ``.metadata`` then records one of
several at one offset) and their split into files.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

import torch

from ...core import CheckpointingException, check_key
from ...dict_utils import nested_values
from ...tensors.fp8 import dequantize, is_float8tensor
from ...mapping import ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica
from .format import data_file_name


@dataclass
class SaveItem:
    key: str  # DCP key: ShardedTensor.key or ShardedObject.unique_key
    payload: Union[torch.Tensor, bytes]
    nbytes: int
    # (global shape as stored, dtype, offsets, sizes, original global shape if reformulated)
    tensor_meta: Optional[Tuple[Tuple[int, ...], torch.dtype, Tuple[int, ...], Tuple[int, ...], Optional[Tuple[int, ...]]]]


def object_payload(obj: ShardedObject) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save([obj.data], buf)
    except Exception as e:  # noqa: BLE001 - unpicklable user object
        raise CheckpointingException(f"Cannot serialize ShardedObject {obj.unique_key!r}: {e}") from e
    return buf.getvalue()


def collect_save_items(sharded_state_dict: ShardedStateDict) -> List[SaveItem]:
    items: List[SaveItem] = []
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, (ShardedTensor, ShardedObject)):
            check_key(sh.key, f"Saving {type(sh).__name__}")
        if not is_main_replica(sh.replica_id):
            continue
        if isinstance(sh, ShardedTensor):
            if sh.data is None:
                raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save")
            sh.validate_metadata_integrity()
            if sh.is_empty_chunk() and math.prod(sh.global_shape) > 0:
                continue  # an empty chunk (or slice) of a tensor that other chunks cover: nothing to store
            # FP8 tensors (Transformer Engine) are stored as their high-precision values.
            local = dequantize(sh.data) if is_float8tensor(sh.data) else sh.data
            if sh.flattened_range is not None:
                # Megatron-Core 0.15 layout: the slice is a range of the last axis of the
                # N-D reformulated tensor; written by its holder, no communication.
                shape, offsets, sizes = sh.reformulated_region()
                data = local.reshape(sizes)
                meta = (shape, sh.dtype, offsets, sizes, tuple(sh.global_shape))
            else:
                offsets, sizes = sh.global_region()
                data = local[(None,) * sh.prepend_axis_num] if sh.prepend_axis_num else local
                meta = (sh.global_shape, sh.dtype, offsets, sizes, None)
            items.append(SaveItem(sh.key, data, data.numel() * data.element_size(), meta))
        elif isinstance(sh, ShardedObject):
            payload = object_payload(sh)
            items.append(SaveItem(sh.unique_key, payload, len(payload), None))
        else:
            raise CheckpointingException(f"Unexpected sharded item {type(sh).__name__} for key {sh.key!r}")
    return items


def hint_prefix(separation_hint: str) -> str:
    """The file name prefix of the keys a ``separation_hint`` separates."""
    return separation_hint.replace("/", "_")


T = TypeVar("T")


def pack_by_bytes(items: Sequence[T], bins: int, nbytes: Callable[[T], int], in_order: bool = True) -> List[List[T]]:
    """The file packer of every writer: ``items`` into at most ``bins`` non-empty bins of
    about equal bytes (largest first, each to the emptiest bin); each bin in the items'
    order (``in_order``) or largest first."""
    packed: List[List[T]] = [[] for _ in range(max(1, bins))]
    loads = [0] * len(packed)
    for item in sorted(items, key=lambda it: -nbytes(it)):
        i = loads.index(min(loads))
        packed[i].append(item)
        loads[i] += nbytes(item)
    if in_order:
        order = {id(it): n for n, it in enumerate(items)}
        packed = [sorted(b, key=lambda it: order[id(it)]) for b in packed]
    return [b for b in packed if b]


def assign_files(items: List[SaveItem], rank: int, thread_count: int,
                  separation_hint: Optional[str]) -> Dict[str, List[SaveItem]]:
    """Split items into at most ``thread_count`` files per group (keys under
    ``separation_hint`` apart, their files named with :func:`hint_prefix`), balancing bytes."""
    groups: Dict[str, List[SaveItem]] = {}
    for item in items:
        prefix = ""
        if separation_hint and item.key.startswith(separation_hint):
            prefix = hint_prefix(separation_hint)
        groups.setdefault(prefix, []).append(item)
    files: Dict[str, List[SaveItem]] = {}
    for prefix, group in groups.items():
        for n, bucket in enumerate(pack_by_bytes(group, thread_count, lambda it: it.nbytes)):
            files[data_file_name(rank, n, prefix)] = bucket
    return files
