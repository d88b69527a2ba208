"""The checkpoint manager's cost: its own overhead per save, and background deletion vs a save.

* ``overhead`` (world sizes ``--world-sizes``): per round, interleaved in rotating order,
  ``plain`` = ``dist_checkpointing.save(state, fresh_dir)`` and ``manager`` =
  ``CheckpointManager.save(step, state, metrics)`` (sync, ``save_interval_steps=2``,
  ``keep_last=2``; its background work is waited for, untimed, before the next
  measurement), each timed between barriers, max over ranks (``_common.timed_collective``).
  ``--state-mib`` MiB of float32 tensors, split over the ranks. Reported: the medians, and
  the median over rounds of ``manager - plain``; ``decision``: a ``save`` call off the
  interval (it returns ``False``), the manager's per-call collectives and checks without
  the save; ``own`` (the target, ≤ 5 ms): a further ``CheckpointManager.save`` timed on each
  rank minus the time of the library ``save`` it called (wrapped to time it), max over
  ranks — the manager's own work per save, without the noise of two separate saves.
* ``deletion`` (world 1): a ``--save-mib`` MiB save into a fresh directory, interleaved:
  ``alone``; ``with_deletion``: the manager's background worker (:class:`RootWorker`) has
  started deleting a committed ``--delete-gib`` GiB checkpoint (its ``metadata.json`` is
  gone) when the save starts, and the save holds further deletion as
  ``CheckpointManager.save`` does (the 64 MiB piece being deleted finishes, the rest
  waits); ``with_deletion_unpaused``: the same without the hold. Before every method
  (``alone`` too, which deletes it after its save) the victim is written and ``sync``-ed,
  untimed. Reported: median save times, the median per-round ratio to ``alone`` (target
  ≤ 1.10 for ``with_deletion``), and when each deletion ended.

Run: ``python benchmarks/bench_manager.py [--rounds 41] [--state-mib 4] [--world-sizes 1,2]
[--delete-rounds 15] [--save-mib 256] [--delete-gib 1.0]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import CheckpointManager, ShardedTensor, serialization
from dist_checkpointing.manager.worker import RootWorker
from dist_checkpointing.storage import PosixStorage

from _common import add_scratch_and_output_flags, closing_lines, spawn_ranks, timed_collective, write_report

HERE = Path(__file__).resolve().parent
TENSORS = 8


def _state(rank: int, world: int, mib: float) -> dict:
    """``TENSORS`` float32 tensors of ``mib`` MiB in all, each split over the ranks."""
    per = max(world, int(mib * (1 << 20) / 4 / TENSORS) // world * world)
    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.rand(per // world), (0, rank, world))
            for i in range(TENSORS)}


class _InnerSaveTimer:
    """Wraps the ``save`` the manager calls, remembering how long the last call took."""

    def __init__(self) -> None:
        self.orig = serialization.save
        self.last = 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.orig(*args, **kwargs)
        finally:
            self.last = time.perf_counter() - start


def _own_time(mgr: CheckpointManager, inner: _InnerSaveTimer, step: int, state: dict) -> float:
    """Seconds of ``mgr.save`` outside the library's ``save`` it calls, max over ranks."""
    dist.barrier()
    start = time.perf_counter()
    mgr.save(step, state, metrics={"loss": 1.0 / (step + 1)})
    own = torch.tensor([time.perf_counter() - start - inner.last])
    dist.all_reduce(own, op=dist.ReduceOp.MAX)
    return float(own.item())


def _overhead_worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    inner = _InnerSaveTimer()
    serialization.save = inner  # what the manager calls (``dc.save``, the plain method, is the original)
    scratch = Path(args.dir) / f"overhead_w{world}"
    state = _state(rank, world, args.state_mib)
    rounds: List[Dict[str, float]] = []
    with CheckpointManager(str(scratch / "root"), save_interval_steps=2, keep_last=2) as mgr:
        for rnd in range(args.rounds + 1):  # round 0 warms up
            order = ["plain", "manager"] if rnd % 2 == 0 else ["manager", "plain"]
            times: Dict[str, float] = {}
            for method in order:
                if method == "plain":
                    target = scratch / f"plain_{rnd}"
                    times[method] = timed_collective(lambda: dc.save(state, str(target)))[0]
                    dist.barrier()
                    if rank == 0:
                        shutil.rmtree(target)
                else:
                    times[method] = timed_collective(
                        lambda: mgr.save(4 * rnd, state, metrics={"loss": 1.0 / (rnd + 1)}))[0]
                    mgr.wait_until_finished()
                    # off the interval: the decision alone (what every call costs besides the save)
                    times["decision"] = timed_collective(lambda: mgr.save(4 * rnd + 1, state))[0]
                    times["own"] = _own_time(mgr, inner, 4 * rnd + 2, state)  # a second save, not timed as a whole
                    mgr.wait_until_finished()
                dist.barrier()
            if rnd:
                rounds.append(times)
    dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(rounds))


def _deletion_rounds(args: argparse.Namespace) -> List[Dict[str, float]]:
    scratch = Path(args.dir) / "deletion"
    scratch.mkdir(parents=True)
    storage = PosixStorage(str(scratch))
    worker = RootWorker(storage, lambda name: PosixStorage(str(scratch / name)))
    victim = scratch / "iter_0000001"
    victim_state = _state(0, 1, args.delete_gib * 1024)
    state = _state(0, 1, args.save_mib)
    methods = ["alone", "with_deletion", "with_deletion_unpaused"]
    rounds = []
    try:
        for rnd in range(args.delete_rounds + 1):  # round 0 warms up
            times: Dict[str, float] = {}
            for method in methods[rnd % 3:] + methods[:rnd % 3]:
                dc.save(victim_state, str(victim))  # for every method: the same state of the disk
                os.sync()
                target = scratch / f"save_{method}"
                start = time.perf_counter()
                if method != "alone":
                    worker.delete(victim.name, committed=True)
                    while (victim / "metadata.json").exists():  # the deletion has started
                        time.sleep(0.0005)
                if method == "with_deletion":  # what CheckpointManager.save does around a save
                    worker.hold_deletions()
                save_start = time.perf_counter()
                dc.save(state, str(target))
                times[method] = time.perf_counter() - save_start
                if method == "with_deletion":
                    worker.release_deletions()
                if method == "alone":
                    worker.delete(victim.name, committed=True)  # untimed
                worker.wait()
                if method != "alone":
                    times[f"{method}_deletion_s"] = time.perf_counter() - start  # until the deletion ended
                assert not victim.exists()
                shutil.rmtree(target)
                os.sync()
            if rnd:
                rounds.append(times)
    finally:
        worker.stop()
    return rounds


def _deletion_worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rounds = _deletion_rounds(args)
    dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--state-mib", type=float, default=4.0)
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--delete-rounds", type=int, default=15)
    ap.add_argument("--save-mib", type=float, default=256.0)
    ap.add_argument("--delete-gib", type=float, default=1.0)
    add_scratch_and_output_flags(ap, HERE.parent.parent / "bench_tmp", HERE / "results" / "bench_manager.json")
    args = ap.parse_args()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    args.dir = tempfile.mkdtemp(prefix="bench_manager_", dir=base)
    started = datetime.datetime.now().astimezone()
    results: Dict[str, object] = {"loadavg_before": os.getloadavg()}
    met: Dict[str, bool] = {}
    try:
        for world in [int(w) for w in args.world_sizes.split(",") if w.strip()]:
            rounds = spawn_ranks(_overhead_worker, world, args)
            plain = statistics.median(r["plain"] for r in rounds)
            managed = statistics.median(r["manager"] for r in rounds)
            overhead = statistics.median(r["manager"] - r["plain"] for r in rounds)
            decision = statistics.median(r["decision"] for r in rounds)
            own = statistics.median(r["own"] for r in rounds)
            results[f"overhead_world{world}"] = {"plain_s": plain, "manager_s": managed, "overhead_s": overhead,
                                                 "decision_s": decision, "own_s": own, "rounds": rounds}
            met[f"overhead world {world} <= 5 ms"] = own <= 0.005
            print(f"[world {world}] {args.state_mib:g} MiB: plain save {plain * 1e3:.1f} ms, manager.save "
                  f"{managed * 1e3:.1f} ms, overhead (median of per-round differences) {overhead * 1e3:.2f} ms; "
                  f"a call off the interval (the decision alone) {decision * 1e3:.2f} ms; manager.save's own time "
                  f"(outside the library's save it calls) {own * 1e3:.2f} ms",
                  flush=True)
        rounds = spawn_ranks(_deletion_worker, 1, args)
        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        ratio = statistics.median(r["with_deletion"] / r["alone"] for r in rounds)
        unpaused = statistics.median(r["with_deletion_unpaused"] / r["alone"] for r in rounds)
        results["deletion"] = {"medians": med, "ratio": ratio, "ratio_unpaused": unpaused, "rounds": rounds}
        met["save with a 1 GiB deletion running <= 1.10x"] = ratio <= 1.10
        print(f"[deletion] {args.save_mib:g} MiB save: alone {med['alone']:.3f} s; with a {args.delete_gib:g} GiB "
              f"deletion running: {med['with_deletion']:.3f} s (x{ratio:.3f}, median of per-round ratios; the "
              f"deletion then ends {med['with_deletion_deletion_s']:.3f} s after it started), without the pause "
              f"{med['with_deletion_unpaused']:.3f} s (x{unpaused:.3f}; deletion "
              f"{med['with_deletion_unpaused_deletion_s']:.3f} s)", flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    results["loadavg_after"] = os.getloadavg()
    summary = {"targets_met": met, "loadavg_before_after": [results["loadavg_before"], results["loadavg_after"]]}
    for line in closing_lines(summary):
        print(line)
    out = write_report(args.output, started, vars(args), "results", results)
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
