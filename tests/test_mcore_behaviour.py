"""Behaviours that match Megatron-Core 0.15's ``dist_checkpointing`` (issue 30, items 2-7):
loads cast into the request's dtype, process-wide state is left as the user set it,
zero-length shards save and load, strategies deep-copy and pickle, exceptions are also
PyTorch's ``CheckpointException``, save/load are silent at INFO, ``load_plain_tensors``
returns flattened keys 1-D."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

from .conftest import get_pool

# ----------------------------------------------------------------------------- zero-length shards

# pattern name -> sizes of the chunks of a 1-D global tensor, one per rank, for world 4 and 8
_EMPTY_PATTERNS: Dict[str, Dict[int, List[int]]] = {
    "trailing-empty": {4: [2, 2, 1, 0], 8: [1, 1, 1, 1, 1, 0, 0, 0]},
    "empty-between": {4: [3, 0, 2, 0], 8: [2, 0, 0, 3, 0, 1, 0, 2]},
    "one-holds-all": {4: [0, 0, 7, 0], 8: [0, 0, 0, 0, 0, 0, 0, 9]},
    "leading-empty": {4: [0, 0, 3, 3], 8: [0, 0, 0, 2, 2, 2, 2, 2]},
}


def _uneven(key: str, sizes: List[int], rank: int, values: torch.Tensor, rows: int = 0) -> ShardedTensor:
    """Rank ``rank``'s chunk of a global tensor split unevenly along its first axis
    (``rows`` > 0: 2-D, ``rows`` columns)."""
    offset, size = sum(sizes[:rank]), sizes[rank]
    data = values[offset:offset + size].clone()
    n = sum(sizes)
    if rows:
        return ShardedTensor(key, data, data.dtype, (size, rows), (n, rows), (offset, 0), None)
    return ShardedTensor(key, data, data.dtype, (size,), (n,), (offset,), None)


def _global(n: int, rows: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    shape = (n, rows) if rows else (n,)
    return torch.arange(math.prod(shape), dtype=dtype).reshape(shape) + 1


def _save_uneven(rank: int, world: int, ckpt: str, pattern: str, fully_parallel: bool) -> None:
    sizes = _EMPTY_PATTERNS[pattern][world]
    n = sum(sizes)
    sd = {"a": _uneven("a", sizes, rank, _global(n)),
          "b": _uneven("b", sizes, rank, _global(n, 3, torch.bfloat16), rows=3),
          # a flattened (distributed optimizer) key whose DP slices are partly empty
          "f": ShardedTensor.from_rank_offsets_flat(
              "f", _global(8)[_flat_range(rank, world)], (8,), flattened_range=_flat_range(rank, world)),
          # a tensor with no elements at all, held by every rank as its main replica
          "z": ShardedTensor("z", torch.zeros(0, 2), torch.float32, (0, 2), (0, 2), (0, 0), None)}
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()) if fully_parallel else None
    dc.save(sd, ckpt, sharded_strategy=strategy)


def _flat_range(rank: int, world: int) -> slice:
    """Rank ``rank``'s slice of an 8-element chunk: the first ranks share it, the rest get
    empty slices at its end."""
    bounds = [min(8, 3 * r) for r in range(world + 1)]
    return slice(bounds[rank], bounds[rank + 1])


def _load_uneven(rank: int, world: int, ckpt: str, sizes: List[int], fully_parallel: bool) -> bool:
    n = sum(sizes)
    sd = {"a": _uneven("a", sizes, rank, torch.zeros(n)),
          "b": _uneven("b", sizes, rank, torch.zeros(n, 3, dtype=torch.bfloat16), rows=3),
          "f": ShardedTensor.from_rank_offsets_flat("f", torch.zeros(8)[_flat_range(rank, world)], (8,),
                                                    flattened_range=_flat_range(rank, world)),
          "z": ShardedTensor("z", torch.ones(0, 2), torch.float32, (0, 2), (0, 2), (0, 0), None, replica_id=rank)}
    strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()) if fully_parallel else None
    out = dc.load(sd, ckpt, sharded_strategy=strategy)
    offset = sum(sizes[:rank])
    assert torch.equal(out["a"], _global(n)[offset:offset + sizes[rank]])
    assert torch.equal(out["b"], _global(n, 3, torch.bfloat16)[offset:offset + sizes[rank]])
    assert torch.equal(out["f"], _global(8)[_flat_range(rank, world)])
    assert out["z"].shape == (0, 2)
    return True


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("pattern", sorted(_EMPTY_PATTERNS))
@pytest.mark.parametrize("fully_parallel", [False, True], ids=["plain", "fully-parallel"])
def test_zero_length_shards_save_and_load(tmp_path, world, pattern, fully_parallel):
    pool = get_pool(world)
    ckpt = str(tmp_path / "c")
    pool.run(_save_uneven, ckpt, pattern, fully_parallel)
    sizes = _EMPTY_PATTERNS[pattern][world]
    assert pool.run(_load_uneven, ckpt, sizes, fully_parallel) == [True] * world
    # resharded: loaded with another pattern of the same global size
    others = [p for p in _EMPTY_PATTERNS if sum(_EMPTY_PATTERNS[p][world]) == sum(sizes) and p != pattern]
    even = [sum(sizes) // world + (r < sum(sizes) % world) for r in range(world)]
    for other in [even] + [_EMPTY_PATTERNS[p][world] for p in others]:
        assert pool.run(_load_uneven, ckpt, other, not fully_parallel) == [True] * world
    plain = dc.load_plain_tensors(ckpt)
    assert torch.equal(plain["a"], _global(sum(sizes)))
    assert plain["z"].shape == (0, 2)
