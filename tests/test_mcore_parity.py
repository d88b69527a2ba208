"""Behaviours that Megatron-Core's own ``dist_checkpointing`` unit tests rely on, found by
running them (Megatron-Core 0.15.3 and 0.19.2, CPU/gloo) against this package through the
switch: each is tested here with our own cases, at several worlds and with the fully
parallel wrappers."""

from __future__ import annotations

from typing import List

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

from .conftest import get_pool

# ----------------------------------------------------------------------------- allow_shape_mismatch

_COLS = 12  # the saved tensor: (3, _COLS), split along axis 1 over the saving ranks


def _saved_values(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(3 * _COLS).reshape(3, _COLS) + 1).to(dtype)


def _save_mismatch(rank: int, world: int, ckpt: str) -> None:
    cols = _COLS // world
    sd = {"e": ShardedTensor.from_rank_offsets("e", _saved_values()[:, rank * cols:(rank + 1) * cols].clone(),
                                               (1, rank, world), allow_shape_mismatch=True)}
    dc.save(sd, ckpt)


def _load_mismatch(rank: int, world: int, ckpt: str, groups: int) -> List[str]:
    """Load chunks of a (3, cols * groups) request for several ``cols``: ranks form
    ``groups`` groups along the sharded axis, each rank in a group a replica of its chunk;
    returns the cases that went wrong."""
    members = world // groups
    group, replica = rank // members, rank % members
    wrong = []
    for cols, dtype, fully_parallel, dataless in [(7, torch.float32, False, False), (7, torch.float32, True, False),
                                                  (3, torch.float32, False, False), (3, torch.float32, True, False),
                                                  (7, torch.bfloat16, True, False), (7, torch.float32, False, True),
                                                  (4, torch.float16, True, True)]:
        data = None if dataless else torch.full((3, cols), 7.0, dtype=dtype)
        sh = ShardedTensor("e", data, dtype, (3, cols), (3, cols * groups), (0, group * cols), None,
                           replica_id=replica, allow_shape_mismatch=True)
        strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()) if fully_parallel else None
        out = dc.load({"e": sh}, ckpt, sharded_strategy=strategy)["e"]
        expected = torch.zeros(3, cols * groups, dtype=dtype)
        stored = min(_COLS, cols * groups)
        expected[:, :stored] = _saved_values(dtype)[:, :stored]
        if not torch.equal(out, expected[:, group * cols:(group + 1) * cols]) or \
                not (dataless or out.data_ptr() == data.data_ptr()):
            wrong.append(f"cols={cols} {dtype} fully_parallel={fully_parallel} dataless={dataless}: {out}")
    return wrong


@pytest.mark.parametrize("world,groups", [(1, 1), (2, 2), (4, 2), (4, 4)])
def test_allow_shape_mismatch_reads_what_is_stored_and_zeros_the_rest(tmp_path, world, groups):
    """Megatron-Core zeroes a request tensor with ``allow_shape_mismatch`` before reading
    into it (e.g. a padded vocabulary grown between runs): the elements the checkpoint does
    not hold read as zeros, not as what the tensor held before; in place, any dtype, plain
    and fully parallel loads, requests wider and narrower than what was saved."""
    pool = get_pool(world)
    ckpt = str(tmp_path / "c")
    pool.run(_save_mismatch, ckpt)
    assert pool.run(_load_mismatch, ckpt, groups) == [[]] * world
