"""Two-tier checkpointing (``CheckpointManager(..., local_dir=, local_interval=,
replication_factor=)``) on real gloo process groups, nodes simulated by an explicit
rank -> node mapping and one directory per node."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from dist_checkpointing import CheckpointingException, CheckpointManager, ShardedObject, ShardedTensor
from dist_checkpointing.manager.local.snapshot import FAIL_SNAPSHOT_ENV, Snapshot, flat_checksum
from dist_checkpointing.runtime.arenas import StagingArena
from dist_checkpointing.manager.local.tier import FAIL_RECV_ENV

from .conftest import get_pool
from .helpers import assert_all_raise, flip_byte


def _tensor(rank: int, step: int) -> torch.Tensor:
    return torch.randn(64, 33, generator=torch.Generator().manual_seed(1000 * step + rank))


def _state(rank: int, world: int, step: int, fill: bool = True) -> dict:
    local = _tensor(rank, step) if fill else torch.zeros(64, 33)
    half = torch.arange(10, dtype=torch.int64) * (step + rank) if fill else torch.zeros(10, dtype=torch.int64)
    return {"model": {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world)),
                      "b": [ShardedTensor.from_rank_offsets("b", half, (0, rank, world))]},
            "rng": ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
            "step": step}


def _check(loaded: dict, rank: int, step: int) -> None:
    assert torch.equal(loaded["model"]["w"], _tensor(rank, step)), (rank, step)
    assert torch.equal(loaded["model"]["b"][0], torch.arange(10, dtype=torch.int64) * (step + rank))
    assert loaded["rng"] == {"rank": rank, "step": step}
    assert loaded["step"] == step


def _manager(rank: int, root: str, local: str, nodes: list, replication: int = 2) -> CheckpointManager:
    return CheckpointManager(root, save_interval_steps=100, local_dir=local, local_interval=1,
                             replication_factor=replication, node_of_rank=nodes)


def _train(rank: int, world: int, root: str, local: str, nodes: list, steps: list, replication: int = 2) -> list:
    with _manager(rank, root, local, nodes, replication) as m:
        for step in steps:
            m.save(step, _state(rank, world, step))
        m.wait_until_finished()
        return list(m.local.complete)


def _restore(rank: int, world: int, root: str, local: str, nodes: list, replication: int = 2) -> tuple:
    with _manager(rank, root, local, nodes, replication) as m:
        loaded = m.load(_state(rank, world, 0, fill=False))
        kind, step = m.restored_from
        _check(loaded, rank, step)
        return kind, step


NODES2 = [0, 0, 1, 1]  # 2 nodes of 2 ranks
NODES4 = [0, 1, 2, 3]  # 4 nodes of 1 rank


def _dirs(tmp_path: Path) -> tuple:
    return str(tmp_path / "root"), str(tmp_path / "node{node}")


def test_restore_from_own_copy_then_from_partner(tmp_path):
    pool = get_pool(4)
    root, local = _dirs(tmp_path)
    assert pool.run(_train, root, local, NODES2, [0, 1, 2, 3]) == [[0, 1, 2, 3]] * 4
    # only the newest local step is kept; each node holds its ranks' copies and their partners' replicas
    assert sorted(p.name for p in (tmp_path / "node0" / "local_0000003").iterdir()) == [
        f"rank_{r:05d}.{ext}" for r in range(4) for ext in ("done", "pt")]
    assert not (tmp_path / "node0" / "local_0000002").exists()
    assert pool.run(_restore, root, local, NODES2) == [("local", 3)] * 4
    shutil.rmtree(tmp_path / "node1")  # node 1 replaced: ranks 2 and 3 restore from node 0's replicas
    assert pool.run(_restore, root, local, NODES2) == [("local", 3)] * 4


def test_both_copies_lost_falls_back_to_persistent(tmp_path):
    pool = get_pool(4)
    root, local = _dirs(tmp_path)
    pool.run(_train, root, local, NODES2, [0, 1, 2])
    for node in (0, 1):  # rank 2's copy and its replica
        for ext in ("pt", "done"):
            os.remove(tmp_path / f"node{node}" / "local_0000002" / f"rank_00002.{ext}")
    assert pool.run(_restore, root, local, NODES2) == [("persistent", 0)] * 4


def test_corrupted_replica_uses_next_replica_then_persistent(tmp_path):
    pool = get_pool(4)
    root, local = _dirs(tmp_path)
    pool.run(_train, root, local, NODES4, [0, 1], 3)  # rank 0's copies: nodes 0, 1 and 2
    shutil.rmtree(tmp_path / "node0")
    flip_byte(tmp_path / "node1" / "local_0000001" / "rank_00000.pt", 200)
    assert pool.run(_restore, root, local, NODES4, 3) == [("local", 1)] * 4
    flip_byte(tmp_path / "node2" / "local_0000001" / "rank_00000.pt", 300)
    assert pool.run(_restore, root, local, NODES4, 3) == [("persistent", 0)] * 4


def _train_with_fault_at_step_2(rank: int, world: int, root: str, local: str, fault_rank: int, env: str) -> tuple:
    """Local steps 1, 2, 3; ``fault_rank`` has ``env`` set while step 2 is saved."""
    with _manager(rank, root, local, NODES2) as m:
        m.save(1, _state(rank, world, 1))
        m.wait_until_finished()
        if rank == fault_rank:
            os.environ[env] = "2"
        try:
            m.save(2, _state(rank, world, 2))
            m.wait_until_finished()
        finally:
            os.environ.pop(env, None)
        after_failure = list(m.local.complete)
        m.save(3, _state(rank, world, 3))  # training goes on
        m.wait_until_finished()
        return after_failure, list(m.local.complete)


def test_partner_failing_during_replication_does_not_count_the_step(tmp_path):
    pool = get_pool(4)
    root, local = _dirs(tmp_path)
    assert pool.run(_train_with_fault_at_step_2, root, local, 2, FAIL_RECV_ENV) == [([1], [1, 3])] * 4
    assert not (tmp_path / "node0" / "local_0000002").exists()
    assert not (tmp_path / "node1" / "local_0000002").exists()
    assert pool.run(_restore, root, local, NODES2) == [("local", 3)] * 4


def _open_unwritable(rank: int, world: int, root: str, local: str) -> None:
    _manager(rank, root, local, NODES2)


def _persistent_only(rank: int, world: int, root: str) -> tuple:
    with CheckpointManager(root) as m:
        m.save(5, _state(rank, world, 5))
    with CheckpointManager(root) as m:
        _check(m.load(_state(rank, world, 0, fill=False)), rank, 5)
        return m.all_steps()


def test_unwritable_local_dir_is_a_clear_error_and_persistent_tier_works(tmp_path):
    pool = get_pool(4)
    root = str(tmp_path / "root")
    (tmp_path / "a_file").write_text("not a directory")
    errors = pool.run_expect_error(_open_unwritable, root, str(tmp_path / "a_file" / "node{node}"))
    assert_all_raise(errors, 4, "Local tier", "not writable", "a_file/node")
    assert pool.run(_persistent_only, root) == [[5]] * 4
    errors = pool.run_expect_error(_open_unwritable, root, "s3://bucket/node{node}")
    assert_all_raise(errors, 4, "Local tier", "must be a node-local path", "s3://bucket/node")


def _resharded(rank: int, world: int, step: int, fill: bool = True) -> dict:
    """A state whose global shapes do not depend on the world size: ``w`` (8, 12) by rows."""
    rows = 8 // world
    full = torch.randn(8, 12, generator=torch.Generator().manual_seed(step))
    return {"w": ShardedTensor.from_rank_offsets("w", full[rank * rows:(rank + 1) * rows].clone() if fill
                                                 else torch.zeros(rows, 12), (0, rank, world)),
            "step": step}


def _run_resharded(rank: int, world: int, root: str, local: str, steps: list, interval: int) -> tuple:
    """Restart: load (the newest step this run can restore), check it, then save ``steps``."""
    nodes = [r * 2 // world for r in range(world)]  # two nodes
    with CheckpointManager(root, save_interval_steps=interval, local_dir=local, local_interval=1,
                           replication_factor=2, node_of_rank=nodes) as m:
        restored = None
        if m.latest_step() is not None:
            loaded = m.load(_resharded(rank, world, 0, fill=False))
            restored = m.restored_from
            assert torch.equal(loaded["w"], _resharded(rank, world, restored[1])["w"].data), restored
            assert loaded["step"] == restored[1]
        for step in steps:
            m.save(step, _resharded(rank, world, step))
        m.wait_until_finished()
        return restored


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4)])
def test_after_a_world_size_change_restarts_restore_the_newest_step_they_can(tmp_path, before, after):
    root, local = _dirs(tmp_path)
    # local steps 1..6 at the old world size, persistent 4
    assert get_pool(before).run(_run_resharded, root, local, [1, 2, 3, 4, 5, 6], 4) == [None] * before
    keep = tmp_path / "old_step_6"
    for node in (0, 1):
        shutil.copytree(tmp_path / f"node{node}" / "local_0000006", keep / f"node{node}")
    # restart at the new size: local step 6 is skipped (another world size), persistent 4 loaded; train on
    assert get_pool(after).run(_run_resharded, root, local, [5], 100) == [("persistent", 4)] * after
    for node in (0, 1):  # once step 5 counted, the old world's copies were removed
        assert sorted(p.name for p in (tmp_path / f"node{node}").iterdir()) == ["local_0000005"]
    # every later restart restores this run's newest step, even with the stale copies put back
    assert get_pool(after).run(_run_resharded, root, local, [], 100) == [("local", 5)] * after
    for node in (0, 1):
        shutil.copytree(keep / f"node{node}", tmp_path / f"node{node}" / "local_0000006")
    assert get_pool(after).run(_run_resharded, root, local, [6], 100) == [("local", 5)] * after
    assert get_pool(after).run(_run_resharded, root, local, [], 100) == [("local", 6)] * after
    markers = sorted(p.name for node in (0, 1) for p in (tmp_path / f"node{node}" / "local_0000006").glob("*.done"))
    assert markers == sorted(f"rank_{r:05d}.done" for r in range(after) for _ in (0, 1))  # own copy + replica


def _restore_other_shape(rank: int, world: int, root: str, local: str, ranks: list) -> None:
    state = _state(rank, world, 0, fill=False)
    if rank in ranks:
        state["model"]["w"] = ShardedTensor.from_rank_offsets("w", torch.zeros(64, 34), (0, rank, world))
    with _manager(rank, root, local, NODES2) as m:
        m.load(state)


def test_a_state_of_another_layout_is_an_error_not_a_damaged_copy(tmp_path):
    pool = get_pool(4)
    root, local = _dirs(tmp_path)
    pool.run(_train, root, local, NODES2, [1])  # no persistent step to fall back to
    errors = pool.run_expect_error(_restore_other_shape, root, local, [0, 1, 2, 3])
    assert_all_raise(errors, 4, "'w@0,0' was saved as (64, 33) torch.float32, the state to load into has (64, 34)")
    shutil.rmtree(tmp_path / "node1")  # ranks 2 and 3 receive from partners: the transport refuses the shape
    errors = pool.run_expect_error(_restore_other_shape, root, local, [2, 3])
    assert_all_raise(errors, 4, "restoring step 1 failed", "rank 2", "was saved as (64, 33) torch.float32", "(64, 34)")


def _train_while_node0_dir_breaks(rank: int, world: int, root: str, local: str) -> tuple:
    import torch.distributed as dist
    node0 = Path(local.format(node=0))
    with CheckpointManager(root, save_interval_steps=2, local_dir=local, local_interval=1, replication_factor=2,
                           node_of_rank=NODES2) as m:
        m.save(1, _state(rank, world, 1))
        m.wait_until_finished()
        dist.barrier()
        if rank == 0:  # node 0's local file system fails: its path is no longer a directory
            shutil.rmtree(node0)
            node0.write_text("not a directory")
        dist.barrier()
        m.save(2, _state(rank, world, 2))  # local (fails on node 0) and persistent
        m.wait_until_finished()
        broken = (list(m.local.complete), m.all_steps())
        dist.barrier()
        if rank == 0:
            node0.unlink()
        dist.barrier()
        m.save(3, _state(rank, world, 3))  # training goes on
        m.wait_until_finished()
        return broken, list(m.local.complete)


def test_a_failing_local_file_system_loses_the_local_step_only(tmp_path):
    pool = get_pool(4)
    root, local = _dirs(tmp_path)
    assert pool.run(_train_while_node0_dir_breaks, root, local) == [(([1], [2]), [1, 3])] * 4
    assert not (tmp_path / "node1" / "local_0000002").exists()  # the replicas written on node 1 were removed
    assert pool.run(_restore, root, local, NODES2) == [("local", 3)] * 4


def _update_right_after_save(rank: int, world: int, root: str, local: str, snapshot: str) -> tuple:
    with CheckpointManager(root, save_interval_steps=100, local_dir=local, local_interval=1, replication_factor=2,
                           node_of_rank=NODES2, local_snapshot=snapshot) as m:
        state = _state(rank, world, 1)
        state["model"]["b"][0].data.share_memory_()  # memory a fork does not isolate: copied before save returns
        m.save(1, state)
        state["model"]["w"].data.add_(1.0)  # the next training step, while the snapshot is written
        state["model"]["b"][0].data.zero_()
        m.wait_until_finished()
        return list(m.local.complete)


@pytest.mark.parametrize("snapshot", ["fork", "copy"])
def test_the_snapshot_is_the_state_when_save_was_called(tmp_path, snapshot):
    pool = get_pool(4)
    root, local = _dirs(tmp_path)
    assert pool.run(_update_right_after_save, root, local, snapshot) == [[1]] * 4
    assert pool.run(_restore, root, local, NODES2) == [("local", 1)] * 4  # the values of step 1, before the update
    shutil.rmtree(tmp_path / "node0")  # and the replicas hold them too
    assert pool.run(_restore, root, local, NODES2) == [("local", 1)] * 4


def _counted_by_maybe_finalize(rank: int, world: int, root: str, local: str) -> tuple:
    import time

    with _manager(rank, root, local, NODES2) as m:
        m.save(1, _state(rank, world, 1))
        polls = 0
        while not m.local.complete and polls < 2000:  # every rank decides alike: the loop ends on every rank together
            m.maybe_finalize()
            polls += 1
            time.sleep(0.01)
        return list(m.local.complete), polls >= 1


def test_maybe_finalize_counts_a_finished_local_step_without_waiting(tmp_path):
    root, local = _dirs(tmp_path)
    assert get_pool(4).run(_counted_by_maybe_finalize, root, local) == [([1], True)] * 4


def test_a_snapshot_that_dies_does_not_count_the_step(tmp_path):
    pool = get_pool(4)
    root, local = _dirs(tmp_path)
    # rank 3's snapshot dies: its partner is told, nobody waits
    assert pool.run(_train_with_fault_at_step_2, root, local, 3, FAIL_SNAPSHOT_ENV) == [([1], [1, 3])] * 4
    assert not (tmp_path / "node0" / "local_0000002").exists()
    assert not (tmp_path / "node1" / "local_0000002").exists()
    assert pool.run(_restore, root, local, NODES2) == [("local", 3)] * 4


def test_a_fork_snapshot_copies_shared_memory_before_returning():
    private, shared = torch.arange(1000.0), torch.arange(2000.0).share_memory_()
    snap = Snapshot({"p": private, "s": shared})
    buffer = StagingArena(snap.size).flat
    child = snap.take(buffer, fork=True)
    shared_slot = buffer[snap.layout[1][1]:snap.layout[1][1] + snap.layout[1][2]].view(torch.float32)
    assert torch.equal(shared_slot, torch.arange(2000.0))  # a fork would not isolate it: copied here
    shared.zero_()
    private.zero_()  # the child still sees the values at the fork
    checksum = child.result()
    assert torch.equal(buffer[:4000].view(torch.float32), torch.arange(1000.0))
    assert torch.equal(shared_slot, torch.arange(2000.0))
    assert checksum == flat_checksum(snap.flat, snap.layout)


@pytest.mark.parametrize("fork", [True, False])
def test_a_snapshot_holds_every_dtype_and_layout(fork):
    tensors = {"bf16": torch.randn(33, 7).to(torch.bfloat16), "strided": torch.arange(60.0).view(6, 10).t(),
               "empty": torch.empty(0, 5), "int": torch.arange(7, dtype=torch.int64), "bool": torch.tensor([True, False])}
    expected = {name: t.clone() for name, t in tensors.items()}
    snap = Snapshot(dict(tensors))
    buffer = StagingArena(snap.size).flat
    child = snap.take(buffer, fork=fork)
    for t in tensors.values():
        if t.numel():
            t.zero_() if t.dtype != torch.bool else t.fill_(False)  # after the snapshot: not in it
    if fork:
        checksum = child.result()
    else:
        assert child.done()  # CPU tensors: copied at the call
        checksum = flat_checksum(snap.flat, snap.layout)
    assert checksum == flat_checksum(snap.flat, snap.layout)
    views = {ident: buffer[off:off + n].view(getattr(torch, dtype.split(".")[-1])).view(shape)
             for ident, off, n, dtype, shape in snap.layout}
    for name, t in expected.items():
        assert views[f"c:/{name}"].dtype == t.dtype and torch.equal(views[f"c:/{name}"], t), name


def test_a_replica_that_cannot_be_opened_uses_the_next_holder(tmp_path):
    pool = get_pool(4)
    root, local = _dirs(tmp_path)
    pool.run(_train, root, local, NODES4, [0, 1], 3)  # rank 0's copies: nodes 0, 1 and 2
    shutil.rmtree(tmp_path / "node0")
    os.remove(tmp_path / "node1" / "local_0000001" / "rank_00000.pt")  # its marker is left: the holder finds no file
    assert pool.run(_restore, root, local, NODES4, 3) == [("local", 1)] * 4
    with open(tmp_path / "node2" / "local_0000001" / "rank_00000.pt", "r+b") as f:
        f.truncate(100)  # shorter than its marker says
    assert pool.run(_restore, root, local, NODES4, 3) == [("persistent", 0)] * 4
