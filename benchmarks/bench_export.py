"""Export benchmark: ``export_checkpoint`` to safetensors (streamed) vs plain file I/O,
``safetensors.torch.save_file`` and the ``torch`` export format.

The GPT-like state of ``bench_save_load.py`` (~``--size-gib`` GiB) is saved once with
``dist_checkpointing.save`` at world size ``--save-world`` (real gloo processes; at world
size 2 the weights are TP-split, so the export has to consolidate them) with the
``linear_fc1`` / ``linear_fc2`` weights of the first ``--flat-layers`` layers stored as
flattened (distributed-optimizer style) keys. That checkpoint is then exported by each
method, in interleaved rounds (order rotated every round; medians over rounds):

* ``export_safetensors``: ``export_checkpoint(ckpt, out, "safetensors")``;
* ``raw_read_write``: the checkpoint's ``.distcp`` files read with ``readinto`` into one
  reused buffer (``--raw-buffer-mib``, default 16) and written to one output file,
  ``fsync`` at the end (the bandwidth anchor: the same bytes through plain file I/O);
* ``safetensors_save_file``: ``safetensors.torch.save_file(load_plain_tensors(ckpt))``
  (the non-streaming path: every tensor in memory at once);
* ``export_torch``: ``export_checkpoint(ckpt, out, "torch")`` (what ``dist-ckpt export
  --format torch`` runs).

Every run is a fresh Python process, so its peak RSS is its own: after the imports the
child resets its RSS high-water mark (``/proc/self/clear_refs``), runs the method, fsyncs
every output file (included in the time: ``export_safetensors`` and ``raw_read_write``
fsync anyway, the others do not) and reports the increase of ``VmHWM`` over the RSS
before the call; it also reports the time spent inside ``os.fsync``. Before every run the
page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``, by the parent, before
the child starts); with ``--cache warm``, or where dropping is not permitted, the
checkpoint is read once instead, so every method reads warm data. Outputs are deleted
(and the file system ``sync``-ed) after every run. Once, before the rounds, the exported
safetensors are compared with ``load_plain_tensors`` and with the saved tensors, the
``dist-ckpt export`` command line's output with the API's, and the torch export with
``load_plain_tensors``.

Run: ``python benchmarks/bench_export.py [--size-gib 1.0] [--rounds 5] [--save-world 2]``
"""

from __future__ import annotations

import argparse
import datetime
import filecmp
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from _common import (
    Param,
    PeakMemory,
    add_scratch_and_output_flags,
    build_params,
    closing_lines,
    fsync_path,
    proc_status_kib,
    read_all_files,
    spawn_ranks,
    write_proc,
    write_report,
)

import dist_checkpointing
from dist_checkpointing import ShardedTensor, load_plain_tensors
from dist_checkpointing.tools import export_checkpoint, inspect_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_export.json"
METHODS = ("export_safetensors", "raw_read_write", "safetensors_save_file", "export_torch")
RSS_TARGET = 1.20  # export_safetensors peak extra RSS <= largest tensor * 1.2
BANDWIDTH_TARGET = 0.8  # export_safetensors GB/s >= 0.8 x raw_read_write GB/s
MiB = 1 << 20

# ----------------------------------------------------------------------------- the checkpoint


def is_flat(p: Param, flat_layers: int) -> bool:
    """Whether ``p`` is stored as a flattened key (fc1/fc2 weights of the first layers)."""
    return any(p.key == f"decoder.layers.{i}.mlp.linear_fc{j}.weight" for i in range(flat_layers) for j in (1, 2))


def sharded(p: Param, rank: int, world: int, flat: bool) -> ShardedTensor:
    """The ShardedTensor of ``p`` (flattened: the rank's whole TP chunk as one flat range)."""
    if not flat:
        return p.sharded(p.tensor, rank, world)
    return ShardedTensor.from_rank_offsets_flat(p.key, p.tensor.reshape(-1), tuple(p.tensor.shape),
                                               (p.tp_axis, rank, world), flattened_range=slice(0, p.tensor.numel()))


def save_worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    """One rank: build its part of the state and save the checkpoint once."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        params = build_params(args.size_gib, rank, world)
        sd = {p.key: sharded(p, rank, world, is_flat(p, args.flat_layers)) for p in params}
        dist.barrier()
        start = time.perf_counter()
        dist_checkpointing.save(sd, args.ckpt)
        dist.barrier()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"save_s": time.perf_counter() - start}, f)
    finally:
        dist.destroy_process_group()


def expected_tensors(size_gib: float, world: int) -> Dict[str, torch.Tensor]:
    """The global tensors of the saved state (the ranks' chunks concatenated along TP)."""
    per_rank = [build_params(size_gib, rank, world) for rank in range(world)]
    out = {}
    for i, p in enumerate(per_rank[0]):
        out[p.key] = p.tensor if p.tp_axis is None else torch.cat([r[i].tensor for r in per_rank], dim=p.tp_axis)
    return out


# ----------------------------------------------------------------------------- methods (child side)


def run_export_safetensors(ckpt: Path, out: Path) -> Dict[str, object]:
    files = export_checkpoint(ckpt, out / "safetensors", "safetensors")
    return {"files": [str(f) for f in files]}


def run_raw_read_write(ckpt: Path, out: Path, buffer_mib: int = 16) -> Dict[str, object]:
    buf = bytearray(buffer_mib * MiB)
    view = memoryview(buf)
    target = out / "raw.bin"
    read_s = 0.0
    with open(target, "wb", buffering=0) as dst:
        for path in sorted(ckpt.glob("*.distcp")):
            with open(path, "rb", buffering=0) as src:
                while True:
                    start = time.perf_counter()
                    n = src.readinto(view)
                    read_s += time.perf_counter() - start
                    if not n:
                        break
                    done = 0
                    while done < n:
                        done += dst.write(view[done:n])
        os.fsync(dst.fileno())
    return {"files": [str(target)], "read_s": read_s}


def run_safetensors_save_file(ckpt: Path, out: Path) -> Dict[str, object]:
    start = time.perf_counter()
    state = load_plain_tensors(ckpt)
    loaded = time.perf_counter()
    target = out / "model.safetensors"
    save_file(state, str(target), metadata={"format": "pt"})
    return {"files": [str(target)], "load_s": loaded - start, "save_s": time.perf_counter() - loaded}


def run_export_torch(ckpt: Path, out: Path) -> Dict[str, object]:
    files = export_checkpoint(ckpt, out / "export.pt", "torch")
    return {"files": [str(f) for f in files]}


RUNNERS: Dict[str, Callable[[Path, Path], Dict[str, object]]] = {
    "export_safetensors": run_export_safetensors,
    "raw_read_write": run_raw_read_write,
    "safetensors_save_file": run_safetensors_save_file,
    "export_torch": run_export_torch,
}


def child(method: str, ckpt: Path, out: Path, raw_buffer_mib: int) -> None:
    """One measured run in this (fresh) process; prints one JSON line."""
    fsync_s = [0.0]  # time spent in os.fsync (the library's and ours): waiting for the disk
    real_fsync = os.fsync

    def timed_fsync(fd: int) -> None:
        start = time.perf_counter()
        real_fsync(fd)
        fsync_s[0] += time.perf_counter() - start

    os.fsync = timed_fsync
    gc.collect()
    base_mib = proc_status_kib("VmRSS") / 1024
    with PeakMemory() as mem:
        start = time.perf_counter()
        if method == "raw_read_write":
            extra = run_raw_read_write(ckpt, out, raw_buffer_mib)
        else:
            extra = RUNNERS[method](ckpt, out)
        called = time.perf_counter()
        for f in extra["files"]:
            fsync_path(Path(f))
        for d in {Path(f).parent for f in extra["files"]}:
            fsync_path(d)
        elapsed = time.perf_counter() - start
    written = sum(Path(f).stat().st_size for f in extra.pop("files"))
    print("RESULT " + json.dumps({"s": elapsed, "call_s": called - start, "fsync_s": fsync_s[0],
                                  "extra_mib": mem.extra_mib,
                                  "base_mib": base_mib, "written_bytes": written, **extra}), flush=True)


# ----------------------------------------------------------------------------- parent side


def drop_caches() -> bool:
    """``sync`` and drop the page cache; False where that is not permitted."""
    os.sync()
    return write_proc("/proc/sys/vm/drop_caches", "3")


def run_child(method: str, ckpt: Path, out: Path, raw_buffer_mib: int = 16) -> Dict[str, object]:
    """Run ``method`` in a fresh process and return its measurements."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", method, "--ckpt", str(ckpt),
                           "--out", str(out), "--raw-buffer-mib", str(raw_buffer_mib)],
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{method} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("RESULT "):])


def verify(args: argparse.Namespace, ckpt: Path, scratch: Path) -> Dict[str, bool]:
    """Untimed checks of the outputs (one of each), against load_plain_tensors and the saved state."""
    out = scratch / "verify"
    out.mkdir(parents=True)
    plain = load_plain_tensors(ckpt)
    expected = expected_tensors(args.size_gib, args.save_world)
    checks = {"load_plain_tensors == saved state": plain.keys() == expected.keys()
              and all(torch.equal(plain[k], expected[k]) for k in expected)}
    del expected
    export_checkpoint(ckpt, out / "api", "safetensors")
    ok = True
    with safe_open(str(out / "api" / "model.safetensors"), framework="pt") as f:
        ok = set(f.keys()) == set(plain)
        for key in plain:
            t = f.get_tensor(key)
            ok = ok and t.dtype == plain[key].dtype and torch.equal(t, plain[key])
    checks["export_safetensors == load_plain_tensors"] = ok
    cli = subprocess.run([sys.executable, "-m", "dist_checkpointing", "export", str(ckpt), str(out / "cli")],
                         capture_output=True, text=True)
    checks["dist-ckpt export == export_checkpoint (bytes)"] = cli.returncode == 0 and filecmp.cmp(
        out / "api" / "model.safetensors", out / "cli" / "model.safetensors", shallow=False)
    shutil.rmtree(out / "api")
    shutil.rmtree(out / "cli")
    export_checkpoint(ckpt, out / "export.pt", "torch")
    loaded = torch.load(out / "export.pt", mmap=True, weights_only=True)
    checks["export_torch == load_plain_tensors"] = loaded.keys() == plain.keys() and all(
        torch.equal(loaded[k], plain[k]) for k in plain)
    del loaded, plain
    shutil.rmtree(out)
    os.sync()
    return checks


def summarize(rounds: List[Dict[str, object]], info: Dict[str, object]) -> Dict[str, object]:
    """Medians, throughputs, memory peaks, ratios and targets."""
    total = info["tensor_bytes"]
    per_method = {}
    for m in METHODS:
        secs = [r[m]["s"] for r in rounds]
        mem = [r[m]["extra_mib"] for r in rounds]
        per_method[m] = {
            "s": secs, "median_s": statistics.median(secs), "min_s": min(secs), "max_s": max(secs),
            "GBps": total / 1e9 / statistics.median(secs),
            "call_median_s": statistics.median(r[m]["call_s"] for r in rounds),
            "fsync_median_s": statistics.median(r[m]["fsync_s"] for r in rounds),
            "extra_mib": mem, "extra_mib_max": max(mem), "extra_mib_median": statistics.median(mem),
            "base_mib_median": statistics.median(r[m]["base_mib"] for r in rounds),
            "written_bytes": rounds[0][m]["written_bytes"],
        }
    sf = per_method["safetensors_save_file"]
    sf["load_median_s"] = statistics.median(r["safetensors_save_file"]["load_s"] for r in rounds)
    sf["save_median_s"] = statistics.median(r["safetensors_save_file"]["save_s"] for r in rounds)
    per_method["raw_read_write"]["read_median_s"] = statistics.median(r["raw_read_write"]["read_s"] for r in rounds)
    largest_mib = info["largest_tensor_bytes"] / MiB
    ratios = {
        "export_safetensors GB/s / raw_read_write GB/s": per_method["raw_read_write"]["median_s"]
        / per_method["export_safetensors"]["median_s"],
        "export_safetensors GB/s / raw_read_write GB/s, median of per-round ratios": statistics.median(
            r["raw_read_write"]["s"] / r["export_safetensors"]["s"] for r in rounds),
        "export_safetensors peak +MiB (max) / largest tensor": per_method["export_safetensors"]["extra_mib_max"]
        / largest_mib,
        "safetensors_save_file s / export_safetensors s": per_method["safetensors_save_file"]["median_s"]
        / per_method["export_safetensors"]["median_s"],
        "export_torch s / export_safetensors s": per_method["export_torch"]["median_s"]
        / per_method["export_safetensors"]["median_s"],
    }
    targets = {
        f"export_safetensors GB/s >= {BANDWIDTH_TARGET} x raw_read_write GB/s":
            ratios["export_safetensors GB/s / raw_read_write GB/s"] >= BANDWIDTH_TARGET,
        f"export_safetensors peak +RSS <= {RSS_TARGET} x largest tensor ({RSS_TARGET * largest_mib:.1f} MiB)":
            ratios["export_safetensors peak +MiB (max) / largest tensor"] <= RSS_TARGET,
    }
    return {"checkpoint": info, "rounds": rounds, "methods": per_method, "ratios": ratios, "targets_met": targets}


def format_table(s: Dict[str, object]) -> str:
    """A plain-text table of the summary."""
    info = s["checkpoint"]
    largest_mib = info["largest_tensor_bytes"] / MiB
    lines = [
        f"checkpoint: saved at world size {info['save_world']}, {info['num_tensors']} tensors ({info['num_flattened']} "
        f"flattened), {info['tensor_bytes'] / MiB:.0f} MiB of tensors in {info['num_distcp']} .distcp files "
        f"({info['distcp_bytes'] / MiB:.0f} MiB); largest tensor {info['largest_tensor']} {largest_mib:.1f} MiB",
        f"{len(s['rounds'])} rounds, fresh process per run, {info['cache']}; medians; GB = 1e9 bytes (tensor bytes); "
        f"+MiB = peak RSS over the process's baseline after imports "
        f"(~{s['methods'][METHODS[0]]['base_mib_median']:.0f} MiB)",
        f"{'method':<23}{'median s':>9}{'GB/s':>7}{'min s':>7}{'max s':>7}{'fsync s':>9}{'+MiB max':>10}"
        f"{'+MiB med':>10}{'x largest':>11}",
    ]
    for m in METHODS:
        r = s["methods"][m]
        lines.append(f"{m:<23}{r['median_s']:>9.2f}{r['GBps']:>7.2f}{r['min_s']:>7.2f}{r['max_s']:>7.2f}"
                     f"{r['fsync_median_s']:>9.2f}{r['extra_mib_max']:>10.0f}{r['extra_mib_median']:>10.0f}"
                     f"{r['extra_mib_max'] / largest_mib:>11.2f}")
    sf = s["methods"]["safetensors_save_file"]
    lines.append(f"fsync s = time inside os.fsync (library's and the benchmark's; median); safetensors_save_file "
                 f"phases (medians): load_plain_tensors {sf['load_median_s']:.2f} s, save_file + fsync "
                 f"{sf['median_s'] - sf['load_median_s']:.2f} s; raw_read_write time in readinto (median) "
                 f"{s['methods']['raw_read_write']['read_median_s']:.2f} s (buffer {s['raw_buffer_mib']} MiB)")
    lines.append("ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in s["ratios"].items()))
    lines.append("verified: " + ", ".join(f"{k}: {v}" for k, v in s["verified"].items()))
    lines.extend(closing_lines(s))
    return "\n".join(lines)


def checkpoint_info(ckpt: Path, save_world: int, cache: str) -> Dict[str, object]:
    """What the benchmark needs to know about the saved checkpoint."""
    ci = inspect_checkpoint(ckpt)
    largest = max(ci.tensors, key=lambda t: t.nbytes)
    distcp = [p for p in ckpt.glob("*.distcp")]
    return {
        "save_world": save_world, "num_tensors": len(ci.tensors), "num_flattened": sum(t.flattened for t in ci.tensors),
        "tensor_bytes": ci.tensor_bytes, "largest_tensor": largest.key, "largest_tensor_bytes": largest.nbytes,
        "num_distcp": len(distcp), "distcp_bytes": sum(p.stat().st_size for p in distcp),
        "disk_bytes": ci.disk_bytes, "cache": cache,
    }


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size, GiB")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    ap.add_argument("--save-world", type=int, default=2, help="world size of the save (TP degree)")
    ap.add_argument("--flat-layers", type=int, default=4,
                    help="store the fc1/fc2 weights of this many layers as flattened keys")
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold",
                    help="cold: drop the page cache before every run (needs root); warm: read the checkpoint once")
    ap.add_argument("--raw-buffer-mib", type=int, default=16, help="raw_read_write: size of the reused buffer, MiB")
    add_scratch_and_output_flags(ap, REPO_ROOT.parent / "bench_tmp", RESULTS_PATH)
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    """Save the checkpoint, verify once, run the rounds, print the table and write the JSON."""
    args = parse_args()
    if args.child:
        child(args.child, Path(args.ckpt), Path(args.out), args.raw_buffer_mib)
        return
    scratch = Path(args.dir) / f"bench_export_{os.getpid()}"
    ckpt = scratch / "ckpt"
    args.ckpt = str(ckpt)
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    cache = args.cache
    if cache == "cold" and not drop_caches():
        print("cannot drop the page cache (not permitted): reading the checkpoint warm instead", flush=True)
        cache = "warm"
    cache_desc = ("page cache dropped before every run (cold reads)" if cache == "cold"
                  else "checkpoint read once before every run (warm reads)")
    try:
        scratch.mkdir(parents=True)
        print(f"== saving the checkpoint (world size {args.save_world}) in {ckpt}", flush=True)
        save_s = spawn_ranks(save_worker, args.save_world, args)["save_s"]
        os.sync()
        info = checkpoint_info(ckpt, args.save_world, cache_desc)
        info["save_s"] = save_s
        print(f"saved in {save_s:.2f} s: {info}", flush=True)
        checks = verify(args, ckpt, scratch)
        print(f"verified: {checks}", flush=True)
        warm_buf = bytearray(64 * MiB)
        rounds: List[Dict[str, object]] = []
        for rnd in range(args.rounds):
            order = METHODS[rnd % len(METHODS):] + METHODS[:rnd % len(METHODS)]
            results: Dict[str, object] = {"order": list(order)}
            for m in order:
                out = scratch / f"out_{m}_round{rnd}"
                out.mkdir()
                if cache == "cold":
                    drop_caches()
                else:
                    read_all_files(ckpt, warm_buf)
                try:
                    results[m] = run_child(m, ckpt, out, args.raw_buffer_mib)
                finally:
                    shutil.rmtree(out, ignore_errors=True)
                    os.sync()
            results["loadavg_after"] = os.getloadavg()
            rounds.append(results)
            print(f"round {rnd + 1}/{args.rounds} s / +MiB: "
                  + "  ".join(f"{m} {results[m]['s']:.2f}/{results[m]['extra_mib']:.0f}" for m in METHODS), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(rounds, info)
    summary["verified"] = checks
    summary["raw_buffer_mib"] = args.raw_buffer_mib
    summary["loadavg_before_after"] = [load_before, os.getloadavg()]
    run_args = {"size_gib": args.size_gib, "rounds": args.rounds, "save_world": args.save_world,
                "flat_layers": args.flat_layers, "cache": cache, "raw_buffer_mib": args.raw_buffer_mib,
                "dir": str(scratch)}
    out = write_report(args.output, started, run_args, "results", summary)
    print(format_table(summary))
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
