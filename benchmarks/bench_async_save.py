"""Async save: how long the training loop is blocked, how long until the checkpoint is final,
and what the copy-on-write snapshot costs the next in-place update; torch DCP as the anchor.

Each rank holds its own ``--size-gib`` GiB GPT-like state (the tensors of
``bench_save_load.py``, TP-split over the ranks, with the small layernorms/biases split too,
so nothing is replicated and every rank writes its full share). Per round and method,
each timing is taken on every rank and the max over ranks is reported:

* ``memcpy`` / ``memcpy_1t``: one copy of the local state into preallocated, already
  touched tensors of the same shapes (``dst.copy_(src)`` per tensor), with torch's default
  threads and with ``torch.set_num_threads(1)``; the faster median is the reference.
* ``sync``: ``dist_checkpointing.save(sd, dir)``.
* ``async``: blocking = ``req = save(sd, dir, async_sharded_save=True)`` +
  ``queue.schedule_async_request(req)`` (one ``AsyncCallsQueue`` per rank, reused); total =
  from the start of ``save`` until ``queue.maybe_finalize_async_calls(blocking=True)``
  returns (``metadata.json`` written), nothing done in between. Also: when the forked
  writer finished (``write``), and the sharding validation and the fork inside ``save``.
* ``async_copy``: the same with ``TorchDistSaveShardedStrategy(async_snapshot="copy")``
  (one strategy per rank, reused): the state is copied into the shared staging arena kept
  from the previous save (made and touched untimed before the first round, as a previous
  save would have, and the persistent writer started), then written by this process's
  persistent writer process; ``write`` is when its reply arrived. The arena stays
  resident across rounds (a second copy of the state in the RSS the fork of ``async``
  sees, as in a trainer that uses both).
* ``dcp``: ``torch.distributed.checkpoint.save`` of the same tensors as plain tensors.
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` (default thread executor and
  stager; its collectives run on a gloo group of their own): blocking until the Future is
  returned, total until ``future.result()``.
* ``async_step`` / ``async_copy_step`` / ``dcp_async_step``: the training-loop impact. An in-place update of the
  whole local state (``t.add_(1.0)`` on every tensor, like an optimizer step) is timed
  with no save in flight, then the async save is started and the same update is timed
  right after it returns (the writer running), then the save is finalized. Pages shared
  with our forked writer are copied by the kernel on their first write; DCP copies the
  state up front instead. In round 1 the checkpoint is loaded back and compared (xxh3 of
  every tensor) with the values from before the update.

``async`` and ``dcp_async`` also time the first update after the save is finalized: after
a fork every private page of the process stays write-protected until its first write,
even once the writer has exited.

Methods run interleaved in rotating order; every checkpoint goes to a fresh directory
that is deleted (and ``sync``-ed) right after its measurement.

``--thp`` runs the ranks with ``THP_MEM_ALLOC_ENABLE=1``: torch's CPU allocator then
asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``) for allocations of 2 MiB or
more, so the state sits in 2 MiB pages and a fork copies one page-table entry per 2 MiB
instead of 512 (the user guide's tuning note). The ranks' ``AnonHugePages`` is reported.

Run: ``python benchmarks/bench_async_save.py [--size-gib 1.0] [--rounds 5] [--world-sizes 1,2] [--thp]``
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from _common import (
    Param,
    add_scratch_and_output_flags,
    build_params,
    clean_dir,
    closing_lines,
    gather_floats,
    hidden_size_for,
    nbytes,
    run_world_sizes,
    spawn_ranks,
)

import dist_checkpointing
from dist_checkpointing import ShardedTensor
from dist_checkpointing import serialization as ser
from dist_checkpointing.integrity.checksums import checksum
from dist_checkpointing.runtime import persistent_worker
from dist_checkpointing.strategies.torch_dist import save as torch_dist_save
from dist_checkpointing.strategies.torch_dist.writing import arena_plan
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, ForkedCall
from dist_checkpointing.tensors.bytes_view import tensor_bytes

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_async_save.json"
METHODS = ("memcpy", "memcpy_1t", "sync", "async", "async_step", "async_copy", "async_copy_step", "dcp", "dcp_async",
           "dcp_async_step")
STEP_METHODS = ("async_step", "async_copy_step", "dcp_async_step")
BLOCKING_VS_MEMCPY = 0.8  # async blocking <= 0.8 x one memcpy of the local state
BLOCKING_VS_SYNC = 0.1  # async blocking <= 0.1 x sync save
TOTAL_VS_SYNC = 1.2  # async total (finalized) <= 1.2 x sync save
MiB = 1 << 20

# ----------------------------------------------------------------------------- the state


def build_local_state(size_gib: float, rank: int, world: int) -> List[Param]:
    """This rank's ~``size_gib`` GiB: the GPT-like model of ``bench_save_load.py`` sized
    ``size_gib * world`` GiB in total and TP-split, with its replicated tensors (layernorms,
    row-parallel biases) split along axis 0 as well, so no tensor is replicated."""
    params = build_params(size_gib * world, rank, world)
    for p in params:
        if p.tp_axis is None:
            n = p.tensor.shape[0] // world
            p.tensor = p.tensor.narrow(0, rank * n, n).clone()
            p.tp_axis = 0
    return params


# ----------------------------------------------------------------------------- instrumentation

# Timestamps from inside the library, recorded by thin wrappers (benchmark-only): the
# sharding validation and the fork happen inside ``save``; ``_wait_for_writer`` returns on
# the queue's worker thread when the forked writer has finished.
_probe: Dict[str, float] = {}


class _TimedForkedCall(ForkedCall):
    def __init__(self, fn, what):
        _probe["rss_at_fork_mib"] = _rss_mib()
        start = time.perf_counter()
        super().__init__(fn, what)
        _probe["fork_s"] = time.perf_counter() - start


_orig_validate = ser.validate_sharding_integrity
_orig_wait_for_writer = torch_dist_save._wait_for_writer


def _timed_validate(*args, **kwargs):
    start = time.perf_counter()
    try:
        return _orig_validate(*args, **kwargs)
    finally:
        _probe["validation_s"] = time.perf_counter() - start


def _timed_wait_for_writer(writer, written):
    _orig_wait_for_writer(writer, written)
    _probe["writer_done_t"] = time.perf_counter()


_orig_job_result = persistent_worker.Job.result


def _timed_job_result(self, timeout=None):  # copy mode: the persistent writer's reply
    value = _orig_job_result(self, timeout)
    _probe["writer_done_t"] = time.perf_counter()
    return value


def install_probes() -> None:
    """Wrap the library's validation, fork and writer wait with timers (module globals)."""
    torch_dist_save.ForkedCall = _TimedForkedCall
    torch_dist_save._wait_for_writer = _timed_wait_for_writer
    persistent_worker.Job.result = _timed_job_result
    ser.validate_sharding_integrity = _timed_validate


def _proc_mib(path: str, field: str) -> float:
    """A ``field: N kB`` line of a ``/proc`` file, in MiB."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mib() -> float:
    return _proc_mib("/proc/self/status", "VmRSS")


def _anon_huge_mib() -> float:
    """This process's memory in transparent huge pages, MiB."""
    return _proc_mib("/proc/self/smaps_rollup", "AnonHugePages")


# ----------------------------------------------------------------------------- helpers


def max_over_ranks(values: List[float]) -> List[float]:
    """Element-wise max of ``values`` over all ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_ranks_true(ok: bool) -> bool:
    """True if ``ok`` on every rank."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def checksums(tensors: List[torch.Tensor]) -> List[int]:
    """xxh3-64 of every tensor's bytes."""
    return [checksum(tensor_bytes(t)) for t in tensors]


def timed_barriered(fn: Callable[[], None]) -> float:
    """Seconds of ``fn`` (barrier before; own time; max over ranks)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return max_over_ranks([elapsed])[0]


# ----------------------------------------------------------------------------- methods


class Bench:
    """Every method for one rank.

    A fork write-protects every private page of this process, and the first write to each
    page afterwards faults (the kernel copies the page while the writer is alive, and only
    re-enables writing once it has exited). So every timed update and copy below follows
    an untimed one that makes its pages writable again, and the destination tensors of the
    memcpy and of the round-1 loads exist only while they are used: the process holds the
    state, torch and nothing else when it forks (its RSS at the fork is reported).
    """

    def __init__(self, params: List[Param], rank: int, world: int, dcp_group, update_threads: int):
        self.params, self.rank, self.world, self.dcp_group = params, rank, world, dcp_group
        self.update_threads = update_threads  # 0: torch's default
        self.tensors = [p.tensor for p in params]
        self.queue = AsyncCallsQueue()  # created once, reused by every async save
        self.default_threads = torch.get_num_threads()
        self.copy_strategy = torch_dist_save.TorchDistSaveShardedStrategy(async_snapshot="copy")
        self._warm_arenas: set = set()

    def _warm_copy_staging(self, sd: Dict[str, ShardedTensor]) -> None:
        """Untimed, what a previous save of the same structure leaves: the copy strategy's
        staging arena (its pages touched, kept across rounds) and its persistent writer
        (started, the arena handed over)."""
        _, _, size, _ = arena_plan(self.copy_strategy._plan_files(sd))
        arena, done = self.copy_strategy._arenas.take(size)
        done()  # the save takes it next
        if arena.id not in self._warm_arenas:
            arena.flat.fill_(0)
            worker = persistent_worker.shared_worker()
            worker.share_arena(arena.id, arena.fd, arena.size)
            worker.submit(os.getpid).result()
            self._warm_arenas.add(arena.id)

    def sharded(self, tensors: List[torch.Tensor]) -> Dict[str, ShardedTensor]:
        return {p.key: ShardedTensor.from_rank_offsets(p.key, t, (p.tp_axis, self.rank, self.world))
                for p, t in zip(self.params, tensors)}

    def local_dict(self, tensors: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {f"{p.key}.rank{self.rank}": t for p, t in zip(self.params, tensors)}

    def update(self) -> None:
        """One in-place update of the whole local state (an optimizer step's writes)."""
        if self.update_threads:
            torch.set_num_threads(self.update_threads)
        try:
            for t in self.tensors:
                t.add_(1.0)
        finally:
            if self.update_threads:
                torch.set_num_threads(self.default_threads)

    def idle_update(self) -> float:
        """Seconds of an update with no save in flight (after an untimed one), max over ranks."""
        self.update()
        return timed_barriered(self.update)

    # --- the methods: each returns its measurements (max over ranks)

    def _memcpy(self, threads: int) -> Dict[str, object]:
        dest = [torch.empty_like(t) for t in self.tensors]
        torch.set_num_threads(threads)
        try:
            def copy() -> None:
                for dst, src in zip(dest, self.tensors):
                    dst.copy_(src)

            copy()  # untimed: touches the destination pages
            return {"blocking_s": timed_barriered(copy), "threads": threads}
        finally:
            torch.set_num_threads(self.default_threads)

    def run_memcpy(self, d: Path, check: bool) -> Dict[str, object]:
        return self._memcpy(self.default_threads)

    def run_memcpy_1t(self, d: Path, check: bool) -> Dict[str, object]:
        return self._memcpy(1)

    def run_sync(self, d: Path, check: bool) -> Dict[str, object]:
        _probe.clear()
        sd = self.sharded(self.tensors)
        elapsed = timed_barriered(lambda: dist_checkpointing.save(sd, d))
        return {"blocking_s": elapsed, "total_s": elapsed,
                "validation_s": max_over_ranks([_probe.get("validation_s", float("nan"))])[0]}

    def run_dcp(self, d: Path, check: bool) -> Dict[str, object]:
        sd = self.local_dict(self.tensors)
        elapsed = timed_barriered(lambda: dcp.save(sd, checkpoint_id=str(d), process_group=self.dcp_group))
        return {"blocking_s": elapsed, "total_s": elapsed}

    def _start_async_save(self, d: Path, copy: bool) -> Tuple[float, float]:
        """Barrier, then our async save of the state into ``d`` (fork mode, or the copy
        strategy with its buffers filled untimed first), scheduled on the queue; returns
        the clock before ``save`` and after ``schedule_async_request``."""
        sd = self.sharded(self.tensors)
        kwargs = {"sharded_strategy": self.copy_strategy} if copy else {}
        if copy:
            self._warm_copy_staging(sd)
        _probe.clear()
        dist.barrier()
        t0 = time.perf_counter()
        request = dist_checkpointing.save(sd, d, async_sharded_save=True, **kwargs)
        self.queue.schedule_async_request(request)
        return t0, time.perf_counter()

    def run_async(self, d: Path, check: bool, copy: bool = False) -> Dict[str, object]:
        """Our async save alone: blocking time, then wait for the finalized checkpoint; then
        the first update after it (the writer has exited)."""
        update_idle = self.idle_update()
        t0, t1 = self._start_async_save(d, copy)
        self.queue.maybe_finalize_async_calls(blocking=True)
        t2 = time.perf_counter()
        update_after = timed_barriered(self.update)
        blocking, total, write, validation, fork, rss = max_over_ranks([
            t1 - t0, t2 - t0, _probe["writer_done_t"] - t0, _probe.get("validation_s", float("nan")),
            _probe.get("fork_s", float("nan")), _probe.get("rss_at_fork_mib", float("nan"))])
        return {"blocking_s": blocking, "total_s": total, "write_done_s": write, "finalize_s": total - write,
                "validation_s": validation, "fork_s": fork, "rss_at_fork_mib_max": rss,
                "update_idle_s": update_idle, "update_after_s": update_after}

    def run_async_copy(self, d: Path, check: bool) -> Dict[str, object]:
        return self.run_async(d, check, copy=True)

    def run_dcp_async(self, d: Path, check: bool) -> Dict[str, object]:
        """DCP's async save alone: blocking until the Future, then ``future.result()``; then
        the first update after it."""
        update_idle = self.idle_update()
        sd = self.local_dict(self.tensors)
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(sd, checkpoint_id=str(d), process_group=self.dcp_group)
        t1 = time.perf_counter()
        future.result()
        t2 = time.perf_counter()
        update_after = timed_barriered(self.update)
        blocking, total = max_over_ranks([t1 - t0, t2 - t0])
        return {"blocking_s": blocking, "total_s": total, "future_type": type(future).__name__,
                "update_idle_s": update_idle, "update_after_s": update_after}

    def run_async_step(self, d: Path, check: bool, copy: bool = False) -> Dict[str, object]:
        """An update with no save in flight, then our async save followed at once by the
        same update (the writer running), then finalization."""
        update_idle = self.idle_update()
        expected = checksums(self.tensors) if check else None
        t0, t1 = self._start_async_save(d, copy)
        self.update()  # the next training step's writes, writer still running
        t2 = time.perf_counter()
        self.queue.maybe_finalize_async_calls(blocking=True)
        t3 = time.perf_counter()
        done = _probe["writer_done_t"]
        blocking, update_busy, total, write = max_over_ranks([t1 - t0, t2 - t1, t3 - t0, done - t0])
        out = {"blocking_s": blocking, "update_idle_s": update_idle, "update_in_flight_s": update_busy,
               "total_s": total, "write_done_s": write,
               "writer_running_at_update_start": all_ranks_true(done > t1),
               "writer_running_at_update_end": all_ranks_true(done > t2), "verified": None}
        if check:
            out["verified"] = self._verify(
                expected, lambda dest: dist_checkpointing.load(self.sharded(dest), d))
        return out

    def run_async_copy_step(self, d: Path, check: bool) -> Dict[str, object]:
        return self.run_async_step(d, check, copy=True)

    def run_dcp_async_step(self, d: Path, check: bool) -> Dict[str, object]:
        """As ``run_async_step`` with DCP's async save (which copies the state up front)."""
        update_idle = self.idle_update()
        expected = checksums(self.tensors) if check else None
        sd = self.local_dict(self.tensors)
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(sd, checkpoint_id=str(d), process_group=self.dcp_group)
        t1 = time.perf_counter()
        running_at_start = not future.done()
        self.update()
        t2 = time.perf_counter()
        running_at_end = not future.done()
        future.result()
        t3 = time.perf_counter()
        blocking, update_busy, total = max_over_ranks([t1 - t0, t2 - t1, t3 - t0])
        out = {"blocking_s": blocking, "update_idle_s": update_idle, "update_in_flight_s": update_busy,
               "total_s": total, "writer_running_at_update_start": all_ranks_true(running_at_start),
               "writer_running_at_update_end": all_ranks_true(running_at_end), "verified": None}
        if check:
            out["verified"] = self._verify(
                expected, lambda dest: dcp.load(self.local_dict(dest), checkpoint_id=str(d),
                                                process_group=self.dcp_group))
        return out

    def _verify(self, expected: List[int], load: Callable[[List[torch.Tensor]], object]) -> bool:
        """Load into zeroed tensors; True if every rank got ``expected`` (and the update did
        change the state since)."""
        dest = [torch.zeros_like(t) for t in self.tensors]
        dist.barrier()
        load(dest)
        ok = checksums(dest) == expected
        changed = checksums(self.tensors) != expected
        return all_ranks_true(ok and changed)


def malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc), so that memory freed by an earlier
    method (e.g. DCP's staging copies of the smaller tensors) does not stay in the RSS and
    make the next fork slower."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_method(method: str, bench: Bench, base: Path, rnd: int) -> Dict[str, object]:
    """One measurement of ``method`` in a fresh directory, deleted (and synced) afterwards."""
    d = base / f"{method}_round{rnd}"
    gc.collect()
    malloc_trim()
    clean_dir(d, bench.rank)
    if bench.rank == 0 and method not in ("memcpy", "memcpy_1t"):
        d.mkdir(parents=True)
    dist.barrier()
    result = getattr(bench, f"run_{method}")(d, rnd == 0)
    clean_dir(d, bench.rank)
    return result


# ----------------------------------------------------------------------------- worker


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    """One rank: build the state, run every round, rank 0 writes the raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        install_probes()
        # DCP's async save runs its collectives on a background thread: give DCP its own
        # group so they never interleave with this thread's barriers on the default group.
        dcp_group = dist.new_group(backend="gloo")
        params = build_local_state(args.size_gib, rank, world)
        huge_mib = min(gather_floats(_anon_huge_mib()))
        bench = Bench(params, rank, world, dcp_group, args.update_threads)
        base = Path(args.dir) / f"world{world}"
        rounds: List[Dict[str, object]] = []
        for rnd in range(args.rounds):
            order = METHODS[rnd % len(METHODS):] + METHODS[:rnd % len(METHODS)]
            results = {m: run_method(m, bench, base, rnd) for m in order}
            rounds.append({"order": list(order), **results})
            if rank == 0:
                r = results
                print(f"[world {world}] round {rnd + 1}/{args.rounds}: memcpy {r['memcpy']['blocking_s']:.3f}"
                      f" (1 thr {r['memcpy_1t']['blocking_s']:.3f})  sync {r['sync']['total_s']:.3f}"
                      f"  async {r['async']['blocking_s']:.3f}/{r['async']['total_s']:.3f}"
                      f"  copy {r['async_copy']['blocking_s']:.3f}/{r['async_copy']['total_s']:.3f}"
                      f"  dcp {r['dcp']['total_s']:.3f}"
                      f"  dcp_async {r['dcp_async']['blocking_s']:.3f}/{r['dcp_async']['total_s']:.3f}"
                      f"  update idle/in flight: ours {r['async_step']['update_idle_s']:.3f}"
                      f"/{r['async_step']['update_in_flight_s']:.3f}"
                      f" copy {r['async_copy_step']['update_idle_s']:.3f}"
                      f"/{r['async_copy_step']['update_in_flight_s']:.3f}"
                      f" dcp {r['dcp_async_step']['update_idle_s']:.3f}"
                      f"/{r['dcp_async_step']['update_in_flight_s']:.3f}", flush=True)
        bench.queue.close()
        all_bytes = gather_floats(float(nbytes(bench.tensors)))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"world_size": world, "hidden_size": hidden_size_for(args.size_gib * world),
                           "num_tensors_per_rank": len(params), "local_bytes_per_rank": all_bytes,
                           "default_threads": bench.default_threads, "thp": args.thp,
                           "anon_huge_pages_mib_min_over_ranks": huge_mib,
                           "update_threads": args.update_threads or bench.default_threads, "rounds": rounds}, f)
            shutil.rmtree(base, ignore_errors=True)
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> Dict[str, object]:
    """Spawn ``world`` ranks and return their raw results."""
    return spawn_ranks(worker, world, args)


# ----------------------------------------------------------------------------- reporting


def _median(rounds: List[Dict[str, object]], method: str, key: str) -> float:
    return statistics.median(r[method][key] for r in rounds)


def summarize(raw: Dict[str, object]) -> Dict[str, object]:
    """Medians, ratios and targets from raw round results."""
    rounds = raw["rounds"]
    med: Dict[str, Dict[str, float]] = {}
    for m in METHODS:
        keys = [k for k, v in rounds[0][m].items() if isinstance(v, float)]
        med[m] = {k: _median(rounds, m, k) for k in keys}
    for m in STEP_METHODS:
        med[m]["update_delta_s"] = med[m]["update_in_flight_s"] - med[m]["update_idle_s"]
        med[m]["update_delta_paired_s"] = statistics.median(
            r[m]["update_in_flight_s"] - r[m]["update_idle_s"] for r in rounds)
        # what the training loop loses to the save: blocking + the update's slowdown
        med[m]["critical_path_paired_s"] = statistics.median(
            r[m]["blocking_s"] + r[m]["update_in_flight_s"] - r[m]["update_idle_s"] for r in rounds)
        for when in ("start", "end"):
            med[m][f"writer_running_at_update_{when}_rounds"] = sum(
                bool(r[m][f"writer_running_at_update_{when}"]) for r in rounds)
    for m in ("async", "async_copy", "dcp_async"):
        med[m]["update_after_delta_paired_s"] = statistics.median(
            r[m]["update_after_s"] - r[m]["update_idle_s"] for r in rounds)
    ref_method = min(("memcpy", "memcpy_1t"), key=lambda m: med[m]["blocking_s"])
    memcpy_ref = med[ref_method]["blocking_s"]
    a, s, da, ds, c = med["async"], med["sync"], med["dcp_async"], med["dcp"], med["async_copy"]
    ratios = {
        "async_blocking / memcpy_ref": a["blocking_s"] / memcpy_ref,
        "async_blocking / sync": a["blocking_s"] / s["total_s"],
        "async_total / sync": a["total_s"] / s["total_s"],
        "async_copy_blocking / memcpy_ref": c["blocking_s"] / memcpy_ref,
        "async_copy_total / sync": c["total_s"] / s["total_s"],
        "dcp_async_blocking / memcpy_ref": da["blocking_s"] / memcpy_ref,
        "dcp_async_blocking / async_blocking": da["blocking_s"] / a["blocking_s"],
        "dcp_async_total / async_total": da["total_s"] / a["total_s"],
        "dcp_async_total / dcp_sync": da["total_s"] / ds["total_s"],
        "dcp_sync / sync": ds["total_s"] / s["total_s"],
    }
    paired = {
        "async_blocking / sync": statistics.median(r["async"]["blocking_s"] / r["sync"]["total_s"] for r in rounds),
        "async_total / sync": statistics.median(r["async"]["total_s"] / r["sync"]["total_s"] for r in rounds),
        "async_copy_total / sync": statistics.median(r["async_copy"]["total_s"] / r["sync"]["total_s"]
                                                     for r in rounds),
    }
    targets = {
        f"async_blocking <= {BLOCKING_VS_MEMCPY} x memcpy ({ref_method})":
            ratios["async_blocking / memcpy_ref"] <= BLOCKING_VS_MEMCPY,
        f"async_blocking <= {BLOCKING_VS_SYNC} x sync": ratios["async_blocking / sync"] <= BLOCKING_VS_SYNC,
        f"async_total <= {TOTAL_VS_SYNC} x sync": ratios["async_total / sync"] <= TOTAL_VS_SYNC,
    }
    verified = {m: rounds[0][m]["verified"] for m in STEP_METHODS}
    return {**{k: v for k, v in raw.items() if k != "rounds"}, "rounds": rounds, "medians": med,
            "memcpy_reference": ref_method, "ratios": ratios, "paired_median_ratios": paired,
            "verified": verified, "targets_met": targets}


def _fmt(x: Optional[float], width: int = 10, prec: int = 3) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.{prec}f}"


def format_table(s: Dict[str, object]) -> str:
    """A plain-text report of one world size."""
    med = s["medians"]
    n_rounds = len(s["rounds"])
    per_rank_mib = [b / MiB for b in s["local_bytes_per_rank"]]
    names = {"memcpy": f"memcpy ({s['default_threads']} thr)", "memcpy_1t": "memcpy (1 thr)",
             "sync": "sync (ours)", "async": "async (ours)", "async_copy": "async copy", "dcp": "dcp save",
             "dcp_async": "dcp async_save", "async_step": "ours async", "async_copy_step": "ours copy",
             "dcp_async_step": "dcp async_save"}
    lines = [
        f"world size {s['world_size']}: {', '.join(f'{m:.0f}' for m in per_rank_mib)} MiB per rank "
        f"({s['num_tensors_per_rank']} tensors per rank, nothing replicated), {n_rounds} rounds, "
        f"medians in s, max over ranks; torch default threads = {s['default_threads']}"
        + (f"; THP_MEM_ALLOC_ENABLE=1 ({s['anon_huge_pages_mib_min_over_ranks']:.0f} MiB in huge pages)"
           if s.get("thp") else ""),
        f"{'method':<16}{'blocking':>10}{'total':>10}{'write':>10}{'finalize':>10}{'upd idle':>10}"
        f"{'upd after':>10}{'+pair':>10}",
    ]
    for m in ("memcpy", "memcpy_1t", "sync", "async", "async_copy", "dcp", "dcp_async"):
        r = med[m]
        lines.append(f"{names[m]:<16}{_fmt(r['blocking_s'])}{_fmt(r.get('total_s'))}{_fmt(r.get('write_done_s'))}"
                     f"{_fmt(r.get('finalize_s'))}{_fmt(r.get('update_idle_s'))}{_fmt(r.get('update_after_s'))}"
                     f"{_fmt(r.get('update_after_delta_paired_s'))}")
    a = med["async"]
    ref = s["memcpy_reference"]
    rest = a["blocking_s"] - a["validation_s"] - a["fork_s"]
    lines.append(f"memcpy reference: {names[ref]} ({med[ref]['blocking_s']:.3f} s)")
    lines.append(
        f"async blocking breakdown: validation {a['validation_s']:.3f} s, fork {a['fork_s']:.3f} s "
        f"(RSS at fork {a['rss_at_fork_mib_max']:.0f} MiB), rest {rest:.3f} s"
        f" (medians); sync save validation {med['sync']['validation_s']:.3f} s")
    lines.append(f"in-place update of the whole state (t.add_(1.0) per tensor, {s['update_threads']} torch threads) "
                 f"right after the async save returns:")
    lines.append(f"{'save':<16}{'blocking':>10}{'upd idle':>10}{'upd busy':>10}{'+upd':>10}{'+upd pair':>10}"
                 f"{'blk+upd':>10}{'total':>10}  running start/end  verified")
    for m in STEP_METHODS:
        r = med[m]
        running = (f"{r['writer_running_at_update_start_rounds']}/{n_rounds}, "
                   f"{r['writer_running_at_update_end_rounds']}/{n_rounds}")
        lines.append(f"{names[m]:<16}{_fmt(r['blocking_s'])}{_fmt(r['update_idle_s'])}{_fmt(r['update_in_flight_s'])}"
                     f"{_fmt(r['update_delta_s'])}{_fmt(r['update_delta_paired_s'])}{_fmt(r['critical_path_paired_s'])}"
                     f"{_fmt(r['total_s'])}  {running:<17}  {s['verified'][m]}")
    lines.append("ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in s["ratios"].items()))
    lines.append("median of per-round ratios: "
                 + ", ".join(f"{k} = {v:.2f}" for k, v in s["paired_median_ratios"].items()))
    lines.extend(closing_lines(s))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size per rank, GiB")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    ap.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes")
    ap.add_argument("--update-threads", type=int, default=0,
                    help="torch threads for the in-place update (default 0: torch's default)")
    ap.add_argument("--thp", action="store_true",
                    help="run the ranks with THP_MEM_ALLOC_ENABLE=1 (torch's allocator asks for huge pages)")
    add_scratch_and_output_flags(ap, REPO_ROOT.parent / "bench_tmp", RESULTS_PATH)
    return ap.parse_args()


def main() -> None:
    """Run every world size, print the tables and write the JSON."""
    args = parse_args()
    if args.thp:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read by torch in the spawned ranks
    run_world_sizes("bench_async_save", args, run_world, summarize, format_table,
                    {"size_gib_per_rank": args.size_gib, "rounds": args.rounds, "update_threads": args.update_threads,
                     "thp": args.thp})


if __name__ == "__main__":
    main()
