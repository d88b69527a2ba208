"""Helpers shared by the benchmark scripts: processes, scratch dirs, report lines, peak
memory and collective timing, file helpers, and the GPT-like state of ``bench_save_load.py``."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_checkpointing import ShardedTensor

NUM_LAYERS = 8  # transformer layers of the GPT-like state


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_dir(path: Path, rank: int) -> None:
    """Remove ``path`` (rank 0), flush the file system, and wait for every rank."""
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.sync()
    dist.barrier()


def closing_lines(summary: Dict[str, object]) -> List[str]:
    """The 'targets' and 'load average' lines of a summary table."""
    if summary.get("targets_not_judged"):  # e.g. a smoke run: too small for the targets to mean anything
        lines = [f"targets: not judged ({summary['targets_not_judged']})"]
    else:
        lines = ["targets: " + ", ".join(f"{k}: {'MET' if ok else 'NOT met'}"
                                         for k, ok in summary["targets_met"].items())]
    if "loadavg_before_after" in summary:
        before, after = summary["loadavg_before_after"]
        lines.append(f"load average (1 min) before/after: {before[0]:.1f} / {after[0]:.1f}")
    return lines


def spawn_ranks(worker: Callable, world: int, args: argparse.Namespace) -> Dict[str, object]:
    """Run ``worker(rank, world, port, args, out_path)`` on ``world`` spawned processes and
    return the JSON that rank 0 writes to ``out_path``."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out_path = tmp.name
    try:
        mp.spawn(worker, args=(world, free_port(), args, out_path), nprocs=world, join=True)
        with open(out_path) as f:
            return json.load(f)
    finally:
        os.unlink(out_path)


def add_scratch_and_output_flags(ap: argparse.ArgumentParser, default_dir: Path, default_output: Path) -> None:
    """The ``--dir`` (scratch directory) and ``--output`` (JSON path) flags of every benchmark."""
    ap.add_argument("--dir", default=str(default_dir), help="scratch directory on the disk under test (not tmpfs)")
    ap.add_argument("--output", default=str(default_output), help="JSON results path")


def write_report(output: str, started: datetime.datetime, run_args: Dict[str, object],
                 results_key: str, results: object) -> Path:
    """Write the JSON report (date, machine, arguments, results) and return its path."""
    report = {
        "date": started.isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
        "args": run_args,
        results_key: results,
    }
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return out


def run_world_sizes(name: str, args: argparse.Namespace, run_world: Callable, summarize: Callable,
                    format_table: Callable, run_args: Dict[str, object]) -> None:
    """Run ``run_world(world, args)`` for each of ``args.world_sizes`` in a scratch dir under
    ``args.dir``, print each summary table, and write the JSON report."""
    worlds = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    base = Path(args.dir)
    made_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{name}_", dir=base))  # removed at the end, whatever happens
    args.dir = str(scratch)
    started = datetime.datetime.now().astimezone()
    summaries = []
    try:
        for world in worlds:
            print(f"== world size {world}: {args.rounds} rounds, scratch {scratch}", flush=True)
            load_before = os.getloadavg()
            summary = summarize(run_world(world, args))
            summary["loadavg_before_after"] = [load_before, os.getloadavg()]  # machine noise
            summaries.append(summary)
            print(format_table(summaries[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if made_base:
            shutil.rmtree(base, ignore_errors=True)
    run_args = dict(run_args, world_sizes=worlds, dir=str(scratch))
    out = write_report(args.output, started, run_args, "results", summaries)
    print(f"JSON results: {out}")  # each table was printed once, as its world size finished


# ----------------------------------------------------------------------------- measuring


def proc_status_kib(field: str) -> int:
    """A ``/proc/self/status`` field, KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakMemory:
    """RSS high-water mark increase during a block (Linux ``clear_refs``, else sampling)."""

    def __init__(self) -> None:
        self.extra_mib = float("nan")
        self._use_clear_refs = _try_reset_hwm()
        self._stop = threading.Event()
        self._peak_kib = 0

    def __enter__(self) -> "PeakMemory":
        self._base_kib = proc_status_kib("VmRSS")
        if self._use_clear_refs:
            _try_reset_hwm()
        else:
            self._peak_kib = self._base_kib
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._peak_kib = max(self._peak_kib, proc_status_kib("VmRSS"))

    def __exit__(self, *exc) -> None:
        if self._use_clear_refs:
            peak = proc_status_kib("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
            peak = self._peak_kib
        self.extra_mib = max(0, peak - self._base_kib) / 1024


def write_proc(path: str, value: str) -> bool:
    """Write ``value`` to a ``/proc`` file; False where that is not permitted."""
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def _try_reset_hwm() -> bool:
    return write_proc("/proc/self/clear_refs", "5")  # resets VmHWM to the current RSS


def timed_collective(fn: Callable[[], None]) -> Tuple[float, float]:
    """(seconds, peak extra RSS MiB) of ``fn`` between barriers, max over ranks."""
    dist.barrier()
    with PeakMemory() as mem:
        start = time.perf_counter()
        fn()
        dist.barrier()
        elapsed = time.perf_counter() - start
    out = torch.tensor([elapsed])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out.item()), mem.extra_mib


def gather_floats(value: float) -> List[float]:
    """``value`` of every rank."""
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value], dtype=torch.float64))
    return [float(t.item()) for t in out]


# ----------------------------------------------------------------------------- files


def fsync_path(path: Path) -> None:
    """fsync a file (or directory) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_all_files(directory: Path, buf: bytearray) -> int:
    """Read every file under ``directory`` once (to warm the page cache); bytes read."""
    view, total = memoryview(buf), 0
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        with open(path, "rb", buffering=0) as f:
            while (n := f.readinto(view)) > 0:
                total += n
    return total


# ----------------------------------------------------------------------------- the GPT-like state


@dataclass
class Param:
    """One local tensor and how it maps into the global tensor."""

    key: str
    tensor: torch.Tensor
    tp_axis: Optional[int]  # None: replicated across TP ranks

    def sharded(self, data: torch.Tensor, rank: int, world: int) -> ShardedTensor:
        """The ShardedTensor of ``data`` (same layout as this param)."""
        if self.tp_axis is None:
            return ShardedTensor.from_rank_offsets(self.key, data, replica_id=rank)
        return ShardedTensor.from_rank_offsets(self.key, data, (self.tp_axis, rank, world))


def hidden_size_for(size_gib: float, layers: int = NUM_LAYERS) -> int:
    """Hidden size h (multiple of 64) so that the state of ``layers`` layers is about ``size_gib`` GiB.

    Bytes ~ 2 (bf16) * (2 * vocab*h + layers * 12 h^2) with vocab = 16 h.
    """
    h = math.sqrt(size_gib * (1 << 30) / (2 * (32 + 12 * layers)))
    return max(64, int(round(h / 64)) * 64)


def build_params(size_gib: float, rank: int, world: int, seed: int = 0, layers: int = NUM_LAYERS) -> List[Param]:
    """This rank's local tensors of a GPT-like model of ``layers`` layers (random values)."""
    h = hidden_size_for(size_gib, layers)
    vocab, ffn = 16 * h, 4 * h
    split_gen = torch.Generator().manual_seed(seed + 1 + rank)
    replicated_gen = torch.Generator().manual_seed(seed)  # replicas hold equal values
    bf16, fp32 = torch.bfloat16, torch.float32

    def rand(shape: Tuple[int, ...], dtype: torch.dtype, replicated: bool = False) -> torch.Tensor:
        gen = replicated_gen if replicated else split_gen
        return torch.randn(shape, generator=gen, dtype=fp32).to(dtype)

    def norm(name: str) -> List[Param]:
        return [Param(f"{name}.{w}", rand((h,), fp32, replicated=True), None) for w in ("weight", "bias")]

    params = [Param("embedding.word_embeddings.weight", rand((vocab // world, h), bf16), 0)]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        params += [
            *norm(p + "input_layernorm"),
            Param(p + "self_attention.linear_qkv.weight", rand((3 * h // world, h), bf16), 0),
            Param(p + "self_attention.linear_qkv.bias", rand((3 * h // world,), fp32), 0),
            Param(p + "self_attention.linear_proj.weight", rand((h, h // world), bf16), 1),
            Param(p + "self_attention.linear_proj.bias", rand((h,), fp32, replicated=True), None),
            *norm(p + "pre_mlp_layernorm"),
            Param(p + "mlp.linear_fc1.weight", rand((ffn // world, h), bf16), 0),
            Param(p + "mlp.linear_fc1.bias", rand((ffn // world,), fp32), 0),
            Param(p + "mlp.linear_fc2.weight", rand((h, ffn // world), bf16), 1),
            Param(p + "mlp.linear_fc2.bias", rand((h,), fp32, replicated=True), None),
        ]
    params += [
        *norm("decoder.final_layernorm"),
        Param("output_layer.weight", rand((vocab // world, h), bf16), 0),
    ]
    return params


def nbytes(tensors: List[torch.Tensor]) -> int:
    """Total bytes of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)
