"""A failure on some ranks only, at any step of ``save`` or ``load``, is raised on every
rank — never a hang (DistPool's timeout fails the test) — and leaves the process group
usable (issue 18, class 2).

Each case injects one failure on rank 1 only: through the user's own inputs where a user
can cause it (factories, common state, preprocessing, objects, strategies), through a
faulty storage (:mod:`.faulty_storage`) for I/O, else by replacing one library step on
that rank for the duration of the call.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor, ShardedTensorFactory
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.strategies import fully_parallel
from dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

from .conftest import get_pool
from .faulty_storage import FaultyStorage

_TIMEOUT = 60.0
_BAD = 1  # the rank that fails


class _Boom(Exception):
    pass


class _Unreadable:
    """Neither picklable nor printable: the common-state digest cannot describe it."""

    def __reduce__(self):
        raise _Boom("cannot pickle")

    def __repr__(self):
        raise _Boom("cannot repr")


def _state(rank: int, world: int, fill: bool = True) -> dict:
    n = 4
    data = torch.arange(n * world, dtype=torch.float32)[rank * n:(rank + 1) * n] if fill else torch.zeros(n)
    return {
        "w": ShardedTensor.from_rank_offsets("w", data.clone(), (0, rank, world)),
        "r": ShardedTensor.from_rank_offsets("r", torch.ones(3) if fill else torch.zeros(3), replica_id=rank),
        "o": ShardedObject("o", {"rank": rank} if fill else None, (world,), (rank,)),
        "step": 5,
    }


@contextlib.contextmanager
def _replaced(module, name, on_bad_rank):
    """``module.name`` raising on the bad rank for the duration of the block."""
    original = getattr(module, name)

    def broken(*args, **kwargs):
        raise _Boom(f"{name} broke")

    if on_bad_rank:
        setattr(module, name, broken)
    try:
        yield
    finally:
        setattr(module, name, original)


def _inject_save(rank, world, ckpt, case):
    bad = rank == _BAD
    sd = _state(rank, world)
    kwargs = {}
    patch = contextlib.nullcontext()
    if case == "factory build":
        def build(key, data, replica_id, flattened_range):
            if bad:
                raise _Boom("build_fn broke")
            return {"f": ShardedTensor.from_rank_offsets(key, data, replica_id=replica_id)}
        sd["f"] = ShardedTensorFactory("f", torch.ones(2), build, lambda x: x["f"], replica_id=rank)
    elif case == "common digest":
        if bad:
            sd["odd"] = _Unreadable()
    elif case == "common preprocessing":
        def preprocess(common):
            if bad:
                raise _Boom("preprocess broke")
            return common
        kwargs["preprocess_common_before_consistancy_check"] = preprocess
    elif case == "common serialization on rank 0":
        if rank == 0:
            sd["fn"] = lambda: None  # torch.save cannot pickle a lambda
    elif case == "object serialization":
        if bad:
            sd["o"] = ShardedObject("o", lambda: None, (world,), (rank,))
    elif case == "summaries":
        from dist_checkpointing import validation
        patch = _replaced(validation, "_summaries", bad)
    elif case == "metadata assembly on rank 0":
        # without validation, rank 1 saves 'w' with another dtype: only rank 0 sees it
        kwargs["validate_access_integrity"] = False
        if bad:
            n = 4
            sd["w"] = ShardedTensor.from_rank_offsets("w", torch.zeros(n, dtype=torch.float64), (0, rank, world))
    elif case == "commit on rank 0":
        if rank == 0:
            ckpt = FaultyStorage(ckpt, "write_atomic", CONFIG_FNAME)
    elif case == "fully parallel assignment":
        kwargs["sharded_strategy"] = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
        patch = _replaced(fully_parallel, "distribute_main_replicas_with_precomputed_distribution", bad)
    elif case == "sharded strategy":
        kwargs["sharded_strategy"] = TorchDistSaveShardedStrategy(thread_count=1 if bad else 2)
        if bad:
            kwargs["sharded_strategy"]._plan_files = lambda sd: (_ for _ in ()).throw(_Boom("planning broke"))
    else:
        raise AssertionError(case)
    with patch:
        dc.save(sd, ckpt, **kwargs)
    return True


def _inject_load(rank, world, ckpt, case):
    bad = rank == _BAD
    sd = _state(rank, world, fill=False)
    kwargs = {}
    patch = contextlib.nullcontext()
    if case == "factory merge":
        def merge(loaded):
            if bad:
                raise _Boom("merge_fn broke")
            return loaded["f"]
        sd["f"] = ShardedTensorFactory(
            "w", torch.zeros(4), lambda key, data, replica_id, flattened_range: {
                "f": ShardedTensor.from_rank_offsets(key, data, (0, rank, world), replica_id=replica_id)},
            merge, replica_id=1)
    elif case == "common state":
        class Broken(TorchCommonLoadStrategy):
            def load_common(self, checkpoint_dir):
                raise _Boom("common load broke")
        kwargs["common_strategy"] = Broken() if bad else None
    elif case == "missing key":
        if bad:
            sd["nope"] = ShardedTensor.from_rank_offsets("nope", torch.zeros(2))
    elif case == "summaries":
        from dist_checkpointing import validation
        patch = _replaced(validation, "_summaries", bad)
    elif case == "fully parallel assignment":
        kwargs["sharded_strategy"] = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
        patch = _replaced(fully_parallel, "_assign_reads", bad)
    elif case == "reading":
        if bad:
            ckpt = FaultyStorage(ckpt, "read", "__*.distcp")
    else:
        raise AssertionError(case)
    with patch:
        dc.load(sd, ckpt, **kwargs)
    return True


def _save_ok(rank, world, ckpt):
    dc.save(_state(rank, world), ckpt)
    return True


def _still_in_step(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def _assert_everywhere(pool, excs, *fragments):
    assert len(excs) == pool.world_size
    for rank, e in enumerate(excs):
        assert isinstance(e, CheckpointingException), f"rank {rank}: {type(e).__name__}: {e}"
        for fragment in fragments:
            assert fragment in str(e), f"rank {rank}: {fragment!r} not in {e}"
    # the ranks left the call together: the next collective pairs up
    assert pool.run(_still_in_step, timeout=_TIMEOUT) == [sum(range(1, pool.world_size + 1))] * pool.world_size


SAVE_CASES = {
    "factory build": "build_fn broke",
    "common digest": "cannot repr",
    "common preprocessing": "preprocess broke",
    "common serialization on rank 0": "common state",
    "object serialization": "'o/shard_1_",
    "summaries": "_summaries broke",
    "metadata assembly on rank 0": "'w'",
    "commit on rank 0": "injected write_atomic fault",
    "fully parallel assignment": "distribute_main_replicas_with_precomputed_distribution broke",
    "sharded strategy": "planning broke",
}


@pytest.mark.parametrize("world,case", [(2, c) for c in SAVE_CASES] + [
    (4, c) for c in ("common digest", "summaries", "fully parallel assignment", "commit on rank 0")])
def test_save_failure_on_some_ranks_raises_everywhere(world, case, tmp_path):
    pool = get_pool(world)
    ckpt = tmp_path / "ckpt"
    excs = pool.run_expect_error(_inject_save, str(ckpt), case, timeout=_TIMEOUT)
    _assert_everywhere(pool, excs, SAVE_CASES[case])
    assert not (ckpt / CONFIG_FNAME).exists()


LOAD_CASES = {
    "factory merge": "merge_fn broke",
    "common state": "common load broke",
    "missing key": "'nope'",
    "summaries": "_summaries broke",
    "fully parallel assignment": "_assign_reads broke",
    "reading": "injected read fault",
}


@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_load_failure_on_some_ranks_raises_everywhere(case, tmp_path):
    pool = get_pool(2)
    ckpt = tmp_path / "ckpt"
    pool.run(_save_ok, str(ckpt), timeout=_TIMEOUT)
    excs = pool.run_expect_error(_inject_load, str(ckpt), case, timeout=_TIMEOUT)
    _assert_everywhere(pool, excs, LOAD_CASES[case])


def _meta_tensor_in_common_state(rank, world, ckpt):
    sd = _state(rank, world)
    if rank == _BAD:
        sd["extra"] = torch.empty(3, device="meta")  # the example of the issue
    dc.save(sd, ckpt)
    return True


def test_meta_tensor_in_one_ranks_common_state_does_not_hang(tmp_path, caplog):
    pool = get_pool(2)
    ckpt = tmp_path / "ckpt"
    assert pool.run(_meta_tensor_in_common_state, str(ckpt), timeout=_TIMEOUT) == [True, True]
    assert "extra" not in dc.load_common_state_dict(ckpt)  # rank 0's common state is saved
