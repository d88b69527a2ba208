"""The GPT job that ``benchmarks/_scale_sim.py`` simulates: its parallel layout, parameters,
and each rank's ShardedTensors / ShardedObjects, built with the library's own constructors
(see that module's docstring for the layout)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from dist_checkpointing.validation import _judge_of


@dataclass(frozen=True)
class GPTConfig:
    """A GPT job: parallelism, shapes, and how the optimizer state is sharded."""

    tp: int = 8
    pp: int = 16
    dp: int = 64
    layers: int = 96
    hidden: int = 12288
    vocab: int = 51200
    seq: int = 2048
    distributed_optimizer: bool = False
    dp_split: str = "buckets"  # "buckets" (Megatron-Core's grad buffer) or "even"
    stacked_layers: bool = False  # Megatron-Core's homogeneous layout: one key per layer parameter, layer axis prepended
    bucket_size: Optional[int] = None  # None: Megatron-Core's max(40M, 1M x dp) elements
    data: str = "meta"  # tensors: "meta" (no memory) or "zeros" (real, for small tests)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def coords(cfg: GPTConfig, rank: int) -> Tuple[int, int, int]:
    """``(tp, dp, pp)`` of a rank."""
    return rank % cfg.tp, rank // cfg.tp % cfg.dp, rank // (cfg.tp * cfg.dp)


def stage_ranks(cfg: GPTConfig, pp: int) -> range:
    """The ranks of one pipeline stage."""
    n = cfg.tp * cfg.dp
    return range(pp * n, (pp + 1) * n)


@dataclass(frozen=True)
class _Param:
    key: str
    shape: Tuple[int, ...]  # global shape (of one layer, for stacked layers)
    tp_axis: Optional[int]  # split across TP along this axis; None: replicated
    layer: Optional[int] = None  # the global layer of a stacked layer parameter


def _layer_params(h: int) -> List[Tuple[str, Tuple[int, ...], Optional[int]]]:
    f = 4 * h
    return [("self_attention.linear_qkv.layer_norm_weight", (h,), None),
            ("self_attention.linear_qkv.layer_norm_bias", (h,), None),
            ("self_attention.linear_qkv.weight", (3 * h, h), 0), ("self_attention.linear_qkv.bias", (3 * h,), 0),
            ("self_attention.linear_proj.weight", (h, h), 1), ("self_attention.linear_proj.bias", (h,), None),
            ("mlp.linear_fc1.layer_norm_weight", (h,), None), ("mlp.linear_fc1.layer_norm_bias", (h,), None),
            ("mlp.linear_fc1.weight", (f, h), 0), ("mlp.linear_fc1.bias", (f,), 0),
            ("mlp.linear_fc2.weight", (h, f), 1), ("mlp.linear_fc2.bias", (h,), None)]


@functools.lru_cache(maxsize=None)
def stage_params(cfg: GPTConfig, pp: int) -> Tuple[_Param, ...]:
    """The parameters of one pipeline stage, in model order."""
    h = cfg.hidden
    out = []
    if pp == 0:
        out += [_Param("embedding.word_embeddings.weight", (cfg.vocab, h), 0),
                _Param("embedding.position_embeddings.weight", (cfg.seq, h), None)]
    per_stage = cfg.layers // cfg.pp
    for layer in range(pp * per_stage, (pp + 1) * per_stage):
        if cfg.stacked_layers:
            out += [_Param(f"decoder.layers.{name}", shape, axis, layer) for name, shape, axis in _layer_params(h)]
        else:
            out += [_Param(f"decoder.layers.{layer}.{name}", shape, axis) for name, shape, axis in _layer_params(h)]
    if pp == cfg.pp - 1:
        out += [_Param("decoder.final_layernorm.weight", (h,), None), _Param("decoder.final_layernorm.bias", (h,), None),
                _Param("output_layer.weight", (cfg.vocab, h), 0)]
    return tuple(out)


def _local_shape(cfg: GPTConfig, p: _Param) -> Tuple[int, ...]:
    return tuple(s // cfg.tp if axis == p.tp_axis else s for axis, s in enumerate(p.shape))


def _optimizer_states(cfg: GPTConfig) -> Tuple[str, ...]:
    return ("param", "exp_avg", "exp_avg_sq") if cfg.distributed_optimizer else ("fp32_param", "exp_avg", "exp_avg_sq")


@functools.lru_cache(maxsize=None)
def dp_slices(cfg: GPTConfig, pp: int) -> Tuple[Tuple[Tuple[int, int, int], ...], ...]:
    """Per DP rank of stage ``pp``: the ``(param index, start, stop)`` slices of the flattened
    local TP chunks that its distributed optimizer holds, in model order."""
    numels = [math.prod(_local_shape(cfg, p)) for p in stage_params(cfg, pp)]
    out: List[List[Tuple[int, int, int]]] = [[] for _ in range(cfg.dp)]
    if cfg.dp_split == "even":
        ranges = [[(i, 0, n)] for i, n in enumerate(numels)]
    else:  # Megatron-Core's buffer: reverse order, buckets of whole params of >= bucket_size elements
        bucket_size = cfg.bucket_size or max(40_000_000, 1_000_000 * cfg.dp)
        ranges, current, size = [], [], 0
        for i in reversed(range(len(numels))):
            current.append((i, size, size + numels[i]))
            size += numels[i]
            if size >= bucket_size:
                ranges.append(current)
                current, size = [], 0
        if current:
            ranges.append(current)
    for bucket in ranges:
        per = -(-bucket[-1][2] // cfg.dp)  # each DP rank's share of the (padded) bucket
        for i, lo, hi in bucket:
            for r in range(lo // per, min(cfg.dp, -(-hi // per))):
                a, b = max(lo, r * per), min(hi, (r + 1) * per)
                if b > a:
                    out[r].append((i, a - lo, b - lo))
    return tuple(tuple(sorted(slices)) for slices in out)


def _data(cfg: GPTConfig, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype) if cfg.data == "zeros" else torch.empty(shape, dtype=dtype, device="meta")


def rank_items(cfg: GPTConfig, rank: int, only: Optional[Set[str]] = None, main_only: bool = False) -> List[Any]:
    """The ShardedTensors and ShardedObjects of ``rank``'s state, in state-dict order; with
    ``only``, just the keys named there (``"tensor:<key>"`` / ``"object:<key>"``, as
    :func:`~dist_checkpointing.validation._summaries` names them); with ``main_only``, just
    the main replicas (what the rank writes). Nothing else is built."""
    tp_r, dp_r, pp_r = coords(cfg, rank)
    params = stage_params(cfg, pp_r)

    def wanted(name: str, replica: Any) -> bool:
        return (only is None or name in only) and (not main_only or is_main_replica(replica))

    def tensor(p: _Param, key: str, dtype: torch.dtype, replica: Any, flat: Optional[Tuple[int, int]] = None):
        pre = int(p.layer is not None)  # the prepended layer axis of a stacked layer parameter
        offsets = [(0, p.layer, cfg.layers)] if pre else []
        offsets += [(p.tp_axis + pre, tp_r, cfg.tp)] if p.tp_axis is not None else []
        local = _local_shape(cfg, p)
        if flat is None:
            return ShardedTensor.from_rank_offsets(key, _data(cfg, local, dtype), *offsets, replica_id=replica,
                                                   prepend_axis_num=pre)
        return ShardedTensor.from_rank_offsets_flat(key, _data(cfg, (flat[1] - flat[0],), dtype), local, *offsets,
                                                    flattened_range=slice(*flat), replica_id=replica,
                                                    prepend_axis_num=pre)

    items: List[Any] = []
    for p in params:
        replica = (0, 0 if p.tp_axis is not None else tp_r, dp_r)
        if wanted(f"tensor:{p.key}", replica):
            items.append(tensor(p, p.key, torch.bfloat16, replica))
    for state in _optimizer_states(cfg):
        if cfg.distributed_optimizer:
            held = [(params[i], (0, 0 if params[i].tp_axis is not None else tp_r, 0), (a, b))
                    for i, a, b in dp_slices(cfg, pp_r)[dp_r]]
        else:
            held = [(p, (0, 0 if p.tp_axis is not None else tp_r, dp_r), None) for p in params]
        for p, replica, flat in held:
            key = f"optimizer.state.{state}.{p.key}"
            if wanted(f"tensor:{key}", replica):
                items.append(tensor(p, key, torch.float32, replica, flat))
    if wanted("object:rng_state", dp_r):
        items.append(ShardedObject("rng_state", {"rank": rank}, (cfg.pp, cfg.tp), (pp_r, tp_r), replica_id=dp_r))
    return items


@functools.lru_cache(maxsize=None)
def stage_names(cfg: GPTConfig, pp: int) -> Tuple[Tuple[str, int], ...]:
    """The summary names (``kind:key``) that the ranks of stage ``pp`` hold, each with the
    number of those ranks that hold it."""
    params = stage_params(cfg, pp)
    holders: Dict[str, int] = {f"tensor:{p.key}": cfg.tp * cfg.dp for p in params}
    for state in _optimizer_states(cfg):
        if cfg.distributed_optimizer:
            for slices in dp_slices(cfg, pp):
                for name in {f"tensor:optimizer.state.{state}.{params[i].key}" for i, _, _ in slices}:
                    holders[name] = holders.get(name, 0) + cfg.tp
        else:
            holders.update({f"tensor:optimizer.state.{state}.{p.key}": cfg.tp * cfg.dp for p in params})
    holders["object:rng_state"] = cfg.tp * cfg.dp
    return tuple(holders.items())


def judge_loads(cfg: GPTConfig) -> Dict[int, Tuple[int, int]]:
    """Per rank: ``(keys judged, estimated bytes received)`` in ``validate_sharding_integrity``:
    as an aggregator, the name and ~40 bytes per holder in each (key, block) it combines; as a
    judge, per block holding each key it judges, the name, ~60 bytes and ~4 bytes per holder
    in the block (the rank lists). Holders are taken as spread evenly over a stage's blocks."""
    block = math.isqrt(cfg.world - 1) + 1
    loads: Dict[int, Tuple[int, int]] = {}

    def add(rank: int, keys: int, nbytes: float) -> None:
        k, b = loads.get(rank, (0, 0))
        loads[rank] = (k + keys, b + int(nbytes))

    for pp in range(cfg.pp):
        ranks = stage_ranks(cfg, pp)
        blocks = sorted({r // block for r in ranks})
        for name, n in stage_names(cfg, pp):
            per_block = n / len(blocks)
            add(_judge_of(name, cfg.world), 1, len(blocks) * (len(name) + 60 + 4 * per_block))
            for b in blocks:
                add(_judge_of(f"{name}#{b}", cfg.world), 0, per_block * (len(name) + 40))
    return loads
