"""The GPT demo (``examples/gpt_demo.py``) runs end to end: locally spawned and under torchrun.

Each run saves a small GPT-like state at TP=2, reloads it at TP=world and TP=1, and
verifies every value; the demo prints "demo OK" and exits 0 only if all of it matched.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List

from . import launch
from .helpers import free_port, slack

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "gpt_demo.py"
SMALL = ["--hidden", "64", "--layers", "2", "--vocab", "512"]
TIMEOUT_S = 180  # a hang is a failure; a normal run takes seconds


def _run(cmd: List[str]) -> subprocess.CompletedProcess:
    """``cmd`` run as a fresh process: torchrun as a real subprocess; ``python DEMO ...``
    forked from the test session's torch-preloaded server (``launch.py``, ~3 s of CPU less)."""
    if cmd[1] == "-m":
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=slack(TIMEOUT_S))
    return launch.run(cmd[1:], cwd=ROOT, timeout=slack(TIMEOUT_S))


def _assert_ok(proc: subprocess.CompletedProcess, phases: List[str]) -> None:
    report = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, report
    assert "demo OK" in proc.stdout, report
    for phase in phases:
        assert phase in proc.stdout, report


def test_demo_spawns_four_ranks(tmp_path: Path) -> None:
    proc = _run([sys.executable, str(DEMO), "--nproc", "4", "--dir", str(tmp_path), *SMALL])
    _assert_ok(proc, ["save tp2dp2", "load tp4", "load tp1"])
    assert list(tmp_path.iterdir()) == []  # the checkpoint is removed without --keep


def test_demo_under_torchrun() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(DEMO), *SMALL]
    _assert_ok(_run(cmd), ["save tp2dp1", "load tp2", "load tp1"])


def test_demo_rejects_sizes_that_do_not_split() -> None:
    proc = _run([sys.executable, str(DEMO), "--nproc", "3", "--hidden", "64", "--vocab", "512"])
    assert proc.returncode != 0
    assert "demo OK" not in proc.stdout
    assert "cannot be split by TP=3" in proc.stderr
