"""Two-tier checkpointing launched the way users launch it: two ``torchrun`` agents on this
machine (``--nnodes 2 --node-rank 0|1 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1),
each simulated node with its own local directory; wipe a node's directory and restart.
The first run goes through real torchrun agents; the others give the ranks the same
variables from forked processes (``launch.Torchrun``), which saves ~3 s of CPU per rank."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from dist_checkpointing.manager.crash import CRASH_ENV

from .helpers import free_port, slack
from .launch import Torchrun

WORKER = Path(__file__).resolve().parent / "two_tier_torchrun_worker.py"
REPO = Path(__file__).resolve().parents[1]


def _launch(tmp: Path, mode: str, steps: int, crash_node1: str = "", real_torchrun: bool = False) -> List[Dict]:
    """Run both agents to completion; every rank's report (none when ``crash_node1`` names
    a crash point for node 1's ranks: then both agents must fail). ``real_torchrun``: two
    ``torch.distributed.run`` agents; else their ranks with torchrun's variables, forked
    from the test session's torch-preloaded server (``launch.py``: ~3 s of CPU less per rank)."""
    out = tmp / f"out_{mode}_{len(list(tmp.glob('out_*')))}"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    node_envs = [dict(env, TWO_TIER_NODE_DIR=str(tmp / f"node{node}")) for node in (0, 1)]
    if crash_node1:
        node_envs[1][CRASH_ENV] = crash_node1
    args = [str(WORKER), mode, str(tmp / "root"), str(steps), str(out)]
    if real_torchrun:
        codes, logs = _real_agents(node_envs, args)
    else:
        job = Torchrun(args, 2, REPO, node_envs, run_id="two_tier")
        codes = job.wait(slack(240))
        logs = [job.output()] * 2
    for code, log in zip(codes, logs):
        assert (code != 0) == bool(crash_node1), log[-4000:]
    if crash_node1:
        return []
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(4)]


def _real_agents(node_envs: List[Dict], args: List[str]) -> Tuple[List[int], List[str]]:
    """Two torchrun agents (c10d rendezvous on 127.0.0.1): their exit codes and logs."""
    port = free_port()
    agents = []
    for node, node_env in enumerate(node_envs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"two_tier_{port}", *args]
        agents.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=slack(240))[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return [agent.returncode for agent in agents], logs


def test_two_torchrun_agents_restore_from_partner_then_fall_back(tmp_path):
    trained = _launch(tmp_path, "train", 4, real_torchrun=True)
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
