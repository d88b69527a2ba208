"""Two-tier checkpointing: the local tier's save and restore against the persistent tier's.

World ``--world`` (default 4) spawned gloo ranks, 2 simulated nodes (ranks split in two
halves: ``node_of_rank``), each node with its own directory under ``--local-base`` (default
``--dir``: the same disk as the persistent root; ``/dev/shm`` for node-local memory). State: ``--size-mib`` MiB of float32 tensors in all
(8 tensors per rank, each rank its own shard). Per round, interleaved in rotating order:

* saves: ``local`` = ``CheckpointManager(local_dir=, local_interval=1, replication_factor=2)
  .save(step)`` (persistent interval never reached; the default fork snapshot): it blocks
  for the snapshot; writing, replication to the partner node and the per-rank markers run
  in the background; ``local_copy`` = the same with ``local_snapshot="copy"`` (the copy on
  the calling thread); ``persistent_async`` = ``CheckpointManager(async_save=True).save(step)``
  of the same state. Reported: ``blocking`` (the ``save`` call) and ``completion`` (until
  ``wait_until_finished`` returns: every rank's copies written and agreed), between
  barriers, max over ranks.
* restores into preallocated zero tensors: ``own`` = the two-tier manager's ``load()`` with
  every node's directory intact; ``partner`` = the same with the second node's directory
  moved away (its ranks receive the replicas from the first node's ranks);
  ``persistent`` = the persistent manager's ``load()``: a read from the disk (its writer
  uses ``O_DIRECT``, so the checkpoint is not in the page cache), while the local tier's
  files are (written through the page cache, or in ``/dev/shm``). Before each restore the
  saves' dirty pages are written back (``os.sync``, untimed), as after a restart. Each
  restore is checked bit-exact against the saved state.

Targets (issue 24): local blocking ≤ persistent async blocking; partner ≤ 2× own; own and
partner each ≥ 3× faster than persistent.

Run: ``python benchmarks/bench_two_tier.py [--rounds 5] [--size-mib 256] [--world 4]``
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
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from dist_checkpointing import CheckpointManager, ShardedTensor

from _common import add_scratch_and_output_flags, closing_lines, spawn_ranks, write_report

HERE = Path(__file__).resolve().parent
TENSORS = 8


def _state(rank: int, world: int, mib: float, fill: bool) -> dict:
    per = int(mib * (1 << 20) / 4 / TENSORS / world)
    gen = torch.Generator().manual_seed(rank)
    return {f"t{i}": ShardedTensor.from_rank_offsets(
        f"t{i}", torch.rand(per, generator=gen) if fill else torch.zeros(per), (0, rank, world))
        for i in range(TENSORS)}


def _max_over_ranks(values: List[float]) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _timed_save(mgr: CheckpointManager, step: int, state: dict) -> Tuple[float, float]:
    """(blocking, completion) seconds of a save, max over ranks."""
    dist.barrier()
    start = time.perf_counter()
    assert mgr.save(step, state)
    blocking = time.perf_counter() - start
    mgr.wait_until_finished()
    dist.barrier()
    return tuple(_max_over_ranks([blocking, time.perf_counter() - start]))  # type: ignore[return-value]


def _timed_load(mgr: CheckpointManager, target: dict, expected: dict) -> Tuple[float, Tuple[str, int], bool]:
    dist.barrier()
    start = time.perf_counter()
    loaded = mgr.load(target)
    dist.barrier()
    elapsed = _max_over_ranks([time.perf_counter() - start])[0]
    ok = all(torch.equal(loaded[k], expected[k].data) for k in expected)
    return elapsed, mgr.restored_from, ok


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    scratch = Path(args.dir)
    nodes = [r * 2 // world for r in range(world)]
    state = _state(rank, world, args.size_mib, fill=True)
    target = _state(rank, world, args.size_mib, fill=False)
    local_base = Path(args.local_dir)
    node1 = local_base / "node1"
    rounds: List[Dict[str, float]] = []
    checks: Dict[str, object] = {}
    two_tier = CheckpointManager(str(scratch / "two_tier_root"), save_interval_steps=10**9,
                                 local_dir=str(local_base / "node{node}"), local_interval=1,
                                 replication_factor=2, node_of_rank=nodes)
    copying = CheckpointManager(str(scratch / "copy_root"), save_interval_steps=10**9,
                                local_dir=str(local_base / "copy_node{node}"), local_interval=1,
                                replication_factor=2, node_of_rank=nodes, local_snapshot="copy")
    persistent = CheckpointManager(str(scratch / "persistent_root"), async_save=True, keep_last=1)

    def moved_away(fn: Callable[[], Tuple[float, Tuple[str, int], bool]]):
        dist.barrier()
        if rank == 0:
            node1.rename(local_base / "node1_away")
        dist.barrier()
        try:
            return fn()
        finally:
            dist.barrier()
            if rank == 0:
                (local_base / "node1_away").rename(node1)
            dist.barrier()

    loads = {"own": lambda: _timed_load(two_tier, target, state),
             "partner": lambda: moved_away(lambda: _timed_load(two_tier, target, state)),
             "persistent": lambda: _timed_load(persistent, target, state)}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        step = rnd + 1
        times: Dict[str, float] = {}
        savers = [("local", two_tier), ("local_copy", copying), ("persistent_async", persistent)]
        for name, mgr in savers[rnd % 3:] + savers[:rnd % 3]:
            times[f"{name}_blocking"], times[f"{name}_completion"] = _timed_save(mgr, step, state)
        names = list(loads)
        for name in names[rnd % 3:] + names[:rnd % 3]:
            _settle()
            times[f"restore_{name}"], source, ok = loads[name]()
            checks[name] = {"source": source, "verified": bool(checks.get(name, {}).get("verified", True) and ok)}
            for t in target.values():
                t.data.zero_()
        if rnd:
            rounds.append(times)
    checks = {k: {"source": v["source"], "verified": all(_gather_flag(v["verified"]))} for k, v in checks.items()}
    for mgr in (two_tier, copying, persistent):
        mgr.close()
    dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps({"rounds": rounds, "checks": checks}))


def _settle() -> None:
    """Before a restore: the saves' dirty pages written back (``os.sync``, untimed), so that
    no restore pays for the writeback of the saves before it (as after a restart)."""
    dist.barrier()
    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()


def _gather_flag(flag: bool) -> List[bool]:
    out = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([float(flag)]))
    return [bool(t.item()) for t in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size-mib", type=float, default=256.0)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--local-base", default=None, help="where the node-local directories go (default: under --dir)")
    add_scratch_and_output_flags(ap, HERE.parent.parent / "bench_tmp", HERE / "results" / "bench_two_tier.json")
    args = ap.parse_args()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    args.dir = tempfile.mkdtemp(prefix="bench_two_tier_", dir=base)
    args.local_dir = tempfile.mkdtemp(prefix="bench_two_tier_local_", dir=args.local_base or args.dir)
    started = datetime.datetime.now().astimezone()
    before = os.getloadavg()
    try:
        result = spawn_ranks(_worker, args.world, args)
    finally:
        shutil.rmtree(args.local_dir, ignore_errors=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    after = os.getloadavg()
    rounds = result["rounds"]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"world {args.world}, 2 simulated nodes, {args.size_mib:g} MiB in all, {args.rounds} rounds, medians (s); "
          f"local dirs under {args.local_base or '--dir'}")
    print(f"{'save':<18}{'blocking':>10}{'completion':>12}")
    for name in ("local", "local_copy", "persistent_async"):
        print(f"{name:<18}{med[name + '_blocking']:>10.3f}{med[name + '_completion']:>12.3f}")
    print(f"{'restore':<18}{'seconds':>10}  source, verified")
    for name in ("own", "partner", "persistent"):
        check = result["checks"][name]
        print(f"{name:<18}{med['restore_' + name]:>10.3f}  {check['source']}, {check['verified']}")
    own, partner, pers = med["restore_own"], med["restore_partner"], med["restore_persistent"]
    met = {"local blocking <= async blocking": med["local_blocking"] <= med["persistent_async_blocking"],
           "partner <= 2x own": partner <= 2 * own,
           "own >= 3x faster than persistent": pers >= 3 * own,
           "partner >= 3x faster than persistent": pers >= 3 * partner}
    print("ratios: local/async blocking %.2f, local copy/async blocking %.2f, partner/own %.2f, "
          "persistent/own %.2f, persistent/partner %.2f" % (
              med["local_blocking"] / med["persistent_async_blocking"],
              med["local_copy_blocking"] / med["persistent_async_blocking"], partner / own, pers / own, pers / partner))
    summary = {"targets_met": met, "loadavg_before_after": [before, after]}
    for line in closing_lines(summary):
        print(line)
    out = write_report(args.output, started, vars(args), "results",
                       {"medians": med, "checks": result["checks"], "rounds": rounds, "targets_met": met,
                        "loadavg_before_after": [before, after]})
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
