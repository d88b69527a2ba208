"""Helpers shared by the benchmark scripts (processes, scratch dirs, report lines)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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

