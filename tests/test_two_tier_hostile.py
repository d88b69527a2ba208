"""Two-tier checkpointing against shared node-local directories, hostile markers and
partial requests, on real gloo process groups (world 2: two nodes of one rank; world 4:
two nodes of two ranks; nodes simulated by an explicit rank -> node mapping and one
directory per node). Every multi-rank call fails by a timeout rather than waiting."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, CheckpointManager, LocalNonpersistentObject, ShardedObject
from dist_checkpointing import ShardedTensor
from dist_checkpointing.integrity.checksums import checksum
from dist_checkpointing.manager.local.marker import RUN_FNAME
from dist_checkpointing.manager.layout import CONTENT_KEY

from .conftest import get_pool
from .helpers import assert_all_raise

TIMEOUT = 90  # seconds: a hang fails the test
NODES = {2: [0, 1], 4: [0, 0, 1, 1]}
WORLDS = pytest.mark.parametrize("world", [2, 4])


def _w(rank: int, step: int) -> torch.Tensor:
    return torch.randn(16, 5, generator=torch.Generator().manual_seed(1000 * step + rank))


def _state(rank: int, world: int, step: int, fill: bool = True) -> dict:
    return {"model": {"w": ShardedTensor.from_rank_offsets("w", _w(rank, step) if fill else torch.zeros(16, 5),
                                                           (0, rank, world)),
                      "scale": torch.tensor([0.5, step])},
            "rng": ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
            "step": step, "args": {"lr": 0.1}}


def _manager(rank: int, world: int, root: str, local: str, takeover: bool = False) -> CheckpointManager:
    return CheckpointManager(root, save_interval_steps=100, local_dir=local, local_interval=1, replication_factor=2,
                             node_of_rank=NODES[world], local_takeover=takeover)


def _train(rank: int, world: int, root: str, local: str, steps: list, takeover: bool = False) -> list:
    with _manager(rank, world, root, local, takeover) as m:
        for step in steps:
            m.save(step, _state(rank, world, step))
        m.wait_until_finished()
        return list(m.local.complete)


def _restore(rank: int, world: int, root: str, local: str, takeover: bool = False) -> tuple:
    with _manager(rank, world, root, local, takeover) as m:
        loaded = m.load(_state(rank, world, 0, fill=False))
        kind, step = m.restored_from
        assert torch.equal(loaded["model"]["w"], _w(rank, step)) and loaded["step"] == step
        assert loaded["rng"] == {"rank": rank, "step": step}
        m.save(step + 1, _state(rank, world, step + 1))  # training goes on: local save, finalize, cleanup
        m.wait_until_finished()
        return kind, step


def _open(rank: int, world: int, root: str, local: str) -> None:
    _manager(rank, world, root, local).close()


def _files(node_dir: Path) -> list:
    return sorted(str(p.relative_to(node_dir)) for p in node_dir.rglob("*") if p.is_file())


def _dirs(tmp_path: Path, job: str) -> tuple:
    return str(tmp_path / job), str(tmp_path / "node{node}")


# ------------------------------------------------------------------ owners of local copies

@WORLDS
def test_another_jobs_copies_are_refused_kept_and_taken_over_only_when_told(tmp_path, world):
    pool = get_pool(world)
    root_a, local = _dirs(tmp_path, "job_a")
    root_b = str(tmp_path / "job_b")
    assert pool.run(_train, root_a, local, [1, 2], timeout=TIMEOUT) == [[1, 2]] * world
    before = {n: _files(tmp_path / f"node{n}") for n in (0, 1)}
    # another root (a reused scratch path, or a restarted job pointed at another root)
    errors = pool.run_expect_error(_restore, root_b, local, timeout=TIMEOUT)
    assert_all_raise(errors, world, "holds local checkpoints of another job", "job_a", "steps [2]",
                     "local_takeover=True")
    # the same root emptied and reused by a new run: a new run id, another job
    shutil.copytree(root_a, tmp_path / "job_a_saved")
    shutil.rmtree(root_a)
    errors = pool.run_expect_error(_open, root_a, local, timeout=TIMEOUT)
    assert_all_raise(errors, world, "holds local checkpoints of another job", "job_a")
    assert {n: _files(tmp_path / f"node{n}") for n in (0, 1)} == before  # nothing read, written nor deleted
    # the restarted job itself (same root, same run id) restores its own copies
    shutil.rmtree(root_a)
    shutil.copytree(tmp_path / "job_a_saved", root_a)
    assert pool.run(_restore, root_a, local, timeout=TIMEOUT) == [("local", 2)] * world
    # told to take the directory over: job A's copies are deleted, never restored
    assert pool.run(_train, root_b, local, [0], True, timeout=TIMEOUT) == [[0]] * world
    for n in (0, 1):
        assert _files(tmp_path / f"node{n}") == sorted(f"local_0000000/rank_{r:05d}.{ext}" for r in range(world)
                                                        for ext in ("done", "pt"))
    assert pool.run(_restore, root_b, local, timeout=TIMEOUT) == [("persistent", 0)] * world  # then saves step 1
    assert pool.run(_restore, root_b, local, timeout=TIMEOUT) == [("local", 1)] * world


def _train_while_another_job_writes(rank: int, world: int, root: str, local: str, other: str) -> tuple:
    """Save step 1; another job's copies of steps 0 and 7 appear in the node directories; save step 2."""
    import torch.distributed as dist

    with _manager(rank, world, root, local) as m:
        m.save(1, _state(rank, world, 1))
        m.wait_until_finished()
        dist.barrier()
        if rank == 0:
            for node in (0, 1):
                for step in ("local_0000000", "local_0000007"):
                    shutil.copytree(Path(other.format(node=node)) / "local_0000003", Path(local.format(node=node)) / step)
                    for marker in (Path(local.format(node=node)) / step).glob("*.done"):
                        doc = json.loads(marker.read_text())
                        doc["step"] = int(step[-7:])
                        marker.write_text(json.dumps(doc))
        dist.barrier()
        m.save(2, _state(rank, world, 2))  # its cleanup removes step 1, never the other job's copies
        m.wait_until_finished()
        try:
            m.load(_state(rank, world, 0, fill=False))
        except CheckpointingException as e:
            return list(m.local.complete), str(e)
    return None


@WORLDS
def test_cleanup_and_restore_never_use_another_jobs_copies(tmp_path, world):
    pool = get_pool(world)
    other_root, other_local = str(tmp_path / "other"), str(tmp_path / "other_node{node}")
    pool.run(_train, other_root, other_local, [3], timeout=TIMEOUT)
    root, local = _dirs(tmp_path, "root")
    results = pool.run(_train_while_another_job_writes, root, local, other_local, timeout=TIMEOUT)
    for complete, error in results:
        assert complete == [1, 2]
        assert "holds local checkpoints of another job" in error and "other" in error
    for n in (0, 1):
        names = {p.name for p in (tmp_path / f"node{n}").iterdir()}
        assert names == {"local_0000000", "local_0000002", "local_0000007"}  # step 1 removed, theirs kept
        assert len(list((tmp_path / f"node{n}" / "local_0000007").glob("*.done"))) == world


# ------------------------------------------------------------------------ hostile markers

def _marker(node: Path, step: int, owner: int) -> Path:
    return node / f"local_{step:07d}" / f"rank_{owner:05d}.done"


def _with_header(doc: dict, header: dict) -> dict:
    raw = pickle.dumps(header)
    return doc | {"header": base64.b64encode(raw).decode(), "header_checksum": f"{checksum(raw):016x}"}


def _huge_layout(doc: dict) -> dict:
    """A header whose checksum holds but whose layout claims a tensor of 2**40 elements."""
    header = pickle.loads(base64.b64decode(doc["header"]))  # (written by the test's own run: plain data)
    entry = header["layout"][0]
    header["layout"][0] = (entry[0], 0, 4 * 2**40, entry[3], (2**40,))
    return _with_header(doc, header)


HOSTILE = {
    "empty object": lambda doc: {},
    "a list": lambda doc: [doc],
    "string step": lambda doc: doc | {"step": str(doc["step"])},
    "step 2**70": lambda doc: doc | {"step": 2**70},
    "huge world": lambda doc: doc | {"world": 2**40},
    "world 0": lambda doc: doc | {"world": 0},
    "negative owner": lambda doc: doc | {"owner": -1},
    "owner of another name": lambda doc: doc | {"owner": (doc["owner"] + 1) % doc["world"]},
    "missing length": lambda doc: {k: v for k, v in doc.items() if k != "length"},
    "list length": lambda doc: doc | {"length": [doc["length"]]},
    "float length": lambda doc: doc | {"length": float(doc["length"])},
    "bool world": lambda doc: doc | {"world": True},
    "checksum not hex": lambda doc: doc | {"checksum": "zz" * 8},
    "header not base64": lambda doc: doc | {"header": "!!"},
    "no job": lambda doc: {k: v for k, v in doc.items() if k != "job"},
    "job of wrong type": lambda doc: doc | {"job": ["root", "run"]},
    "huge layout": _huge_layout,
}


def _damage(marker: Path, how: str) -> None:
    if how == "fifo":
        marker.unlink()
        os.mkfifo(marker)
    elif how == "symlink":
        target = marker.with_name("elsewhere.json")
        marker.rename(target)
        marker.symlink_to(target)
    else:
        marker.write_text(json.dumps(HOSTILE[how](json.loads(marker.read_text()))))


def _train_and_reference(rank: int, world: int, root: str, local: str, ref: str) -> None:
    """Local steps 0..2, and step 2's state as a plain checkpoint ``ref`` (to compare with), with
    the content metadata the manager records."""
    _train(rank, world, root, local, [0, 1, 2])
    dc.save(_state(rank, world, 2), ref, content_metadata={CONTENT_KEY: {"step": 2, "metrics": None}})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Local step 2 (persistent step 0) at world 2 and 4."""
    runs = {}
    for world in (2, 4):
        base = tmp_path_factory.mktemp(f"world{world}")
        get_pool(world).run(_train_and_reference, str(base / "root"), str(base / "node{node}"), str(base / "ref"),
                            timeout=TIMEOUT)
        runs[world] = base
    return runs


def _restore_copy(rank: int, world: int, root: str, local: str, train_on: bool = False) -> tuple:
    """Restore from (copies of) the saved run's node directories; ``train_on``: then save a
    local step (its finalize and cleanup read the same directories)."""
    with _manager(rank, world, root, local) as m:
        loaded = m.load(_state(rank, world, 0, fill=False))
        kind, step = m.restored_from
        assert torch.equal(loaded["model"]["w"], _w(rank, step)) and loaded["rng"] == {"rank": rank, "step": step}
        if train_on:  # a local step only (the persistent interval is 100): the saved root is not written
            m.save(step + 1, _state(rank, world, step + 1))
            m.wait_until_finished()
            return kind, step, list(m.local.complete)
        return kind, step


_KINDS = [*HOSTILE, "fifo", "symlink"]
_AT_4 = ("empty object", "step 2**70", "huge world", "list length", "huge layout", "fifo")


@pytest.mark.parametrize("world,how", [(2, how) for how in _KINDS] + [(4, how) for how in _AT_4])
def test_a_hostile_marker_is_a_damaged_copy(saved, tmp_path, world, how):
    root, local = str(saved[world] / "root"), str(tmp_path / "node{node}")
    for name in ("node0", "node1"):
        shutil.copytree(saved[world] / name, tmp_path / name)
    pool = get_pool(world)
    last = world - 1  # its own copy is on node 1, its replica on node 0
    _damage(_marker(tmp_path / "node1", 2, last), how)
    assert pool.run(_restore_copy, root, local, timeout=TIMEOUT) == [("local", 2)] * world  # from the replica
    for node, owner in ((0, last), (0, 0), (1, 0)):
        _damage(_marker(tmp_path / f"node{node}", 2, owner), how)
    # no valid copy of the last rank's shards: the persistent tier, on every rank alike; then a local step
    # is saved, finalized and the directories cleaned up with the hostile markers in them
    assert pool.run(_restore_copy, root, local, True, timeout=TIMEOUT) == [("persistent", 0, [1])] * world


# ------------------------------------------------ a local restore answers like a persistent load

def _request(rank: int, world: int, variant: str) -> dict:
    full = _state(rank, world, 0, fill=False)
    sharded = {"model": {"w": full["model"]["w"]}, "rng": full["rng"]}  # what model.sharded_state_dict() gives
    return {"sharded only": sharded,
            "some sharded items": {"model": {"w": full["model"]["w"]}},
            "other common values": full | {"step": 999, "new": "mine", "args": {"lr": 1.0}},
            "non-persistent": sharded | {"mine": LocalNonpersistentObject({"rank": rank})}}[variant]


def _assert_same(got, expected, path="") -> None:
    assert type(got) is type(expected), (path, type(got), type(expected))
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), (path, sorted(got), sorted(expected))
        for k in expected:
            _assert_same(got[k], expected[k], f"{path}/{k}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_same(g, e, f"{path}/{i}")
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), path
    else:
        assert got == expected, path


def _restore_like_load(rank: int, world: int, root: str, local: str, ref: str, variant: str) -> tuple:
    with _manager(rank, world, root, local) as m:
        got = m.load(_request(rank, world, variant))
        restored_from = m.restored_from
    _assert_same(got, dc.load(_request(rank, world, variant), ref))
    return restored_from


@WORLDS
@pytest.mark.parametrize("variant", ["sharded only", "some sharded items", "other common values", "non-persistent"])
def test_a_local_restore_returns_what_load_returns(saved, tmp_path, world, variant):
    base, pool = saved[world], get_pool(world)
    args = (str(base / "root"), str(base / "node{node}"), str(base / "ref"), variant)
    assert pool.run(_restore_like_load, *args, timeout=TIMEOUT) == [("local", 2)] * world  # from own copies
    for name in ("node0", "node1"):
        shutil.copytree(base / name, tmp_path / name)
    shutil.rmtree(tmp_path / "node1")  # node 1 replaced: its ranks receive their copies from node 0's replicas
    args = (args[0], str(tmp_path / "node{node}"), *args[2:])
    assert pool.run(_restore_like_load, *args, timeout=TIMEOUT) == [("local", 2)] * world


def _local_and_persistent_alike(rank: int, world: int, root: str, local: str, ref_root: str) -> tuple:
    for where, kw in ((ref_root, {}), (root, dict(local_dir=local, local_interval=1, replication_factor=2,
                                                 node_of_rank=NODES[world]))):
        with CheckpointManager(where, save_interval_steps=1 if where == ref_root else 100, **kw) as m:
            for step in (1, 2):
                m.save(step, _state(rank, world, step), content_metadata={"run": "r7"})
            m.wait_until_finished()
    with _manager(rank, world, root, local) as m:
        got = m.load(_request(rank, world, "sharded only"))
        restored_from = m.restored_from
    _assert_same(got, dc.load(_request(rank, world, "sharded only"), str(Path(ref_root) / "iter_0000002")))
    assert got["content_metadata"]["run"] == "r7"
    return restored_from


@WORLDS
def test_a_local_restore_returns_what_the_persistent_step_returns(tmp_path, world):
    """Content metadata included: the manager's record (its step) and the user's; the
    reference is the same steps saved by a manager to the persistent tier."""
    root, local = _dirs(tmp_path, "root")
    assert get_pool(world).run(_local_and_persistent_alike, root, local, str(tmp_path / "ref"),
                               timeout=TIMEOUT) == [("local", 2)] * world


def _persist_sharded_only(rank: int, world: int, root: str, local: str) -> tuple:
    with _manager(rank, world, root, local) as m:
        m.load(_request(rank, world, "sharded only"), persist_local=True)
        m.wait_until_finished()
        return m.restored_from, m.all_steps()


@WORLDS
def test_persist_local_of_a_sharded_only_request_keeps_the_common_state(tmp_path, world):
    pool = get_pool(world)
    root, local = _dirs(tmp_path, "root")
    pool.run(_train, root, local, [1, 2], timeout=TIMEOUT)
    assert pool.run(_persist_sharded_only, root, local, timeout=TIMEOUT) == [(("local", 2), [2])] * world
    common = dc.load_common_state_dict(Path(root) / "iter_0000002")
    assert common["step"] == 2 and common["args"] == {"lr": 0.1}
    assert torch.equal(common["model"]["scale"], torch.tensor([0.5, 2.0]))
