"""Concurrent saves into one directory end with at most one success, and the one that
succeeds is exactly what it saved (issue 18, class 1).

Two jobs are two real gloo process groups (the session's pools of different world sizes)
started at the same instant; threads race inside one process; a restarted job meets the
async save of the old one still in flight; a save whose directory is taken over before it
commits fails on every rank.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.integrity.save_claim import CLAIM_FNAME
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.tools import validate_checkpoint

from .conftest import get_pool

_TIMEOUT = 60.0
_N = 4096  # elements of the global tensor


def _values(job: int) -> torch.Tensor:
    return torch.arange(_N, dtype=torch.float32) + 1000.0 * job


def _job_state(rank: int, world: int, job: int) -> dict:
    n = _N // world
    return {
        "w": ShardedTensor.from_rank_offsets("w", _values(job)[rank * n:(rank + 1) * n].clone(), (0, rank, world)),
        "o": ShardedObject("o", {"job": job, "rank": rank}, (world,), (rank,)),
        "job": job,
        "blob": torch.full((256,), float(job)),
    }


def _race(rank, world, ckpt, job, start_at):
    state = _job_state(rank, world, job)
    while time.time() < start_at:
        time.sleep(0.0002)
    try:
        dc.save(state, ckpt)
        return "ok"
    except CheckpointingException as e:
        return f"refused: {e}"


def _check_holds_exactly(ckpt: Path, job: int, world: int) -> None:
    """The checkpoint is complete and holds job ``job``'s state, nothing of another job's."""
    assert (ckpt / CONFIG_FNAME).exists() and not (ckpt / CLAIM_FNAME).exists()
    assert torch.equal(dc.load_plain_tensors(ckpt)["w"], _values(job))
    common = dc.load_common_state_dict(ckpt)
    assert common["job"] == job and torch.equal(common["blob"], torch.full((256,), float(job)))
    request = {"o": [ShardedObject("o", None, (world,), (r,)) for r in range(world)]}
    objects = dc.load(request, ckpt)["o"]
    assert objects == [{"job": job, "rank": r} for r in range(world)]
    assert validate_checkpoint(ckpt).ok


@pytest.mark.parametrize("worlds", [(2, 1), (2, 4)], ids=lambda w: f"worlds{w[0]}+{w[1]}")
def test_two_jobs_racing_for_one_directory(worlds, tmp_path):
    pools = [get_pool(w) for w in worlds]
    for p in pools:  # both started (spawning is not part of the race)
        p.run(_race, str(tmp_path / "warmup" / str(p.world_size)), 0, 0.0, timeout=_TIMEOUT)
    for round_ in range(4):
        ckpt = tmp_path / f"race{round_}"
        start_at = time.time() + 0.3
        for job, p in enumerate(pools):
            p.submit(_race, str(ckpt), job, start_at)
        outcomes = [[v for _, v in p.collect(_race, _TIMEOUT)] for p in pools]
        per_job = []
        for job, results in enumerate(outcomes):
            assert len(set(r == "ok" for r in results)) == 1, f"job {job} split: {results}"  # agreed on every rank
            per_job.append(results[0])
        winners = [job for job, r in enumerate(per_job) if r == "ok"]
        assert len(winners) == 1, per_job
        loser = 1 - winners[0]
        assert "refusing to save" in per_job[loser] and str(ckpt) in per_job[loser], per_job[loser]
        _check_holds_exactly(ckpt, winners[0], worlds[winners[0]])


def test_threads_racing_for_one_directory(tmp_path):
    for round_ in range(3):
        ckpt = tmp_path / f"race{round_}"
        results: dict = {}
        start_at = time.time() + 0.2

        def job(i: int) -> None:
            results[i] = _race(0, 1, str(ckpt), i, start_at)

        threads = [threading.Thread(target=job, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(_TIMEOUT)
        winners = [i for i, r in results.items() if r == "ok"]
        assert len(results) == 4 and len(winners) == 1, results
        _check_holds_exactly(ckpt, winners[0], 1)


# ----------------------------------------------------------------------------- async in flight

_QUEUES: dict = {}


def _start_async(rank, world, ckpt, job):
    if "q" in _QUEUES:  # an earlier test's queue (the pool's processes outlive tests): its calls end here
        _QUEUES.pop("q").close(abort=True)
    queue = _QUEUES["q"] = AsyncCallsQueue()  # call indices from 0, whatever ran before
    request = dc.save(_job_state(rank, world, job), ckpt, async_sharded_save=True)
    queue.schedule_async_request(request)
    return True


def _finalize_async(rank, world):
    try:
        return _QUEUES["q"].maybe_finalize_async_calls(blocking=True)
    except CheckpointingException as e:
        return f"failed: {e}"


def test_restarted_job_meets_async_save_in_flight(tmp_path):
    ckpt = tmp_path / "ckpt"
    old, new = get_pool(2), get_pool(1)
    old.run(_start_async, str(ckpt), 0, timeout=_TIMEOUT)
    assert (ckpt / CLAIM_FNAME).exists()
    # the restarted job (another process group) saves into the same directory meanwhile
    assert new.run(_race, str(ckpt), 1, 0.0, timeout=_TIMEOUT)[0].startswith("refused")
    assert old.run(_finalize_async, timeout=_TIMEOUT) == [[0], [0]]
    _check_holds_exactly(ckpt, 0, 2)


@pytest.mark.parametrize("takeover", ["claim replaced", "claim removed", "common.pt by another save"])
def test_directory_taken_over_before_commit_fails_everywhere(takeover, tmp_path):
    ckpt = tmp_path / "ckpt"
    pool = get_pool(2)
    pool.run(_start_async, str(ckpt), 0, timeout=_TIMEOUT)
    claim = ckpt / CLAIM_FNAME
    if takeover == "claim replaced":
        other = claim.with_name("other_claim")  # replaced whole, as a save that recreated it would
        other.write_text(json.dumps({"save_id": "someone-else", "host": "h", "pid": 1, "time": 0}))
        os.replace(other, claim)
    elif takeover == "claim removed":
        claim.unlink()
    else:
        sidecar = ckpt / "common.pt.checksum"
        for _ in range(200):  # written by the queue's thread
            if sidecar.exists():
                break
            time.sleep(0.05)
        record = json.loads(sidecar.read_text())
        sidecar.write_text(json.dumps(dict(record, save_id="someone-else")))
    results = pool.run(_finalize_async, timeout=_TIMEOUT)
    for r in results:
        assert isinstance(r, str) and r.startswith("failed") and "not committing" in r, results
    assert not (ckpt / CONFIG_FNAME).exists()
    assert not dc.check_is_distributed_checkpoint(ckpt)


def test_claim_is_refused_with_its_holder_and_leftover_claim_blocks(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / CLAIM_FNAME).write_text(json.dumps({"save_id": "abc", "host": "node7", "pid": 42, "time": 0}))
    with pytest.raises(CheckpointingException, match="node7") as info:
        dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, ckpt)
    assert "not empty" in str(info.value)
    assert sorted(p.name for p in ckpt.iterdir()) == [CLAIM_FNAME]  # nothing touched
    # a successful save leaves no claim behind, and its files record its id
    good = tmp_path / "good"
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4)), "x": 1}, good)
    assert not (good / CLAIM_FNAME).exists()
    ids = {json.loads((good / f"{name}.checksum").read_text())["save_id"] for name in ("common.pt", ".metadata")}
    from dist_checkpointing.strategies.torch import read_metadata
    assert ids == {read_metadata(good).storage_meta.save_id}
