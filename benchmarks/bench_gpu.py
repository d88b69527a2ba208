"""Async save of GPU state (issue 31): what the training loop pays, against a pinned
device-to-host copy and torch DCP; sync save/load against DCP and the raw disk.

One process (world 1, a gloo group), a GPT-like state of ``--size-gib`` GiB on the GPU:
the tensors of ``bench_save_load.py`` (bf16 weights, fp32 layernorms/biases) plus three
fp32 optimizer-like tensors per parameter (``fp32_param``, ``exp_avg``, ``exp_avg_sq``),
about 400 tensors of mixed sizes. Phases, each with interleaved rounds (order rotated by
one each round; medians with min/max), after one untimed warm-up save per method:

A. async, no extra pinned memory:

   * ``d2h``: the floor: a non-blocking copy of every tensor into preallocated pinned
     buffers, then ``torch.cuda.synchronize()``;
   * ``auto`` (the default strategy: "stream" on GPU state), ``stream``, ``copy``, ``fork``:
     ``dist_checkpointing.save(..., async_sharded_save=True)`` + scheduling on one
     ``AsyncCallsQueue``. blocking = until that returns; staged = until
     ``request.wait_for_staging()`` returns (from the call); total = until
     ``maybe_finalize_async_calls(blocking=True)`` returns (checkpoint complete). The
     sharded state dict is built before the clock starts; the blocking time's split as
     ``save`` reports it (``progress_callback``: "plan" = validation + claiming the
     directory, "snapshot" = issuing the staging copies) is in the JSON;
   * ``dcp_default``: ``torch.distributed.checkpoint.async_save`` with its default stager;
     ``dcp_best``: with ``DefaultStager(StagingOptions(pinned, no shared memory (the
     upload runs on a thread), async staging, non-blocking copies))``, one stager reused
     (its pinned buffers are cached), where the installed torch has it. blocking = until
     ``async_save`` returns; staged = until ``staging_completion`` (or = blocking);
     total = until the upload completes. A stager that raises is reported, replaced by a
     fresh one, and the run goes on;
   * device memory: ``torch.cuda.max_memory_allocated()`` rise during each save.

B. bit-exactness of ``auto``/``stream``/``copy``/``fork``: the trainer adds 1 to every
   tensor on the current stream right after the call returns (no wait), the checkpoint is
   loaded back and must equal the state at the call, bit for bit.

C. ``stream`` and ``fork`` again while the process holds ``--pinned-extra-gib`` GiB of
   unrelated, touched pinned memory (``stream`` of phase A is the baseline; both phases
   also hold the floor's pinned buffers, DCP's cached ones and the arenas).

D. sync: ``ours`` (``save`` / ``load`` in place into GPU tensors), ``dcp``
   (``dcp.save`` / ``dcp.load``), ``raw`` (D2H into the pinned buffers + one file written
   and fsynced / read + H2D). Loads with a warm page cache; the first round is verified.

Targets (issue 31): blocking of ``auto`` <= ``dcp_best``'s; staged of ``auto`` <= 1.2x
``d2h``; bit-exact; blocking of ``stream`` with the pinned memory <= 1.2x without (+1 ms);
device memory of ``auto``/``stream`` <= the largest tensor (0 expected: contiguous state).

``--dry-run``: the same code paths with CPU tensors (``auto`` is then "fork"), a small state
and 0.1 GiB of (pageable) extra memory; its figures mean nothing for the targets.

Run (GPU): ``python benchmarks/bench_gpu.py --size-gib 2 --rounds 5`` (~3 min on an H100);
``python benchmarks/bench_gpu.py --dry-run`` anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from _common import build_params, free_port, read_all_files
from _gpu_report import ASYNC, OURS, PINNED, SYNC, summarize, table

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.torch_dist.save import TorchDistSaveShardedStrategy

try:
    from torch.distributed.checkpoint import staging as dcp_staging
except ImportError:  # an old torch
    dcp_staging = None

REPO_ROOT = Path(__file__).resolve().parent.parent
MiB, GiB = 1 << 20, 1 << 30


# ----------------------------------------------------------------------------- the state


def build_state(size_gib: float, device: torch.device) -> Dict[str, torch.Tensor]:
    """~``size_gib`` GiB: bf16 weights (1/7 of the bytes) and 3 fp32 tensors per parameter."""
    gen = torch.Generator(device=device).manual_seed(0)
    state: Dict[str, torch.Tensor] = {}
    for p in build_params(size_gib / 7, 0, 1):
        state[p.key] = p.tensor.to(device)
        shape = tuple(p.tensor.shape)
        for name in ("fp32_param", "exp_avg", "exp_avg_sq"):
            t = torch.randn(shape, generator=gen, device=device)
            state[f"optimizer.state.{name}.{p.key}"] = t.abs_() if name == "exp_avg_sq" else t
    return state


def sharded(state: Dict[str, torch.Tensor]) -> Dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, t) for k, t in state.items()}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------- the bench


class Bench:
    """The state, the buffers, the strategies and the queue of one run."""

    def __init__(self, args: argparse.Namespace, device: torch.device, scratch: Path):
        self.args, self.device, self.scratch = args, device, scratch
        self.cuda = device.type == "cuda"
        self.state = build_state(args.size_gib, device)
        self.dest = {k: torch.empty_like(t) for k, t in self.state.items()}
        self.host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda) for k, t in self.state.items()}
        self.strategies = {m: TorchDistSaveShardedStrategy(async_snapshot=m) for m in ("stream", "copy", "fork")}
        self.strategies["auto"] = None  # the registered default
        self.queue = AsyncCallsQueue()
        self.dcp_stager: Any = None
        self.dcp_errors: List[str] = []
        self.dcp_fresh_stagers = 0
        self.warm = bytearray(64 * MiB)

    # -- helpers
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def dir(self, name: str) -> Path:
        d = self.scratch / name
        shutil.rmtree(d, ignore_errors=True)
        return d

    def device_base(self) -> int:
        self.sync()
        if not self.cuda:
            return 0
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def device_extra(self, base: int) -> float:
        self.sync()
        return (torch.cuda.max_memory_allocated() - base) / MiB if self.cuda else 0.0

    # -- phase A: one async save (or the floor), timed
    def run_async(self, method: str, name: str) -> Dict[str, Any]:
        if method == "d2h":
            self.sync()
            t0 = time.perf_counter()
            for k, t in self.state.items():
                self.host[k].copy_(t, non_blocking=self.cuda)
            self.sync()
            s = time.perf_counter() - t0
            return {"blocking_s": s, "staged_s": s, "total_s": s, "device_extra_mib": 0.0}
        d = self.dir(name)
        sd = sharded(self.state) if method in self.strategies else {k: t for k, t in self.state.items()}
        base = self.device_base()
        t0 = time.perf_counter()
        phases: Dict[str, float] = {}

        def phase_ended(event: Dict[str, Any]) -> None:
            if "seconds" in event:
                phases[event["phase"]] = event["seconds"]

        if method in self.strategies:
            request = dc.save(sd, str(d), sharded_strategy=self.strategies[method], async_sharded_save=True,
                              progress_callback=phase_ended)
            self.queue.schedule_async_request(request)
            t1 = time.perf_counter()
            request.wait_for_staging()
            t2 = time.perf_counter()
            self.queue.maybe_finalize_async_calls(blocking=True)
        else:
            stager = self._stager(method)
            response = dcp.async_save(sd, checkpoint_id=str(d), **({} if stager is None else {"async_stager": stager}))
            t1 = time.perf_counter()
            staging = getattr(response, "staging_completion", None)
            if staging is not None:
                staging.result()
            t2 = time.perf_counter()
            (response.upload_completion if staging is not None else response).result()
        t3 = time.perf_counter()
        out = {"blocking_s": t1 - t0, "staged_s": t2 - t0, "total_s": t3 - t0,
               "device_extra_mib": self.device_extra(base), "save_phases_s": phases}
        shutil.rmtree(d, ignore_errors=True)
        return out

    def _stager(self, method: str) -> Any:
        if method == "dcp_default":
            return None
        if self.dcp_stager is None:
            options = dcp_staging.StagingOptions(use_pinned_memory=self.cuda,
                                                 use_shared_memory=self.args.dcp_shared_memory,
                                                 use_async_staging=True, use_non_blocking_copy=self.cuda)
            self.dcp_stager = dcp_staging.DefaultStager(options)
            self.dcp_fresh_stagers += 1
        return self.dcp_stager

    def dcp_failed(self, method: str, error: BaseException, rnd: int) -> None:
        """Note an error inside DCP; a failed best stager is replaced by a fresh one."""
        self.dcp_errors.append(f"{method} round {rnd}: {type(error).__name__}: {error}"[:500])
        if method == "dcp_best" and self.dcp_stager is not None:
            stager, self.dcp_stager = self.dcp_stager, None
            try:
                stager.close()
            except Exception:  # noqa: BLE001 - a broken stager: dropped
                pass

    # -- phase B
    def bit_exact(self, method: str) -> Dict[str, Any]:
        """The trainer changes every tensor right after the call; the checkpoint must be the state at the call."""
        expected = {k: t.clone() for k, t in self.state.items()}
        d = self.dir(f"exact_{method}")
        request = dc.save(sharded(self.state), str(d), sharded_strategy=self.strategies[method],
                          async_sharded_save=True)
        for t in self.state.values():
            t.add_(1)
        self.queue.schedule_async_request(request)
        self.queue.maybe_finalize_async_calls(blocking=True)
        for t in self.dest.values():
            t.zero_()
        dc.load(sharded(self.dest), str(d))
        shutil.rmtree(d, ignore_errors=True)
        wrong = [k for k, t in self.dest.items() if not torch.equal(t, expected[k])]
        unchanged = [k for k, t in self.state.items() if torch.equal(t, expected[k])]
        return {"bit_exact": not wrong and not unchanged, "wrong": wrong[:5], "not_changed": unchanged[:5]}

    # -- phase D
    def run_sync(self, method: str, name: str, check: bool) -> Dict[str, Any]:
        d = self.dir(name)
        d.mkdir(parents=True)
        self.sync()
        t0 = time.perf_counter()
        getattr(self, f"{method}_save")(d)
        self.sync()
        save_s = time.perf_counter() - t0
        read_all_files(d, self.warm)
        for t in self.dest.values():
            t.zero_()
        self.sync()
        t0 = time.perf_counter()
        getattr(self, f"{method}_load")(d)
        self.sync()
        load_s = time.perf_counter() - t0
        ok = all(torch.equal(t, self.state[k]) for k, t in self.dest.items()) if check else None
        shutil.rmtree(d, ignore_errors=True)
        return {"save_s": save_s, "load_s": load_s, "verified": ok}

    def ours_save(self, d: Path) -> None:
        dc.save(sharded(self.state), str(d))

    def ours_load(self, d: Path) -> None:
        dc.load(sharded(self.dest), str(d))

    def dcp_save(self, d: Path) -> None:
        dcp.save(dict(self.state), checkpoint_id=str(d))

    def dcp_load(self, d: Path) -> None:
        dcp.load(self.dest, checkpoint_id=str(d))

    def raw_save(self, d: Path) -> None:
        for k, t in self.state.items():
            self.host[k].copy_(t, non_blocking=self.cuda)
        self.sync()
        with open(d / "state.bin", "wb", buffering=0) as f:
            for h in self.host.values():
                view = memoryview(h.reshape(-1).view(torch.uint8).numpy())
                done = 0
                while done < len(view):
                    done += f.write(view[done:])
            os.fsync(f.fileno())

    def raw_load(self, d: Path) -> None:
        with open(d / "state.bin", "rb", buffering=0) as f:
            for k, h in self.host.items():
                view = memoryview(h.reshape(-1).view(torch.uint8).numpy())
                done = 0
                while done < len(view):
                    n = f.readinto(view[done:])
                    if not n:
                        raise EOFError("raw: file shorter than the state")
                    done += n
                self.dest[k].copy_(h, non_blocking=self.cuda)


def rotated(methods: tuple, rnd: int) -> List[str]:
    k = rnd % len(methods)
    return list(methods[k:] + methods[:k])


def run(args: argparse.Namespace, device: torch.device, scratch: Path, partial: Callable[[Dict[str, Any]], None]
        ) -> Dict[str, Any]:
    """Every phase; the raw results (``partial`` is given them after each phase)."""
    bench = Bench(args, device, scratch)
    info = {"tensors": len(bench.state), "state_bytes": sum(nbytes(t) for t in bench.state.values()),
            "largest_tensor_bytes": max(nbytes(t) for t in bench.state.values())}
    print(f"state: {info['tensors']} tensors, {info['state_bytes'] / GiB:.2f} GiB on {device}", flush=True)
    has_best = all(hasattr(dcp_staging, name) for name in ("DefaultStager", "StagingOptions"))
    methods = tuple(m for m in ASYNC if m != "dcp_best" or has_best)
    rounds: Dict[str, List[Dict[str, Any]]] = {m: [] for m in (*methods, *PINNED, *SYNC)}
    raw: Dict[str, Any] = {"state": info, "rounds": rounds, "warm_up": {}, "bit_exact": {},
                           "dcp_best_stager": None if not has_best else {
                               "use_pinned_memory": bench.cuda, "use_shared_memory": args.dcp_shared_memory,
                               "use_async_staging": True, "use_non_blocking_copy": bench.cuda},
                           "dcp_errors": bench.dcp_errors}
    try:
        # A: async
        for rnd in range(-1, args.rounds):  # round -1: warm-up (arenas, the writer process, DCP's cached buffers)
            for m in rotated(methods, max(rnd, 0)):
                try:
                    r = bench.run_async(m, f"{m}_{rnd}")
                except Exception as e:  # noqa: BLE001 - DCP's stager: reported, the run goes on
                    if not m.startswith("dcp"):
                        raise
                    bench.dcp_failed(m, e, rnd)
                    continue
                if rnd >= 0:
                    rounds[m].append(r)
                else:
                    raw["warm_up"][m] = r
            if rnd >= 0:
                print(f"A round {rnd} (blocking/staged s): " + ", ".join(
                    f"{m} {rounds[m][-1]['blocking_s']:.4f}/{rounds[m][-1]['staged_s']:.4f}"
                    for m in methods if rounds[m]), flush=True)
        partial(raw)
        # B: bit-exact with the trainer changing every tensor right after the call
        raw["bit_exact"] = {m: bench.bit_exact(m) for m in OURS}
        print("B bit-exact: " + ", ".join(f"{m} {v['bit_exact']}" for m, v in raw["bit_exact"].items()), flush=True)
        partial(raw)
        # C: unrelated pinned memory held by the process
        t0 = time.perf_counter()
        extra = torch.empty(int(args.pinned_extra_gib * GiB), dtype=torch.uint8, pin_memory=bench.cuda)
        extra.fill_(1)
        raw["pinned_alloc_s"] = time.perf_counter() - t0
        for rnd in range(args.rounds):
            for m in rotated(PINNED, rnd):
                rounds[m].append(bench.run_async(m.split("_")[0], f"{m}_{rnd}"))
        del extra
        gc.collect()
        empty_host_cache = (getattr(torch.accelerator, "empty_host_cache", None)
                            or getattr(torch._C, "_host_emptyCache", None))
        if bench.cuda and empty_host_cache is not None:
            empty_host_cache()  # torch's pinned-memory cache would keep it
        print(f"C with {args.pinned_extra_gib} GiB pinned (allocated in {raw['pinned_alloc_s']:.1f} s), blocking s: " +
              ", ".join(f"{m} {statistics.median(r['blocking_s'] for r in rounds[m]):.4f}" for m in PINNED), flush=True)
        partial(raw)
        # D: sync save/load
        for rnd in range(args.rounds):
            for m in rotated(SYNC, rnd):
                rounds[m].append(bench.run_sync(m, f"sync_{m}_{rnd}", check=rnd == 0))
        print("D sync (save/load s): " + ", ".join(
            f"{m} {statistics.median(r['save_s'] for r in rounds[m]):.3f}/"
            f"{statistics.median(r['load_s'] for r in rounds[m]):.3f}" for m in SYNC), flush=True)
    finally:
        bench.queue.close()
        if bench.dcp_stager is not None:
            bench.dcp_stager.close()
    raw["dcp_best_stagers_created"] = bench.dcp_fresh_stagers
    return raw


# ----------------------------------------------------------------------------- main


def fs_type(path: Path) -> str:
    """The file system type of ``path`` (longest matching mount point in /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, fstype = line.split()[:3]
                if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                    best, kind = mount, fstype
    except OSError:
        pass
    return kind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=None, help="GPU state size (default 2; dry run 0.02)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pinned-extra-gib", type=float, default=None, help="unrelated pinned memory held in phase C "
                                                                           "(default 16; dry run 0.1)")
    ap.add_argument("--dcp-shared-memory", action="store_true", help="DCP's best stager with use_shared_memory=True")
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors, small sizes: checks the code paths only")
    ap.add_argument("--dir", default=str(REPO_ROOT.parent / "bench_tmp"), help="scratch directory (on disk, not tmpfs)")
    ap.add_argument("--out", "--output", dest="out", default=str(REPO_ROOT / "benchmarks" / "results" / "gpu.json"))
    args = ap.parse_args()
    args.size_gib = args.size_gib if args.size_gib is not None else (0.02 if args.dry_run else 2.0)
    if args.pinned_extra_gib is None:
        args.pinned_extra_gib = 0.1 if args.dry_run else 16.0
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: use --dry-run")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)  # DCP's async_save needs a CPU backend
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench_gpu_", dir=base))
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    machine = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
               "scratch_fs": fs_type(base), "loadavg_before": load_before}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(report: Dict[str, Any]) -> None:
        out.write_text(json.dumps({"date": started.isoformat(timespec="seconds"), "machine": machine,
                                   "args": vars(args), "dry_run": args.dry_run, **report}, indent=1, default=str))

    try:
        raw = run(args, device, scratch, lambda so_far: write({"partial": True, "raw": so_far}))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        dist.destroy_process_group()
    summary = summarize(raw, args.dry_run)
    machine["loadavg_after"] = os.getloadavg()
    print(f"\n{'DRY RUN (CPU tensors): figures not meaningful for the targets. ' if args.dry_run else ''}"
          f"{machine['gpu'] or 'CPU'}, torch {torch.__version__}, {raw['state']['state_bytes'] / GiB:.2f} GiB, "
          f"{args.rounds} rounds, scratch on {machine['scratch_fs']}\n")
    print(table(raw, summary))
    write({"partial": False, "summary": summary, "raw": raw})
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
