"""CheckpointManager under SIGKILL: a run killed mid-save, mid-finalize, mid-tracker-update
or mid-deletion leaves a root from which the next run resumes at the newest complete step.

Each run is real processes (one per rank, a gloo group): this file, run as a script, is
the training job (forked from the test session's torch-preloaded server, ``launch.py``). The crash points are the manager's test hook (``DIST_CKPT_MANAGER_CRASH``,
``dist_checkpointing/manager/crash.py``): the process SIGKILLs itself there.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
CRASH_ENV = "DIST_CKPT_MANAGER_CRASH"
INTERVAL, LAST = 10, 50


def _state(rank: int, world: int, step: int, fill: bool = True) -> dict:
    import torch
    from dist_checkpointing import ShardedObject, ShardedTensor

    local = torch.arange(4, dtype=torch.float32) + 100 * step + 10 * rank if fill else torch.zeros(4)
    return {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world)),
            "o": ShardedObject("o", [rank, step], (world,), (rank,)), "step": step}


def _job(mode: str, root: str, async_save: bool) -> None:
    """One rank of the job: ``train`` saves steps INTERVAL..LAST (keep_last=2); ``resume``
    loads the newest complete step, checks every value, saves the next step and reports."""
    import torch
    import torch.distributed as dist

    from dist_checkpointing import CheckpointManager

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with CheckpointManager(root, save_interval_steps=INTERVAL, keep_last=2, async_save=async_save) as mgr:
        if mode == "train":
            for step in range(INTERVAL, LAST + 1):
                if mgr.save(step, _state(rank, world, step), metrics={"loss": 1.0 / step}):
                    mgr.wait_until_finished()  # the crash point in rank 0's worker is reached before step + 1
        else:
            found = mgr.all_steps()
            latest = mgr.latest_step()
            loaded = mgr.load(_state(rank, world, 0, fill=False))
            expected = _state(rank, world, latest)
            assert torch.equal(loaded["w"], expected["w"].data) and loaded["o"] == [rank, latest], loaded
            assert loaded["step"] == latest
            mgr.save(latest + INTERVAL, _state(rank, world, latest + INTERVAL), metrics={"loss": 0.0})
            mgr.wait_until_finished()
            print(json.dumps({"found": found, "latest": latest, "after": mgr.all_steps()}), flush=True)
    dist.destroy_process_group()


def _launch(world: int, mode: str, root: Path, async_save: bool, crash: str = "") -> list:
    from .helpers import free_port
    from .launch import Launched

    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world)}
    env.pop(CRASH_ENV, None)
    if crash:
        env[CRASH_ENV] = crash
    return [Launched([__file__, mode, str(root), str(int(async_save))], env={**env, "RANK": str(rank)})
            for rank in range(world)]


def _crash_run(world: int, root: Path, async_save: bool, crash: str) -> None:
    """Run the job until rank 0 kills itself at the crash point; then kill the other ranks
    (blocked in a collective, or done)."""
    from .helpers import slack

    procs = _launch(world, "train", root, async_save, crash)
    try:
        procs[0].wait(timeout=slack(120))
        assert procs[0].returncode == -signal.SIGKILL, (procs[0].returncode, procs[0].communicate())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.communicate()


def _resume(world: int, root: Path, async_save: bool) -> dict:
    from .helpers import slack

    procs = _launch(world, "resume", root, async_save)
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=slack(120))
            assert proc.returncode == 0, f"rc {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(o == outs[0] for o in outs), outs  # every rank agrees
    return outs[0]


def _iter_dirs(root: Path) -> List[str]:
    return sorted(p.name for p in root.glob("iter_*"))


# (crash point, async, world) -> (the newest complete step found on resume, complete steps found)
CASES = {
    ("save:30", True, 2): (20, [10, 20]),         # the data files are being written
    ("finalize:30", True, 2): (20, [10, 20]),     # every rank wrote its files; not committed
    ("finalize:30", True, 1): (20, [10, 20]),
    ("tracker:30", False, 2): (30, [10, 20, 30]),  # committed, tracker still names 20; 10 not deleted yet
    ("tracker:30", True, 2): (30, [10, 20, 30]),
    ("delete:10", False, 2): (30, [20, 30]),      # iter_10's metadata.json deleted, the rest not
}


@pytest.mark.parametrize("crash, async_save, world", list(CASES), ids=[
    f"{c.split(':')[0]}-{'async' if a else 'sync'}-world{w}" for c, a, w in CASES])
def test_sigkill_then_resume_at_newest_complete(tmp_path, crash, async_save, world):
    root = tmp_path / "run"
    _crash_run(world, root, async_save, crash)
    killed_at = _iter_dirs(root)
    latest, found = CASES[(crash, async_save, world)]
    if crash.startswith(("save", "finalize")):
        assert "iter_0000030" in killed_at and not (root / "iter_0000030" / "metadata.json").exists()
    if crash.startswith("tracker"):
        assert (root / "latest_checkpointed_iteration.txt").read_text() == "20"
    if crash.startswith("delete"):
        assert (root / "iter_0000010").exists() and not (root / "iter_0000010" / "metadata.json").exists()
    report = _resume(world, root, async_save)
    assert report == {"found": found, "latest": latest, "after": [latest, latest + INTERVAL]}
    # leftovers removed, retention applied, tracker names the newest
    assert _iter_dirs(root) == [f"iter_{s:07d}" for s in report["after"]]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == str(latest + INTERVAL)


if __name__ == "__main__":
    _job(sys.argv[1], sys.argv[2], bool(int(sys.argv[3])))
