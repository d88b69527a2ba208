"""Two-tier checkpointing launched as users launch it on two nodes: ``torchrun --nnodes 2
--nproc-per-node 2`` on each, simulated on this machine (each node with its own local
directory); wipe a node's directory and restart. The ranks get the variables torchrun's
agents give them and the job stops when one rank fails, as under torchrun, but are forked
from the test session's torch-preloaded server (``launch.Torchrun``: ~3 s of CPU less per
rank, ~2 s per agent). A real torchrun launch is tested by ``test_demo`` and ``test_docs``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, List

from dist_checkpointing.manager.crash import CRASH_ENV

from .helpers import slack
from .launch import Torchrun

WORKER = Path(__file__).resolve().parent / "two_tier_torchrun_worker.py"
REPO = Path(__file__).resolve().parents[1]


def _launch(tmp: Path, mode: str, steps: int, crash_node1: str = "") -> List[Dict]:
    """Run both simulated nodes' ranks to completion; every rank's report (none when
    ``crash_node1`` names a crash point for node 1's ranks: then both nodes must fail)."""
    out = tmp / f"out_{mode}_{len(list(tmp.glob('out_*')))}"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    node_envs = [dict(env, TWO_TIER_NODE_DIR=str(tmp / f"node{node}")) for node in (0, 1)]
    if crash_node1:
        node_envs[1][CRASH_ENV] = crash_node1
    job = Torchrun([str(WORKER), mode, str(tmp / "root"), str(steps), str(out)], 2, REPO, node_envs,
                   run_id="two_tier")
    codes = job.wait(slack(240))
    for code in codes:
        assert (code != 0) == bool(crash_node1), job.output()[-4000:]
    if crash_node1:
        return []
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(4)]


def test_two_torchrun_agents_restore_from_partner_then_fall_back(tmp_path):
    trained = _launch(tmp_path, "train", 4)
    assert [r["local_complete"] for r in trained] == [[1, 2, 3, 4]] * 4
    # each agent's ranks use their node's directory
    assert {r["node_dir"] for r in trained} == {str(tmp_path / "node0"), str(tmp_path / "node1")}

    shutil.rmtree(tmp_path / "node1")  # node 1 replaced: its directory is empty
    restored = _launch(tmp_path, "restore", 0)
    assert all(r["restored_from"] == ["local", 4] and r["bit_exact"] for r in restored), restored
    assert sorted(r["own_copy_on_node"] for r in restored) == [False, False, True, True]  # 2 ranks from partners

    for node in ("node0", "node1"):  # both copies lost: the persistent step 3
        shutil.rmtree(tmp_path / node, ignore_errors=True)
    restored = _launch(tmp_path, "restore", 0)
    assert all(r["restored_from"] == ["persistent", 3] and r["bit_exact"] for r in restored), restored


def test_a_kill_during_a_local_save_restores_the_previous_local_step(tmp_path):
    _launch(tmp_path, "train", 5, crash_node1="local:5")  # node 1's ranks SIGKILL themselves in step 5's save
    restored = _launch(tmp_path, "restore", 0)
    assert all(r["restored_from"] == ["local", 4] and r["bit_exact"] for r in restored), restored
