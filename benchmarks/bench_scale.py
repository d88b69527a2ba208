"""What one save / repeated save / load costs each rank in collective traffic, at several
world sizes with constant per-rank state (real gloo processes).

Every rank holds ``--keys`` tensors, each split over the world along its first axis, plus
a few replicated ones and one ShardedObject piece. For each world size the script counts,
on every rank, the calls of ``torch.distributed`` functions and the bytes they deliver to
that rank (``tests/collective_counter.py``) during: a first ``save``, a second ``save`` of
the same layout with a ``cached_metadata`` strategy, and a ``load`` — once with the default
strategies, once with the fully parallel wrappers over the world (the save wrapper with
``do_cache_distribution=True``). Flat per-rank cost
means the median rank's bytes and calls do not grow with the world size; rank 0 also
receives the item locations it writes into ``.metadata``. The load also counts each rank's
bytes read from the ``.metadata*`` files (with the per-key index: its share of the index).

Then it simulates one ordinary rank and rank 0 of an 8,192-rank TP8 x PP16 x DP64 GPT job
(``_scale_sim.py``, ``_gpt_job.py``: validation, save planning, rank 0's ``.metadata``, and
every rank's metadata read at load) and one DP group's fully parallel planning
(``_plan_sim.py``), running the library's own code on the messages those ranks would receive.

    python benchmarks/bench_scale.py                      # --world-sizes 2,4,8,16 --keys 200 (~7 min)
    python benchmarks/bench_scale.py --no-simulation      # the real processes only (~2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

import dist_checkpointing as dc  # noqa: E402
from dist_checkpointing import ShardedObject, ShardedTensor  # noqa: E402
from dist_checkpointing import validation  # noqa: E402
from dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import (  # noqa: E402
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from tests.collective_counter import count_collectives  # noqa: E402
from tests.dist_pool import DistPool  # noqa: E402
from tests.metadata_read_counter import count_metadata_reads  # noqa: E402
from dist_checkpointing.strategies.torch_dist import index_view  # noqa: E402

RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_scale.json"
PHASES = ("save", "repeated save", "load")


def _state(rank: int, world: int, keys: int, fill: bool = True) -> dict:
    def data(*shape):
        return torch.ones(*shape) if fill else torch.zeros(*shape)

    sd = {f"layers.{k}.weight": ShardedTensor.from_rank_offsets(f"layers.{k}.weight", data(2, 8), (0, rank, world))
          for k in range(keys)}
    sd.update({f"norm.{k}": ShardedTensor.from_rank_offsets(f"norm.{k}", data(8), replica_id=rank) for k in range(4)})
    sd["rng"] = ShardedObject("rng", {"rank": rank} if fill else None, (world,), (rank,))
    sd["iteration"] = 100
    return sd


def _measure(rank: int, world: int, root: str, keys: int, wrapped: bool) -> dict:
    validation._LAST_VALID.clear()  # the first save validates, as in a fresh process
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    load_strategy = TorchDistLoadShardedStrategy()
    if wrapped:
        strategy = FullyParallelSaveStrategyWrapper(strategy, do_cache_distribution=True)
        load_strategy = FullyParallelLoadStrategyWrapper(load_strategy)
    out = {}
    for phase, target in (("save", "a"), ("repeated save", "b")):
        state = _state(rank, world, keys)
        with count_collectives() as count:
            dc.save(state, f"{root}/{target}", sharded_strategy=strategy)
        out[phase] = (count.received, count.n_calls)
    request = _state(rank, world, keys, fill=False)
    index_view.INDEX_ABOVE_BYTES = 0  # this small checkpoint's load through the per-key index, as a large one's
    with count_collectives() as count, count_metadata_reads() as read:
        dc.load(request, f"{root}/b", sharded_strategy=load_strategy)
    out["load"] = (count.received, count.n_calls)
    out["metadata_read"] = read["bytes"]
    out["index_bytes"] = os.path.getsize(f"{root}/b/.metadata.index")
    return out


def _simulate(stacked: bool) -> list:
    """The 8,192-rank simulations: validation, save planning and rank 0's metadata
    (``_scale_sim.py``), and fully parallel planning in one DP group (``_plan_sim.py``)."""
    from benchmarks import _plan_sim, _scale_sim

    out = []
    for layout in (False, True) if stacked else (False,):
        for variant in _scale_sim.VARIANTS:
            res = _scale_sim.simulate(variant, stacked_layers=layout)
            _scale_sim.print_table(res)
            out.append(res)
    for variant in _scale_sim.VARIANTS:
        res = _plan_sim.simulate(variant)
        _plan_sim.print_table(res)
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="2,4,8,16")
    ap.add_argument("--keys", type=int, default=200, help="sharded tensors per rank (default 200)")
    ap.add_argument("--output", default=str(RESULTS_PATH))
    ap.add_argument("--no-simulation", action="store_true", help="only the real processes")
    ap.add_argument("--stacked", action="store_true",
                    help="simulate Megatron-Core's stacked layer layout too (about 3 more minutes)")
    args = ap.parse_args()
    results = []
    print(f"{'world':>5}  {'strategy':<15}{'phase':<14}{'median kB':>10}{'rank 0 kB':>10}{'max kB':>8}"
          "  calls (median rank / rank 0)")
    for world in [int(w) for w in args.world_sizes.split(",") if w.strip()]:
        pool = DistPool(world)
        try:
            for wrapped in (False, True):
                with tempfile.TemporaryDirectory() as root:
                    per_rank = pool.run(_measure, root, args.keys, wrapped, timeout=600)
                strategy = "fully parallel" if wrapped else "default"
                reads = [r["metadata_read"] for r in per_rank]
                results.append({"world": world, "strategy": strategy, "phase": "load metadata read",
                                "median_read": statistics.median(reads), "max_read": max(reads),
                                "all_ranks_read": sum(reads), "index_bytes": per_rank[0]["index_bytes"]})
                print(f"{world:>5}  {strategy:<15}load: .metadata* bytes read, median rank {statistics.median(reads) / 1e3:.1f} kB, "
                      f"max {max(reads) / 1e3:.1f} kB, all ranks {sum(reads) / 1e3:.1f} kB "
                      f"(index {per_rank[0]['index_bytes'] / 1e3:.1f} kB)", flush=True)
                for phase in PHASES:
                    received = [r[phase][0] for r in per_rank]
                    calls = [r[phase][1] for r in per_rank]
                    row = {"world": world, "strategy": strategy, "phase": phase,
                           "median_received": statistics.median(received), "rank0_received": received[0],
                           "max_received": max(received), "median_calls": statistics.median(calls),
                           "rank0_calls": calls[0]}
                    results.append(row)
                    print(f"{world:>5}  {strategy:<15}{phase:<14}{row['median_received'] / 1e3:>10.1f}"
                          f"{row['rank0_received'] / 1e3:>10.1f}{row['max_received'] / 1e3:>8.1f}"
                          f"  {row['median_calls']:.0f} / {row['rank0_calls']}", flush=True)
        finally:
            pool.close()
    simulations = [] if args.no_simulation else _simulate(args.stacked)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"keys_per_rank": args.keys, "loadavg": os.getloadavg(), "results": results,
                               "simulations": simulations}, indent=1, default=str))
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
