"""Scale simulation of ``exchange_utils.distribute_shards_to_ranks``: 8,192 ranks x 100,000 shards, one core.

The greedy assignment that the fully parallel save/load wrappers run on every rank (the
same input on every rank of a parallelization group) is timed on one CPU core (the process
pins itself with ``os.sched_setaffinity``) for several holder patterns:

* ``all_ranks``: every shard held by all ranks (one shared holder list: see below);
* ``dp_groups_64``: every shard held by one of 128 DP groups of 64 consecutive ranks (one
  shared list per group);
* ``random_8``: every shard held by 8 random ranks (a list of its own per shard);
* ``single``: every shard held by one random rank (a list of its own per shard);
* ``all_ranks_unshared`` (``--unshared-shards`` shards only): every shard held by all ranks,
  each with its *own* (equal) list, to show what sharing saves; extrapolated to
  ``--shards``.

Sizes are log-uniform random integers from 1 B to 64 MiB; a random 10% of the shards are
passed as ``cross_parallelization_group_loads``. The function reads holder lists that are
the *same object* once (``id(list)``), so callers with many shards on the same ranks must
share the list; ``distribution_from_summaries`` does that itself (identical holder lists are
canonicalised before the call). Input construction is not timed; each pattern is timed
``--repeats`` times (median reported), and the balance is reported as max/mean bytes per
rank, also for the same input without cross-group loads (one untimed call: those shards are
placed after all others, so large ones land on ranks already at about the mean), next to a
lower bound for it.

Run: ``python benchmarks/bench_distribution.py [--ranks 8192] [--shards 100000] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import Dict, List, Tuple

from _common import write_report

from dist_checkpointing.exchange_utils import distribute_shards_to_ranks

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_distribution.json"
PATTERNS = ("all_ranks", "dp_groups_64", "random_8", "single")
DP_GROUP = 64
RANDOM_HOLDERS = 8
MAX_SIZE = 64 << 20
CROSS_FRACTION = 0.10
TARGET_S = 5.0  # per pattern, one core

ShardId = Tuple[str, Tuple[int, ...], Tuple[int, ...]]


def shard_ids(n: int) -> List[ShardId]:
    """Shard ids shaped like the library's: (key, global offset, flattened range)."""
    return [(f"decoder.layers.{i // 64}.param{i % 64}", (i % 8 * 4096, 0), ()) for i in range(n)]


def build_input(pattern: str, n_ranks: int, sids: List[ShardId], rng: random.Random) -> Dict[ShardId, List[int]]:
    """``shard_to_ranks`` for a holder pattern."""
    if pattern in ("all_ranks", "all_ranks_unshared"):
        everyone = list(range(n_ranks))
        if pattern == "all_ranks":
            return {sid: everyone for sid in sids}  # one list object for every shard
        return {sid: list(everyone) for sid in sids}  # equal lists, distinct objects
    if pattern == "dp_groups_64":
        groups = [list(range(g, g + DP_GROUP)) for g in range(0, n_ranks, DP_GROUP)]
        return {sid: groups[rng.randrange(len(groups))] for sid in sids}
    if pattern == "random_8":
        return {sid: rng.sample(range(n_ranks), RANDOM_HOLDERS) for sid in sids}
    if pattern == "single":
        return {sid: [rng.randrange(n_ranks)] for sid in sids}
    raise ValueError(pattern)


def lower_bound(shard_to_ranks: Dict[ShardId, List[int]], sizes: Dict[ShardId, int], mean: float,
                disjoint: bool) -> float:
    """A lower bound on max/mean for any assignment: per holder set, max(largest shard,
    bytes / holders) when the holder sets are disjoint; else max(largest shard, mean)."""
    if not disjoint:
        return max(max(sizes.values()), mean) / mean
    per_set: Dict[Tuple[int, ...], List[int]] = {}
    seen: Dict[int, Tuple[int, ...]] = {}
    for sid, ranks in shard_to_ranks.items():
        key = seen.get(id(ranks))
        if key is None:
            key = seen[id(ranks)] = tuple(sorted(ranks))
        entry = per_set.setdefault(key, [0, 0])
        entry[0] += sizes[sid]
        entry[1] = max(entry[1], sizes[sid])
    return max(max(largest, total / len(key)) for key, (total, largest) in per_set.items()) / mean


def run_pattern(pattern: str, n_ranks: int, n_shards: int, repeats: int, seed: int) -> Dict[str, object]:
    """Build the input (untimed), time ``repeats`` calls, check and measure the assignment."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    sids = shard_ids(n_shards)
    log_max = math.log(MAX_SIZE)
    sizes = {sid: min(MAX_SIZE, max(1, int(math.exp(rng.uniform(0.0, log_max))))) for sid in sids}
    cross = rng.sample(sids, int(CROSS_FRACTION * n_shards))
    shard_to_ranks = build_input(pattern, n_ranks, sids, rng)
    build_s = time.perf_counter() - t0
    times: List[float] = []
    assignment: Dict[ShardId, int] = {}
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        assignment = distribute_shards_to_ranks(shard_to_ranks, sizes, n_ranks, cross)
        times.append(time.perf_counter() - start)
    ok = len(assignment) == n_shards and all(assignment[sid] in shard_to_ranks[sid] for sid in sids)

    def rank_loads(a: Dict[ShardId, int]) -> List[int]:
        out = [0] * n_ranks
        for sid, rank in a.items():
            out[rank] += sizes[sid]
        return out

    loads = rank_loads(assignment)
    total = sum(loads)
    mean = total / n_ranks
    # Untimed: the same input without cross-group loads (they are placed after every other shard).
    no_cross = rank_loads(distribute_shards_to_ranks(shard_to_ranks, sizes, n_ranks))
    disjoint = pattern != "random_8"
    return {
        "pattern": pattern, "ranks": n_ranks, "shards": n_shards, "cross_shards": len(cross),
        "distinct_holder_lists": len({id(r) for r in shard_to_ranks.values()}),
        "input_build_s": build_s, "times_s": times, "median_s": statistics.median(times),
        "total_bytes": total, "max_over_mean": max(loads) / mean, "max_over_mean_without_cross": max(no_cross) / mean,
        "lower_bound_max_over_mean": lower_bound(shard_to_ranks, sizes, mean, disjoint),
        "lower_bound_exact_for_partition": disjoint, "idle_ranks": sum(1 for x in loads if x == 0),
        "valid": ok,
    }


def format_table(results: List[Dict[str, object]], extrapolated: Dict[str, object], core: int) -> str:
    r0 = results[0]
    lines = [
        f"distribute_shards_to_ranks: {r0['ranks']} ranks x {r0['shards']} shards, sizes log-uniform 1 B - 64 MiB, "
        f"{r0['cross_shards']} cross-group loads; one core (CPU {core}); median of {len(r0['times_s'])} runs",
        f"{'pattern':<22}{'lists':>8}{'median s':>10}{'min s':>8}{'max s':>8}{'max/mean':>10}{'no cross':>10}"
        f"{'bound':>8}{'idle ranks':>12}  valid",
    ]
    for r in results:
        bound = f"{r['lower_bound_max_over_mean']:.2f}" + ("" if r["lower_bound_exact_for_partition"] else "*")
        lines.append(f"{r['pattern']:<22}{r['distinct_holder_lists']:>8}{r['median_s']:>10.3f}{min(r['times_s']):>8.3f}"
                     f"{max(r['times_s']):>8.3f}{r['max_over_mean']:>10.2f}{r['max_over_mean_without_cross']:>10.2f}{bound:>8}"
                     f"{r['idle_ranks']:>12}"
                     f"  {r['valid']}")
    if extrapolated:
        e = extrapolated
        lines.append(f"{e['pattern']:<22}{e['distinct_holder_lists']:>8}{e['median_s']:>10.3f}  ({e['shards']} shards; "
                     f"x {e['scale']:.0f} = {e['extrapolated_s']:.1f} s for {r0['shards']} shards)")
    lines.append("lists = distinct holder list objects; max/mean = bytes per rank, max over mean over all ranks; "
                 "no cross = the same without cross-group loads (untimed call); bound = lower bound on max/mean "
                 "for any assignment "
                 "(largest shard or bytes / holders per holder set; * = holder sets overlap: max(largest shard, "
                 "mean) / mean only)")
    lines.append("targets: " + ", ".join(f"{r['pattern']} <= {TARGET_S:g} s: "
                                          f"{'MET' if r['median_s'] <= TARGET_S else 'NOT met'}" for r in results))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8192)
    ap.add_argument("--shards", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per pattern (median reported)")
    ap.add_argument("--unshared-shards", type=int, default=1000,
                    help="shards for the all_ranks_unshared pattern (0: skip)")
    ap.add_argument("--core", type=int, default=0, help="CPU core to pin to")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=str(RESULTS_PATH), help="JSON results path")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    os.sched_setaffinity(0, {args.core})
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    results = []
    for pattern in PATTERNS:
        results.append(run_pattern(pattern, args.ranks, args.shards, args.repeats, args.seed))
        print(f"{pattern}: median {results[-1]['median_s']:.3f} s (input built in {results[-1]['input_build_s']:.1f} s)",
              flush=True)
    extrapolated: Dict[str, object] = {}
    if args.unshared_shards:
        e = run_pattern("all_ranks_unshared", args.ranks, args.unshared_shards, args.repeats, args.seed)
        e["scale"] = args.shards / args.unshared_shards
        e["extrapolated_s"] = e["median_s"] * e["scale"]
        extrapolated = e
    load_after = os.getloadavg()
    run_args = {**vars(args), "cpu_affinity": sorted(os.sched_getaffinity(0))}
    out = write_report(args.output, started, run_args, "results",
                       {"patterns": results, "unshared": extrapolated, "target_s": TARGET_S,
                        "loadavg_before_after": [load_before, load_after]})
    print(format_table(results, extrapolated, args.core))
    print(f"load average (1 min) before/after: {load_before[0]:.1f} / {load_after[0]:.1f}")
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
