"""Side-by-side save/load timings: dist_checkpointing vs torch DCP, torch.save and raw disk.

A GPT-like state (~``--size-gib`` GiB: embedding, output layer and 8 transformer layers
whose qkv/proj/fc1/fc2 weights are tensor-parallel (TP) split, plus replicated fp32
layernorms) is saved and loaded by each method, at each world size (real gloo processes;
at world size 2 every rank holds its TP half, so the total stays the same).

``ours`` runs with the defaults (item checksums at save, verification at load, sharding
validation); ``ours_nocheck`` is the same save/load with checksums and their verification
off, so ``ours / ours_nocheck`` is the cost of integrity checking.

Methods run interleaved: every round runs each method once, in rotating order. Every save
goes to a fresh directory, deleted (and ``sync``-ed) after the method's load. Loads are
timed with a warm page cache (the method's files are read once, untimed, before). Each
timing is taken between two barriers and is the max over ranks.

Run: ``python benchmarks/bench_save_load.py [--size-gib 1.0] [--rounds 5] [--world-sizes 1,2]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from _common import (
    NUM_LAYERS,
    Param,
    add_scratch_and_output_flags,
    build_params,
    clean_dir,
    closing_lines,
    gather_floats,
    hidden_size_for,
    nbytes,
    read_all_files,
    run_world_sizes,
    spawn_ranks,
    timed_collective,
)

import dist_checkpointing
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_save_load.json"
METHODS = ("ours", "ours_nocheck", "dcp", "torch_save", "raw")
INTEGRITY_TARGET = 1.05  # ours (checksums on) / ours_nocheck, save and load
MiB = 1 << 20

# ----------------------------------------------------------------------------- file helpers


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def readinto_exact(f, view: memoryview) -> None:
    """Fill ``view`` from ``f`` (raises on a short file)."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise EOFError("file shorter than expected")
        done += n


# ----------------------------------------------------------------------------- methods


class Methods:
    """Save/load implementations of every method for one rank."""

    def __init__(self, params: List[Param], dest: List[torch.Tensor], rank: int, world: int):
        self.params, self.dest, self.rank, self.world = params, dest, rank, world
        self.loaded_torch: Optional[Dict[str, torch.Tensor]] = None
        # Created once and reused, like the registered default strategies that ``ours`` gets.
        self.nocheck_save_strategy = TorchDistSaveShardedStrategy(checksums=False)
        self.nocheck_load_strategy = TorchDistLoadShardedStrategy(verify_checksums=False)

    def _local_dict(self, tensors: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {f"{p.key}.rank{self.rank}": t for p, t in zip(self.params, tensors)}

    def _sharded(self, tensors: List[torch.Tensor]) -> Dict[str, ShardedTensor]:
        return {p.key: p.sharded(t, self.rank, self.world) for p, t in zip(self.params, tensors)}

    # ours
    def ours_save(self, d: Path) -> None:
        dist_checkpointing.save(self._sharded([p.tensor for p in self.params]), d)

    def ours_load(self, d: Path) -> None:
        dist_checkpointing.load(self._sharded(self.dest), d)

    # ours without checksums (save) and without checksum verification (load)
    def ours_nocheck_save(self, d: Path) -> None:
        dist_checkpointing.save(self._sharded([p.tensor for p in self.params]), d,
                                sharded_strategy=self.nocheck_save_strategy)

    def ours_nocheck_load(self, d: Path) -> None:
        dist_checkpointing.load(self._sharded(self.dest), d, sharded_strategy=self.nocheck_load_strategy)

    # torch.distributed.checkpoint
    def dcp_save(self, d: Path) -> None:
        dcp.save(self._local_dict([p.tensor for p in self.params]), checkpoint_id=str(d))

    def dcp_load(self, d: Path) -> None:
        dcp.load(self._local_dict(self.dest), checkpoint_id=str(d))

    # torch.save / torch.load
    def torch_save_save(self, d: Path) -> None:
        path = d / f"rank{self.rank}.pt"
        with open(path, "wb") as f:
            torch.save(self._local_dict([p.tensor for p in self.params]), f)
            f.flush()
            os.fsync(f.fileno())

    def torch_save_load(self, d: Path) -> None:
        self.loaded_torch = torch.load(d / f"rank{self.rank}.pt", weights_only=True)

    # raw file I/O
    def raw_save(self, d: Path) -> None:
        with open(d / f"rank{self.rank}.bin", "wb", buffering=0) as f:
            for p in self.params:
                view = byte_view(p.tensor)
                done = 0
                while done < len(view):
                    done += f.write(view[done:])
            os.fsync(f.fileno())

    def raw_load(self, d: Path) -> None:
        with open(d / f"rank{self.rank}.bin", "rb", buffering=0) as f:
            for t in self.dest:
                readinto_exact(f, byte_view(t))

    def get(self, method: str, action: str) -> Callable[[Path], None]:
        """The bound ``{method}_{action}`` function."""
        return getattr(self, f"{method}_{action}")

    def loaded(self, method: str) -> List[torch.Tensor]:
        """The tensors the last load of ``method`` produced."""
        if method == "torch_save":
            assert self.loaded_torch is not None
            return list(self.loaded_torch.values())
        return self.dest


# ----------------------------------------------------------------------------- measuring


def verify(method: str, methods: Methods) -> bool:
    """True if the last load of ``method`` returned the saved values (all ranks)."""
    ok = all(torch.equal(p.tensor, t) for p, t in zip(methods.params, methods.loaded(method)))
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def run_method(method: str, methods: Methods, base: Path, rnd: int, warm_buf: bytearray,
               check: bool) -> Dict[str, object]:
    """One save + warm load of ``method`` in a fresh directory; the measurements."""
    rank = methods.rank
    d = base / f"{method}_round{rnd}"
    clean_dir(d, rank)
    if rank == 0:
        d.mkdir(parents=True)
    dist.barrier()
    save_s, save_mem = timed_collective(lambda: methods.get(method, "save")(d))
    files_bytes = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    if rank == 0:
        read_all_files(d, warm_buf)  # warm page cache for every rank's files
    if check:
        for t in methods.dest:
            t.zero_()
    load_s, load_mem = timed_collective(lambda: methods.get(method, "load")(d))
    ok = verify(method, methods) if check else None
    methods.loaded_torch = None
    clean_dir(d, rank)
    return {
        "save_s": save_s, "load_s": load_s, "checkpoint_bytes": files_bytes, "verified": ok,
        "save_extra_mib": gather_floats(save_mem), "load_extra_mib": gather_floats(load_mem),
    }


# ----------------------------------------------------------------------------- worker


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    """One rank: build the state, run every round, rank 0 writes the raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        params = build_params(args.size_gib, rank, world, layers=args.layers)
        dest = [torch.zeros_like(p.tensor) for p in params]  # preallocated, pages touched
        methods = Methods(params, dest, rank, world)
        base = Path(args.dir) / f"world{world}"
        warm_buf = bytearray(64 * MiB)
        local_bytes = nbytes([p.tensor for p in params])
        rounds: List[Dict[str, Dict[str, object]]] = []
        for rnd in range(args.rounds):
            order = METHODS[rnd % len(METHODS):] + METHODS[:rnd % len(METHODS)]
            results = {m: run_method(m, methods, base, rnd, warm_buf, check=rnd == 0) for m in order}
            rounds.append({"order": list(order), **results})
            if rank == 0:
                line = "  ".join(f"{m} {results[m]['save_s']:.2f}/{results[m]['load_s']:.2f}" for m in METHODS)
                print(f"[world {world}] round {rnd + 1}/{args.rounds} save/load s: {line}", flush=True)
        all_bytes = gather_floats(float(local_bytes))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"world_size": world, "hidden_size": hidden_size_for(args.size_gib, args.layers),
                           "num_tensors_per_rank": len(params), "local_bytes_per_rank": all_bytes,
                           "rounds": rounds}, f)
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    finally:
        dist.destroy_process_group()



def run_world(world: int, args: argparse.Namespace) -> Dict[str, object]:
    """Spawn ``world`` ranks and return their raw results."""
    return spawn_ranks(worker, world, args)


# ----------------------------------------------------------------------------- reporting


def summarize(raw: Dict[str, object]) -> Dict[str, object]:
    """Medians, throughputs, memory peaks and ratios from raw round results."""
    rounds = raw["rounds"]
    total = sum(raw["local_bytes_per_rank"])
    per_method = {}
    for m in METHODS:
        save = [r[m]["save_s"] for r in rounds]
        load = [r[m]["load_s"] for r in rounds]
        per_method[m] = {
            "save_s": save, "load_s": load,
            "save_median_s": statistics.median(save), "load_median_s": statistics.median(load),
            "save_GBps": total / 1e9 / statistics.median(save),
            "load_GBps": total / 1e9 / statistics.median(load),
            "checkpoint_bytes": rounds[0][m]["checkpoint_bytes"],
            "verified": rounds[0][m]["verified"],
            "save_peak_extra_mib_per_rank": [max(r[m]["save_extra_mib"][k] for r in rounds)
                                             for k in range(raw["world_size"])],
            "load_peak_extra_mib_per_rank": [max(r[m]["load_extra_mib"][k] for r in rounds)
                                             for k in range(raw["world_size"])],
        }
    med = {m: (per_method[m]["save_median_s"], per_method[m]["load_median_s"]) for m in METHODS}
    ratios = {
        "ours_save / raw_save": med["ours"][0] / med["raw"][0],
        "dcp_save / ours_save": med["dcp"][0] / med["ours"][0],
        "dcp_load / ours_load": med["dcp"][1] / med["ours"][1],
        "torch_save / ours_save": med["torch_save"][0] / med["ours"][0],
        "torch_load / ours_load": med["torch_save"][1] / med["ours"][1],
        "ours_load / raw_load": med["ours"][1] / med["raw"][1],
        "ours_save / ours_nocheck_save": med["ours"][0] / med["ours_nocheck"][0],
        "ours_load / ours_nocheck_load": med["ours"][1] / med["ours_nocheck"][1],
    }
    # Less noise-prone view of the integrity overhead: median over rounds of the per-round
    # ratio (both runs of a round are close in time, mostly back to back).
    paired = {
        f"ours_{a} / ours_nocheck_{a}": statistics.median(r["ours"][f"{a}_s"] / r["ours_nocheck"][f"{a}_s"]
                                                          for r in rounds)
        for a in ("save", "load")
    }
    targets = {
        "ours_save / raw_save <= 1.25": ratios["ours_save / raw_save"] <= 1.25,
        "dcp_save / ours_save >= 2": ratios["dcp_save / ours_save"] >= 2.0,
        "dcp_load / ours_load >= 3": ratios["dcp_load / ours_load"] >= 3.0,
        f"ours_save / ours_nocheck_save <= {INTEGRITY_TARGET}":
            ratios["ours_save / ours_nocheck_save"] <= INTEGRITY_TARGET,
        f"ours_load / ours_nocheck_load <= {INTEGRITY_TARGET}":
            ratios["ours_load / ours_nocheck_load"] <= INTEGRITY_TARGET,
    }
    small = total < MIN_JUDGED_BYTES
    return {**{k: v for k, v in raw.items() if k != "rounds"}, "state_bytes_total": total,
            "rounds": rounds, "methods": per_method, "ratios": ratios,
            "integrity_overhead_paired_median": paired, "targets_met": {} if small else targets,
            "targets_not_judged": f"a state of {total / (1 << 30):.2f} GiB is dominated by fixed costs; the targets "
                                  f"are judged from {MIN_JUDGED_BYTES / (1 << 30):.1f} GiB" if small else None}


MIN_JUDGED_BYTES = 1 << 29  # smaller states (smoke runs) time fixed costs, not throughput


def format_table(s: Dict[str, object]) -> str:
    """A plain-text table of one world size's summary."""
    per_rank_mib = [b / MiB for b in s["local_bytes_per_rank"]]
    lines = [
        f"world size {s['world_size']}: state {s['state_bytes_total'] / (1 << 30):.3f} GiB total "
        f"({', '.join(f'{m:.0f}' for m in per_rank_mib)} MiB per rank, {s['num_tensors_per_rank']} tensors "
        f"per rank), {len(s['rounds'])} rounds, medians; GB = 1e9 bytes",
        f"{'method':<13}{'save s':>8}{'save GB/s':>11}{'load s':>8}{'load GB/s':>11}"
        f"{'save +MiB':>11}{'load +MiB':>11}  verified",
    ]
    for m in METHODS:
        r = s["methods"][m]
        save_mem = "/".join(f"{x:.0f}" for x in r["save_peak_extra_mib_per_rank"])
        load_mem = "/".join(f"{x:.0f}" for x in r["load_peak_extra_mib_per_rank"])
        lines.append(f"{m:<13}{r['save_median_s']:>8.2f}{r['save_GBps']:>11.2f}{r['load_median_s']:>8.2f}"
                     f"{r['load_GBps']:>11.2f}{save_mem:>11}{load_mem:>11}  {r['verified']}")
    integrity = {k: v for k, v in s["ratios"].items() if "nocheck" in k}
    lines.append("ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in s["ratios"].items() if k not in integrity))
    lines.append("integrity overhead (checksums on / off): " + ", ".join(f"{k} = {v:.3f}" for k, v in integrity.items())
                 + "; median of per-round ratios: "
                 + ", ".join(f"{v:.3f}" for v in s["integrity_overhead_paired_median"].values()))
    lines.extend(closing_lines(s))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="total state size (all ranks), GiB")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    ap.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes")
    ap.add_argument("--layers", type=int, default=NUM_LAYERS,
                    help="transformer layers (12 tensors each): many layers of a small state = many small tensors")
    add_scratch_and_output_flags(ap, REPO_ROOT.parent / "bench_tmp", RESULTS_PATH)
    return ap.parse_args()


def main() -> None:
    """Run every world size, print the tables and write the JSON."""
    args = parse_args()
    run_world_sizes("bench_save_load", args, run_world, summarize, format_table,
                    {"size_gib": args.size_gib, "rounds": args.rounds, "layers": args.layers})


if __name__ == "__main__":
    main()
