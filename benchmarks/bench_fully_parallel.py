"""Fully parallel save/load (``FullyParallelSave/LoadStrategyWrapper``) vs plain save/load and torch DCP.

World size 4, real processes (``torch.multiprocessing`` spawn, gloo on ``127.0.0.1``, one
torch thread each). Two GPT-like states of ~``--size-mib`` MiB in all (52 tensors: bf16
weights, fp32 biases and layernorms):

* ``a_dp4``: DP=4, every rank holds the whole state (``replica_id = rank``); the fully
  parallel group is the world;
* ``b_tp2dp2``: TP2 x DP2 (rank = dp * 2 + tp): weights split over the 2 TP ranks,
  ``replica_id = dp``; TP-replicated tensors ``replica_id = rank``; the fully parallel
  group is the rank's DP group ({0, 2} or {1, 3}).

For each state, interleaved rounds (rotating order, medians over rounds):

* saves: ``plain`` (``TorchDistSaveShardedStrategy()``), ``fully_parallel``
  (``FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), group)``) and ``dcp``
  (``torch.distributed.checkpoint.save`` of the local tensors; DCP dedups replicated
  tensors), each into a fresh directory: wall time (barrier-timed, max over ranks) and the
  bytes of every rank's ``__{rank}_*.distcp`` files (writer balance max/mean);
* loads (warm page cache) of the ``fully_parallel`` round's checkpoint: ``plain``
  (``TorchDistLoadShardedStrategy()``) and ``FullyParallelLoadStrategyWrapper`` with each
  exchange algorithm; ``dcp`` loads the DCP checkpoint: wall time, and the bytes every rank
  reads (``/proc/self/io`` ``rchar`` delta around the load; gloo's socket traffic is not
  counted there) as reads per stored byte.

Then plan caching, with many small tensors (``--small-tensors`` x ``--small-kib`` KiB fp32,
DP=4 replicated): repeated saves with ``FullyParallelSaveStrategyWrapper(
TorchDistSaveShardedStrategy(), do_cache_distribution=False)`` vs
``FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(cached_metadata=True),
do_cache_distribution=True)`` (and DCP with and without ``enable_plan_caching``), then the
same for loads with the load wrapper's ``do_cache_distribution`` (and a plain load).

Run: ``python benchmarks/bench_fully_parallel.py [--size-mib 256] [--rounds 5] [--parts large,caching]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from _common import (
    add_scratch_and_output_flags,
    clean_dir,
    closing_lines,
    gather_floats,
    read_all_files,
    spawn_ranks,
    timed_collective,
    write_report,
)

import dist_checkpointing
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_fully_parallel.json"
WORLD = 4
NUM_LAYERS = 4
SAVE_METHODS = ("plain", "fully_parallel", "dcp")
LOAD_METHODS = ("plain", "fp_broadcast", "fp_gather_rounds", "fp_gather_object", "dcp")
EXCHANGE_ALGO = {"fp_broadcast": "broadcast", "fp_gather_rounds": "gather_rounds",
                 "fp_gather_object": "gather_object"}
CACHE_SAVE_METHODS = ("fp_nocache", "fp_cached", "dcp", "dcp_plan_cached")
CACHE_LOAD_METHODS = ("fp_nocache", "fp_cached", "plain")  # DCP load: see the large states
WRITER_BALANCE_TARGET = 1.05  # writer bytes max / mean with the save wrapper
FP_SAVE_TARGET = 0.6  # fully parallel save / plain save, DP=4
READS_TARGET = 1.05  # bytes read per stored byte with the load wrapper ("~1.0")
DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")
MiB = 1 << 20


# ----------------------------------------------------------------------------- the states


@dataclass(frozen=True)
class Param:
    """One global tensor: shape, dtype and TP split axis (``None``: replicated across TP)."""

    key: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    tp_axis: Optional[int]


@dataclass(frozen=True)
class Layout:
    """A layout of the 4 ranks: rank = dp_rank * tp + tp_rank."""

    name: str
    tp: int
    dp: int

    def coords(self, rank: int) -> Tuple[int, int]:
        """(tp_rank, dp_rank)."""
        return rank % self.tp, rank // self.tp

    def dp_group_ranks(self, tp_rank: int) -> List[int]:
        return [d * self.tp + tp_rank for d in range(self.dp)]


LAYOUTS = (Layout("a_dp4", 1, 4), Layout("b_tp2dp2", 2, 2))
DESCRIPTIONS = {"a_dp4": "DP=4, fully replicated; fully parallel group = world",
                "b_tp2dp2": "TP2 x DP2; fully parallel group = DP group {0,2} / {1,3}"}


def hidden_size_for(size_mib: float) -> int:
    """Hidden size h (multiple of 64) so that the state is about ``size_mib`` MiB.

    Bytes ~ 2 (bf16) * (2 * vocab*h + layers * 12 h^2) with vocab = 16 h = 160 h^2 for 4 layers.
    """
    h = math.sqrt(size_mib * MiB / (2 * (32 + 12 * NUM_LAYERS)))
    return max(64, int(round(h / 64)) * 64)


def build_params(h: int) -> List[Param]:
    """A GPT-like model: embedding, 4 transformer layers, output layer (52 tensors)."""
    bf16, fp32 = torch.bfloat16, torch.float32

    def norm(name: str) -> List[Param]:
        return [Param(f"{name}.{w}", (h,), fp32, None) for w in ("weight", "bias")]

    params = [Param("embedding.word_embeddings.weight", (16 * h, h), bf16, 0)]
    for i in range(NUM_LAYERS):
        p = f"decoder.layers.{i}."
        params += [
            *norm(p + "input_layernorm"),
            Param(p + "self_attention.linear_qkv.weight", (3 * h, h), bf16, 0),
            Param(p + "self_attention.linear_qkv.bias", (3 * h,), fp32, 0),
            Param(p + "self_attention.linear_proj.weight", (h, h), bf16, 1),
            Param(p + "self_attention.linear_proj.bias", (h,), fp32, None),
            *norm(p + "pre_mlp_layernorm"),
            Param(p + "mlp.linear_fc1.weight", (4 * h, h), bf16, 0),
            Param(p + "mlp.linear_fc1.bias", (4 * h,), fp32, 0),
            Param(p + "mlp.linear_fc2.weight", (h, 4 * h), bf16, 1),
            Param(p + "mlp.linear_fc2.bias", (h,), fp32, None),
        ]
    return params + [*norm("decoder.final_layernorm"), Param("output_layer.weight", (16 * h, h), bf16, 0)]


def global_value(param: Param, seed: int) -> torch.Tensor:
    """The deterministic global tensor of a parameter (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(param.shape, dtype=param.dtype).uniform_(-1, 1, generator=gen)


class RankState:
    """One rank's local tensors (saved values and zeroed load destinations) for a layout."""

    def __init__(self, layout: Layout, h: int, rank: int):
        self.layout, self.rank = layout, rank
        self.tp_rank, self.dp_rank = layout.coords(rank)
        self.params = build_params(h)
        self.saved: Dict[str, torch.Tensor] = {}
        for seed, p in enumerate(self.params):
            g = global_value(p, seed)
            if p.tp_axis is not None and layout.tp > 1:
                g = g.chunk(layout.tp, p.tp_axis)[self.tp_rank].clone()  # contiguous, own storage
            self.saved[p.key] = g
        self.dest = {k: torch.zeros_like(t) for k, t in self.saved.items()}  # pages touched

    def sharded(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, ShardedTensor]:
        out = {}
        for p in self.params:
            if p.tp_axis is not None and self.layout.tp > 1:
                out[p.key] = ShardedTensor.from_rank_offsets(
                    p.key, tensors[p.key], (p.tp_axis, self.tp_rank, self.layout.tp), replica_id=self.dp_rank)
            else:  # replicated on every rank: rank 0 holds the main replica
                out[p.key] = ShardedTensor.from_rank_offsets(p.key, tensors[p.key], replica_id=self.rank)
        return out

    def dcp_key(self, p: Param) -> str:
        split = p.tp_axis is not None and self.layout.tp > 1
        return f"{p.key}.tp{self.tp_rank}" if split else p.key  # same key on replicas: DCP dedups

    def dcp_dict(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {self.dcp_key(p): tensors[p.key] for p in self.params}

    def local_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved.values())

    def verify(self) -> bool:
        return all(torch.equal(self.dest[k], t) for k, t in self.saved.items())


# ----------------------------------------------------------------------------- instrumented strategies


class TimedSave(TorchDistSaveShardedStrategy):
    """The torch_dist save strategy, recording the seconds of its last ``save`` on this rank."""

    last_s = 0.0

    def save(self, sharded_state_dict, checkpoint_dir):
        start = time.perf_counter()
        try:
            super().save(sharded_state_dict, checkpoint_dir)
        finally:
            self.last_s = time.perf_counter() - start


class TimedFPSave(FullyParallelSaveStrategyWrapper):
    last_s = 0.0

    def save(self, sharded_state_dict, checkpoint_dir):
        start = time.perf_counter()
        try:
            super().save(sharded_state_dict, checkpoint_dir)
        finally:
            self.last_s = time.perf_counter() - start


class TimedLoad(TorchDistLoadShardedStrategy):
    last_s = 0.0

    def load(self, sharded_state_dict, checkpoint_dir):
        start = time.perf_counter()
        try:
            return super().load(sharded_state_dict, checkpoint_dir)
        finally:
            self.last_s = time.perf_counter() - start


class TimedFPLoad(FullyParallelLoadStrategyWrapper):
    last_s = 0.0

    def load(self, sharded_state_dict, checkpoint_dir):
        start = time.perf_counter()
        try:
            return super().load(sharded_state_dict, checkpoint_dir)
        finally:
            self.last_s = time.perf_counter() - start


# ----------------------------------------------------------------------------- measuring


def rchar() -> int:
    """Bytes this process has read with read-like syscalls (``/proc/self/io``; all threads)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise KeyError("rchar")


def gather_ints(value: int) -> List[int]:
    """``value`` of every rank (int64)."""
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.int64))
    return [int(t.item()) for t in out]


def gather_max(value: float) -> float:
    return max(gather_floats(value))


def all_true(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def writer_bytes(d: Path) -> List[int]:
    """Bytes of every rank's ``__{rank}_*.distcp`` files in ``d``."""
    out = [0] * WORLD
    for p in d.iterdir():
        m = DISTCP.match(p.name)
        if m:
            out[int(m.group(1))] += p.stat().st_size
    return out


def new_dir(d: Path, rank: int) -> None:
    clean_dir(d, rank)
    if rank == 0:
        d.mkdir(parents=True)
    dist.barrier()


# ----------------------------------------------------------------------------- part 1: large states


class LargeMethods:
    """Every save/load method for one rank and layout (strategies created once, reused)."""

    def __init__(self, state: RankState, group: Any):
        self.state, self.group = state, group
        self.plain_save = TimedSave()
        self.fp_save = TimedFPSave(TimedSave(), group)
        self.plain_load = TimedLoad()
        self.fp_loads = {m: TimedFPLoad(TimedLoad(), group, exchange_algo=a) for m, a in EXCHANGE_ALGO.items()}

    def save(self, method: str, d: Path) -> Tuple[float, float]:
        """Run a save; (strategy seconds, base-strategy write seconds) on this rank."""
        s = self.state
        if method == "dcp":
            dcp.save(s.dcp_dict(s.saved), checkpoint_id=str(d))
            return float("nan"), float("nan")
        strategy = self.plain_save if method == "plain" else self.fp_save
        dist_checkpointing.save(s.sharded(s.saved), d, sharded_strategy=strategy)
        inner = self.plain_save if method == "plain" else self.fp_save.base_strategy
        return strategy.last_s, inner.last_s

    def load(self, method: str, d: Path) -> Tuple[float, float, bool]:
        """Run a load; (strategy seconds, base-strategy read seconds, filled the request's
        own tensors) on this rank."""
        s = self.state
        if method == "dcp":
            dcp.load(s.dcp_dict(s.dest), checkpoint_id=str(d))
            return float("nan"), float("nan"), True
        strategy = self.plain_load if method == "plain" else self.fp_loads[method]
        loaded = dist_checkpointing.load(s.sharded(s.dest), d, sharded_strategy=strategy)
        in_place = all(loaded[k] is s.dest[k] for k in s.dest)
        inner = self.plain_load if method == "plain" else strategy.base_strategy
        return strategy.last_s, inner.last_s, in_place


def run_large(layout: Layout, args: argparse.Namespace, rank: int, group: Any, warm_buf: bytearray) -> Dict:
    """Interleaved rounds of saves and loads for one layout; raw results (rank 0)."""
    h = hidden_size_for(args.size_mib)
    state = RankState(layout, h, rank)
    methods = LargeMethods(state, group)
    base = Path(args.dir) / layout.name
    rounds: List[Dict[str, object]] = []
    for rnd in range(args.rounds):
        check = rnd == 0
        saves: Dict[str, Dict[str, object]] = {}
        order_s = SAVE_METHODS[rnd % len(SAVE_METHODS):] + SAVE_METHODS[:rnd % len(SAVE_METHODS)]
        for m in order_s:
            d = base / f"save_{m}"
            new_dir(d, rank)
            box: Dict[str, Tuple[float, float]] = {}
            wall, mem = timed_collective(lambda: box.setdefault("t", methods.save(m, d)))
            strat_s, write_s = box["t"]
            saves[m] = {"save_s": wall, "strategy_s": gather_max(strat_s), "write_s": gather_max(write_s),
                        "plan_s": gather_max(strat_s - write_s), "save_extra_mib": gather_floats(mem),
                        "writer_bytes": writer_bytes(d) if rank == 0 else None}
            if m == "plain":
                clean_dir(d, rank)  # loads use the fully parallel save's checkpoint
        ours, theirs = base / "save_fully_parallel", base / "save_dcp"
        if rank == 0:
            for d in (ours, theirs):
                read_all_files(d, warm_buf)  # warm page cache (ours writes with O_DIRECT)
        stored = {"ours": sum(writer_bytes(ours)), "dcp": sum(writer_bytes(theirs))}
        loads: Dict[str, Dict[str, object]] = {}
        order_l = LOAD_METHODS[rnd % len(LOAD_METHODS):] + LOAD_METHODS[:rnd % len(LOAD_METHODS)]
        for m in order_l:
            d = theirs if m == "dcp" else ours
            if check:
                for t in state.dest.values():
                    t.zero_()
            box = {}

            def load() -> None:
                before = rchar()
                box["t"] = methods.load(m, d)
                box["read"] = rchar() - before

            wall, mem = timed_collective(load)
            strat_s, read_s, in_place = box["t"]
            reads = gather_ints(box["read"])
            loads[m] = {"load_s": wall, "strategy_s": gather_max(strat_s), "read_s": gather_max(read_s),
                        "exchange_s": gather_max(strat_s - read_s), "read_bytes": reads,
                        "stored_bytes": stored["dcp" if m == "dcp" else "ours"],
                        "load_extra_mib": gather_floats(mem),
                        "verified": all_true(in_place and state.verify()) if check else None}
        clean_dir(base, rank)
        rounds.append({"save_order": list(order_s), "load_order": list(order_l),
                       "loadavg_1min_after": os.getloadavg()[0], "saves": saves, "loads": loads})
        if rank == 0:
            s = "  ".join(f"{m} {saves[m]['save_s']:.2f}" for m in SAVE_METHODS)
            lo = "  ".join(f"{m} {loads[m]['load_s']:.2f}" for m in LOAD_METHODS)
            print(f"[{layout.name}] round {rnd + 1}/{args.rounds} save s: {s} | load s: {lo}  "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    return {"layout": layout.name, "description": DESCRIPTIONS[layout.name], "tp": layout.tp, "dp": layout.dp,
            "hidden_size": h, "num_tensors": len(state.params), "local_bytes_per_rank": gather_ints(state.local_bytes()),
            "rounds": rounds}


# ----------------------------------------------------------------------------- part 2: plan caching


class SmallState:
    """``n`` replicated fp32 tensors of ``kib`` KiB (equal on every rank, ``replica_id = rank``)."""

    def __init__(self, n: int, kib: int, rank: int):
        self.rank = rank
        gen = torch.Generator().manual_seed(7)
        numel = kib * 1024 // 4
        self.saved = {f"layers.{i // 20}.p{i % 20}": torch.randn(numel, generator=gen) for i in range(n)}
        self.dest = {k: torch.zeros_like(t) for k, t in self.saved.items()}

    def sharded(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, ShardedTensor]:
        return {k: ShardedTensor.from_rank_offsets(k, t, replica_id=self.rank) for k, t in tensors.items()}


def run_caching(args: argparse.Namespace, rank: int) -> Dict:
    """Repeated saves, then loads, of an unchanged small-tensor structure, interleaved."""
    state = SmallState(args.small_tensors, args.small_kib, rank)
    base = Path(args.dir) / "caching"
    save_strategies = {
        "fp_nocache": TimedFPSave(TimedSave(), do_cache_distribution=False),
        "fp_cached": TimedFPSave(TimedSave(cached_metadata=True), do_cache_distribution=True),
    }

    def save(m: str, d: Path) -> None:
        if m in save_strategies:
            dist_checkpointing.save(state.sharded(state.saved), d, sharded_strategy=save_strategies[m])
        else:
            dcp.save(dict(state.saved), checkpoint_id=str(d),
                     planner=DefaultSavePlanner(enable_plan_caching=m == "dcp_plan_cached"))

    save_times: Dict[str, List[float]] = {m: [] for m in CACHE_SAVE_METHODS}
    # per call, max over ranks: wrapper save - wrapped save (planning), and the wrapped save
    save_phases: Dict[str, Dict[str, List[float]]] = {m: {"plan_s": [], "inner_s": []} for m in save_strategies}
    for i in range(args.cache_calls + 1):  # call 0: the first call of every method (plans, allocates)
        order = CACHE_SAVE_METHODS[i % len(CACHE_SAVE_METHODS):] + CACHE_SAVE_METHODS[:i % len(CACHE_SAVE_METHODS)]
        for m in order:
            d = base / f"{m}_{i}"
            new_dir(d, rank)
            save_times[m].append(timed_collective(lambda: save(m, d))[0])
            if m in save_strategies:
                w = save_strategies[m]
                save_phases[m]["plan_s"].append(gather_max(w.last_s - w.base_strategy.last_s))
                save_phases[m]["inner_s"].append(gather_max(w.base_strategy.last_s))
            clean_dir(d, rank)

    ours = base / "ckpt_ours"
    new_dir(ours, rank)
    dist_checkpointing.save(state.sharded(state.saved), ours,
                            sharded_strategy=FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()))
    if rank == 0:
        read_all_files(ours, bytearray(16 * MiB))
    load_strategies = {
        "fp_nocache": TimedFPLoad(TimedLoad(), do_cache_distribution=False),
        "fp_cached": TimedFPLoad(TimedLoad(), do_cache_distribution=True),
        "plain": TimedLoad(),
    }

    def load(m: str) -> None:
        dist_checkpointing.load(state.sharded(state.dest), ours, sharded_strategy=load_strategies[m])

    load_times: Dict[str, List[float]] = {m: [] for m in CACHE_LOAD_METHODS}
    # per call, max over ranks: wrapper load - wrapped load (planning + exchange), and the wrapped load
    load_phases: Dict[str, Dict[str, List[float]]] = {m: {"plan_s": [], "inner_s": []} for m in CACHE_LOAD_METHODS}
    verified: Dict[str, bool] = {}
    for i in range(args.cache_calls + 1):
        order = CACHE_LOAD_METHODS[i % len(CACHE_LOAD_METHODS):] + CACHE_LOAD_METHODS[:i % len(CACHE_LOAD_METHODS)]
        for m in order:
            if i <= 1:  # the first (planning) and the second (cached plan) call are checked
                for t in state.dest.values():
                    t.zero_()
            load_times[m].append(timed_collective(lambda: load(m))[0])
            w = load_strategies[m]
            inner = w.base_strategy.last_s if m != "plain" else w.last_s
            load_phases[m]["plan_s"].append(gather_max(w.last_s - inner))
            load_phases[m]["inner_s"].append(gather_max(inner))
            if i <= 1:
                ok = all(torch.equal(state.dest[k], t) for k, t in state.saved.items())
                verified[m] = all_true(ok) and verified.get(m, True)
    clean_dir(base, rank)
    if rank == 0:
        print("[caching] saves median s: " + "  ".join(f"{m} {statistics.median(v[1:]):.3f}"
                                                         for m, v in save_times.items())
              + " | loads median s: " + "  ".join(f"{m} {statistics.median(v[1:]):.3f}"
                                                   for m, v in load_times.items()), flush=True)
    return {"tensors": args.small_tensors, "kib": args.small_kib, "calls": args.cache_calls,
            "save_s": save_times, "load_s": load_times, "save_phases": save_phases, "load_phases": load_phases,
            "load_verified": verified}


# ----------------------------------------------------------------------------- worker


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    """One rank: both large layouts, then the caching runs; rank 0 writes the raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 4 ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        warm_buf = bytearray(64 * MiB)
        large = []
        for layout in LAYOUTS if "large" in args.parts else ():
            if layout.tp == 1:
                group = None  # the world
            else:  # every rank creates every DP group, in the same order
                groups = [dist.new_group(layout.dp_group_ranks(t)) for t in range(layout.tp)]
                group = groups[layout.coords(rank)[0]]
            large.append(run_large(layout, args, rank, group, warm_buf))
        caching = run_caching(args, rank) if "caching" in args.parts else None
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"world_size": world, "large": large, "caching": caching}, f)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- reporting


def med(xs: List[float]) -> float:
    return statistics.median(xs)


def summarize_large(raw: Dict[str, object]) -> Dict[str, object]:
    """Medians, writer balance, reads per stored byte and the targets of one layout."""
    rounds = raw["rounds"]
    saves, loads = {}, {}
    for m in SAVE_METHODS:
        rs = [r["saves"][m] for r in rounds]
        wb = rs[0]["writer_bytes"]
        saves[m] = {
            "save_s": [r["save_s"] for r in rs], "save_median_s": med([r["save_s"] for r in rs]),
            "write_median_s": med([r["write_s"] for r in rs]), "plan_median_s": med([r["plan_s"] for r in rs]),
            "writer_bytes_per_rank": wb, "stored_bytes": sum(wb),
            "writer_max_over_mean": max(wb) / (sum(wb) / len(wb)),
            "save_peak_extra_mib_per_rank": [max(r["save_extra_mib"][k] for r in rs) for k in range(WORLD)],
        }
    for m in LOAD_METHODS:
        rs = [r["loads"][m] for r in rounds]
        per_round_ratio = [sum(r["read_bytes"]) / r["stored_bytes"] for r in rs]
        loads[m] = {
            "load_s": [r["load_s"] for r in rs], "load_median_s": med([r["load_s"] for r in rs]),
            "read_median_s": med([r["read_s"] for r in rs]), "exchange_median_s": med([r["exchange_s"] for r in rs]),
            "read_bytes_per_rank_round1": rs[0]["read_bytes"], "stored_bytes": rs[0]["stored_bytes"],
            "reads_per_stored_byte": med(per_round_ratio),
            "load_peak_extra_mib_per_rank": [max(r["load_extra_mib"][k] for r in rs) for k in range(WORLD)],
            "verified": rs[0]["verified"],
        }
    plain_save = saves["plain"]["save_median_s"]
    ratios = {"fully_parallel_save / plain_save": saves["fully_parallel"]["save_median_s"] / plain_save,
              "dcp_save / fully_parallel_save": saves["dcp"]["save_median_s"] / saves["fully_parallel"]["save_median_s"],
              "fully_parallel_save / plain_save, median of per-round ratios":
                  med([r["saves"]["fully_parallel"]["save_s"] / r["saves"]["plain"]["save_s"] for r in rounds])}
    for m in LOAD_METHODS[1:]:
        ratios[f"{m}_load / plain_load"] = loads[m]["load_median_s"] / loads["plain"]["load_median_s"]
    targets = {
        f"fully_parallel writer max/mean <= {WRITER_BALANCE_TARGET}":
            saves["fully_parallel"]["writer_max_over_mean"] <= WRITER_BALANCE_TARGET,
    }
    if raw["tp"] == 1:
        targets[f"fully_parallel_save / plain_save <= {FP_SAVE_TARGET}"] = \
            ratios["fully_parallel_save / plain_save"] <= FP_SAVE_TARGET
    for m in EXCHANGE_ALGO:
        targets[f"{m} reads per stored byte <= {READS_TARGET}"] = loads[m]["reads_per_stored_byte"] <= READS_TARGET
    return {**{k: v for k, v in raw.items() if k != "rounds"}, "rounds": rounds,
            "saves": saves, "loads": loads, "ratios": ratios, "targets_met": targets}


def summarize_caching(raw: Dict[str, object]) -> Dict[str, object]:
    """Median per-call time after the first call, and what caching saves."""
    def stats(xs: List[float]) -> Dict[str, object]:
        return {"calls_s": xs, "first_s": xs[0], "median_after_first_s": med(xs[1:]),
                "min_after_first_s": min(xs[1:]), "max_after_first_s": max(xs[1:])}

    saves = {m: stats(v) for m, v in raw["save_s"].items()}
    loads = {m: stats(v) for m, v in raw["load_s"].items()}
    for d, phases in ((saves, raw["save_phases"]), (loads, raw["load_phases"])):
        for m, ph in phases.items():
            d[m]["plan_first_s"], d[m]["inner_first_s"] = ph["plan_s"][0], ph["inner_s"][0]
            d[m]["plan_median_after_first_s"] = med(ph["plan_s"][1:])
            d[m]["inner_median_after_first_s"] = med(ph["inner_s"][1:])
            d[m]["phases"] = ph

    def saving(d: Dict[str, Dict[str, object]], a: str, b: str, xs: Dict[str, List[float]]) -> Dict[str, float]:
        ms = (d[a]["median_after_first_s"] - d[b]["median_after_first_s"]) * 1e3
        paired = med([(x - y) * 1e3 for x, y in zip(xs[a][1:], xs[b][1:])])
        return {"ms": ms, "pct": 100 * ms / 1e3 / d[a]["median_after_first_s"], "paired_median_ms": paired}

    return {"tensors": raw["tensors"], "kib": raw["kib"], "calls": raw["calls"], "saves": saves, "loads": loads,
            "save_saving": saving(saves, "fp_nocache", "fp_cached", raw["save_s"]),
            "dcp_save_saving": saving(saves, "dcp", "dcp_plan_cached", raw["save_s"]),
            "load_saving": saving(loads, "fp_nocache", "fp_cached", raw["load_s"]),
            "load_verified": raw["load_verified"]}


def fmt_ranks(xs: List[float]) -> str:
    return "/".join(f"{x:.0f}" for x in xs)


def format_large(s: Dict[str, object]) -> str:
    """A plain-text table of one layout's summary."""
    local = [b / MiB for b in s["local_bytes_per_rank"]]
    stored = s["saves"]["fully_parallel"]["stored_bytes"]
    lines = [
        f"{s['layout']}: {s['description']}; h={s['hidden_size']}, {s['num_tensors']} tensors, "
        f"{fmt_ranks(local)} MiB per rank, checkpoint {stored / MiB:.0f} MiB; {len(s['rounds'])} rounds, medians, "
        "barrier-timed (max over ranks)",
        f"{'save':<18}{'save s':>8}{'plan s':>8}{'write s':>9}{'writer MiB per rank':>22}{'max/mean':>10}"
        f"{'+MiB per rank':>16}",
    ]
    for m in SAVE_METHODS:
        r = s["saves"][m]
        plan = "-" if m != "fully_parallel" else f"{r['plan_median_s']:.3f}"
        write = "-" if m == "dcp" else f"{r['write_median_s']:.3f}"
        lines.append(f"{m:<18}{r['save_median_s']:>8.3f}{plan:>8}{write:>9}"
                     f"{fmt_ranks([b / MiB for b in r['writer_bytes_per_rank']]):>22}{r['writer_max_over_mean']:>10.2f}"
                     f"{fmt_ranks(r['save_peak_extra_mib_per_rank']):>16}")
    lines.append(f"{'load':<18}{'load s':>8}{'read s':>8}{'exch s':>9}{'read MiB per rank':>22}"
                 f"{'reads/B':>10}{'+MiB per rank':>16}  verified")
    for m in LOAD_METHODS:
        r = s["loads"][m]
        read = "-" if m == "dcp" else f"{r['read_median_s']:.3f}"
        exch = "-" if m in ("dcp", "plain") else f"{r['exchange_median_s']:.3f}"
        lines.append(f"{m:<18}{r['load_median_s']:>8.3f}{read:>8}{exch:>9}"
                     f"{fmt_ranks([b / MiB for b in r['read_bytes_per_rank_round1']]):>22}"
                     f"{r['reads_per_stored_byte']:>10.2f}{fmt_ranks(r['load_peak_extra_mib_per_rank']):>16}"
                     f"  {r['verified']}")
    lines.append("plan s = wrapper save - wrapped strategy save; write s / read s = wrapped (or plain) strategy "
                 "save / load; exch s = wrapper load - wrapped load (planning + exchange); per-phase figures max "
                 "over ranks. reads/B = sum over ranks of rchar during the load / stored .distcp bytes. "
                 "+MiB = peak extra RSS (max over rounds)")
    lines.append("ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in s["ratios"].items()))
    lines.extend(closing_lines(s))
    return "\n".join(lines)


def format_caching(s: Dict[str, object]) -> str:
    lines = [
        f"plan caching: {s['tensors']} replicated fp32 tensors x {s['kib']} KiB (DP=4, fully parallel group = world), "
        f"{s['calls']} calls after the first, interleaved; barrier-timed (max over ranks)",
        f"{'save':<18}{'first s':>9}{'median s':>10}{'min s':>8}{'max s':>8}{'plan s':>9}{'inner s':>9}",
    ]

    def phases(r: Dict[str, object], plain: bool = False) -> str:
        if "plan_median_after_first_s" not in r:
            return f"{'-':>9}{'-':>9}"
        plan = "-" if plain else f"{r['plan_median_after_first_s']:.3f}"
        return f"{plan:>9}{r['inner_median_after_first_s']:>9.3f}"

    for m in CACHE_SAVE_METHODS:
        r = s["saves"][m]
        lines.append(f"{m:<18}{r['first_s']:>9.3f}{r['median_after_first_s']:>10.3f}{r['min_after_first_s']:>8.3f}"
                     f"{r['max_after_first_s']:>8.3f}{phases(r)}")
    lines.append(f"{'load':<18}{'first s':>9}{'median s':>10}{'min s':>8}{'max s':>8}{'plan s':>9}{'inner s':>9}"
                 "  verified")
    for m in CACHE_LOAD_METHODS:
        r = s["loads"][m]
        lines.append(f"{m:<18}{r['first_s']:>9.3f}{r['median_after_first_s']:>10.3f}{r['min_after_first_s']:>8.3f}"
                     f"{r['max_after_first_s']:>8.3f}{phases(r, m == 'plain')}  {s['load_verified'][m]}")
    lines.append("medians over the calls after the first; plan s = wrapper call - wrapped strategy call (save: "
                 "planning; load: planning + exchange), inner s = wrapped strategy call (the plain load: its whole "
                 "call), max over ranks per call")
    for name, key in (("save (ours)", "save_saving"), ("save (DCP plan caching)", "dcp_save_saving"),
                      ("load (ours)", "load_saving")):
        v = s[key]
        lines.append(f"caching saves per {name}: {v['ms']:.1f} ms ({v['pct']:.1f}%) by medians; "
                     f"median of paired differences {v['paired_median_ms']:.1f} ms")
    if "loadavg_before_after" in s:
        before, after = s["loadavg_before_after"]
        lines.append(f"load average (1 min) before/after: {before[0]:.1f} / {after[0]:.1f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=float, default=256.0, help="state size (all shards of one copy), MiB")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    ap.add_argument("--small-tensors", type=int, default=2000, help="tensors in the plan-caching state")
    ap.add_argument("--small-kib", type=int, default=4, help="KiB per tensor in the plan-caching state")
    ap.add_argument("--cache-calls", type=int, default=10, help="timed calls after the first (plan caching)")
    ap.add_argument("--parts", default="large,caching", help="comma-separated parts to run: large, caching")
    add_scratch_and_output_flags(ap, REPO_ROOT.parent / "bench_tmp", RESULTS_PATH)
    return ap.parse_args()


def main() -> None:
    """Run, print the tables and write the JSON."""
    args = parse_args()
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not args.parts or set(args.parts) - {"large", "caching"}:
        raise SystemExit(f"--parts: choose from large, caching (got {args.parts})")
    scratch = Path(args.dir) / f"bench_fully_parallel_{os.getpid()}"
    args.dir = str(scratch)
    started = datetime.datetime.now().astimezone()
    print(f"== world size {WORLD}: {args.rounds} rounds, scratch {scratch}", flush=True)
    load_before = os.getloadavg()
    try:
        raw = spawn_ranks(worker, WORLD, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load_after = os.getloadavg()
    large = [summarize_large(r) for r in raw["large"]]
    for s in large:
        s["loadavg_before_after"] = [load_before, load_after]
    caching = summarize_caching(raw["caching"]) if raw["caching"] is not None else None
    if caching is not None:
        caching["loadavg_before_after"] = [load_before, load_after]
    run_args = {"size_mib": args.size_mib, "rounds": args.rounds, "small_tensors": args.small_tensors,
                "small_kib": args.small_kib, "cache_calls": args.cache_calls, "parts": args.parts,
                "dir": str(scratch)}
    out = write_report(args.output, started, run_args, "results", {"large": large, "caching": caching})
    tables = [format_large(s) for s in large] + ([format_caching(caching)] if caching is not None else [])
    print("\n\n".join(tables))
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
