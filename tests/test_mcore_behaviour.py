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
from dist_checkpointing.strategies.base import CopyableStrategy
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

from .conftest import get_pool
from .helpers import assert_all_raise

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


# ----------------------------------------------------------------------------- loading into another dtype

_CAST_CASES = [  # (stored dtype, requested dtype)
    (torch.float32, torch.bfloat16), (torch.int64, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16), (torch.float16, torch.float64), (torch.float32, torch.float8_e4m3fn),
]


def _cast_values(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(n) % 7 - 3).to(torch.float32).mul(0.5).to(dtype) if dtype.is_floating_point \
        else torch.arange(n, dtype=dtype) * 3 - 5


def _save_for_cast(rank: int, world: int, ckpt: str) -> None:
    sd = {}
    for i, (stored, _) in enumerate(_CAST_CASES):
        glob = _cast_values(8 * world, stored).reshape(2 * world, 4)
        sd[f"t{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", glob[2 * rank:2 * rank + 2].clone(), (0, rank, world))
        # flattened: each rank's chunk split into two DP-style slices held by this rank
        chunk = glob[2 * rank:2 * rank + 2].flatten()
        sd[f"f{i}"] = [ShardedTensor.from_rank_offsets_flat(f"f{i}", chunk[a:b].clone(), (2, 4), (0, rank, world),
                                                             flattened_range=slice(a, b)) for a, b in ((0, 3), (3, 8))]
    dc.save(sd, ckpt)


def _load_cast(rank: int, world: int, ckpt: str, fully_parallel: bool) -> bool:
    """Each key requested in another dtype: whole (every rank; resharded), as this rank's
    half (a regular grid of another fragmentation) and flattened on another grid."""
    strategy = TorchDistLoadShardedStrategy()
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(strategy)
    request, expected = {}, {}
    for i, (stored, wanted) in enumerate(_CAST_CASES):
        glob = _cast_values(8 * world, stored).reshape(2 * world, 4).to(wanted)
        whole = torch.zeros(2 * world, 4, dtype=wanted)
        request[f"w{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", whole, replica_id=rank)
        expected[f"w{i}"] = (whole, glob)
        cols = torch.zeros(2 * world, 2, dtype=wanted)
        request[f"c{i}"] = ShardedTensor.from_rank_offsets(f"t{i}", cols, (1, rank % 2, 2), replica_id=rank // 2)
        expected[f"c{i}"] = (cols, glob[:, 2 * (rank % 2): 2 * (rank % 2) + 2])
        flat = torch.zeros(5, dtype=wanted)  # a slice of this rank's (2 * world, 4) chunk flattened
        request[f"f{i}"] = ShardedTensor.from_rank_offsets_flat(f"f{i}", flat, (2 * world, 4), replica_id=rank,
                                                                 flattened_range=slice(3 + rank, 8 + rank))
        expected[f"f{i}"] = (flat, glob.flatten()[3 + rank:8 + rank])
    out = {}
    for kind in "wcf":  # one load per layout (fully parallel takes one shard per key and offset)
        out.update(dc.load({k: v for k, v in request.items() if k[0] == kind}, ckpt, sharded_strategy=strategy))
    for name, (target, want) in expected.items():
        assert out[name] is target, name  # filled in place
        assert out[name].dtype == want.dtype and torch.equal(out[name], want), (name, out[name], want)
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("fully_parallel", [False, True], ids=["plain", "fully-parallel"])
def test_load_casts_into_the_requested_dtype(tmp_path, world, fully_parallel):
    pool = get_pool(world)
    ckpt = str(tmp_path / "c")
    pool.run(_save_for_cast, ckpt)
    assert pool.run(_load_cast, ckpt, fully_parallel) == [True] * world
    plain = dc.load_plain_tensors(ckpt)  # unaffected: stored dtypes
    for i, (stored, _) in enumerate(_CAST_CASES):
        assert plain[f"t{i}"].dtype == stored and plain[f"f{i}"].dtype == stored


def _load_strict_dtype(rank: int, world: int, ckpt: str, i: int) -> None:
    stored, wanted = _CAST_CASES[i]
    t = torch.zeros(2, 4, dtype=wanted)
    dc.load({"t": ShardedTensor.from_rank_offsets(f"t{i}", t, (0, rank, world))}, ckpt,
            sharded_strategy=TorchDistLoadShardedStrategy(strict_dtypes=True))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_strict_dtypes_refuses_another_dtype_on_every_rank(tmp_path, world):
    pool = get_pool(world)
    ckpt = str(tmp_path / "c")
    pool.run(_save_for_cast, ckpt)
    for i, (stored, wanted) in enumerate(_CAST_CASES[:3]):
        excs = pool.run_expect_error(_load_strict_dtype, ckpt, i)
        assert_all_raise(excs, world, "Dtype mismatch", f"'t{i}'", str(stored), str(wanted))


# ----------------------------------------------------------------------------- process-wide state


class UserRegistered:
    """A class a user allowed with ``torch.serialization.add_safe_globals``."""

    def __init__(self, value: int = 0):
        self.value = value


class NotAllowed:
    """A class nobody allowed: unpickling it fails (the failure path)."""


def _process_state() -> Dict[str, Any]:
    """What a library call must leave as the user set it."""
    import gc
    import logging
    import multiprocessing
    import os
    import random
    import signal
    import sys
    import warnings

    import numpy as np
    import torch.distributed as dist

    loggers = {name: (lg.level, list(lg.handlers), lg.propagate, lg.disabled)
               for name, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    with open("/proc/self/status") as f:
        umask = [line for line in f if line.startswith("Umask:")]
    return {
        "safe_globals": sorted(map(repr, torch.serialization.get_safe_globals())),
        "gc": gc.isenabled(), "gc_threshold": gc.get_threshold(),
        "torch_rng": torch.get_rng_state().tolist(), "py_rng": random.getstate(),
        "np_rng": repr(np.random.get_state()),
        "default_dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(), "env": dict(os.environ), "sys_path": list(sys.path),
        "cwd": os.getcwd(), "umask": umask, "recursion": sys.getrecursionlimit(),
        "signals": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR2,
                                                      signal.SIGPIPE, signal.SIGHUP)},
        "root_logger": (logging.root.level, list(logging.root.handlers)), "loggers": loggers,
        "warnings": list(warnings.filters), "start_method": multiprocessing.get_start_method(allow_none=True),
        "default_pg": (dist.get_rank(), dist.get_world_size(), dist.group.WORLD),
    }


def _state_ops(rank: int, world: int, ckpt: str, gc_enabled: bool) -> List[str]:
    """Set some user state, run each library entry point (successes and failures); return
    the names of the calls after which any of :func:`_process_state` changed."""
    import argparse
    import gc
    import io
    import logging

    torch.serialization.add_safe_globals([argparse.Namespace, UserRegistered])
    (gc.enable if gc_enabled else gc.disable)()
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("user.module").setLevel(logging.ERROR)
    torch.manual_seed(1234 + rank)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0) + rank, (0, rank, world)),
          "o": dc.ShardedObject("o", argparse.Namespace(lr=rank), (world,), (rank,)),
          "args": argparse.Namespace(lr=0.1), "user": UserRegistered(3)}
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world)),
               "o": dc.ShardedObject("o", None, (world,), (rank,))}
    bad = {"o": dc.ShardedObject("bad", NotAllowed(), (world,), (rank,))}
    ops = {
        "save": lambda: dc.save(sd, ckpt),
        "save_fully_parallel": lambda: dc.save(sd, ckpt + "_fp", FullyParallelSaveStrategyWrapper(
            TorchDistSaveShardedStrategy())),
        "async_save": lambda: dc.save(sd, ckpt + "_async", async_sharded_save=True).execute_sync(),
        "save_bad_object": lambda: dc.save(bad, ckpt + "_bad"),
        "load": lambda: dc.load(request, ckpt),
        "load_fully_parallel": lambda: dc.load(request, ckpt, FullyParallelLoadStrategyWrapper(
            TorchDistLoadShardedStrategy())),
        "load_common_state_dict": lambda: dc.load_common_state_dict(ckpt),
        "load_plain_tensors": lambda: dc.load_plain_tensors(ckpt),
        "load_tensors_metadata": lambda: dc.load_tensors_metadata(ckpt),
        "load_missing_key (fails)": lambda: dc.load({"x": ShardedTensor.from_rank_offsets("x", torch.zeros(1))}, ckpt),
        "load_unsafe_object (fails)": lambda: dc.load({"o": dc.ShardedObject("bad", None, (world,), (rank,))},
                                                      ckpt + "_bad"),
        "load_no_checkpoint (fails)": lambda: dc.load(request, ckpt + "_nothing"),
    }
    changed = []
    for name, op in ops.items():
        before = _process_state()
        try:
            op()
        except dc.CheckpointingException:
            assert "fails" in name, name
        else:
            assert "fails" not in name, name
        after = _process_state()
        changed += [f"{name}: {k}" for k in before if k != "loggers" and before[k] != after[k]]
        changed += [f"{name}: logger {n}" for n, v in before["loggers"].items() if after["loggers"].get(n) != v]
    # the symptom: the user's registration still lets a plain safe torch.load read it
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(lr=1), "u": UserRegistered(5)}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["args"].lr == 1 and loaded["u"].value == 5
    gc.enable()
    return changed


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("gc_enabled", [True, False], ids=["gc-on", "gc-off"])
def test_library_calls_leave_process_state_as_the_user_set_it(tmp_path, world, gc_enabled):
    pool = get_pool(world)
    changed = pool.run(_state_ops, str(tmp_path / "c"), gc_enabled)
    assert changed == [[]] * world, changed


# ----------------------------------------------------------------------------- copyable strategies

# Megatron-Core 0.15.3's attributes of each strategy (those user code sets or reads)
_MCORE_ATTRS = {
    TorchDistSaveShardedStrategy: {"backend", "version", "keep_only_main_replica", "thread_count",
                                   "use_cached_ckpt_structure", "cached_global_metadata", "separation_hint"},
    TorchDistLoadShardedStrategy: {"cached_global_metadata"},
    FullyParallelSaveStrategyWrapper: {"backend", "version", "base_strategy", "parallelization_group",
                                       "do_cache_distribution", "cached_distribution"},
    FullyParallelLoadStrategyWrapper: {"base_strategy", "parallelization_group", "do_cache_distribution",
                                       "exchange_algo", "cached_distribution", "cached_global_metadata"},
}


def _all_strategies() -> List[Any]:
    from dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_common_strategy,
        get_default_save_sharded_strategy,
    )
    from dist_checkpointing.strategies.common import TorchCommonLoadStrategy, TorchCommonSaveStrategy
    from dist_checkpointing.strategies.common_object import CommonStateObjectSaveStrategy

    return [get_default_save_sharded_strategy(), get_default_save_common_strategy(),
            TorchDistSaveShardedStrategy(thread_count=3, cached_metadata=True, separation_hint="opt"),
            TorchDistSaveShardedStrategy(async_snapshot="copy"), TorchDistLoadShardedStrategy(strict_dtypes=True),
            FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), None, True),
            FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), None, True, "gather_rounds"),
            TorchCommonSaveStrategy(), TorchCommonLoadStrategy(allow_pickle=True), CommonStateObjectSaveStrategy()]


def _settings(strategy: Any) -> Dict[str, Any]:
    out = {}
    for name, value in vars(strategy).items():
        if name.startswith("_"):
            continue
        out[name] = _settings(value) if isinstance(value, CopyableStrategy) else value
    return out


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_every_strategy_copies_with_its_settings(how):
    import copy
    import pickle

    for strategy in _all_strategies():
        clone = copy.deepcopy(strategy) if how == "deepcopy" else pickle.loads(pickle.dumps(strategy))
        assert type(clone) is type(strategy) and clone is not strategy
        assert _settings(clone) == _settings(strategy), type(strategy).__name__
        for cls, attrs in _MCORE_ATTRS.items():
            if isinstance(strategy, cls):
                missing = {a for a in attrs if not hasattr(clone, a)}
                assert not missing, (cls.__name__, missing)


def test_default_strategy_deepcopy_configured_as_megatron_lm_does(tmp_path):
    """Megatron-Core's own test: ``deepcopy(get_default_save_sharded_strategy())`` then
    ``use_cached_ckpt_structure = True``; the copy saves (three times, reusing its cache)
    and the registered default stays as it was."""
    import copy

    from dist_checkpointing.serialization import get_default_save_sharded_strategy

    default = get_default_save_sharded_strategy()
    strategy = copy.deepcopy(default)
    strategy.use_cached_ckpt_structure = True
    assert strategy.cached_metadata and not default.use_cached_ckpt_structure
    for i in range(3):
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0) + i)}
        dc.save(sd, tmp_path / f"s{i}", sharded_strategy=strategy)
        assert torch.equal(dc.load_plain_tensors(tmp_path / f"s{i}")["w"], torch.arange(6.0) + i)
    assert strategy.cached_global_metadata is not None and default.cached_global_metadata is None
    again = copy.deepcopy(strategy)  # a used strategy copies too (its cache with it)
    assert again.cached_global_metadata is not None
    load = TorchDistLoadShardedStrategy()
    dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, tmp_path / "s2", sharded_strategy=load)
    assert load.cached_global_metadata is not None  # what Megatron-LM hands to its save strategy
    plugged = copy.deepcopy(default)
    plugged.cached_global_metadata = load.cached_global_metadata
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(6))}, tmp_path / "s3", sharded_strategy=plugged)
    assert torch.equal(dc.load_plain_tensors(tmp_path / "s3")["w"], torch.ones(6))


def _copy_wrappers_with_group(rank: int, world: int, ckpt: str) -> bool:
    import copy

    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    save = copy.deepcopy(FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), group, True))
    load = copy.deepcopy(FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), group, True))
    assert save.parallelization_group is group and load.parallelization_group is group  # shared, not copied
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0), replica_id=rank)}
    dc.save(sd, ckpt, sharded_strategy=save)
    out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8), replica_id=rank)}, ckpt,
                  sharded_strategy=copy.deepcopy(load))
    assert torch.equal(out["w"], torch.arange(8.0))
    return save.cached_distribution is not None or world == 1


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fully_parallel_wrappers_deepcopy_sharing_their_group(tmp_path, world):
    assert get_pool(world).run(_copy_wrappers_with_group, str(tmp_path / "c")) == [True] * world


# ----------------------------------------------------------------------------- exceptions and logs


def _catch_as_pytorch(rank: int, world: int, ckpt: str, case: str) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    request = {"missing-key": {"x": ShardedTensor.from_rank_offsets("nope", torch.zeros(2), (0, rank, world))},
               "wrong-shape": {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3), (0, rank, world))},
               "not-a-checkpoint": {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, world))}}
    where = ckpt + "_none" if case == "not-a-checkpoint" else ckpt
    try:
        dc.load(request[case], where)
    except CheckpointException as e:  # Megatron-Core lets PyTorch's exception propagate here
        assert isinstance(e, dc.CheckpointingException) and isinstance(e, Exception)
        assert e.failures == {} and str(e) == e.args[0]
        return str(e)
    raise AssertionError("no exception")


def _save_w(rank: int, world: int, ckpt: str) -> None:
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, world))}, ckpt)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_errors_are_also_pytorch_checkpoint_exceptions(tmp_path, world):
    pool = get_pool(world)
    ckpt = str(tmp_path / "c")
    pool.run(_save_w, ckpt)
    for case, fragment in (("missing-key", "nope"), ("wrong-shape", "Global shape mismatch"),
                           ("not-a-checkpoint", "_none")):
        messages = pool.run(_catch_as_pytorch, ckpt, case)
        assert all(fragment in m for m in messages), messages


def test_exception_constructor_pickle_and_subclasses():
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    from dist_checkpointing.tools.output import OutputExistsError

    for e in (dc.CheckpointingException("boom"), dc.CheckpointingException("boom", {1: (ValueError("x"), None)}),
              dc.CheckpointingException(), OutputExistsError("/x")):
        clone = pickle.loads(pickle.dumps(e))
        assert type(clone) is type(e) and str(clone) == str(e) and isinstance(clone, CheckpointException)
        assert set(clone.failures) == set(e.failures)


def _logs_at_info(rank: int, world: int, ckpt: str) -> List[str]:
    import logging

    records: List[str] = []
    handler = logging.Handler(level=logging.INFO)
    handler.emit = lambda record: records.append(f"{record.name}: {record.getMessage()}")
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)  # as Megatron-LM sets it
    try:
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, world)), "it": 1}
        dc.save(sd, ckpt)
        dc.save(sd, ckpt + "_fp", FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()))
        dc.save(sd, ckpt + "_async", async_sharded_save=True).execute_sync()
        request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, world))}
        dc.load(request, ckpt)
        dc.load(request, ckpt, FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()))
        dc.load_common_state_dict(ckpt)
        dc.load_plain_tensors(ckpt)
    finally:
        root.removeHandler(handler)
        root.setLevel(old)
    return records


@pytest.mark.parametrize("world", [1, 2, 4])
def test_save_and_load_are_silent_at_info(tmp_path, world):
    assert get_pool(world).run(_logs_at_info, str(tmp_path / "c")) == [[]] * world


def _common_state_warning(rank: int, world: int, ckpt: str) -> List[str]:
    import logging

    records: List[str] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("dist_checkpointing").addHandler(handler)
    try:
        dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, world)), "rank": rank}, ckpt)
    finally:
        logging.getLogger("dist_checkpointing").removeHandler(handler)
    return records


@pytest.mark.parametrize("world", [2, 4])
def test_common_state_warning_worded_as_megatron_core(tmp_path, world):
    """Megatron-Core's test matches the whole message."""
    logs = get_pool(world).run(_common_state_warning, str(tmp_path / "c"))
    assert logs[0] == []
    for rank in range(1, world):
        assert logs[rank] == [f"Rank {rank} common state dict differs from rank 0 common state dict. "
                              f"Keys only on rank 0: [], Keys only on {rank}: [], "
                              "Mismatched keys: [(('rank',), <class 'int'>, <class 'int'>)]"], logs[rank]


def _strict_messages(rank: int, world: int, ckpt: str, strict: str) -> str:
    import logging

    from dist_checkpointing.validation import StrictHandling

    records: List[str] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("dist_checkpointing").addHandler(handler)
    request = {"x": ShardedTensor.from_rank_offsets("extra", torch.zeros(1), replica_id=rank)}
    try:
        dc.load(request, ckpt, strict=StrictHandling(strict))
    except dc.CheckpointingException as e:
        return str(e)
    finally:
        logging.getLogger("dist_checkpointing").removeHandler(handler)
    return "\n".join(records)


@pytest.mark.parametrize("world", [1, 2])
def test_strict_messages_worded_as_megatron_core(tmp_path, world):
    pool = get_pool(world)
    ckpt = str(tmp_path / "c")
    pool.run(_save_w, ckpt)
    for strict in ("log_all", "raise_all"):
        for text in pool.run(_strict_messages, ckpt, strict):
            assert "Missing keys (for all ranks): ['w']" in text, text
            assert "Unexpected keys" in text and "'extra'" in text, text
    for text in pool.run(_strict_messages, ckpt, "log_unexpected"):
        assert "Unexpected keys (for this rank): ['extra']" in text and "Missing keys" not in text, text


# ----------------------------------------------------------------------------- load_plain_tensors of flattened keys


def _save_flat(rank: int, world: int, ckpt: str) -> None:
    glob = torch.arange(24.0).reshape(4, 6)
    chunk = glob.flatten()
    bounds = [24 * r // world for r in range(world + 1)]
    dc.save({"f": ShardedTensor.from_rank_offsets_flat("f", chunk[bounds[rank]:bounds[rank + 1]].clone(), (4, 6),
                                                       flattened_range=slice(bounds[rank], bounds[rank + 1])),
             "n": ShardedTensor.from_rank_offsets("n", glob[rank * 4 // world:(rank + 1) * 4 // world].clone(),
                                                  (0, rank, world)) if 4 % world == 0 else
             ShardedTensor.from_rank_offsets("n", glob.clone(), replica_id=rank)}, ckpt)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_load_plain_tensors_returns_flattened_keys_1d(tmp_path, world):
    ckpt = str(tmp_path / "c")
    get_pool(world).run(_save_flat, ckpt)
    glob = torch.arange(24.0).reshape(4, 6)
    flat = dc.load_plain_tensors(ckpt)
    assert flat["f"].shape == (24,) and torch.equal(flat["f"], glob.flatten())
    assert torch.equal(flat["n"], glob)  # a key not stored flattened keeps its shape
    nd = dc.load_plain_tensors(ckpt, original_shape=True)
    assert torch.equal(nd["f"], glob) and torch.equal(nd["n"], glob)
    assert dc.load_tensors_metadata(ckpt)["f"].global_shape == (4, 6)
