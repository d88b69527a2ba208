"""Peer-to-peer transfer of a training state: ``PGTransport`` vs plain gloo sends.

World size 2 (real processes, ``torch.multiprocessing`` spawn, gloo on ``127.0.0.1``, one
torch thread each). Rank 0 sends a state of ``--tensors`` fp32/bf16 tensors, ~``--size-mib``
MiB in all, to rank 1: ``--tensors - 8`` small tensors with log-uniform sizes from 256 B to
``--small-max-kib`` KiB, plus 8 large ones (2-D) that bring the total to ``--size-mib``.
Methods:

* ``transport_inplace``: ``PGTransport.send_checkpoint([1], state)`` /
  ``PGTransport(..., state_dict=lambda: dest).recv_checkpoint(0)`` where ``dest`` holds
  preallocated, touched tensors of the same shapes (the bytes land in them);
* ``transport_alloc``: the same, the receiver without ``state_dict`` (allocates new tensors);
* ``single_send``: the same bytes as one contiguous uint8 tensor, ``dist.send`` /
  ``dist.recv`` into a preallocated buffer (the anchor: what the wire can do);
* ``plan_pattern``: the transport's own data messages for this state (its plan: large tensors
  alone, small ones in buckets), every one posted at once on both sides, the buckets
  packed before the clock starts, no metadata: what the transport costs without its
  metadata round, packing and Python bookkeeping;
* ``split_send@N`` (``--split-counts``): those contiguous bytes in N equal messages, every one
  posted at once on both sides (what the number of messages alone costs on this wire);
* ``chunked_send``: those contiguous bytes in messages of the default ``BUCKET_BYTES``, at most
  two sends in flight and the next receive posted one ahead (the transport's data pattern
  without metadata or packing copies);
* ``per_tensor_send``: one blocking ``dist.send`` / ``dist.recv`` per tensor, into the
  preallocated tensors (what no bucketing would cost);
* ``broadcast_object``: ``dist.broadcast_object_list([state], src=0)`` (pickle);
* ``transport_inplace@N``: ``transport_inplace`` with ``dist_checkpointing.transport.BUCKET_BYTES``
  set to N MiB on both ranks (the bucket-size sweep; the default size is the
  ``transport_inplace`` row);
* ``transport_inplace@aloneK`` (``--sweep-alone-kib``): ``transport_inplace`` with
  ``ALONE_BYTES`` set to K KiB on both ranks: tensors below it go into buckets (copied),
  the others travel alone (one message each).

One untimed warm-up round runs every method once and checks that rank 1 received the values
rank 0 sent (its destination tensors zeroed before). Then ``--rounds`` interleaved rounds,
each running every method once in an order rotated by one each round; medians over rounds.
The target (transport / single send <= 1.5) is checked twice: on the medians of all rounds,
and on the best round of each (on a shared machine the single send is bimodal, ~0.06 s or
~0.11 s for the same bytes, so a median ratio alone can pass only because the anchor was
mostly slow): the target is met only if both ratios are within it.
Time: barrier on both ranks, then the receiver's wall time until it has everything (the
sender's time until its call returns is recorded too). Memory: peak extra RSS per rank
(``/proc/self/clear_refs`` + ``VmHWM``) during the call, max over rounds; CPU time of each
process (all its threads) during the call; time in Python's garbage collector and the number
of calls that ran a full (generation 2) collection.

Run: ``python benchmarks/bench_transport.py [--size-mib 256] [--tensors 4000] [--rounds 7]``
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from _common import spawn_ranks, write_report
from bench_save_load import PeakMemory

import dist_checkpointing.transport as transport
from dist_checkpointing.transport import PGTransport

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_transport.json"
MiB = 1 << 20
DEFAULT_BUCKET = transport.BUCKET_BYTES
DEFAULT_ALONE = transport.ALONE_BYTES
BASE_METHODS = ("single_send", "chunked_send", "plan_pattern", "transport_inplace", "transport_alloc",
                "per_tensor_send", "broadcast_object")
TARGET = 1.5  # transport / single_send (the bucketing target)
NUM_LARGE = 8
LARGE_FRACTIONS = (0.25, 0.20, 0.15, 0.12, 0.10, 0.08, 0.06, 0.04)  # of the bytes left after the small ones
TIMEOUT = timedelta(minutes=5)

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
    """``(BUCKET_BYTES, ALONE_BYTES)`` for a method: ``transport_inplace@N`` sets the bucket
    to N MiB, ``transport_inplace@aloneK`` the alone threshold to K KiB; the defaults otherwise."""
    base, _, at = method.partition("@")
    if not base.startswith("transport") or not at:
        return DEFAULT_BUCKET, DEFAULT_ALONE
    if at.startswith("alone"):
        return DEFAULT_BUCKET, int(at[len("alone"):]) * 1024
    return int(at) * MiB, DEFAULT_ALONE


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def transport_plan(tensors: List[torch.Tensor]) -> Any:
    """The library's metadata for these tensors, with its message plan (as the sender makes them)."""
    columns, _ = transport._Columns.describe(tensors)
    meta = transport._Meta(None, columns)
    meta.plan()
    return meta


def pack_bucket(buf: torch.Tensor, meta: Any, members: List[int], tensors: List[torch.Tensor]) -> None:
    """Pack a bucket of the plan the way the sender does."""
    transport._pack(buf, transport._segments(meta, members), tensors)


# ----------------------------------------------------------------------------- the receiver's phases


class TimedTransport(PGTransport):
    """``PGTransport`` that records when things happen (library code unchanged): on the
    sender, when the header goes out (after flattening the state and pickling the metadata)
    and when the first data message goes out; on the receiver, how long its check of the
    metadata takes and when the data phase starts and ends (everything before it is the
    header, the metadata and the agreement), and how many data messages the sender planned."""

    phases: Dict[str, float] = {}

    def _send(self, tensor, dst, tag, *args, **kwargs):  # type: ignore[override]
        now = time.perf_counter()
        if tag == transport._TAG_HEADER:
            TimedTransport.phases["header_sent"] = now
        elif tag >= transport._TAG_DATA and "first_data_sent" not in TimedTransport.phases:
            TimedTransport.phases["first_data_sent"] = now
        return super()._send(tensor, dst, tag, *args, **kwargs)

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


# ----------------------------------------------------------------------------- one rank


class Rank:
    def __init__(self, rank: int, args: argparse.Namespace):
        self.rank = rank
        self.args = args
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
        flat = self.flat if rank == 0 else self.flat_buf
        # split_send@N: the contiguous bytes in N equal slices (cut before the clock starts)
        self.splits = {n: [flat[self.total * k // n:self.total * (k + 1) // n] for k in range(n)]
                       for n in args.split_counts}
        self.split = 0  # the N of the split_send call running
        self.gc = GCTimer()
        # plan_pattern: the transport's data messages, buckets packed up front
        self.meta = transport_plan(self.tensors)
        self.columns, self.plan = self.meta.columns, self.meta.messages
        own = self.tensors if rank == 0 else self.dest_tensors
        self.plan_buffers = []
        for size, members in self.plan:
            if transport._alone(self.columns, size, members):
                self.plan_buffers.append(byte_view(own[members[0]]))
                continue
            buf = torch.zeros(size, dtype=torch.uint8)
            if rank == 0:
                pack_bucket(buf, self.meta, members, self.tensors)
            self.plan_buffers.append(buf)

    # --- the methods: (sender, receiver) ---------------------------------------------
    def transport_send(self) -> None:
        TimedTransport(None, TIMEOUT, torch.device("cpu")).send_checkpoint([1], self.state)

    def transport_inplace_recv(self) -> None:
        self.received = TimedTransport(None, TIMEOUT, torch.device("cpu"),
                                       state_dict=lambda: self.dest).recv_checkpoint(0)

    def transport_alloc_recv(self) -> None:
        self.received = TimedTransport(None, TIMEOUT, torch.device("cpu")).recv_checkpoint(0)

    def single_send_send(self) -> None:
        dist.send(self.flat, 1)

    def single_send_recv(self) -> None:
        dist.recv(self.flat_buf, 0)
        self.received = self.flat_buf

    def split_send_send(self) -> None:
        pg = dist.group.WORLD
        for work in [pg.send([b], 1, 300 + m) for m, b in enumerate(self.splits[self.split])]:
            work.wait()

    def split_send_recv(self) -> None:
        pg = dist.group.WORLD
        for work in [pg.recv([b], 0, 300 + m) for m, b in enumerate(self.splits[self.split])]:
            work.wait()
        self.received = self.flat_buf

    def chunked_send_send(self) -> None:
        pg, c = dist.group.WORLD, DEFAULT_BUCKET
        in_flight: List[Any] = [None, None]
        for m, off in enumerate(range(0, self.total, c)):
            if in_flight[m % 2] is not None:
                in_flight[m % 2].wait()
            in_flight[m % 2] = pg.send([self.flat[off:off + c]], 1, 100 + m)
        for w in in_flight:
            if w is not None:
                w.wait()

    def chunked_send_recv(self) -> None:
        pg, c = dist.group.WORLD, DEFAULT_BUCKET
        offs = list(range(0, self.total, c))
        work = pg.recv([self.flat_buf[0:c]], 0, 100)
        for m in range(len(offs)):
            work.wait()
            if m + 1 < len(offs):  # posted one ahead, like the transport's receiver
                work = pg.recv([self.flat_buf[offs[m + 1]:offs[m + 1] + c]], 0, 101 + m)
        self.received = self.flat_buf

    def plan_pattern_send(self) -> None:
        pg = dist.group.WORLD
        for work in [pg.send([b], 1, 200 + m) for m, b in enumerate(self.plan_buffers)]:
            work.wait()

    def plan_pattern_recv(self) -> None:
        pg = dist.group.WORLD
        for work in [pg.recv([b], 0, 200 + m) for m, b in enumerate(self.plan_buffers)]:
            work.wait()
        self.received = self.plan_buffers

    def per_tensor_send_send(self) -> None:
        for t in self.tensors:
            dist.send(t, 1)

    def per_tensor_send_recv(self) -> None:
        for t in self.dest_tensors:
            dist.recv(t, 0)
        self.received = self.dest

    def broadcast_object_send(self) -> None:
        dist.broadcast_object_list([self.state], src=0)

    def broadcast_object_recv(self) -> None:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        self.received = box[0]

    def fns(self, method: str) -> Callable[[], None]:
        base = method.split("@")[0]
        if self.rank == 0:
            return self.transport_send if base.startswith("transport") else getattr(self, f"{base}_send")
        return getattr(self, f"{base}_recv")

    # --- the check ---------------------------------------------------------------------
    def zero_destinations(self) -> None:
        if self.rank == 1:
            for t in self.dest_tensors:
                t.zero_()
            for b in self.plan_buffers:
                b.zero_()
            self.flat_buf.zero_()
            self.dest["step"] = 0

    def verify(self, method: str) -> bool:
        """On rank 1: did the last call deliver the sent values?"""
        base = method.split("@")[0]
        got = self.received
        if base in ("single_send", "chunked_send", "split_send"):
            off, ok = 0, True
            for t in self.tensors:
                n = t.numel() * t.element_size()
                ok = ok and torch.equal(got[off:off + n], byte_view(t))
                off += n
            return ok and off == got.numel()
        if base == "per_tensor_send":
            return all(torch.equal(a, b) for a, b in zip(self.tensors, self.dest_tensors))
        if base == "plan_pattern":  # every received message holds the sender's bytes
            for (size, members), buf in zip(self.plan, got):
                expected = torch.zeros(size, dtype=torch.uint8)
                pack_bucket(expected, self.meta, members, self.tensors)
                if not torch.equal(buf, expected):
                    return False
            return True
        ok = got["step"] == 1234 and list(got["model"]) == list(self.state["model"])
        ok = ok and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(self.tensors, got["model"].values()))
        if base == "transport_inplace":  # in place: the receiver's own tensors
            ok = ok and all(a is b for a, b in zip(got["model"].values(), self.dest_tensors))
        return ok

    # --- one timed call ----------------------------------------------------------------
    def run(self, method: str, check: bool) -> Dict[str, Any]:
        self.split = int(method.split("@")[1]) if method.startswith("split_send@") else 0
        # on both ranks (only the sender's sizes count: they travel with its metadata)
        transport.BUCKET_BYTES, transport.ALONE_BYTES = transport_sizes(method)
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
        transport.BUCKET_BYTES, transport.ALONE_BYTES = DEFAULT_BUCKET, DEFAULT_ALONE
        out = {"s": elapsed, "extra_mib": mem.extra_mib, "verified": ok, "gc_s": gc_s, "gc_full": gc_full,
               "cpu_s": cpu_s}
        if "data_start" in ph:  # the transport's receiver
            out.update(meta_s=ph["data_start"] - start, data_s=ph["data_end"] - ph["data_start"],
                       after_s=start + elapsed - ph["data_end"], messages=ph["messages"], check_s=ph["check_s"])
        elif "header_sent" in ph:  # the transport's sender
            out.update(plan_s=ph["header_sent"] - start, first_data_s=ph["first_data_sent"] - start)
        return out

    def copy_cost(self) -> Tuple[float, int, int]:
        """Seconds to pack every bucket of the default plan into a reused buffer the way the
        sender does, alone in this process, nothing sent (median of 3); and how many tensors
        and bytes the plan packs."""
        meta = transport_plan(self.tensors)
        columns = meta.columns
        buckets = [(size, members) for size, members in meta.messages if not transport._alone(columns, size, members)]
        buf = torch.empty(max((size for size, _ in buckets), default=0), dtype=torch.uint8)
        buf.zero_()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            for size, members in buckets:
                pack_bucket(buf[:size], meta, members, self.tensors)
            times.append(time.perf_counter() - start)
        packed = [i for _, members in buckets for i in members]
        return statistics.median(times), len(packed), sum(columns.nbytes[i] for i in packed)


def gather(value: Any) -> List[Any]:
    out: List[Any] = [None, None]
    dist.all_gather_object(out, value)
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    """One rank: build the state, warm up + check, run the rounds; rank 0 writes the raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        me = Rank(rank, args)
        methods = list(BASE_METHODS if args.broadcast_object else BASE_METHODS[:-1])
        methods += [f"split_send@{n}" for n in args.split_counts]
        methods += [f"transport_inplace@{b}" for b in args.sweep_mib if b * MiB != DEFAULT_BUCKET]
        methods += [f"transport_inplace@alone{k}" for k in args.sweep_alone_kib if k * 1024 != DEFAULT_ALONE]
        warmup = {}
        for m in methods:
            r = me.run(m, check=True)
            warmup[m] = gather(r)
        if rank == 1:
            print("[warm-up] verified: " + ", ".join(f"{m} {warmup[m][1]['verified']}" for m in methods), flush=True)
        rounds = []
        for rnd in range(args.rounds):
            k = rnd % len(methods)
            order = methods[k:] + methods[:k]
            res = {m: gather(me.run(m, check=False)) for m in order}
            rounds.append({"order": order, **res})
            if rank == 0:
                print(f"round {rnd + 1}/{args.rounds} recv s: "
                      + "  ".join(f"{m} {res[m][1]['s']:.3f}" for m in methods), flush=True)
        copy_s, packed_count, packed_bytes = me.copy_cost() if rank == 0 else (None, None, None)
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
                           "default_bucket_mib": DEFAULT_BUCKET / MiB,
                           "sender_pack_copy_s": copy_s, "packed_tensors": packed_count,
                           "plan_messages": len(me.plan),
                           "packed_bytes": packed_bytes, "warmup": warmup, "rounds": rounds}, f)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- reporting


def summarize(raw: Dict[str, Any]) -> Dict[str, Any]:
    rounds, total = raw["rounds"], raw["total_bytes"]
    per = {}
    for m in raw["methods"]:
        recv = [r[m][1]["s"] for r in rounds]
        send = [r[m][0]["s"] for r in rounds]
        d = {
            "recv_s": recv, "send_s": send,
            "recv_median_s": statistics.median(recv), "recv_min_s": min(recv), "recv_max_s": max(recv),
            "send_median_s": statistics.median(send),
            "GBps": total / 1e9 / statistics.median(recv),
            "peak_extra_mib_per_rank": [max(r[m][k]["extra_mib"] for r in rounds) for k in range(2)],
            "cpu_median_s_per_rank": [statistics.median(r[m][k]["cpu_s"] for r in rounds) for k in range(2)],
            "gc_median_s_per_rank": [statistics.median(r[m][k]["gc_s"] for r in rounds) for k in range(2)],
            "gc_max_s_per_rank": [max(r[m][k]["gc_s"] for r in rounds) for k in range(2)],
            "calls_with_full_gc_per_rank": [sum(r[m][k]["gc_full"] > 0 for r in rounds) for k in range(2)],
            "verified": raw["warmup"][m][1]["verified"],
            "bucket_mib": transport_sizes(m)[0] / MiB if m.startswith("transport") or m == "chunked_send" else None,
        }
        if "meta_s" in rounds[0][m][1]:
            for key in ("meta_s", "check_s", "data_s", "after_s"):
                d[f"recv_{key}_median"] = statistics.median(r[m][1][key] for r in rounds)
            for key in ("plan_s", "first_data_s"):
                d[f"send_{key}_median"] = statistics.median(r[m][0][key] for r in rounds)
            d["messages"] = rounds[0][m][1]["messages"]
        per[m] = d
    single = per["single_send"]["recv_median_s"]
    ratios = {f"{m} / single_send": per[m]["recv_median_s"] / single for m in raw["methods"] if m != "single_send"}
    paired = {f"{m} / single_send": statistics.median(r[m][1]["s"] / r["single_send"][1]["s"] for r in rounds)
              for m in raw["methods"] if m != "single_send"}
    best = {f"{m} / single_send": per[m]["recv_min_s"] / per["single_send"]["recv_min_s"]
            for m in raw["methods"] if m != "single_send"}
    targets = {}
    for m in ("transport_inplace", "transport_alloc"):
        key = f"{m} / single_send"
        targets[f"{key} <= {TARGET}"] = ratios[key] <= TARGET and best[key] <= TARGET
    return {**{k: v for k, v in raw.items() if k != "rounds"}, "rounds": rounds, "per_method": per,
            "ratios": ratios, "paired_median_ratios": paired, "best_ratios": best, "targets_met": targets}


def format_table(s: Dict[str, Any]) -> str:
    lo, med, hi = s["tensor_bytes_min_median_max"]
    large = s["large_tensor_mib"]
    lines = [
        f"rank 0 -> rank 1, gloo on 127.0.0.1: {s['num_tensors']} tensors ({s['num_bf16']} bf16, rest fp32; "
        f"{lo} B - {hi / MiB:.1f} MiB, median {med / 1024:.1f} KiB; {s['num_tensors'] - NUM_LARGE} small = "
        f"{s['small_tensor_bytes_total'] / MiB:.1f} MiB, {NUM_LARGE} large {min(large):.1f}-{max(large):.1f} MiB), "
        f"{s['total_bytes'] / MiB:.1f} MiB in all; {len(s['rounds'])} rounds, medians of the receiver's time "
        f"from a barrier until it has everything; GB = 1e9 bytes",
        f"{'method':<23}{'bucket':>7}{'msgs':>6}{'recv s':>8}{'min s':>7}{'max s':>7}{'GB/s':>7}"
        f"{'x single':>9}{'paired':>8}{'best':>6}{'send s':>8}{'meta s':>8}{'data s':>8}{'+MiB r0/r1':>12}"
        f"{'cpu s r0/r1':>13}{'gc ms r0/r1':>13}{'full gc':>9}  verified",
    ]
    for m, r in s["per_method"].items():
        bucket = f"{r['bucket_mib']:.0f}M" if r["bucket_mib"] is not None else "-"
        ratio = s["ratios"].get(f"{m} / single_send", 1.0)
        paired = s["paired_median_ratios"].get(f"{m} / single_send", 1.0)
        best = s["best_ratios"].get(f"{m} / single_send", 1.0)
        meta = f"{r['recv_meta_s_median']:.3f}" if "recv_meta_s_median" in r else "-"
        data = f"{r['recv_data_s_median']:.3f}" if "recv_data_s_median" in r else "-"
        msgs = str(r["messages"]) if "messages" in r else {
            "single_send": "1", "per_tensor_send": str(s["num_tensors"]), "plan_pattern": str(s["plan_messages"]),
            "chunked_send": str(-(-s["total_bytes"] // int(s["default_bucket_mib"] * MiB)))}.get(
            m, m.split("@")[1] if m.startswith("split_send@") else "-")
        mem = "/".join(f"{x:.0f}" for x in r["peak_extra_mib_per_rank"])
        cpu = "/".join(f"{x:.2f}" for x in r["cpu_median_s_per_rank"])
        gcms = "/".join(f"{x * 1e3:.0f}" for x in r["gc_median_s_per_rank"])
        full = "/".join(str(x) for x in r["calls_with_full_gc_per_rank"])
        lines.append(f"{m:<23}{bucket:>7}{msgs:>6}{r['recv_median_s']:>8.3f}{r['recv_min_s']:>7.3f}"
                     f"{r['recv_max_s']:>7.3f}{r['GBps']:>7.2f}{ratio:>9.2f}{paired:>8.2f}{best:>6.2f}"
                     f"{r['send_median_s']:>8.3f}{meta:>8}{data:>8}{mem:>12}{cpu:>13}{gcms:>13}{full:>9}  {r['verified']}")
    ti = s["per_method"]["transport_inplace"]
    lines.append(f"transport_inplace, medians: receiver: header+metadata+agreement {ti['recv_meta_s_median']:.3f} s "
                 f"(its check of the metadata {ti['recv_check_s_median']:.3f} s), data {ti['recv_data_s_median']:.3f} s, "
                 f"unflatten {ti['recv_after_s_median']:.3f} s; sender: flatten+pickle until the header goes out "
                 f"{ti['send_plan_s_median']:.3f} s, first data message at {ti['send_first_data_s_median']:.3f} s")
    lines.append(f"sender's packing of the {s['packed_tensors']} tensors it puts into buckets "
                 f"({s['packed_bytes'] / MiB:.1f} MiB), alone in one process: {s['sender_pack_copy_s']:.3f} s")
    lines.append("x single: ratio of the medians; paired: median of the per-round ratios; best: ratio of the "
                 "fastest rounds (min s)")
    lines.append("targets (x single and best both within): " + ", ".join(f"{k}: {'MET' if ok else 'NOT met'}" for k, ok in s["targets_met"].items()))
    if "library" in s:
        lib = s["library"]
        lines.append(f"library: commit {lib['commit']}{' + local changes to transport.py' if lib['transport_py_modified'] else ''}"
                     f" (transport.py sha1 {lib['transport_py_sha1']})")
    if s.get("malloc_mmap_threshold_kib"):
        lines.append(f"(children ran with MALLOC_MMAP_THRESHOLD_={s['malloc_mmap_threshold_kib']} KiB)")
    if "loadavg_before_after" in s:
        b, a = s["loadavg_before_after"]
        lines.append(f"load average (1/5/15 min) before: {b[0]:.2f} {b[1]:.2f} {b[2]:.2f}, "
                     f"after: {a[0]:.2f} {a[1]:.2f} {a[2]:.2f}")
    return "\n".join(lines)


def library_version() -> Dict[str, Any]:
    """The commit the library is at, whether its working tree differs, and a hash of
    ``transport.py`` as it was when the run started (the file under test)."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "?"
    src = Path(transport.__file__).read_bytes()
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "transport_py_modified": git("status", "--porcelain", "--", "dist_checkpointing/transport.py") != "",
            "transport_py_sha1": hashlib.sha1(src).hexdigest()[:12]}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256, help="total state size, MiB")
    ap.add_argument("--tensors", type=int, default=4000, help="number of tensors")
    ap.add_argument("--small-max-kib", type=float, default=256.0, help="largest small tensor, KiB")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (medians over them)")
    ap.add_argument("--sweep-alone-kib", default="",
                    help="ALONE_BYTES values to sweep, KiB (e.g. 32,128,256; '' for none)")
    ap.add_argument("--split-counts", default="64,861,2000",
                    help="split_send@N methods: the same bytes in N equal messages ('' for none)")
    ap.add_argument("--sweep-mib", default="4,8,16,32,64", help="BUCKET_BYTES values to sweep, MiB ('' for none)")
    ap.add_argument("--no-broadcast-object", dest="broadcast_object", action="store_false",
                    help="skip the broadcast_object_list method")
    ap.add_argument("--malloc-mmap-threshold-kib", type=int, default=0,
                    help="set MALLOC_MMAP_THRESHOLD_ in the ranks (e.g. 1024): a larger allocation that no "
                         "free heap chunk can serve is mmap-ed and returned to the OS when freed, so '+MiB' "
                         "shows the buffers each call allocates (with glibc's default dynamic threshold, freed "
                         "buffers <= 32 MiB stay in the heap and are reused unseen); 0 = glibc default")
    ap.add_argument("--output", default=str(RESULTS_PATH), help="JSON results path")
    args = ap.parse_args()
    args.sweep_mib = [int(x) for x in args.sweep_mib.split(",") if x.strip()]
    args.sweep_alone_kib = [int(x) for x in args.sweep_alone_kib.split(",") if x.strip()]
    args.split_counts = [int(x) for x in args.split_counts.split(",") if x.strip()]
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
