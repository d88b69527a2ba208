"""CPU time of each ``dist-ckpt`` subcommand on a small checkpoint (mostly import time).

Each command runs as ``python -m dist_checkpointing ...`` in a fresh process; its CPU time
(user + system, from ``resource.getrusage(RUSAGE_CHILDREN)``) and wall time are recorded.
The commands run interleaved, ``--rounds`` times, and the median is reported, with the heavy
modules each command imported (``torch``, ``torch.distributed.checkpoint``). ``--baseline DIR``
runs each command from another source tree too (e.g. an earlier commit's
``git archive COMMIT | tar -x -C DIR``), interleaved with this one's, for a side-by-side table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]

_MAKE = """
import sys, torch, dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
state = {f"layer{i}.weight": ShardedTensor.from_rank_offsets(f"layer{i}.weight", torch.full((64, 64), float(i)))
         for i in range(20)}
state["opt.exp_avg"] = ShardedTensor.from_rank_offsets_flat(
    "opt.exp_avg", torch.arange(64.0), (8, 8), flattened_range=slice(0, 64))
state["rng"] = ShardedObject("rng", {"seed": 1}, (1,), (0,))
state["iteration"] = 7
dc.save(state, sys.argv[1])
"""

# the probe: prints which heavy modules a command imported (run after the command, at exit)
_PROBE = ("import atexit, sys; atexit.register(lambda: sys.stderr.write('HEAVY ' + ','.join("
          "m for m in ('torch', 'torch.distributed.checkpoint') if m in sys.modules) + '\\n'))")


def _commands(ckpt: Path, out: Path) -> Dict[str, List[str]]:
    return {
        "(no arguments)": [],
        "--help": ["--help"],
        "--version": ["--version"],
        "inspect": ["inspect", str(ckpt)],
        "inspect --json": ["inspect", "--json", str(ckpt)],
        "validate": ["validate", str(ckpt)],
        "export": ["export", "--force", str(ckpt), str(out / "hf")],
        "convert": ["convert", "--force", str(ckpt), str(out / "c19")],
        "import": ["import", "--force", str(out / "hf"), str(out / "imported")],
    }


def _env(tree: Path) -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def _run(args: List[str], tree: Path) -> Dict[str, object]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PROBE + "\nimport runpy, sys; sys.argv[0] = 'dist-ckpt'; "
                           "runpy.run_module('dist_checkpointing', run_name='__main__', alter_sys=True)", *args],
                          capture_output=True, text=True, env=_env(tree), cwd=tree, timeout=300)  # (-c: cwd first on sys.path)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"dist-ckpt {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    heavy = [line[6:] for line in proc.stderr.splitlines() if line.startswith("HEAVY ")]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"cpu_s": cpu, "wall_s": wall, "heavy": heavy[-1] if heavy else "?"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--baseline", metavar="DIR", help="also run each command from this source tree")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "bench_cli.json"))
    args = parser.parse_args()
    trees = {"this": ROOT} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    scratch = Path(tempfile.mkdtemp(prefix="bench_cli_"))
    try:
        ckpt = scratch / "ckpt"
        subprocess.run([sys.executable, "-c", _MAKE, str(ckpt)], check=True, env=_env(ROOT))
        commands = _commands(ckpt, scratch)
        load_before = os.getloadavg()
        runs: Dict[str, Dict[str, List[Dict[str, object]]]] = {t: {name: [] for name in commands} for t in trees}
        for _ in range(args.rounds):  # interleaved: every round runs every command once from every tree
            for name, argv in commands.items():
                for tree, path in trees.items():
                    runs[tree][name].append(_run(argv, path))
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary: Dict[str, Dict[str, object]] = {t: {} for t in trees}
    header = "".join(f" {t + ' CPU s':>14} {t + ' wall s':>15}" for t in trees)
    print(f"{'command':<16}{header}  heavy modules imported ({', '.join(trees)})")
    for name in commands:
        cells, heavy = "", []
        for tree in trees:
            rs = runs[tree][name]
            cpu, wall = statistics.median(r["cpu_s"] for r in rs), statistics.median(r["wall_s"] for r in rs)
            summary[tree][name] = {"cpu_s": cpu, "wall_s": wall, "heavy": rs[-1]["heavy"], "runs": rs}
            cells += f" {cpu:14.2f} {wall:15.2f}"
            heavy.append(rs[-1]["heavy"] or "-")
        print(f"{name:<16}{cells}  {' | '.join(heavy)}")
    print(f"medians of {args.rounds}; load average (1 min) before/after: {load_before[0]:.1f} / {load_after[0]:.1f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"rounds": args.rounds, "trees": {t: str(p) for t, p in trees.items()},
                                             "loadavg_before_after": [load_before, load_after],
                                             "commands": summary}, indent=2))


if __name__ == "__main__":
    main()
