"""Fully parallel save/load wrappers (``strategies/fully_parallel.py``) on real gloo groups.

The ranks of a pool build TP x DP sharded states (tensors split over TP with
``from_rank_offsets`` and replicated over DP, TP-replicated tensors, ShardedObjects and
common state), save them with ``FullyParallelSaveStrategyWrapper`` and load them with
``FullyParallelLoadStrategyWrapper`` over the whole world or over DP sub-groups made with
``torch.distributed.new_group``. Values are random bytes viewed as the tested dtype and are
compared byte for byte. Who writes and who reads is observed from outside the wrappers:
the ``__{rank}_*.distcp`` file sizes, the writer of every item recorded in ``.metadata``,
the shards each rank hands to the wrapped load strategy, and ``/proc/self/io`` ``rchar``.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.dict_utils import nested_values
from dist_checkpointing.exchange_utils import distribute_shards_to_ranks
from dist_checkpointing.strategies.base import SaveShardedStrategy
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    read_metadata,
)

from .conftest import get_pool
from .helpers import RecordingLoad, assert_all_raise

ALGOS = ("broadcast", "gather_rounds", "gather_object")
DTYPES = ("float32", "bfloat16", "int16", "int64", "float8_e4m3fn")
_ERR_TIMEOUT = 60.0  # an error case that hangs fails after this long
_DISTCP_RE = re.compile(r"^(?:.*?)__(\d+)_\d+\.distcp$")


# ----------------------------------------------------------------------------- groups (rank side)

_GROUPS: Dict[Any, List[Tuple[List[int], Any]]] = {}


def _new_groups(name: Any, rank_lists: List[List[int]]) -> List[Tuple[List[int], Any]]:
    """Every rank creates every group of ``rank_lists``, in the same order, once per process."""
    if name not in _GROUPS:
        _GROUPS[name] = [(ranks, dist.new_group(ranks)) for ranks in rank_lists]
    return _GROUPS[name]


def _dp_group(tp: int) -> Any:
    """This rank's DP group of a TP x DP layout (rank = dp * tp + tp_rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = _new_groups(("dp", world, tp), [list(range(t, world, tp)) for t in range(tp)])
    return groups[rank % tp][1]


def _group(kind: str, tp: int) -> Any:
    return None if kind == "world" else _dp_group(tp)


def _group_ranks(kind: str, tp: int, rank: int, world: int) -> List[int]:
    return list(range(world)) if kind == "world" else list(range(rank % tp, world, tp))


# ----------------------------------------------------------------------------- values and states


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _values(key: str, shape: Tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Deterministic random bytes viewed as ``dtype`` (any bit pattern, NaNs included)."""
    n = math.prod(shape) * dtype.itemsize
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}:{salt}".encode()))
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(math.prod(shape) * dtype.itemsize, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _at(d: Any, path: Tuple) -> Any:
    for p in path:
        d = d[p]
    return d


def _state(rank: int, world: int, tp: int, dtype: torch.dtype, salt: int, fill: bool = True,
           tp_objects: bool = True, tuple_replicas: bool = False):
    """A TP x DP model state (rank = dp * tp + tp_rank) and, by path, the expected loaded
    values and the request's own data tensors (None where the request has no data).

    With ``fill=False`` it is a load request: zero tensors (one non-contiguous, one an
    ``nn.Parameter`` for float dtypes, one data-less ShardedTensor) and data-less objects.
    ``norm`` (replicated over TP and DP) has replica id ``(tp_rank, dp_rank)`` with
    ``tuple_replicas``, else ``rank``.
    """
    tpr, dpr = rank % tp, rank // tp
    expected: Dict[Tuple, Any] = {}
    datas: Dict[Tuple, Optional[torch.Tensor]] = {}

    def data(path, full, index, noncontig=False, param=False):
        exp = full[index].clone()
        expected[path] = exp
        t = exp.clone() if fill else _zeros(exp.shape, dtype)
        if noncontig:  # same shape and values, column-major strides
            t = t.t().contiguous().t()
            assert not t.is_contiguous()
        if param and not fill and dtype.is_floating_point and dtype.itemsize > 1:
            t = torch.nn.Parameter(t)
        datas[path] = t
        return t

    def split(shape, axis):
        n = shape[axis] // tp
        return tuple(slice(tpr * n, (tpr + 1) * n) if a == axis else slice(None) for a in range(len(shape)))

    col = ShardedTensor.from_rank_offsets(
        "dec.col", data(("model", "col"), _values("dec.col", (32, 12), dtype, salt), split((32, 12), 0)),
        (0, tpr, tp), replica_id=dpr)
    row = ShardedTensor.from_rank_offsets(
        "dec.row", data(("model", "row"), _values("dec.row", (12, 32), dtype, salt), split((12, 32), 1),
                        noncontig=True),
        (1, tpr, tp), replica_id=dpr)
    layers_full = _values("dec.layers", (3, 16, 8), dtype, salt)
    layers = []
    for i in range(3):
        n = 16 // tp
        t = data(("model", "layers", i), layers_full, (i, slice(tpr * n, (tpr + 1) * n), slice(None)))
        layers.append(ShardedTensor.from_rank_offsets("dec.layers", t, (0, i, 3), (1, tpr, tp), replica_id=dpr,
                                                      prepend_axis_num=1))
    emb = ShardedTensor.from_rank_offsets(
        "emb", data(("model", "emb"), _values("emb", (16, 8), dtype, salt), split((16, 8), 0)),
        (0, tpr, tp), replica_id=dpr)
    if not fill:
        emb = emb.without_data()
        datas[("model", "emb")] = None
    norm = ShardedTensor.from_rank_offsets(
        "norm", data(("model", "norm"), _values("norm", (40,), dtype, salt), (slice(None),)),
        replica_id=(tpr, dpr) if tuple_replicas else rank)
    bias = ShardedTensor.from_rank_offsets(
        "bias", data(("model", "bias"), _values("bias", (24,), dtype, salt), (slice(None),), param=True),
        replica_id=rank)
    sd: Dict[str, Any] = {
        "model": {"col": col, "row": row, "layers": layers, "emb": emb, "norm": norm, "bias": bias},
        "iteration": salt,
    }
    objs: Dict[str, Any] = {}
    all_obj = {"salt": salt, "items": [1, 2.5, "x"]}
    objs["all"] = ShardedObject("all_obj", all_obj if fill else None, (1,), (0,), replica_id=rank)
    expected[("objs", "all")] = all_obj
    if tp_objects:
        tp_obj = {"tp": tpr, "salt": salt, "name": "t" * (tpr + 1)}
        objs["tp"] = ShardedObject("tp_obj", tp_obj if fill else None, (tp,), (tpr,), replica_id=dpr)
        expected[("objs", "tp")] = tp_obj
    sd["objs"] = objs
    expected[("iteration",)] = salt
    return sd, expected, datas


def _check(loaded: dict, expected: dict, datas: dict, where: str) -> int:
    for path, exp in expected.items():
        got = _at(loaded, path)
        if isinstance(exp, torch.Tensor):
            assert isinstance(got, torch.Tensor), (where, path, type(got))
            assert got.dtype == exp.dtype and tuple(got.shape) == tuple(exp.shape), \
                (where, path, got.dtype, tuple(got.shape), exp.dtype, tuple(exp.shape))
            assert torch.equal(_bytes(got), _bytes(exp)), f"{where}: {path} has wrong bytes"
            own = datas.get(path)
            if own is not None:
                assert got is own, f"{where}: {path} is not the request's own tensor"
        else:
            assert got == exp, (where, path, got, exp)
    return len(expected)


def _replica_ids(sd: dict) -> list:
    return [(sh.key, sh.replica_id) for sh in nested_values(sd) if isinstance(sh, (ShardedTensor, ShardedObject))]


def _save_w(group, **kw) -> FullyParallelSaveStrategyWrapper:
    return FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), group, **kw)


def _load_w(group, algo="broadcast", **kw) -> FullyParallelLoadStrategyWrapper:
    return FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), group, exchange_algo=algo, **kw)


# ----------------------------------------------------------------------------- round trips


def _roundtrip_rank(rank, world, base, tp, kind, combos, tuple_replicas=False):
    """Save with the wrapper once per dtype, load with the wrapper once per (dtype, algo) of ``combos``."""
    group = _group(kind, tp) if dist.is_initialized() else None
    checked = 0
    dtypes = list(dict.fromkeys(d for d, _ in combos))
    for di, dname in enumerate(dtypes):
        dtype = _dtype(dname)
        ckpt = os.path.join(base, f"{kind}_tp{tp}_{dname}")
        sd, _, _ = _state(rank, world, tp, dtype, salt=di, tuple_replicas=tuple_replicas)
        before = _replica_ids(sd)
        dc.save(sd, ckpt, sharded_strategy=_save_w(group))
        assert _replica_ids(sd) == before, "the save wrapper modified the caller's replica ids"
        for algo in [a for d, a in combos if d == dname]:
            req, exp, datas = _state(rank, world, tp, dtype, salt=di, fill=False, tuple_replicas=tuple_replicas)
            loaded = dc.load(req, ckpt, sharded_strategy=_load_w(group, algo))
            checked += _check(loaded, exp, datas, f"rank {rank} {kind} tp{tp} {dname} {algo}")
    return checked


_ALL = [(d, a) for d in DTYPES for a in ALGOS]
_DIAGONAL = [(d, ALGOS[i % len(ALGOS)]) for i, d in enumerate(DTYPES)]
_N_CHECKED = 11  # items _check compares per load of _state


@pytest.mark.parametrize("world,tp,kind,combos", [
    (2, 1, "world", _ALL), (2, 1, "dp", _DIAGONAL), (2, 2, "world", _DIAGONAL),
    (4, 1, "world", _ALL), (4, 2, "world", _DIAGONAL), (4, 2, "dp", _ALL),
], ids=["w2-dp2-world-all", "w2-dp2-subgroup", "w2-tp2-world", "w4-dp4-world-all", "w4-tp2dp2-world",
        "w4-tp2dp2-subgroups-all"])
def test_roundtrip_algos_and_dtypes(world, tp, kind, combos, tmp_path):
    checked = get_pool(world).run(_roundtrip_rank, str(tmp_path), tp, kind, combos)
    assert checked == [len(combos) * _N_CHECKED] * world, checked


def _tiny_buffers_rank(rank, world, base, tp, kind, combos):
    """Round trips with exchange buffers far smaller than the shards: large shards broadcast
    alone, small ones in several buckets, gather rounds that split shards."""
    import dist_checkpointing.exchange.tensors as eu  # where the buffer sizes live

    saved = eu.SMALL_SHARD_BYTES, eu.BUCKET_BYTES, eu.ROUND_BYTES
    eu.SMALL_SHARD_BYTES, eu.BUCKET_BYTES, eu.ROUND_BYTES = 200, 700, 333
    try:
        return _roundtrip_rank(rank, world, base, tp, kind, combos)
    finally:
        eu.SMALL_SHARD_BYTES, eu.BUCKET_BYTES, eu.ROUND_BYTES = saved


@pytest.mark.parametrize("world,tp,kind", [(2, 1, "world"), (4, 2, "dp")])
def test_roundtrip_with_tiny_exchange_buffers(world, tp, kind, ckpt_location):
    combos = [(d, a) for d in ("float32", "int16", "float8_e4m3fn") for a in ALGOS[:2]]
    checked = get_pool(world).run(_tiny_buffers_rank, ckpt_location("tiny"), tp, kind, combos)
    assert checked == [len(combos) * _N_CHECKED] * world, checked


def _tuple_replicas_minimal_rank(rank, world, ckpt):
    # Megatron-style tuple replica ids, main replica (0, 0) on rank 0; two same-size tensors,
    # so the greedy assignment gives "b" to rank 1.
    sd = {k: ShardedTensor.from_rank_offsets(k, torch.full((64,), float(i)), replica_id=(0, rank))
          for i, k in enumerate(("a", "b"))}
    dc.save(sd, ckpt, sharded_strategy=_save_w(None))
    loaded = dc.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(64), replica_id=(0, rank)) for k in sd}, ckpt)
    assert torch.equal(loaded["a"], torch.full((64,), 0.0)) and torch.equal(loaded["b"], torch.full((64,), 1.0))
    return True


def test_tuple_replica_ids_minimal(pool2, ckpt_location):
    """Library bug: fully_parallel.py compares ``replica_id == 0`` instead of using
    is_main_replica, so a holder of main replica ``(0, 0)`` that was not chosen keeps it and
    the shard is written twice ("saved as main replica by both rank 0 and rank 1")."""
    assert all(pool2.run(_tuple_replicas_minimal_rank, ckpt_location("ckpt")))


def test_tuple_replica_ids_tp_dp(tmp_path):
    """The TP x DP state with ``norm`` replicated with replica ids (tp_rank, dp_rank)."""
    combos = [("float32", "broadcast")]
    for tp, kind in ((1, "world"), (2, "dp")):
        checked = get_pool(4).run(_roundtrip_rank, str(tmp_path / f"tp{tp}"), tp, kind, combos, True)
        assert checked == [_N_CHECKED] * 4


def _interop_rank(rank, world, base, tp, kind):
    """Plain save -> wrapped load, wrapped save -> plain load, and resharded wrapped loads."""
    group = _group(kind, tp)
    dtype = torch.bfloat16
    plain, wrapped = os.path.join(base, "plain"), os.path.join(base, "wrapped")
    dc.save(_state(rank, world, tp, dtype, salt=5)[0], plain)
    dc.save(_state(rank, world, tp, dtype, salt=6)[0], wrapped, sharded_strategy=_save_w(group))
    for algo in ALGOS:
        req, exp, datas = _state(rank, world, tp, dtype, salt=5, fill=False)
        _check(dc.load(req, plain, sharded_strategy=_load_w(group, algo)), exp, datas, f"plain->fp {algo}")
    req, exp, datas = _state(rank, world, tp, dtype, salt=6, fill=False)
    _check(dc.load(req, wrapped), exp, datas, "fp->plain")
    # Resharding: every other TP layout that divides the world, over the world and its DP groups.
    n = 0
    for load_tp in (1, 2, 4):
        if load_tp == tp or world % load_tp:
            continue
        for load_kind in ("world", "dp"):
            for algo in (ALGOS if load_kind == "dp" else ALGOS[n % len(ALGOS):][:1]):
                req, exp, datas = _state(rank, world, load_tp, dtype, salt=6, fill=False, tp_objects=False)
                loaded = dc.load(req, wrapped, sharded_strategy=_load_w(_group(load_kind, load_tp), algo))
                _check(loaded, exp, datas, f"reshard tp{tp}->tp{load_tp} {load_kind} {algo}")
                n += 1
    return n


@pytest.mark.parametrize("world,tp,kind", [(2, 2, "world"), (4, 2, "dp"), (4, 2, "world")])
def test_interop_with_plain_strategies_and_resharding(world, tp, kind, tmp_path):
    done = get_pool(world).run(_interop_rank, str(tmp_path), tp, kind)
    assert min(done) >= 4


# ----------------------------------------------------------------------------- flattened slices

# key: (global shape, TP-split axis, prepended axes)
_FLAT_KEYS = {"opt.fw": ((16, 12), 0, 0), "opt.fl": ((2, 8, 6), 1, 1)}


def _flat_state(rank, world, tp, salt, mode, fracs, fill):
    """Optimizer-style state: ``mode`` 'flat' = each DP rank its own slice of its TP chunk
    (cut at ``fracs[tp_rank]``, replica 0), 'shared' = the same slice ``fracs`` on every DP
    rank (replica dp), 'full' = the whole TP chunk non-flattened (replica dp)."""
    tpr, dpr = rank % tp, rank // tp
    dtype = torch.float32
    sd, expected, datas = {}, {}, {}
    for key, (shape, axis, prepend) in _FLAT_KEYS.items():
        full = _values(key, shape, dtype, salt)
        layers = range(shape[0]) if prepend else [None]
        items = []
        for li, layer in enumerate(layers):
            glob = full[layer] if prepend else full
            laxis = axis - prepend
            n = glob.shape[laxis] // tp
            chunk = glob.narrow(laxis, tpr * n, n)
            offs = ([(0, layer, shape[0])] if prepend else []) + [(axis, tpr, tp)]
            path = (key, li)
            numel = chunk.numel()
            if mode == "full":
                exp = chunk.clone()
            else:
                if mode == "flat":
                    cuts = [int(f * numel) for f in fracs[tpr]]
                    a, b = cuts[dpr], cuts[dpr + 1]
                else:
                    a, b = int(fracs[0] * numel), int(fracs[1] * numel)
                exp = chunk.reshape(-1)[a:b].clone()
            expected[path] = exp
            t = exp.clone() if fill else _zeros(exp.shape, dtype)
            datas[path] = t
            if mode == "full":
                sh = ShardedTensor.from_rank_offsets(key, t, *offs, replica_id=dpr, prepend_axis_num=prepend)
            else:
                sh = ShardedTensor.from_rank_offsets_flat(
                    key, t, tuple(chunk.shape), *offs, flattened_range=slice(a, b),
                    replica_id=0 if mode == "flat" else dpr, prepend_axis_num=prepend)
            items.append(sh)
        sd[key] = items
    return sd, expected, datas


_SAVE_FRACS = ((0, 0.4, 1), (0, 0.6, 1))
_LOAD_FRACS = ((0, 0.7, 1), (0, 0.25, 1))


def _flat_rank(rank, world, base, tp, kind):
    group = _group(kind, tp)
    flat, full = os.path.join(base, "flat"), os.path.join(base, "full")
    dc.save(_flat_state(rank, world, tp, 1, "flat", _SAVE_FRACS, True)[0], flat, sharded_strategy=_save_w(group))
    dc.save(_flat_state(rank, world, tp, 2, "full", None, True)[0], full, sharded_strategy=_save_w(group))
    # the whole TP chunk as one flat slice, replicated over DP: the wrapper picks the writers
    shared = os.path.join(base, "shared")
    dc.save(_flat_state(rank, world, tp, 3, "shared", (0, 1), True)[0], shared, sharded_strategy=_save_w(group))
    cases = [(flat, 1, "flat", _SAVE_FRACS), (flat, 1, "flat", _LOAD_FRACS), (flat, 1, "full", None),
             (flat, 1, "shared", (0.1, 0.8)), (full, 2, "flat", _LOAD_FRACS), (full, 2, "shared", (0.3, 0.9)),
             (full, 2, "full", None), (shared, 3, "full", None), (shared, 3, "flat", _LOAD_FRACS),
             (shared, 3, "shared", (0, 1))]
    n = 0
    for i, (ckpt, salt, mode, fracs) in enumerate(cases):
        for algo in (ALGOS if i < 3 else ALGOS[i % len(ALGOS):][:1]):
            req, exp, datas = _flat_state(rank, world, tp, salt, mode, fracs, False)
            loaded = dc.load(req, ckpt, sharded_strategy=_load_w(group, algo))
            _check(loaded, exp, datas, f"rank {rank} case {i} {mode} {fracs} {algo}")
            n += 1
    return n


@pytest.mark.parametrize("kind", ["dp", "world"])
def test_flattened_optimizer_slices_roundtrip(kind, tmp_path):
    assert get_pool(4).run(_flat_rank, str(tmp_path), 2, kind) == [16] * 4


# ----------------------------------------------------------------------------- ranks needing different shards

# key: (elements, ranks of the 4 that request it): shards that different subsets of the
# ranks need, one that every rank needs.
_NEEDS = {"big1": (4096, (1,)), "big2": (4096, (2,)), "big3": (4096, (3,)), "s_a": (100, (0, 1)),
          "s_b": (60, (0, 2)), "s_c": (90, (0, 3)), "s_d": (70, (0, 1, 2, 3)), "s_e": (80, (0, 2, 3))}


def _needs_rank(rank, world, ckpt, tiny):
    import dist_checkpointing.exchange.tensors as eu  # where the buffer sizes live

    dtype = torch.int16  # not a gloo dtype: travels as bytes
    sd = {k: ShardedTensor.from_rank_offsets(k, _values(k, (n,), dtype, 9), replica_id=rank)
          for k, (n, _) in _NEEDS.items()}
    dc.save(sd, ckpt, sharded_strategy=_save_w(None))
    saved = eu.SMALL_SHARD_BYTES, eu.BUCKET_BYTES, eu.ROUND_BYTES
    if tiny:
        eu.SMALL_SHARD_BYTES, eu.BUCKET_BYTES, eu.ROUND_BYTES = 150, 400, 100
    try:
        for algo in ALGOS:
            req, exp, datas = {}, {}, {}
            for k, (n, needers) in _NEEDS.items():
                if rank in needers:
                    t = _zeros((n,), dtype)
                    req[k] = ShardedTensor.from_rank_offsets(k, t, replica_id=needers.index(rank))
                    if k == "s_e" and rank == 3:
                        req[k] = req[k].without_data()
                        t = None
                    exp[(k,)], datas[(k,)] = _values(k, (n,), dtype, 9), t
            recorder = RecordingLoad()
            strategy = FullyParallelLoadStrategyWrapper(recorder, None, exchange_algo=algo)
            _check(dc.load(req, ckpt, sharded_strategy=strategy), exp, datas, f"rank {rank} {algo} tiny={tiny}")
        return sorted(k for k, _ in recorder.reads)
    finally:
        eu.SMALL_SHARD_BYTES, eu.BUCKET_BYTES, eu.ROUND_BYTES = saved


@pytest.mark.parametrize("tiny", [False, True], ids=["default-buffers", "tiny-buffers"])
def test_exchange_to_ranks_needing_different_shards(tiny, tmp_path):
    reads = get_pool(4).run(_needs_rank, str(tmp_path / "ckpt"), tiny)
    # every shard is read once, by a rank that requests it; s_d (requested by every rank)
    # travels with the algorithm, the others point to point to the ranks that request them
    assert sorted(k for keys in reads for k in keys) == sorted(_NEEDS), reads
    for rank, keys in enumerate(reads):
        assert all(rank in _NEEDS[k][1] for k in keys), (rank, keys)


def _edge_cases_rank(rank, world, base):
    """A shard held twice by every rank (tied weights), empty and overlapping flat slices,
    an unexpected key with ``strict=RETURN_ALL``, objects only."""
    tied, flat, objs = (os.path.join(base, n) for n in ("tied", "flat", "objs"))
    arange = torch.arange(8.0)
    dc.save({"a": ShardedTensor.from_rank_offsets("tied", arange.clone(), replica_id=rank),
             "b": ShardedTensor.from_rank_offsets("tied", arange.clone(), replica_id=rank + world)},
            tied, sharded_strategy=_save_w(None))
    chunk = torch.arange(12.0).reshape(3, 4)
    bounds = [0, 0, 5, 12, 12] if world == 4 else [0, 12, 12]
    a, b = bounds[rank], bounds[rank + 1]
    dc.save({"f": ShardedTensor.from_rank_offsets_flat("f", chunk.reshape(-1)[a:b].clone(), (3, 4),
                                                       flattened_range=slice(a, b))},
            flat, sharded_strategy=_save_w(None))
    dc.save({"o": ShardedObject("o", {"r": 1}, (1,), (0,), replica_id=rank),
             "p": ShardedObject("p", rank, (world,), (rank,))}, objs, sharded_strategy=_save_w(None))
    for algo in ALGOS:
        t1, t2 = torch.zeros(8), torch.zeros(8)
        loaded = dc.load({"a": ShardedTensor.from_rank_offsets("tied", t1, replica_id=rank),
                          "b": ShardedTensor.from_rank_offsets("tied", t2, replica_id=rank + world)},
                         tied, sharded_strategy=_load_w(None, algo))
        assert loaded["a"] is t1 and loaded["b"] is t2 and torch.equal(t1, arange) and torch.equal(t2, arange)
        for x, y, replica in ((a, b, 0), (2, 9, rank), ((3, 3) if rank % 2 else (1, 10)) + (rank,)):
            e = torch.zeros(y - x)
            loaded = dc.load({"f": ShardedTensor.from_rank_offsets_flat("f", e, (3, 4), flattened_range=slice(x, y),
                                                                        replica_id=replica)},
                             flat, sharded_strategy=_load_w(None, algo))
            assert loaded["f"] is e and torch.equal(e, chunk.reshape(-1)[x:y]), (algo, x, y, e)
        req = {"a": ShardedTensor.from_rank_offsets("tied", torch.zeros(8), replica_id=rank),
               "u": ShardedTensor.from_rank_offsets("unexpected", torch.zeros(5), replica_id=rank)}
        loaded, missing, unexpected = dc.load(req, tied, sharded_strategy=_load_w(None, algo),
                                              strict=dc.StrictHandling.RETURN_ALL)
        assert "u" not in loaded and unexpected == {"unexpected"} and not missing, (missing, unexpected)
        assert torch.equal(loaded["a"], arange)
        loaded = dc.load({"o": ShardedObject("o", None, (1,), (0,), replica_id=rank),
                          "p": ShardedObject("p", None, (world,), ((rank + 1) % world,))},
                         objs, sharded_strategy=_load_w(None, algo))
        assert loaded["o"] == {"r": 1} and loaded["p"] == (rank + 1) % world, loaded
    return True


def test_edge_cases(pool4, tmp_path):
    assert all(pool4.run(_edge_cases_rank, str(tmp_path)))


# ----------------------------------------------------------------------------- balance and writers

_SIZES = (16384, 12288, 10240, 8192, 8192, 6144, 5120, 4096, 4096, 3072, 2048, 2048, 1536, 1024)


def _rep_state(rank, world, tp, salt, fill, sizes=_SIZES, drop=(), extra=True, shift=False):
    """Replicated state: ``w{i}`` of ``sizes[i]`` fp32 per TP chunk (replica dp), ``x``
    replicated everywhere (replica ``rank``, or ``rank - 1`` with ``shift``), ``extra``
    replicated everywhere (replica ``rank``). Keys in ``drop`` are left out."""
    tpr, dpr = rank % tp, rank // tp
    sd, expected, datas = {}, {}, {}

    def add(key, n, offs, replica):
        if key in drop:
            return
        if offs:  # the TP chunk of a (tp * n,) global tensor
            exp = _values(key, (tp * n,), torch.float32, salt)[tpr * n:(tpr + 1) * n].clone()
        else:
            exp = _values(key, (n,), torch.float32, salt)
        t = exp.clone() if fill else torch.zeros(n)
        expected[(key,)], datas[(key,)] = exp, t
        sd[key] = ShardedTensor.from_rank_offsets(key, t, *offs, replica_id=replica)

    for i, n in enumerate(sizes):
        add(f"w{i}", n, [(0, tpr, tp)], dpr)
    add("x", 300, [], (rank + world - 1) % world if shift else rank)
    if extra:
        add("extra", 200, [], rank)
    return sd, expected, datas


def _bytes_per_rank(ckpt: str, world: int) -> List[int]:
    out = [0] * world
    for f in os.listdir(ckpt):
        m = _DISTCP_RE.match(f)
        if m:
            out[int(m.group(1))] += os.path.getsize(os.path.join(ckpt, f))
    return out


def _writers(ckpt: str) -> Dict[Tuple[str, Tuple[int, ...]], int]:
    """(key, global offset) -> the rank whose file holds the item, from ``.metadata``."""
    md = read_metadata(ckpt)
    out = {}
    for idx, info in md.storage_data.items():
        if idx.offset is not None:
            m = _DISTCP_RE.match(info.relative_path)
            assert m, info.relative_path
            out[(idx.fqn, tuple(idx.offset))] = int(m.group(1))
    return out


def _save_rep_rank(rank, world, ckpt, tp, kind, wrapped):
    group = _group(kind, tp)
    sd = _rep_state(rank, world, tp, 3, True)[0]
    dc.save(sd, ckpt, sharded_strategy=_save_w(group) if wrapped else None)
    req, exp, datas = _rep_state(rank, world, tp, 3, False)
    _check(dc.load(req, ckpt), exp, datas, "balance reload")


def test_save_balance_dp4(tmp_path):
    pool = get_pool(4)
    fp, plain = str(tmp_path / "fp"), str(tmp_path / "plain")
    pool.run(_save_rep_rank, fp, 1, "world", True)
    pool.run(_save_rep_rank, plain, 1, "world", False)
    per_rank = _bytes_per_rank(fp, 4)
    mean = sum(per_rank) / 4
    assert max(per_rank) / mean <= 1.3, per_rank
    assert min(per_rank) > 0, per_rank
    plain_per_rank = _bytes_per_rank(plain, 4)
    assert plain_per_rank[1:] == [0, 0, 0] and plain_per_rank[0] > 0, plain_per_rank
    assert abs(sum(plain_per_rank) - sum(per_rank)) <= 0.02 * sum(per_rank), (plain_per_rank, per_rank)


def test_save_balance_dp_subgroups(tmp_path):
    """TP2 x DP2: both members of each DP group write, balanced within the group."""
    pool = get_pool(4)
    fp, plain = str(tmp_path / "fp"), str(tmp_path / "plain")
    pool.run(_save_rep_rank, fp, 2, "dp", True)
    pool.run(_save_rep_rank, plain, 2, "dp", False)
    per_rank = _bytes_per_rank(fp, 4)
    for members in ([0, 2], [1, 3]):
        b = [per_rank[r] for r in members]
        assert min(b) > 0 and max(b) / (sum(b) / 2) <= 1.3, per_rank
    plain_per_rank = _bytes_per_rank(plain, 4)
    assert plain_per_rank[2] == plain_per_rank[3] == 0 and min(plain_per_rank[:2]) > 0, plain_per_rank
    # Only items whose main replica was in the group moved: x and extra (main on rank 0) stay in group {0, 2}.
    writers = _writers(fp)
    assert writers[("x", (0,))] in (0, 2) and writers[("extra", (0,))] in (0, 2), writers


def _writer_pref_rank(rank, world, ckpt, tp, kind):
    group = _group(kind, tp)
    dc.save(_rep_state(rank, world, tp, 4, True)[0], ckpt, sharded_strategy=_save_w(group))
    req, exp, datas = _rep_state(rank, world, tp, 4, False)
    requested = sorted((sh.key, tuple(sh.global_offset)) for sh in nested_values(req))
    recorder = RecordingLoad()
    loaded = dc.load(req, ckpt, sharded_strategy=FullyParallelLoadStrategyWrapper(recorder, group))
    _check(loaded, exp, datas, "writer preference")
    return requested, recorder.reads


@pytest.mark.parametrize("tp,kind", [(1, "world"), (2, "dp"), (2, "world")])
def test_load_reads_each_shard_on_its_writer(tp, kind, tmp_path):
    world = 4
    ckpt = str(tmp_path / "ckpt")
    results = get_pool(world).run(_writer_pref_rank, ckpt, tp, kind)
    writers = _writers(ckpt)
    compared = 0
    for rank, (requested, reads) in enumerate(results):
        members = _group_ranks(kind, tp, rank, world)
        # the wrapped strategy reads each shard written inside the group on its writer
        assert len(reads) == len(set(reads)), (rank, reads)
        for shard in reads:
            assert shard in requested, (rank, shard)
            if writers[shard] in members:
                assert writers[shard] == rank, (rank, shard, writers[shard])
                compared += 1
    assert compared >= len(_SIZES), compared
    # Each shard needed by a group is read once in that group.
    groups = {tuple(_group_ranks(kind, tp, r, world)) for r in range(world)}
    for members in groups:
        reads = [s for r in members for s in results[r][1]]
        needed = set().union(*(results[r][0] for r in members))
        assert sorted(reads) == sorted(needed), (members, len(reads), len(needed))


# ----------------------------------------------------------------------------- bytes read


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _read_bytes_rank(rank, world, ckpt, tp, kind):
    group = _group(kind, tp)
    sizes = (25000,) * 8
    dc.save(_rep_state(rank, world, tp, 7, True, sizes=sizes, extra=False)[0], ckpt, sharded_strategy=_save_w(group))
    out = {}
    for repeat in range(2):  # the first round warms imports and caches
        for label in ("plain", "fp"):
            req, exp, datas = _rep_state(rank, world, tp, 7, False, sizes=sizes, extra=False)
            strategy = _load_w(group) if label == "fp" else TorchDistLoadShardedStrategy()
            dist.barrier()
            before = _rchar()
            loaded = dc.load(req, ckpt, sharded_strategy=strategy)
            out[label] = _rchar() - before
            _check(loaded, exp, datas, f"read bytes {label}")
    return out


@pytest.mark.parametrize("tp,kind", [(1, "world"), (2, "dp")])
def test_each_stored_byte_read_once_per_group(tp, kind, tmp_path):
    world = 4
    ckpt = str(tmp_path / "ckpt")
    results = get_pool(world).run(_read_bytes_rank, ckpt, tp, kind)
    files = os.listdir(ckpt)
    data = sum(os.path.getsize(os.path.join(ckpt, f)) for f in files if f.endswith(".distcp"))
    small = sum(os.path.getsize(os.path.join(ckpt, f)) for f in files if not f.endswith(".distcp"))
    dp = world // tp  # every rank of a DP group needs everything its group stores
    fp = [r["fp"] for r in results]
    plain = [r["plain"] for r in results]
    slack = world * small + 64 * 1024
    assert 0.9 * data <= sum(fp) <= data + slack, (fp, data, small)
    assert sum(plain) >= 0.9 * dp * data, (plain, data)
    assert sum(plain) >= 0.9 * dp * sum(fp), (plain, fp)
    # and the reading is shared: nobody reads much more than its share
    assert max(fp) <= 1.3 * data / world + small + 16 * 1024, (fp, data)


# ----------------------------------------------------------------------------- caching


def _own_written_keys(ckpt: str, rank: int) -> List[str]:
    return sorted({k for (k, _), w in _writers(ckpt).items() if w == rank and k.startswith("w")})


def _cache_rank(rank, world, base, tp, kind, cached_metadata):
    group = _group(kind, tp)
    save_w = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(cached_metadata=cached_metadata), group,
                                              do_cache_distribution=True)
    load_w = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), group, do_cache_distribution=True)
    log = []

    def step(i, save_kw=None, load_kw=None, load_from=None):
        ckpt = os.path.join(base, f"step{i}")
        if save_kw is not None:
            dc.save(_rep_state(rank, world, tp, i, True, **save_kw)[0], ckpt, sharded_strategy=save_w)
        src = os.path.join(base, f"step{load_from}") if load_from is not None else ckpt
        salt = load_from if load_from is not None else i
        req, exp, datas = _rep_state(rank, world, tp, salt, False, **(load_kw or {"extra": False}))
        _check(dc.load(req, src, sharded_strategy=load_w), exp, datas, f"rank {rank} step {i}")
        log.append(i)
        return src

    for i in range(3):  # same structure, new values each time
        last = step(i, save_kw={})
    # One rank (DP rank 1, so main replicas stay where they were) changes alone.
    odd = tp
    # It stops holding the shards it wrote last time: a stale plan would leave them unwritten.
    mine = _own_written_keys(last, odd)
    assert mine
    step(3, save_kw={"drop": tuple(mine) if rank == odd else ()})
    step(4, save_kw={})
    # It alone requests one more key: a stale plan does not know that shard.
    step(5, load_kw={"extra": rank == odd}, load_from=4)
    # It alone stops requesting the shards it read (= wrote): a stale plan waits on it.
    mine = _own_written_keys(os.path.join(base, "step4"), odd)
    assert mine
    step(6, load_kw={"extra": False, "drop": tuple(mine) if rank == odd else ()}, load_from=4)
    step(7, load_kw={"extra": False}, load_from=4)
    # The main replica of x moves from rank 0 to rank 1 (another DP group when there are several).
    step(8, save_kw={"shift": True}, load_kw={"extra": False, "shift": True})
    step(9, save_kw={}, load_kw={"extra": False})
    step(10, save_kw={})
    return log


@pytest.mark.parametrize("tp,kind,cached_metadata", [(1, "world", True), (2, "dp", False)])
def test_cached_distribution_replans_on_any_change(tp, kind, cached_metadata, tmp_path):
    logs = get_pool(4).run(_cache_rank, str(tmp_path), tp, kind, cached_metadata)
    assert all(log == list(range(11)) for log in logs), logs


def _cache_world2_rank(rank, world, base):
    save_w = _save_w(None, do_cache_distribution=True)
    load_ws = [_load_w(None, algo, do_cache_distribution=True) for algo in ALGOS]
    for i in range(4):
        ckpt = os.path.join(base, f"s{i}")
        sd = _state(rank, world, 1, torch.float32, salt=i)[0]
        if i == 2 and rank == 1:  # rank 1 alone holds one more (replica-0) tensor
            sd["own"] = ShardedTensor.from_rank_offsets("own", torch.full((5,), float(i)))
        dc.save(sd, ckpt, sharded_strategy=save_w)
        for load_w in load_ws:
            req, exp, datas = _state(rank, world, 1, torch.float32, salt=i, fill=False)
            _check(dc.load(req, ckpt, sharded_strategy=load_w), exp, datas, f"step {i} {load_w.exchange_algo}")
    return True


def test_cached_distribution_world2_all_algos(tmp_path):
    assert all(get_pool(2).run(_cache_world2_rank, str(tmp_path)))


# ----------------------------------------------------------------------------- bad input


def _unknown_algo_rank(rank, world):
    FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo="all_to_all_please")


def test_unknown_exchange_algo(pool2):
    with pytest.raises(CheckpointingException, match="all_to_all_please"):
        FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo="all_to_all_please")
    assert_all_raise(pool2.run_expect_error(_unknown_algo_rank), 2, "all_to_all_please")


def _small_state(rank, world, fill=True):
    return {"t": ShardedTensor.from_rank_offsets("t", torch.arange(6.0) if fill else torch.zeros(6), replica_id=rank),
            "o": ShardedObject("o", {"v": 1} if fill else None, (1,), (0,), replica_id=rank)}


def _foreign_group(world):
    """A group of ranks {0} (world 2) or {0, 1} (world 4) that every rank creates and passes."""
    members = [0] if world == 2 else [0, 1]
    return _new_groups(("foreign", world), [members])[0][1]


def _foreign_group_save(rank, world, ckpt):
    dc.save(_small_state(rank, world), ckpt, sharded_strategy=_save_w(_foreign_group(world)))


def _foreign_group_load(rank, world, ckpt):
    dc.load(_small_state(rank, world, False), ckpt, sharded_strategy=_load_w(_foreign_group(world)))


def _plain_save(rank, world, ckpt):
    dc.save(_small_state(rank, world), ckpt)


def test_group_without_the_calling_rank(pool2, pool4, tmp_path):
    for pool, outsiders in ((pool2, [1]), (pool4, [2, 3])):
        w = pool.world_size
        frags = [f"rank {r} is not a member" for r in outsiders]
        excs = pool.run_expect_error(_foreign_group_save, str(tmp_path / f"s{w}"), timeout=_ERR_TIMEOUT)
        assert_all_raise(excs, w, *frags)
        assert not dc.check_is_distributed_checkpoint(tmp_path / f"s{w}")
        ckpt = str(tmp_path / f"l{w}")
        pool.run(_plain_save, ckpt)
        excs = pool.run_expect_error(_foreign_group_load, ckpt, timeout=_ERR_TIMEOUT)
        assert_all_raise(excs, w, *frags)


def _missing_key_rank(rank, world, ckpt, kind, only_last):
    group = _group(kind, 2)
    req, _, _ = _state(rank, world, 2, torch.float32, salt=0, fill=False)
    if not only_last or rank == world - 1:
        req["nope"] = ShardedTensor.from_rank_offsets("nope.weight", torch.zeros(4),
                                                      replica_id=0 if only_last else rank)
    dc.load(req, ckpt, sharded_strategy=_load_w(group))


def _missing_object_rank(rank, world, ckpt):
    req, _, _ = _state(rank, world, 2, torch.float32, salt=0, fill=False)
    req["objs"]["ghost"] = ShardedObject("ghost_obj", None, (1,), (0,), replica_id=rank)
    dc.load(req, ckpt, sharded_strategy=_load_w(None))


def _fp_save_state(rank, world, ckpt, tp, kind):
    dc.save(_state(rank, world, tp, torch.float32, salt=0)[0], ckpt, sharded_strategy=_save_w(_group(kind, tp)))


def _fp_load_state(rank, world, ckpt, tp, kind, algo):
    req, _, _ = _state(rank, world, tp, torch.float32, salt=0, fill=False)
    dc.load(req, ckpt, sharded_strategy=_load_w(_group(kind, tp), algo))


def test_unreadable_shards_raise_everywhere(pool4, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pool4.run(_fp_save_state, ckpt, 2, "dp")
    for kind in ("dp", "world"):
        for only_last in (False, True):
            excs = pool4.run_expect_error(_missing_key_rank, ckpt, kind, only_last, timeout=_ERR_TIMEOUT)
            assert_all_raise(excs, 4, "nope.weight")
    assert_all_raise(pool4.run_expect_error(_missing_object_rank, ckpt, timeout=_ERR_TIMEOUT), 4, "ghost_obj")
    # A data file lost after the save: whoever is to read from it fails, and so does everyone else.
    victim = sorted(f for f in os.listdir(ckpt) if f.startswith("__3_"))[0]
    os.remove(os.path.join(ckpt, victim))
    for kind in ("dp", "world"):
        for algo in ALGOS:
            excs = pool4.run_expect_error(_fp_load_state, ckpt, 2, kind, algo, timeout=_ERR_TIMEOUT)
            assert_all_raise(excs, 4, victim)


def _differing_rank(rank, world, ckpt, what, action, kind):
    """``t.differs`` (same key and offset) with another local shape or dtype on the last
    rank; only the wrapper's own plan can notice (validate_access_integrity=False)."""
    group = _group(kind, 2) if kind != "world" else None
    odd = rank == world - 1
    n = 6 if (what == "shape" and odd) else 4
    dtype = torch.float64 if (what == "dtype" and odd) else torch.float32
    sd = {"t": ShardedTensor.from_rank_offsets("t.differs", torch.ones(n, dtype=dtype), replica_id=rank),
          "ok": ShardedTensor.from_rank_offsets("ok", torch.ones(3), replica_id=rank)}
    if action == "save":
        dc.save(sd, ckpt, sharded_strategy=_save_w(group), validate_access_integrity=False)
    else:
        dc.load(sd, ckpt, sharded_strategy=_load_w(group), validate_access_integrity=False)


def _save_differs_good(rank, world, ckpt):
    dc.save({"t": ShardedTensor.from_rank_offsets("t.differs", torch.ones(4), replica_id=rank),
             "ok": ShardedTensor.from_rank_offsets("ok", torch.ones(3), replica_id=rank)}, ckpt)


def test_structure_differing_between_group_ranks(pool2, pool4, tmp_path):
    for pool, kinds in ((pool2, ("world",)), (pool4, ("world", "dp"))):
        w = pool.world_size
        good = str(tmp_path / f"good{w}")
        pool.run(_save_differs_good, good)
        for kind in kinds:
            for what in ("shape", "dtype"):
                bad = str(tmp_path / f"bad_{w}_{kind}_{what}")
                excs = pool.run_expect_error(_differing_rank, bad, what, "save", kind, timeout=_ERR_TIMEOUT)
                assert_all_raise(excs, w, "t.differs")
                assert not dc.check_is_distributed_checkpoint(bad)
                excs = pool.run_expect_error(_differing_rank, good, what, "load", kind, timeout=_ERR_TIMEOUT)
                assert_all_raise(excs, w, "t.differs")


class _SyncOnlySave(SaveShardedStrategy):
    """A sharded save strategy that cannot save asynchronously."""

    def __init__(self):
        super().__init__("torch_dist", 1)
        self._inner = TorchDistSaveShardedStrategy()

    def save(self, sharded_state_dict, checkpoint_dir):
        self._inner.save(sharded_state_dict, checkpoint_dir)


def _async_rank(rank, world, ckpt):
    FullyParallelSaveStrategyWrapper(_SyncOnlySave()).async_save(_small_state(rank, world), ckpt)


def test_async_save_needs_an_async_base_strategy(pool2, tmp_path):
    excs = pool2.run_expect_error(_async_rank, str(tmp_path / "a"), timeout=_ERR_TIMEOUT)
    assert_all_raise(excs, 2, "asynchronously")


# ----------------------------------------------------------------------------- world 1 and the assignment


def test_world1_wrappers_are_transparent(tmp_path):
    # without any process group, in this process
    n = _roundtrip_rank(0, 1, str(tmp_path / "nopg"), 1, "world", _ALL)
    assert n == len(_ALL) * _N_CHECKED
    # a gloo world of one rank, over the world and over a one-rank sub-group
    pool = get_pool(1)
    for kind in ("world", "dp"):
        assert pool.run(_roundtrip_rank, str(tmp_path / kind), 1, kind, _DIAGONAL) == [len(_DIAGONAL) * _N_CHECKED]


def test_distribute_shards_to_ranks_greedy_order():
    # fewest holders first, then largest first, each to its least-loaded holder (lowest rank on ties)
    holders = {"a": [0, 1], "b": [0, 1], "c": [1], "d": [0, 1]}
    sizes = {"a": 10, "b": 5, "c": 3, "d": 5}
    assert distribute_shards_to_ranks(holders, sizes, 2) == {"c": 1, "a": 0, "b": 1, "d": 1}
    # cross-group shards come last
    assert distribute_shards_to_ranks(holders, sizes, 2, cross_parallelization_group_loads=["c"]) == \
        {"a": 0, "b": 1, "d": 1, "c": 1}
    with pytest.raises(CheckpointingException):
        distribute_shards_to_ranks({"a": [2]}, {"a": 1}, 2)


# ----------------------------------------------------------------------------- groups disagreeing between ranks
# (last in the file: while the library hangs here, the 4-rank pool is restarted afterwards)


def _mixed_group_rank(rank, world, ckpt):
    """Ranks 0, 1 pass their group {0, 1}; ranks 2, 3 pass None (the whole world, which
    contains 0 and 1, who passed another group)."""
    halves = _new_groups(("halves", world), [[0, 1], [2, 3]])
    group = halves[0][1] if rank < 2 else None
    dc.save(_small_state(rank, world), ckpt, sharded_strategy=_save_w(group))


def test_groups_disagreeing_between_ranks_raise_everywhere(pool4, tmp_path):
    """Library bug: ``_check_group`` returns at once for ``None`` while the ranks that passed
    a group run a world-wide ``all_gather_object``; the collectives pair up wrongly, ranks
    0 and 1 raise a confused error and ranks 2 and 3 hang."""
    excs = pool4.run_expect_error(_mixed_group_rank, str(tmp_path / "mixed"), timeout=10)
    assert_all_raise(excs, 4, "parallelization group")
