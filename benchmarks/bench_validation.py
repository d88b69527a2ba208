"""Cost of the save-time sharding validation at world size 4 with ~1,000 keys per rank.

Four real processes (``torch.multiprocessing`` spawn, gloo on ``127.0.0.1``) each hold a
state dict of ``--keys`` keys: small tensors TP-split across the 4 ranks (so every global
tensor has 4 chunks, alternately split along axis 0 and axis 1), plus ``--replicated``
replicated keys (``replica_id = rank``). Measured, each between two barriers and as the
max over ranks, medians over ``--runs`` runs (after one untimed warm-up):

* ``validate_sharding_integrity(nested_values(sd))`` alone;
* a full ``dist_checkpointing.save`` of the state with validation on (the default) and off
  (``validate_access_integrity=False``), interleaved (the order alternates every run),
  each into a fresh directory that is deleted (and ``sync``-ed) afterwards.

Run: ``python benchmarks/bench_validation.py [--keys 1000] [--replicated 8] [--runs 10]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from _common import (
    add_scratch_and_output_flags,
    clean_dir,
    closing_lines,
    spawn_ranks,
    write_report,
)

import dist_checkpointing
from dist_checkpointing import ShardedTensor
from dist_checkpointing.dict_utils import nested_values
from dist_checkpointing.validation import validate_sharding_integrity

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_validation.json"
WORLD = 4
TARGET_S = 1.0  # validation alone, median, max over ranks


def build_state(keys: int, replicated: int, rank: int, world: int) -> Dict[str, Dict[str, ShardedTensor]]:
    """``keys`` ShardedTensors per rank: ``keys - replicated`` TP-split, ``replicated`` replicated."""
    gen = torch.Generator().manual_seed(rank)
    split: Dict[str, ShardedTensor] = {}
    for i in range(keys - replicated):
        axis = i % 2
        local = (16, 8) if axis == 0 else (8, 16)  # global (64, 8) or (8, 64) at world 4
        split[f"layers.{i // 10}.w{i % 10}"] = ShardedTensor.from_rank_offsets(
            f"layers.{i // 10}.w{i % 10}", torch.randn(local, generator=gen), (axis, rank, world))
    same = torch.Generator().manual_seed(12345)  # replicas hold equal values
    norms = {
        f"norm{i}": ShardedTensor.from_rank_offsets(f"norm{i}", torch.randn((64,), generator=same),
                                                    replica_id=rank)
        for i in range(replicated)
    }
    return {"model": {"split": split, "replicated": norms}}


def timed(fn: Callable[[], None]) -> float:
    """Seconds of ``fn`` between barriers, max over ranks."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    out = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out.item())



def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    """One rank: build the state, time validation and saves; rank 0 writes the raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 4 processes on a small machine
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sd = build_state(args.keys, args.replicated, rank, world)
        n_items = len(list(nested_values(sd)))
        base = Path(args.dir)

        validate = lambda: validate_sharding_integrity(nested_values(sd))  # noqa: E731
        warmup_s = timed(validate)
        validation = [timed(validate) for _ in range(args.runs)]

        def save(tag: str, validate_on: bool, n: int) -> float:
            d = base / f"{tag}_{n}"
            clean_dir(d, rank)
            seconds = timed(lambda: dist_checkpointing.save(sd, d, validate_access_integrity=validate_on))
            clean_dir(d, rank)
            return seconds

        save("warmup", True, 0)  # first save allocates the writer's write buffers
        saves: Dict[str, List[float]] = {"on": [], "off": []}
        for n in range(args.runs):
            order = ("on", "off") if n % 2 == 0 else ("off", "on")
            for tag in order:
                saves[tag].append(save(tag, tag == "on", n))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"items_per_rank": n_items, "validation_warmup_s": warmup_s,
                           "validation_s": validation, "save_validation_on_s": saves["on"],
                           "save_validation_off_s": saves["off"]}, f)
    finally:
        dist.destroy_process_group()



def summarize(raw: Dict[str, object], args: argparse.Namespace) -> Dict[str, object]:
    """Medians (and min/max) of every timing, the validation share of a save, the target."""
    def stats(xs: List[float]) -> Dict[str, object]:
        return {"runs_s": xs, "median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}

    timings = {
        "validate_sharding_integrity": stats(raw["validation_s"]),
        "save, validation on": stats(raw["save_validation_on_s"]),
        "save, validation off": stats(raw["save_validation_off_s"]),
    }
    on, off = timings["save, validation on"]["median_s"], timings["save, validation off"]["median_s"]
    validation = timings["validate_sharding_integrity"]["median_s"]
    return {
        "world_size": WORLD, "keys_per_rank": args.keys, "replicated_keys": args.replicated,
        "chunks_per_split_key": WORLD, "items_per_rank": raw["items_per_rank"], "runs": args.runs,
        "validation_warmup_s": raw["validation_warmup_s"], "timings": timings,
        "save_on_minus_off_s": on - off, "save_on / save_off": on / off,
        "targets_met": {f"validate_sharding_integrity median < {TARGET_S:g} s": validation < TARGET_S},
    }


def format_table(s: Dict[str, object]) -> str:
    """A plain-text table of the summary."""
    lines = [
        f"world size {s['world_size']}: {s['keys_per_rank']} keys per rank ({s['keys_per_rank'] - s['replicated_keys']} "
        f"TP-split into {s['chunks_per_split_key']} chunks, {s['replicated_keys']} replicated), {s['runs']} runs, "
        "barrier-timed, max over ranks",
        f"{'what':<30}{'median s':>10}{'min s':>9}{'max s':>9}",
    ]
    for name, t in s["timings"].items():
        lines.append(f"{name:<30}{t['median_s']:>10.4f}{t['min_s']:>9.4f}{t['max_s']:>9.4f}")
    lines.append(f"first (warm-up) validation: {s['validation_warmup_s']:.4f} s; save on - off (medians): "
                 f"{s['save_on_minus_off_s']:+.4f} s, on / off = {s['save_on / save_off']:.3f}")
    lines.extend(closing_lines(s))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1000, help="keys per rank (split + replicated)")
    ap.add_argument("--replicated", type=int, default=8, help="of which replicated (replica_id = rank)")
    ap.add_argument("--runs", type=int, default=10, help="timed runs (medians over them)")
    add_scratch_and_output_flags(ap, REPO_ROOT.parent / "bench_tmp", RESULTS_PATH)
    args = ap.parse_args()
    if not 0 <= args.replicated < args.keys:
        ap.error("--replicated must be in [0, --keys)")
    return args


def main() -> None:
    """Spawn the 4 ranks, print the table and write the JSON."""
    args = parse_args()
    scratch = Path(args.dir) / f"bench_validation_{os.getpid()}"
    args.dir = str(scratch)
    started = datetime.datetime.now().astimezone()
    try:
        load_before = os.getloadavg()
        raw = spawn_ranks(worker, WORLD, args)
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(raw, args)
    summary["loadavg_before_after"] = [load_before, load_after]
    run_args = {
        "keys": args.keys,
        "replicated": args.replicated,
        "runs": args.runs,
        "dir": str(scratch),
    }
    out = write_report(args.output, started, run_args, "result", summary)
    print(format_table(summary))
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
