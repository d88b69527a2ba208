"""Peer-to-peer transfer of a training state: our ``PGTransport`` against PyTorch's.

PyTorch ships a peer transport too, ``torch.distributed.checkpoint._pg_transport.PGTransport``
(one pickled metadata message, then one blocking send per tensor); ours
(``dist_checkpointing.transport.PGTransport``) checks the metadata on the receiver first and
sends small tensors in buckets. Both run side by side on the same state and the same group.

World size 2 (real processes, ``torch.multiprocessing`` spawn, gloo on ``127.0.0.1``, one
torch thread each). Rank 0 sends a state of ``--tensors`` fp32/bf16 tensors, ~``--size-mib``
MiB in all, to rank 1: ``--tensors - 8`` small tensors with log-uniform sizes from 256 B to
``--small-max-kib`` KiB, plus 8 large ones (2-D) that bring the total to ``--size-mib``.
Methods (sender / receiver):

* ``ours_inplace``: ``PGTransport(group, timeout, cpu).send_checkpoint([1], state)`` /
  ``PGTransport(..., state_dict=lambda: dest).recv_checkpoint(0)``, ``dest`` preallocated,
  touched tensors of the same shapes (the bytes land in them);
* ``ours_alloc``: the same, the receiver without ``state_dict`` (allocates new tensors);
* ``torch_inplace`` / ``torch_alloc``: the same two calls on PyTorch's ``PGTransport``;
* ``single_send``: the same bytes as one contiguous uint8 tensor, ``dist.send`` /
  ``dist.recv`` into a preallocated buffer: the physical reference (what the wire does
  with the bytes alone), not a target;
* ``ours_inplace@N`` (``--sweep-mib``) / ``ours_inplace@aloneK`` (``--sweep-alone-kib``):
  ``ours_inplace`` with ``dist_checkpointing.transport.wire.BUCKET_BYTES`` set to N MiB, or
  ``ALONE_BYTES`` to K KiB, on both ranks (tuning sweeps; none by default).

One untimed warm-up round runs every method once and checks that rank 1 received the values
rank 0 sent (its destinations zeroed before; in place: into its own tensors). Then
``--rounds`` interleaved rounds, each running every method once in an order rotated by one
each round; medians over rounds. Time: barrier on both ranks, then the receiver's wall time
until it has everything (the sender's time until its call returns is recorded too).
Memory: peak extra RSS per rank (``/proc/self/clear_refs`` + ``VmHWM``) during the call, max
over rounds; CPU time of each process (all its threads) during the call; time in Python's
garbage collector and the number of calls that ran a full (generation 2) collection.

Target (issue 21): ours at least ``TARGET`` times faster than PyTorch's in place, judged on
the ratio of the medians and on the median of the per-round ratios (both must be met).

Run: ``python benchmarks/bench_transport.py [--size-mib 256] [--tensors 4000] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._pg_transport import PGTransport as TorchPGTransport

from _common import PeakMemory, spawn_ranks, write_report

import dist_checkpointing.transport as transport
from dist_checkpointing.transport import PGTransport

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_transport.json"
MiB = 1 << 20
METHODS = ("single_send", "ours_inplace", "ours_alloc", "torch_inplace", "torch_alloc")
TARGET = 3.0  # torch_inplace / ours_inplace, at least
NUM_LARGE = 8
LARGE_FRACTIONS = (0.25, 0.20, 0.15, 0.12, 0.10, 0.08, 0.06, 0.04)  # of the bytes left after the small ones
TIMEOUT = timedelta(minutes=5)
DEFAULT_BUCKET, DEFAULT_ALONE = transport.wire.BUCKET_BYTES, transport.wire.ALONE_BYTES

# ----------------------------------------------------------------------------- the state


def tensor_specs(args: argparse.Namespace) -> List[Tuple[Tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor (the same on both ranks)."""
    rng = random.Random(0)
    specs: List[Tuple[Tuple[int, ...], torch.dtype]] = []
    lo, hi = math.log(256), math.log(args.small_max_kib * 1024)
    small_bytes = 0
    for _ in range(args.tensors - NUM_LARGE):
        dtype = rng.choice((torch.float32, torch.bfloat16))
        elsize = 4 if dtype == torch.float32 else 2
        numel = max(1, int(math.exp(rng.uniform(lo, hi))) // elsize)
        specs.append(((numel,), dtype))
        small_bytes += numel * elsize
    rest = args.size_mib * MiB - small_bytes
    if rest <= 0:
        raise SystemExit(f"--size-mib {args.size_mib} is smaller than the small tensors ({small_bytes / MiB:.1f} MiB)")
    cols = 1024
    for k, frac in enumerate(LARGE_FRACTIONS):
        dtype = torch.float32 if k % 2 == 0 else torch.bfloat16
        elsize = 4 if dtype == torch.float32 else 2
        rows = max(1, int(rest * frac) // (elsize * cols))
        specs.append(((rows, cols), dtype))
    # Large tensors spread through the state (as in a model), not all at the end.
    large = specs[-NUM_LARGE:]
    small = specs[:-NUM_LARGE]
    step = len(small) // NUM_LARGE
    out: List[Tuple[Tuple[int, ...], torch.dtype]] = []
    for k in range(NUM_LARGE):
        out += small[k * step:(k + 1) * step if k < NUM_LARGE - 1 else len(small)]
        out.append(large[k])
    return out


def build_state(specs, fill: bool) -> Dict[str, Any]:
    """The state dict: ``{"model": {name: tensor}, "step": 1234}``, random values (seeded:
    the same on every rank) when ``fill``, else zeroed (touched) tensors."""
    gen = torch.Generator().manual_seed(1234)
    model = {}
    for i, (shape, dtype) in enumerate(specs):
        if fill:
            t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        else:
            t = torch.empty(shape, dtype=dtype)
            t.zero_()
        model[f"layer{i // 10:03d}.param{i % 10}"] = t
    return {"model": model, "step": 1234 if fill else 0}


def transport_sizes(method: str) -> Tuple[int, int]:
    """``(BUCKET_BYTES, ALONE_BYTES)`` for a method: ``ours_inplace@N`` sets the bucket to
    N MiB, ``ours_inplace@aloneK`` the alone threshold to K KiB; the defaults otherwise."""
    at = method.partition("@")[2]
    if not at:
        return DEFAULT_BUCKET, DEFAULT_ALONE
    if at.startswith("alone"):
        return DEFAULT_BUCKET, int(at[len("alone"):]) * 1024
    return int(at) * MiB, DEFAULT_ALONE


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a uint8 view."""
    return t.reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------- one rank


class TimedTransport(PGTransport):
    """``PGTransport`` that records when things happen (library code unchanged, nothing
    added per message): on the sender, when the first message goes out (after flattening
    the state and pickling the metadata) and when the data phase starts (its first message
    is posted at once); on the receiver, how long its check of the metadata takes and when
    the data phase starts and ends (everything before it is the header, the metadata and
    the agreement), and how many data messages the sender planned."""

    phases: Dict[str, float] = {}

    def _send_head(self, *args, **kwargs):  # type: ignore[override]
        TimedTransport.phases["header_sent"] = time.perf_counter()
        return super()._send_head(*args, **kwargs)

    def _send_data(self, *args, **kwargs):  # type: ignore[override]
        TimedTransport.phases["first_data_sent"] = time.perf_counter()
        return super()._send_data(*args, **kwargs)

    def _destinations(self, meta, *args, **kwargs):  # type: ignore[override]
        t0 = time.perf_counter()
        try:
            return super()._destinations(meta, *args, **kwargs)
        finally:
            TimedTransport.phases["check_s"] = time.perf_counter() - t0

    def _receive_data(self, meta, *args, **kwargs):  # type: ignore[override]
        t0 = time.perf_counter()
        try:
            return super()._receive_data(meta, *args, **kwargs)
        finally:
            TimedTransport.phases.update(data_start=t0, data_end=time.perf_counter(), messages=len(meta.messages))


class GCTimer:
    """Time this process spends in Python's garbage collector (``gc.callbacks``), and the
    number of full (generation 2) collections, since the last ``reset``."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2

    def reset(self) -> None:
        self.seconds, self.full = 0.0, 0


TRANSPORTS = {"ours": TimedTransport, "torch": TorchPGTransport}


class Rank:
    """One rank's state, destinations and methods."""

    def __init__(self, rank: int, args: argparse.Namespace):
        self.rank = rank
        specs = tensor_specs(args)
        # Rank 0: the state to send. Rank 1: the same values as a reference (for the check).
        self.state = build_state(specs, fill=True)
        self.tensors = list(self.state["model"].values())
        self.total = sum(t.numel() * t.element_size() for t in self.tensors)
        if rank == 0:
            self.flat = torch.cat([byte_view(t) for t in self.tensors])  # single_send's contiguous bytes
        else:
            self.dest = build_state(specs, fill=False)  # preallocated, touched
            self.dest_tensors = list(self.dest["model"].values())
            self.flat_buf = torch.empty(self.total, dtype=torch.uint8)
            self.flat_buf.zero_()
        self.received: Any = None  # what the last call produced on rank 1
        self.gc = GCTimer()
        self.pg = dist.group.WORLD

    # --- the methods: (sender, receiver) ---------------------------------------------
    def transport_send(self, impl: str) -> None:
        """Send the state with ``impl``'s transport (``ours`` or ``torch``)."""
        TRANSPORTS[impl](self.pg, TIMEOUT, torch.device("cpu")).send_checkpoint([1], self.state)

    def transport_recv(self, impl: str, inplace: bool) -> None:
        """Receive it in place (into ``dest``) or into new tensors."""
        own = {"state_dict": lambda: self.dest} if inplace else {}
        self.received = TRANSPORTS[impl](self.pg, TIMEOUT, torch.device("cpu"), **own).recv_checkpoint(0)

    def single_send_send(self) -> None:
        dist.send(self.flat, 1)

    def single_send_recv(self) -> None:
        dist.recv(self.flat_buf, 0)
        self.received = self.flat_buf

    def fns(self, method: str) -> Callable[[], None]:
        """This rank's side of ``method``."""
        base = method.split("@")[0]
        if base == "single_send":
            return self.single_send_send if self.rank == 0 else self.single_send_recv
        impl, mode = base.split("_")
        if self.rank == 0:
            return functools.partial(self.transport_send, impl)
        return functools.partial(self.transport_recv, impl, mode == "inplace")

    # --- the check ---------------------------------------------------------------------
    def zero_destinations(self) -> None:
        if self.rank == 1:
            for t in self.dest_tensors:
                t.zero_()
            self.flat_buf.zero_()
            self.dest["step"] = 0

    def verify(self, method: str) -> bool:
        """On rank 1: did the last call deliver the sent values (in place: into its own tensors)?"""
        got = self.received
        if method == "single_send":
            off, ok = 0, True
            for t in self.tensors:
                n = t.numel() * t.element_size()
                ok = ok and torch.equal(got[off:off + n], byte_view(t))
                off += n
            return ok and off == got.numel()
        ok = got["step"] == 1234 and list(got["model"]) == list(self.state["model"])
        ok = ok and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(self.tensors, got["model"].values()))
        if method.split("@")[0].endswith("_inplace"):  # the receiver's own memory (PyTorch's returns views of it)
            ok = ok and all(a.data_ptr() == b.data_ptr() for a, b in zip(got["model"].values(), self.dest_tensors))
        return ok

    # --- one timed call ----------------------------------------------------------------
    def run(self, method: str, check: bool) -> Dict[str, Any]:
        """One call of ``method`` between a barrier and the end of this rank's side."""
        # on both ranks (only the sender's sizes count: they travel with its metadata)
        transport.wire.BUCKET_BYTES, transport.wire.ALONE_BYTES = transport_sizes(method)
        if check:
            self.zero_destinations()
        TimedTransport.phases = {}
        fn = self.fns(method)
        with PeakMemory() as mem:
            dist.barrier()
            self.gc.reset()
            cpu0 = time.process_time()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            cpu_s = time.process_time() - cpu0  # every thread of the process (gloo's included)
            gc_s, gc_full = self.gc.seconds, self.gc.full
        ph = TimedTransport.phases
        dist.barrier()
        ok = self.verify(method) if (check and self.rank == 1) else None
        self.received = None
        transport.wire.BUCKET_BYTES, transport.wire.ALONE_BYTES = DEFAULT_BUCKET, DEFAULT_ALONE
        out = {"s": elapsed, "extra_mib": mem.extra_mib, "verified": ok, "gc_s": gc_s, "gc_full": gc_full,
               "cpu_s": cpu_s}
        if "data_start" in ph:  # our receiver
            out.update(meta_s=ph["data_start"] - start, data_s=ph["data_end"] - ph["data_start"],
                       after_s=start + elapsed - ph["data_end"], messages=ph["messages"], check_s=ph["check_s"])
        elif "header_sent" in ph:  # our sender
            out.update(plan_s=ph["header_sent"] - start, first_data_s=ph["first_data_sent"] - start)
        return out


def gather(value: Any) -> List[Any]:
    """``value`` of both ranks."""
    out: List[Any] = [None, None]
    dist.all_gather_object(out, value)
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    """One rank: build the state, warm up + check, run the rounds; rank 0 writes the raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # PyTorch's receiver unpickles a TreeSpec, which warns about a deprecated leaf class
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        me = Rank(rank, args)
        methods = list(METHODS)
        methods += [f"ours_inplace@{b}" for b in args.sweep_mib if b * MiB != DEFAULT_BUCKET]
        methods += [f"ours_inplace@alone{k}" for k in args.sweep_alone_kib if k * 1024 != DEFAULT_ALONE]
        warmup = {m: gather(me.run(m, check=True)) for m in methods}
        if rank == 1:
            print("[warm-up] verified: " + ", ".join(f"{m} {warmup[m][1]['verified']}" for m in methods), flush=True)
        rounds = []
        for rnd in range(args.rounds):
            k = rnd % len(methods)
            order = methods[k:] + methods[:k]
            res = {m: gather(me.run(m, check=False)) for m in order}
            rounds.append({"order": order, "loadavg": os.getloadavg(), **res})
            if rank == 0:
                print(f"round {rnd + 1}/{args.rounds} recv s: "
                      + "  ".join(f"{m} {res[m][1]['s']:.3f}" for m in methods), flush=True)
        dist.barrier()
        if rank == 0:
            specs = tensor_specs(args)
            sizes = sorted(math.prod(s) * (4 if d == torch.float32 else 2) for s, d in specs)
            with open(out_path, "w") as f:
                json.dump({"methods": methods, "total_bytes": me.total, "num_tensors": len(specs),
                           "tensor_bytes_min_median_max": [sizes[0], sizes[len(sizes) // 2], sizes[-1]],
                           "large_tensor_mib": [s / MiB for s in sizes[-NUM_LARGE:]],
                           "small_tensor_bytes_total": sum(sizes[:-NUM_LARGE]),
                           "num_bf16": sum(d == torch.bfloat16 for _, d in specs),
                           "warmup": warmup, "rounds": rounds}, f)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- reporting


def _median_of(rounds: List[Dict[str, Any]], m: str, rank: int, key: str) -> float:
    return statistics.median(r[m][rank][key] for r in rounds)


def summarize(raw: Dict[str, Any]) -> Dict[str, Any]:
    """Medians, ratios and the target of the raw results."""
    rounds, total = raw["rounds"], raw["total_bytes"]
    per = {}
    for m in raw["methods"]:
        recv = [r[m][1]["s"] for r in rounds]
        d = {
            "recv_s": recv, "send_s": [r[m][0]["s"] for r in rounds],
            "recv_median_s": statistics.median(recv), "recv_min_s": min(recv), "recv_max_s": max(recv),
            "send_median_s": _median_of(rounds, m, 0, "s"),
            "GBps": total / 1e9 / statistics.median(recv),
            "peak_extra_mib_per_rank": [max(r[m][k]["extra_mib"] for r in rounds) for k in range(2)],
            "cpu_median_s_per_rank": [_median_of(rounds, m, k, "cpu_s") for k in range(2)],
            "gc_median_s_per_rank": [_median_of(rounds, m, k, "gc_s") for k in range(2)],
            "calls_with_full_gc_per_rank": [sum(r[m][k]["gc_full"] > 0 for r in rounds) for k in range(2)],
            "verified": raw["warmup"][m][1]["verified"],
        }
        if "meta_s" in rounds[0][m][1]:
            for key in ("meta_s", "check_s", "data_s", "after_s"):
                d[f"recv_{key}_median"] = _median_of(rounds, m, 1, key)
            for key in ("plan_s", "first_data_s"):
                d[f"send_{key}_median"] = _median_of(rounds, m, 0, key)
            d["messages"] = rounds[0][m][1]["messages"]
        per[m] = d

    def ratios(a: str, b: str) -> Dict[str, float]:
        """a / b: of the medians, the median of the per-round ratios, of the fastest rounds."""
        return {"medians": per[a]["recv_median_s"] / per[b]["recv_median_s"],
                "paired": statistics.median(r[a][1]["s"] / r[b][1]["s"] for r in rounds),
                "best": per[a]["recv_min_s"] / per[b]["recv_min_s"]}

    speedups = {f"{kind}: torch / ours": ratios(f"torch_{kind}", f"ours_{kind}") for kind in ("inplace", "alloc")}
    vs_single = {m: ratios(m, "single_send") for m in raw["methods"] if m != "single_send"}
    inplace = speedups["inplace: torch / ours"]
    targets = {f"torch_inplace / ours_inplace >= {TARGET}": min(inplace["medians"], inplace["paired"]) >= TARGET}
    return {**{k: v for k, v in raw.items() if k != "rounds"}, "rounds": rounds, "per_method": per,
            "speedups": speedups, "vs_single_send": vs_single, "targets_met": targets}


def format_table(s: Dict[str, Any]) -> str:
    """The summary as a table."""
    lo, med, hi = s["tensor_bytes_min_median_max"]
    large = s["large_tensor_mib"]
    lines = [
        f"rank 0 -> rank 1, gloo on 127.0.0.1: {s['num_tensors']} tensors ({s['num_bf16']} bf16, rest fp32; "
        f"{lo} B - {hi / MiB:.1f} MiB, median {med / 1024:.1f} KiB; {s['num_tensors'] - NUM_LARGE} small = "
        f"{s['small_tensor_bytes_total'] / MiB:.1f} MiB, {NUM_LARGE} large {min(large):.1f}-{max(large):.1f} MiB), "
        f"{s['total_bytes'] / MiB:.1f} MiB in all; {len(s['rounds'])} rounds, medians of the receiver's time "
        f"from a barrier until it has everything; GB = 1e9 bytes",
        f"{'method':<22}{'msgs':>6}{'recv s':>8}{'min s':>7}{'max s':>7}{'GB/s':>7}{'x single':>9}"
        f"{'send s':>8}{'+MiB r0/r1':>12}{'cpu s r0/r1':>13}{'gc ms r0/r1':>13}{'full gc':>9}  verified",
    ]
    for m, r in s["per_method"].items():
        msgs = str(r["messages"]) if "messages" in r else {
            "single_send": "1"}.get(m, str(s["num_tensors"] + 2))  # PyTorch's: length, metadata, one per tensor
        ratio = s["vs_single_send"][m]["medians"] if m in s["vs_single_send"] else 1.0
        mem = "/".join(f"{x:.0f}" for x in r["peak_extra_mib_per_rank"])
        cpu = "/".join(f"{x:.2f}" for x in r["cpu_median_s_per_rank"])
        gcms = "/".join(f"{x * 1e3:.0f}" for x in r["gc_median_s_per_rank"])
        full = "/".join(str(x) for x in r["calls_with_full_gc_per_rank"])
        lines.append(f"{m:<22}{msgs:>6}{r['recv_median_s']:>8.3f}{r['recv_min_s']:>7.3f}{r['recv_max_s']:>7.3f}"
                     f"{r['GBps']:>7.2f}{ratio:>9.2f}{r['send_median_s']:>8.3f}{mem:>12}{cpu:>13}{gcms:>13}"
                     f"{full:>9}  {r['verified']}")
    for name, r in s["speedups"].items():
        lines.append(f"{name}: {r['medians']:.2f}x (ratio of the medians), {r['paired']:.2f}x (median of the "
                     f"per-round ratios), {r['best']:.2f}x (fastest rounds)")
    oi = s["per_method"]["ours_inplace"]
    lines.append(f"ours_inplace, medians: receiver: header+metadata+check {oi['recv_meta_s_median']:.3f} s "
                 f"(its check of the metadata {oi['recv_check_s_median']:.3f} s), data {oi['recv_data_s_median']:.3f} s, "
                 f"unflatten {oi['recv_after_s_median']:.3f} s; sender: flatten+pickle until the header goes out "
                 f"{oi['send_plan_s_median']:.3f} s, data phase starts at {oi['send_first_data_s_median']:.3f} s")
    lines.append("x single: ratio of the medians to single_send's (the physical reference, not a target)")
    lines.append("targets: " + ", ".join(f"{k}: {'MET' if ok else 'NOT met'}" for k, ok in s["targets_met"].items()))
    if "library" in s:
        lib = s["library"]
        lines.append(f"library: commit {lib['commit']}{' + local changes to transport/' if lib['transport_modified'] else ''}"
                     f" (transport/ sha1 {lib['transport_sha1']}); torch {torch.__version__}")
    if s.get("malloc_mmap_threshold_kib"):
        lines.append(f"(children ran with MALLOC_MMAP_THRESHOLD_={s['malloc_mmap_threshold_kib']} KiB)")
    if "loadavg_before_after" in s:
        b, a = s["loadavg_before_after"]
        lines.append(f"load average (1/5/15 min) before: {b[0]:.2f} {b[1]:.2f} {b[2]:.2f}, "
                     f"after: {a[0]:.2f} {a[1]:.2f} {a[2]:.2f}")
    return "\n".join(lines)


def library_version() -> Dict[str, Any]:
    """The commit the library is at, whether its working tree differs, and a hash of the
    ``transport/`` package's files as they were when the run started (the code under test)."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "?"
    digest = hashlib.sha1()
    for path in sorted(Path(transport.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "transport_modified": git("status", "--porcelain", "--", "dist_checkpointing/transport") != "",
            "transport_sha1": digest.hexdigest()[:12]}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256, help="total state size, MiB")
    ap.add_argument("--tensors", type=int, default=4000, help="number of tensors")
    ap.add_argument("--small-max-kib", type=float, default=256.0, help="largest small tensor, KiB")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (medians over them)")
    ap.add_argument("--sweep-mib", default="", help="BUCKET_BYTES values to sweep, MiB (e.g. 4,8,32)")
    ap.add_argument("--sweep-alone-kib", default="", help="ALONE_BYTES values to sweep, KiB (e.g. 32,128,512)")
    ap.add_argument("--malloc-mmap-threshold-kib", type=int, default=0,
                    help="set MALLOC_MMAP_THRESHOLD_ in the ranks (e.g. 1024): a larger allocation that no "
                         "free heap chunk can serve is mmap-ed and returned to the OS when freed, so '+MiB' "
                         "shows the buffers each call allocates (with glibc's default dynamic threshold, freed "
                         "buffers <= 32 MiB stay in the heap and are reused unseen); 0 = glibc default")
    ap.add_argument("--output", default=str(RESULTS_PATH), help="JSON results path")
    args = ap.parse_args()
    args.sweep_mib = [int(x) for x in args.sweep_mib.split(",") if x.strip()]
    args.sweep_alone_kib = [int(x) for x in args.sweep_alone_kib.split(",") if x.strip()]
    return args


def main() -> None:
    args = parse_args()
    started = datetime.datetime.now().astimezone()
    print(f"== {started.isoformat(timespec='seconds')}: {args.size_mib} MiB in {args.tensors} tensors, "
          f"{args.rounds} rounds", flush=True)
    if args.malloc_mmap_threshold_kib:  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold_kib * 1024)
    library = library_version()  # before the run: the code under test
    before = os.getloadavg()
    summary = summarize(spawn_ranks(worker, 2, args))
    summary["malloc_mmap_threshold_kib"] = args.malloc_mmap_threshold_kib
    summary["library"] = library
    summary["loadavg_before_after"] = [before, os.getloadavg()]
    run_args = {k: v for k, v in vars(args).items() if k != "output"}
    run_args["library"] = library
    out = write_report(args.output, started, run_args, "results", summary)
    print(format_table(summary))
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
