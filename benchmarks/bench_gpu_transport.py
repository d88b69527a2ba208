"""Peer-to-peer transfer of GPU state over gloo (issue 31, item 4): our ``PGTransport``
with and without the host bounce buffers (``HOST_STAGING``) against PyTorch's, on the same state, in the same run.

World size 2 (spawned processes, gloo on ``127.0.0.1``, one torch thread each), both ranks
on the one GPU (``cuda:0``). The state is ``bench_transport.py``'s (``--tensors`` fp32/bf16
tensors, ~``--size-mib`` MiB: many small ones, 8 large ones), built on the CPU from the
same seed on both ranks and moved to the GPU: rank 0 sends it, rank 1 holds a reference
copy and zeroed destination tensors of the same shapes on the GPU. Methods (sender /
receiver; the transport's ``device`` is the CPU, as gloo needs):

* ``ours_pageable``: ``dist_checkpointing.transport`` with ``HOST_STAGING = False`` (each
  tensor copied to or from pageable host memory where it is packed or sent, synchronously;
  buckets packed on the host one tensor at a time), received in place into the GPU tensors;
* ``ours_staged``: the same with ``HOST_STAGING = True`` (pinned host buffers, buckets packed
  and unpacked on the GPU, non-blocking copies pipelined with the messages);
* ``torch``: ``torch.distributed.checkpoint._pg_transport.PGTransport`` with
  ``state_dict=lambda: dest`` (GPU tensors). Its receiver only receives in place into
  tensors on the transport's device type: with GPU destinations and a CPU transport it
  returns new CPU tensors and leaves the GPU tensors as they were (the warm-up records
  where its results are and whether the destinations changed);
* ``torch_h2d``: ``torch``, then the receiver copies each returned tensor into its GPU
  tensor (``copy_``): what a trainer must add to have the state on its GPU;
* ``single_send``: the same bytes as one contiguous host uint8 tensor, ``dist.send`` /
  ``dist.recv``: the wire's floor (host memory only, no device copy), not a target.

One untimed warm-up round runs every method once and checks rank 1's result against its
reference, bit for bit, and that ours landed in its own GPU tensors. Then ``--rounds``
interleaved rounds, the order rotated by one each round; medians (min/max). Time: barrier
on both ranks, then each rank's wall time until its call returns and its device is
synchronized (the receiver's is the figure). Rank 0 writes the JSON after every round, so a
timeout still leaves figures.

``--dry-run``: CPU tensors, a small state: checks the script only (``ours_pageable`` and
``ours_staged`` then take the same path: there is nothing to stage).

Run (GPU): ``python benchmarks/bench_gpu_transport.py --size-mib 1024 --rounds 5``;
``python benchmarks/bench_gpu_transport.py --dry-run`` anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint._pg_transport import PGTransport as TorchPGTransport

from _common import free_port
from bench_transport import build_state, byte_view, tensor_specs

import dist_checkpointing.transport as transport
from dist_checkpointing.transport import PGTransport

REPO_ROOT = Path(__file__).resolve().parent.parent
METHODS = ("single_send", "ours_pageable", "ours_staged", "torch", "torch_h2d")
RATIOS = (("torch", "ours_staged"), ("torch", "ours_pageable"), ("torch_h2d", "ours_staged"),
          ("torch_h2d", "ours_pageable"), ("ours_pageable", "ours_staged"))
TIMEOUT = timedelta(minutes=2)
HOST = torch.device("cpu")
MiB = 1 << 20


class Rank:
    """One rank's state (rank 0) or reference and destinations (rank 1), and the methods."""

    def __init__(self, rank: int, args: argparse.Namespace, device: torch.device):
        self.rank, self.device = rank, device
        specs = tensor_specs(args)
        host_state = build_state(specs, fill=True)
        self.state = {"model": {k: t.to(device) for k, t in host_state["model"].items()}, "step": 1234}
        self.tensors = list(self.state["model"].values())
        self.total = sum(t.numel() * t.element_size() for t in self.tensors)
        if rank == 0:
            self.flat = torch.cat([byte_view(t) for t in host_state["model"].values()])
        else:
            self.dest = {"model": {k: torch.zeros_like(t) for k, t in self.state["model"].items()}, "step": 0}
            self.dest_tensors = list(self.dest["model"].values())
            self.flat_buf = torch.zeros(self.total, dtype=torch.uint8)
        self.received: Any = None
        self.pg = dist.group.WORLD

    def sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def fn(self, method: str) -> Callable[[], None]:
        """This rank's side of ``method``."""
        if method == "single_send":
            if self.rank == 0:
                return lambda: dist.send(self.flat, 1)
            return lambda: dist.recv(self.flat_buf, 0)
        impl = TorchPGTransport if method.startswith("torch") else PGTransport
        if self.rank == 0:
            return lambda: impl(self.pg, TIMEOUT, HOST).send_checkpoint([1], self.state)

        def receive() -> None:
            self.received = impl(self.pg, TIMEOUT, HOST, state_dict=lambda: self.dest).recv_checkpoint(0)
            if method == "torch_h2d":
                with torch.no_grad():
                    for d, r in zip(self.dest_tensors, self.received["model"].values()):
                        d.copy_(r)
        return receive

    def check(self, method: str) -> Dict[str, Any]:
        """Rank 1, after a warm-up call into zeroed destinations: where the values landed."""
        if method == "single_send":
            want = torch.cat([byte_view(t.cpu()) for t in self.tensors])
            return {"verified": torch.equal(self.flat_buf, want)}
        got = list(self.received["model"].values())
        values_ok = self.received["step"] == 1234 and all(
            torch.equal(byte_view(g.contiguous()), byte_view(t.to(g.device))) for g, t in zip(got, self.tensors))
        dest_ok = all(torch.equal(d, t) for d, t in zip(self.dest_tensors, self.tensors))
        out = {"verified": values_ok and (dest_ok or method == "torch"),
               "result_devices": sorted({str(g.device) for g in got}), "gpu_destinations_hold_the_values": dest_ok}
        if method.startswith("ours"):
            out["verified"] = out["verified"] and all(g is d for g, d in zip(got, self.dest_tensors))
        return out

    def run(self, method: str, check: bool) -> Dict[str, Any]:
        transport.wire.HOST_STAGING = method == "ours_staged"
        if check and self.rank == 1:
            for t in self.dest_tensors:
                t.zero_()
            self.flat_buf.zero_()
        fn = self.fn(method)
        self.sync()
        dist.barrier()
        start = time.perf_counter()
        fn()
        self.sync()
        out: Dict[str, Any] = {"s": time.perf_counter() - start}
        dist.barrier()
        if check and self.rank == 1:
            out.update(self.check(method))
        self.received = None
        return out


def gather(value: Any) -> List[Any]:
    out: List[Any] = [None, None]
    dist.all_gather_object(out, value)
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    device = HOST
    if not args.dry_run:
        torch.cuda.set_device(0)  # both ranks share the one GPU
        device = torch.device("cuda", 0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        me = Rank(rank, args, device)
        raw: Dict[str, Any] = {"total_bytes": me.total, "tensors": len(me.tensors), "device": str(device),
                               "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
                               "warm_up": {}, "rounds": []}
        raw["warm_up"] = {m: gather(me.run(m, check=True)) for m in METHODS}
        if rank == 1:
            print("[warm-up] " + ", ".join(f"{m} verified {raw['warm_up'][m][1]['verified']}" for m in METHODS),
                  flush=True)
        for rnd in range(args.rounds):
            k = rnd % len(METHODS)
            order = list(METHODS[k:] + METHODS[:k])
            res = {m: gather(me.run(m, check=False)) for m in order}
            raw["rounds"].append({"order": order, "loadavg": os.getloadavg(), **res})
            if rank == 0:
                print(f"round {rnd + 1}/{args.rounds} recv s: " + "  ".join(
                    f"{m} {res[m][1]['s']:.3f}" for m in METHODS), flush=True)
                write(args, {"partial": True, "raw": raw})
        if rank == 0:
            write(args, {"partial": False, "raw": raw})
    finally:
        dist.destroy_process_group()


def write(args: argparse.Namespace, report: Dict[str, Any]) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": args.started, "dry_run": args.dry_run, "args": {k: v for k, v in vars(args).items()},
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                        "cuda": torch.version.cuda}}
    out.write_text(json.dumps({**meta, **report}, indent=1, default=str))


def summarize(raw: Dict[str, Any]) -> Dict[str, Any]:
    """Medians (min/max) of each side's time, and the ratios (of the medians, and the
    median of the per-round ratios) of the receivers' times."""
    rounds = raw["rounds"]
    per = {}
    for m in METHODS:
        recv = [r[m][1]["s"] for r in rounds]
        per[m] = {"recv_median_s": statistics.median(recv), "recv_min_s": min(recv), "recv_max_s": max(recv),
                  "send_median_s": statistics.median(r[m][0]["s"] for r in rounds),
                  "GBps": raw["total_bytes"] / 1e9 / statistics.median(recv), **raw["warm_up"][m][1]}
    ratios = {f"{a} / {b}": {"medians": per[a]["recv_median_s"] / per[b]["recv_median_s"],
                             "paired": statistics.median(r[a][1]["s"] / r[b][1]["s"] for r in rounds)}
              for a, b in RATIOS}
    return {"per_method": per, "ratios": ratios}


def table(raw: Dict[str, Any], s: Dict[str, Any]) -> str:
    lines = [f"{raw['gpu'] or 'CPU (dry run)'}: rank 0 -> rank 1 over gloo, both on {raw['device']}, "
             f"{raw['tensors']} tensors, {raw['total_bytes'] / MiB:.1f} MiB; {len(raw['rounds'])} rounds; "
             f"receiver's time until its device is synchronized",
             f"{'method':<15}{'recv s':>8}{'min':>7}{'max':>7}{'GB/s':>7}{'send s':>8}  verified  results on  "
             f"GPU tensors hold the values"]
    for m, r in s["per_method"].items():
        lines.append(f"{m:<15}{r['recv_median_s']:>8.3f}{r['recv_min_s']:>7.3f}{r['recv_max_s']:>7.3f}"
                     f"{r['GBps']:>7.2f}{r['send_median_s']:>8.3f}  {str(r['verified']):<8}  "
                     f"{','.join(r.get('result_devices', ['-'])):<10}  {r.get('gpu_destinations_hold_the_values', '-')}")
    for name, r in s["ratios"].items():
        lines.append(f"{name}: {r['medians']:.2f}x (ratio of the medians), {r['paired']:.2f}x (median per-round ratio)")
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=None, help="state size, MiB (default 1024; dry run 24)")
    ap.add_argument("--tensors", type=int, default=None, help="number of tensors (default 4000; dry run 400)")
    ap.add_argument("--small-max-kib", type=float, default=256.0, help="largest small tensor, KiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors, a small state: checks the script only")
    ap.add_argument("--out", "--output", dest="out",
                    default=str(REPO_ROOT / "benchmarks" / "results" / "gpu_transport.json"))
    args = ap.parse_args(argv)
    args.size_mib = args.size_mib or (24 if args.dry_run else 1024)
    args.tensors = args.tensors or (400 if args.dry_run else 4000)
    if args.dry_run:
        args.small_max_kib = min(args.small_max_kib, 64.0)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: use --dry-run")
    args.started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return args


def main() -> None:
    args = parse_args()
    print(f"== {args.started}: {args.size_mib} MiB in {args.tensors} tensors, {args.rounds} rounds"
          f"{' (DRY RUN: CPU tensors)' if args.dry_run else ''}", flush=True)
    mp.spawn(worker, args=(2, free_port(), args), nprocs=2, join=True)
    report = json.loads(Path(args.out).read_text())
    summary = summarize(report["raw"])
    print(table(report["raw"], summary))
    write(args, {"partial": False, "summary": summary, "raw": report["raw"]})
    print(f"JSON results: {args.out}")


if __name__ == "__main__":
    main()
