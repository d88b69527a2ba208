"""Simulated fully parallel planning in one data-parallel group of the 8,192-rank GPT job.

``FullyParallelSaveStrategyWrapper`` / ``FullyParallelLoadStrategyWrapper`` plan inside their
parallelization group (the DP group: 64 ranks of the TP8 x PP16 x DP64 job of
``_gpt_job.py``) with ``exchange.plan.plan_shards``. This builds the 64 members' states with
``rank_items`` and their ``local_tensor_summary``, computes with the library's own steps
(``_to_judges``, ``_judge``, ``_balance``, ``_answers``) every message a member would receive
— pickled as ``exchange_objects`` pickles them, unpickled where the real code unpickles
them — and runs ``plan_shards`` unchanged on one member (an ordinary one and group rank 0,
which balances) with ``torch.distributed`` replaced by ``_scale_sim.SimulatedNetwork``.
Measured: CPU seconds (median of 5), the ``tracemalloc`` peak, the bytes delivered to the
member, and the balance of the plan (the most bytes one member writes over the mean),
checked equal to the greedy assignment over every summary at once
(``distribution_from_summaries``, what an all-gather plan computes).

    python benchmarks/_plan_sim.py           # non-flat (identical lists) and distopt (judges)
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Dict, List, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks._gpt_job import GPTConfig, rank_items  # noqa: E402
from benchmarks._scale_sim import SimulatedNetwork, config_for, simulated  # noqa: E402
from dist_checkpointing.exchange_utils import distribution_from_summaries, local_tensor_summary  # noqa: E402
from dist_checkpointing.exchange.plan import (  # noqa: E402
    _answers, _balance, _digest, _judge, _to_judges, plan_shards,
)


def _wire(obj: Any) -> bytes:
    return b"" if obj is None else pickle.dumps(obj)


def _roundtrip(obj: Any) -> Any:
    return None if obj is None else pickle.loads(pickle.dumps(obj))


def group_summaries(cfg: GPTConfig, tp: int = 3, pp: int = 7) -> List[list]:
    """The summaries of the members of the DP group of ``(tp, pp)``, by group rank."""
    members = [pp * cfg.tp * cfg.dp + dp * cfg.tp + tp for dp in range(cfg.dp)]
    return [local_tensor_summary({str(i): sh for i, sh in enumerate(rank_items(cfg, r))}) for r in members]


def messages(summaries: List[list], member: int) -> Tuple[List[List[bytes]], List[List[int]]]:
    """What ``member`` receives in ``plan_shards``: the payload of each exchange (one
    ``bytes`` per sender) and the results of its all_reduce / reduce calls."""
    size = len(summaries)
    digests = [_digest(s) for s in summaries]
    agreed = [max(d[i] for d in digests) for i in range(16)] + [255 - min(d[i] for d in digests) for i in range(16)]
    if agreed[:16] == [255 - b for b in agreed[16:]]:  # identical lists: the flags of the main replicas
        ordered = [sorted(s, key=lambda e: e[0]) for s in summaries]
        flags = [max(int(o[i][2]) for o in ordered) for i in range(len(ordered[0]))]
        return [], [agreed, flags]
    outgoing = [_to_judges(s, size) for s in summaries]
    first = [_wire(outgoing[s][member]) for s in range(size)]
    judged = [_judge([_roundtrip(outgoing[s][j]) for s in range(size)], size) for j in range(size)]
    to_balancer = [_roundtrip(multi or None) for _, _, multi, _ in judged]
    second = [_wire(to_balancer[j]) if member == 0 else b"" for j in range(size)]
    forced = [sum(f[i] for _, _, _, f in judged) for i in range(2 * size)]
    decided = _balance(to_balancer, forced, size)
    third = [_wire(decided[member]) if s == 0 else b"" for s in range(size)]
    answers = [_answers(h, m, _roundtrip(decided[j]) or {}, size) for j, (h, m, _, _) in enumerate(judged)]
    fourth = [_wire(answers[j].get(member)) for j in range(size)]
    return [first, second, third, fourth], [agreed] + ([forced] if member == 0 else [])


def measure(cfg: GPTConfig, summaries: List[list], member: int, repeats: int = 5) -> Dict[str, Any]:
    """``plan_shards`` on ``member`` with the simulated messages."""
    inboxes, reductions = messages(summaries, member)

    def run() -> Tuple[float, SimulatedNetwork, Any]:
        net = SimulatedNetwork(member, len(summaries), inboxes, reductions=reductions)
        with simulated(net):
            c0 = time.process_time()
            plan = plan_shards(summaries[member])
            return time.process_time() - c0, net, plan

    times = [run()[0] for _ in range(repeats)]
    tracemalloc.start()
    _, net, plan = run()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"member": member, "shards": len(summaries[member]), "cpu_s": statistics.median(times),
            "received_bytes": net.received, "calls": net.calls, "tracemalloc_peak_mib": peak / 2 ** 20,
            "own_payload_matches": net.self_payload_ok, "plan": plan}


def simulate(variant: str) -> Dict[str, Any]:
    """One DP group of ``variant``: an ordinary member and group rank 0, and the plan's balance."""
    cfg = config_for(variant)
    t0 = time.perf_counter()
    summaries = group_summaries(cfg)
    build_s = time.perf_counter() - t0
    ordinary, first = measure(cfg, summaries, 37), measure(cfg, summaries, 0)
    expected = distribution_from_summaries(summaries).main_rank_for_shard
    infos = {sid: info for s in summaries for sid, info, _ in s}
    for res in (ordinary, first):
        plan = res.pop("plan")
        res["same_as_all_gather_plan"] = all(expected[sid] == r for sid, r in plan.reader.items())
    loads = [0] * len(summaries)
    for sid, r in expected.items():
        loads[r] += infos[sid].nbytes
    return {"variant": variant, "group_size": len(summaries), "inputs_build_s": build_s,
            "all_gather_bytes": sum(len(pickle.dumps(s)) for s in summaries),
            "path": "identical lists" if not messages(summaries, 37)[0] else "judges + balancer",
            "ordinary_member": ordinary, "group_rank0": first,
            "balance_max_over_mean": max(loads) / statistics.mean(loads)}


def print_table(res: Dict[str, Any]) -> None:
    """One variant's planning figures."""
    print(f"\nfully parallel planning, {res['variant']}: DP group of {res['group_size']} ({res['path']}); "
          f"written bytes max/mean {res['balance_max_over_mean']:.3f}; an all-gather of the summaries would "
          f"deliver {res['all_gather_bytes'] / 1e3:.0f} kB to every member")
    for label in ("ordinary_member", "group_rank0"):
        r = res[label]
        print(f"  {label:<16} shards {r['shards']:>4}  CPU {r['cpu_s']:.4f} s  received {r['received_bytes'] / 1e3:.1f} kB"
              f"  traced peak {r['tracemalloc_peak_mib']:.1f} MiB  calls {sum(r['calls'].values())}"
              f"  own payload ok {r['own_payload_matches']}  same plan as all-gather {r['same_as_all_gather_plan']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="non-flat,distopt")
    args = ap.parse_args()
    for variant in args.variants.split(","):
        print_table(simulate(variant))


if __name__ == "__main__":
    main()
