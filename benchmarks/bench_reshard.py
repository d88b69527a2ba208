"""Resharding loads of flattened (distributed-optimizer) state vs the same-layout load.

An Adam-like optimizer state (``exp_avg`` and ``exp_avg_sq``, fp32) of a GPT-like model
(~``--size-mib`` MiB in all: embedding, output layer and ``--layers`` transformer layers,
tensor-parallel (TP) split like Megatron-Core's, plus TP-replicated layernorms and biases) is
saved once at world size 4 as TP2 x DP2 *flat* state: every rank declares, for every
tensor, a contiguous slice of the flattened elements of its TP chunk
(``ShardedTensor.from_rank_offsets_flat``; the two DP ranks of a TP chunk split it in
halves). Then the state is loaded, by 4 ranks, in each of these layouts:

* ``a_same``: TP2 x DP2 flat with the saved slices (the reference);
* ``b_dp_bounds``: TP2 x DP2 flat, DP boundary at 30% of each chunk (+1 element) instead of 50%;
* ``c_tp4_flat``: TP4 x DP1 flat (each rank's slice is its whole TP4 chunk);
* ``d_dp4_flat``: TP1 x DP4 flat (each rank a quarter of every flattened global tensor);
* ``e_tp4``: TP4, not flat (each rank's TP4 chunk in its original shape).

Layouts run interleaved: every round loads each layout once, in rotating order, into
preallocated tensors, with the page cache warm (every checkpoint file is read once,
untimed, at the start of every round). Each load is timed between two barriers (max over
ranks); medians over rounds. The peak extra RSS of every rank is recorded during every
load. The first round checks every loaded value against the global tensors.

Run: ``python benchmarks/bench_reshard.py [--size-mib 384] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

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
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_reshard.json"
WORLD = 4
TARGET_RATIO = 1.5  # resharding load / same-layout load (medians)
MiB = 1 << 20


# ----------------------------------------------------------------------------- the state


@dataclass(frozen=True)
class Param:
    """One model parameter: global shape and TP split axis (``None``: replicated across TP)."""

    name: str
    shape: Tuple[int, ...]
    tp_axis: Optional[int]


@dataclass(frozen=True)
class Layout:
    """A parallel layout of 4 ranks: rank = dp * tp + tp_rank."""

    name: str
    tp: int
    dp: int
    flat: bool
    dp_boundary: float = 0.5  # for dp == 2: where the first DP rank's slice ends (fraction)
    boundary_shift: int = 0  # elements added to that boundary (off the row grid)

    def coords(self, rank: int) -> Tuple[int, int]:
        """(tp rank, dp rank) of ``rank``."""
        return rank % self.tp, rank // self.tp

    def slice_of(self, n: int, dp_rank: int) -> slice:
        """The DP rank's slice of a flattened chunk of ``n`` elements."""
        if self.dp == 2:
            cut = min(n, int(n * self.dp_boundary) + self.boundary_shift)
            return slice(0, cut) if dp_rank == 0 else slice(cut, n)
        return slice(dp_rank * n // self.dp, (dp_rank + 1) * n // self.dp)


SAVED = Layout("a_same", 2, 2, True)
LAYOUTS = (
    SAVED,
    Layout("b_dp_bounds", 2, 2, True, dp_boundary=0.3, boundary_shift=1),
    Layout("c_tp4_flat", 4, 1, True),
    Layout("d_dp4_flat", 1, 4, True),
    Layout("e_tp4", 4, 1, False),
)
NAMES = tuple(lay.name for lay in LAYOUTS)
DESCRIPTIONS = {
    "a_same": "TP2xDP2 flat, same slices",
    "b_dp_bounds": "TP2xDP2 flat, DP cut at 30%+1",
    "c_tp4_flat": "TP4xDP1 flat",
    "d_dp4_flat": "TP1xDP4 flat",
    "e_tp4": "TP4 non-flat",
}


def hidden_size_for(size_mib: float, layers: int) -> int:
    """Hidden size h (multiple of 64) so that the two fp32 states are about ``size_mib`` MiB.

    Parameters ~ 2 * vocab*h + layers * 12 h^2 with vocab = 16 h; 8 bytes per parameter.
    """
    h = math.sqrt(size_mib * MiB / (8 * (32 + 12 * layers)))
    return max(64, int(round(h / 64)) * 64)


def build_params(h: int, layers: int) -> List[Param]:
    """The parameters of a GPT-like model (Megatron-Core names and TP split axes)."""
    vocab, ffn = 16 * h, 4 * h

    def norm(name: str) -> List[Param]:
        return [Param(f"{name}.{w}", (h,), None) for w in ("weight", "bias")]

    params = [Param("embedding.word_embeddings.weight", (vocab, h), 0)]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        params += [
            *norm(p + "input_layernorm"),
            Param(p + "self_attention.linear_qkv.weight", (3 * h, h), 0),
            Param(p + "self_attention.linear_qkv.bias", (3 * h,), 0),
            Param(p + "self_attention.linear_proj.weight", (h, h), 1),
            Param(p + "self_attention.linear_proj.bias", (h,), None),
            *norm(p + "pre_mlp_layernorm"),
            Param(p + "mlp.linear_fc1.weight", (ffn, h), 0),
            Param(p + "mlp.linear_fc1.bias", (ffn,), 0),
            Param(p + "mlp.linear_fc2.weight", (h, ffn), 1),
            Param(p + "mlp.linear_fc2.bias", (h,), None),
        ]
    params += [*norm("decoder.final_layernorm"), Param("output_layer.weight", (vocab, h), 0)]
    return params


STATES = ("exp_avg", "exp_avg_sq")


def state_keys(params: List[Param]) -> List[Tuple[str, Param, int]]:
    """(checkpoint key, param, seed) of every optimizer-state tensor."""
    out = []
    for s, state in enumerate(STATES):
        for i, p in enumerate(params):
            out.append((f"optimizer.state.{state}.{p.name}", p, 1000 * s + i))
    return out


def global_value(param: Param, seed: int) -> torch.Tensor:
    """The (deterministic) global tensor of one state key."""
    t = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
    return t.square_() if seed >= 1000 else t  # exp_avg_sq is non-negative


def chunk_index(param: Param, layout: Layout, tp_rank: int) -> Tuple[slice, ...]:
    """Index of the rank's TP chunk in the global tensor."""
    idx = [slice(None)] * len(param.shape)
    if param.tp_axis is not None:
        size = param.shape[param.tp_axis] // layout.tp
        idx[param.tp_axis] = slice(tp_rank * size, (tp_rank + 1) * size)
    return tuple(idx)


def local_value(global_t: torch.Tensor, param: Param, layout: Layout, rank: int) -> torch.Tensor:
    """What ``rank`` holds of ``global_t`` in ``layout`` (a contiguous copy)."""
    tp_rank, dp_rank = layout.coords(rank)
    chunk = global_t[chunk_index(param, layout, tp_rank)]
    if not layout.flat:
        return chunk.contiguous()
    return chunk.reshape(-1)[layout.slice_of(chunk.numel(), dp_rank)].clone()


def sharded(key: str, data: torch.Tensor, param: Param, layout: Layout, rank: int) -> ShardedTensor:
    """The ShardedTensor of ``data`` (``rank``'s part of ``key`` in ``layout``)."""
    tp_rank, dp_rank = layout.coords(rank)
    offsets = [(param.tp_axis, tp_rank, layout.tp)] if param.tp_axis is not None and layout.tp > 1 else []
    replica = tp_rank if param.tp_axis is None else 0  # TP-replicated: one TP rank writes
    if not layout.flat:
        return ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=replica)
    chunk_shape = list(param.shape)
    if param.tp_axis is not None:
        chunk_shape[param.tp_axis] //= layout.tp
    n = math.prod(chunk_shape)
    return ShardedTensor.from_rank_offsets_flat(key, data, tuple(chunk_shape), *offsets,
                                                flattened_range=layout.slice_of(n, dp_rank), replica_id=replica)


# ----------------------------------------------------------------------------- worker


class RankState:
    """One rank's saved tensors and its preallocated destination tensors for every layout."""

    def __init__(self, h: int, layers: int, rank: int):
        self.rank = rank
        self.keys = state_keys(build_params(h, layers))
        self.saved: Dict[str, torch.Tensor] = {}
        self.dest: Dict[str, Dict[str, torch.Tensor]] = {lay.name: {} for lay in LAYOUTS}
        for key, param, seed in self.keys:
            g = global_value(param, seed)
            self.saved[key] = local_value(g, param, SAVED, rank)
            for lay in LAYOUTS:  # zeros: pages touched before any timing
                self.dest[lay.name][key] = torch.zeros_like(local_value(g, param, lay, rank))
            del g

    def save_request(self) -> Dict[str, ShardedTensor]:
        return {key: sharded(key, self.saved[key], param, SAVED, self.rank) for key, param, _ in self.keys}

    def load_request(self, layout: Layout) -> Dict[str, ShardedTensor]:
        dest = self.dest[layout.name]
        return {key: sharded(key, dest[key], param, layout, self.rank) for key, param, _ in self.keys}

    def verify(self, layout: Layout, loaded: Dict[str, torch.Tensor]) -> bool:
        """Every loaded tensor equals the expected part of the global tensor (this rank)."""
        ok = True
        for key, param, seed in self.keys:
            expected = local_value(global_value(param, seed), param, layout, self.rank)
            ok &= loaded[key] is self.dest[layout.name][key] and torch.equal(loaded[key], expected)
        return ok

    def local_bytes(self, layout: Layout) -> int:
        return sum(t.numel() * t.element_size() for t in self.dest[layout.name].values())


def all_true(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    """One rank: save once, then run every round of loads; rank 0 writes the raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 4 ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        h = hidden_size_for(args.size_mib, args.layers)
        state = RankState(h, args.layers, rank)
        strategy = None if args.verify_checksums else TorchDistLoadShardedStrategy(verify_checksums=False)
        ckpt = Path(args.dir) / "ckpt"
        clean_dir(Path(args.dir), rank)
        save_s, save_mem = timed_collective(lambda: dist_checkpointing.save(state.save_request(), ckpt))
        files = sorted(p for p in ckpt.iterdir() if p.is_file())
        ckpt_bytes = sum(p.stat().st_size for p in files)
        warm_buf = bytearray(64 * MiB)
        rounds: List[Dict[str, object]] = []
        for rnd in range(args.rounds):
            order = NAMES[rnd % len(NAMES):] + NAMES[:rnd % len(NAMES)]
            if rank == 0:
                read_all_files(ckpt, warm_buf)  # warm page cache
            results: Dict[str, Dict[str, object]] = {}
            for name in order:
                layout = next(lay for lay in LAYOUTS if lay.name == name)
                check = rnd == 0
                if check:
                    for t in state.dest[name].values():
                        t.zero_()
                request = state.load_request(layout)
                box: Dict[str, object] = {}

                def load() -> None:
                    box["loaded"] = dist_checkpointing.load(request, ckpt, sharded_strategy=strategy)

                load_s, load_mem = timed_collective(load)
                ok = all_true(state.verify(layout, box["loaded"])) if check else None
                results[name] = {"load_s": load_s, "load_extra_mib": gather_floats(load_mem), "verified": ok}
            rounds.append({"order": list(order), "loadavg_1min_after": os.getloadavg()[0], **results})
            if rank == 0:
                line = "  ".join(f"{n} {results[n]['load_s']:.3f}" for n in NAMES)
                print(f"round {rnd + 1}/{args.rounds} load s: {line}  (load average {os.getloadavg()[0]:.1f})",
                      flush=True)
        local = {lay.name: gather_floats(float(state.local_bytes(lay))) for lay in LAYOUTS}
        save_mem_all = gather_floats(save_mem)
        if rank == 0:
            params = build_params(h, args.layers)
            largest = max(math.prod(p.shape) for p in params) * 4
            with open(out_path, "w") as f:
                json.dump({"world_size": world, "hidden_size": h, "layers": args.layers,
                           "num_keys": len(state.keys), "largest_global_tensor_bytes": largest,
                           "checkpoint_bytes": ckpt_bytes, "checkpoint_files": len(files),
                           "save_s": save_s, "save_extra_mib": save_mem_all,
                           "local_bytes_per_rank": local, "rounds": rounds}, f)
        clean_dir(Path(args.dir), rank)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> Dict[str, object]:
    """Spawn the 4 ranks and return their raw results."""
    return spawn_ranks(worker, WORLD, args)


# ----------------------------------------------------------------------------- reporting


def summarize(raw: Dict[str, object]) -> Dict[str, object]:
    """Medians, throughputs, ratios to the same-layout load and memory peaks."""
    rounds = raw["rounds"]
    total = sum(raw["local_bytes_per_rank"][SAVED.name])
    ref = statistics.median(r[SAVED.name]["load_s"] for r in rounds)
    per_layout = {}
    for name in NAMES:
        times = [r[name]["load_s"] for r in rounds]
        med = statistics.median(times)
        per_layout[name] = {
            "description": DESCRIPTIONS[name], "load_s": times, "load_median_s": med,
            "load_GBps": total / 1e9 / med, "ratio_to_same": med / ref,
            "ratio_to_same_paired_median": statistics.median(r[name]["load_s"] / r[SAVED.name]["load_s"]
                                                             for r in rounds),
            "load_peak_extra_mib_per_rank": [max(r[name]["load_extra_mib"][k] for r in rounds)
                                             for k in range(raw["world_size"])],
            "local_mib_per_rank": [b / MiB for b in raw["local_bytes_per_rank"][name]],
            "verified": rounds[0][name]["verified"],
        }
    targets = {f"{n} / a_same <= {TARGET_RATIO}": per_layout[n]["ratio_to_same"] <= TARGET_RATIO
               for n in NAMES if n != SAVED.name}
    return {**{k: v for k, v in raw.items() if k != "rounds"}, "state_bytes_total": total, "rounds": rounds,
            "layouts": per_layout, "targets_met": targets}


def format_table(s: Dict[str, object]) -> str:
    """A plain-text table of the summary."""
    lines = [
        f"world size {s['world_size']}: saved as TP2xDP2 flat; {s['num_keys']} keys (exp_avg + exp_avg_sq, fp32, "
        f"h={s['hidden_size']}, {s['layers']} layers), state {s['state_bytes_total'] / MiB:.0f} MiB "
        f"(largest global tensor {s['largest_global_tensor_bytes'] / MiB:.1f} MiB), checkpoint "
        f"{s['checkpoint_bytes'] / MiB:.0f} MiB in {s['checkpoint_files']} files; save {s['save_s']:.2f} s",
        f"{len(s['rounds'])} rounds, warm page cache, barrier-timed (max over ranks), medians; GB = 1e9 bytes; "
        "+MiB = peak extra RSS per rank during the load (max over rounds)",
        f"{'layout':<14}{'description':<31}{'load s':>8}{'GB/s':>7}{'x a':>6}{'x a/rnd':>8}"
        f"{'local MiB':>11}{'+MiB per rank':>18}  verified",
    ]
    for name in NAMES:
        r = s["layouts"][name]
        mem = "/".join(f"{x:.0f}" for x in r["load_peak_extra_mib_per_rank"])
        local = f"{max(r['local_mib_per_rank']):.0f}"
        lines.append(f"{name:<14}{r['description']:<31}{r['load_median_s']:>8.3f}{r['load_GBps']:>7.2f}"
                     f"{r['ratio_to_same']:>6.2f}{r['ratio_to_same_paired_median']:>8.2f}{local:>11}{mem:>18}"
                     f"  {r['verified']}")
    lines.append("x a = ratio of medians to a_same; x a/rnd = median of the per-round ratios; "
                 "local MiB = requested bytes per rank (max)")
    lines.extend(closing_lines(s))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=float, default=384.0, help="total optimizer state (both moments), MiB")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    ap.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                    help="load with TorchDistLoadShardedStrategy(verify_checksums=False)")
    add_scratch_and_output_flags(ap, REPO_ROOT.parent / "bench_tmp", RESULTS_PATH)
    return ap.parse_args()


def main() -> None:
    """Run, print the table and write the JSON."""
    args = parse_args()
    scratch = Path(args.dir) / f"bench_reshard_{os.getpid()}"
    args.dir = str(scratch)
    started = datetime.datetime.now().astimezone()
    print(f"== world size {WORLD}: {args.rounds} rounds, scratch {scratch}", flush=True)
    load_before = os.getloadavg()
    try:
        summary = summarize(run(args))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary["loadavg_before_after"] = [load_before, os.getloadavg()]
    run_args = {
        "size_mib": args.size_mib,
        "layers": args.layers,
        "rounds": args.rounds,
        "verify_checksums": args.verify_checksums,
        "dir": str(scratch),
    }
    out = write_report(args.output, started, run_args, "result", summary)
    print(format_table(summary))
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
