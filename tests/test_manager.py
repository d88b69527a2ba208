"""CheckpointManager (``dist_checkpointing.manager``): intervals, retention, resume, the
Megatron-LM layout, bad input and faults, on real gloo process groups (world 1 and 2; some 4).

Crash safety under SIGKILL is tested in ``test_manager_crash.py`` (real subprocesses).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, CheckpointManager, ShardedObject, ShardedTensor
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.manager.layout import CONTENT_KEY, INDEX_FNAME, TRACKER_FNAME
from dist_checkpointing.manager.lock import LOCK_FNAME
from dist_checkpointing.manager.retention import RetentionPolicy
from dist_checkpointing.strategies.torch_dist import writing as torch_dist_writing

from .conftest import get_pool
from .helpers import assert_all_raise, slack, slow_writes
from .launch import Launched


@pytest.fixture(params=[1, 2], ids=lambda w: f"world{w}")
def pool12(request):
    return get_pool(request.param)


def _state(rank: int, world: int, step: int, fill: bool = True) -> dict:
    """Each rank's shard of ``w`` holds ``step + rank``; a per-rank object; common ``step``."""
    local = torch.full((3,), float(step + rank)) if fill else torch.zeros(3)
    return {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world)),
            "o": ShardedObject("o", {"rank": rank, "step": step}, (world,), (rank,)),
            "step": step}


def _check_loaded(loaded: dict, rank: int, step: int) -> None:
    assert torch.equal(loaded["w"], torch.full((3,), float(step + rank))), (rank, step, loaded["w"])
    assert loaded["o"] == {"rank": rank, "step": step}
    assert loaded["step"] == step


def _dirs(root) -> list:
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith("iter_"))


def _complete(root) -> list:
    return sorted(p.name for p in Path(root).glob("iter_*") if (p / CONFIG_FNAME).exists())


# ----------------------------------------------------------------------------- policies


def test_retention_policies_combine():
    steps = {s: {"loss": float(v)} for s, v in zip(range(10, 110, 10), [5, 3, 9, 1, 7, 2, 8, 6, 4, 10])}
    assert RetentionPolicy().to_delete(steps) == []  # no policy: keep everything
    assert RetentionPolicy(keep_last=2).to_delete(steps) == list(range(10, 90, 10))
    assert RetentionPolicy(keep_every_n_steps=40).to_delete(steps) == [10, 20, 30, 50, 60, 70, 90]
    assert RetentionPolicy(keep_best=2, best_metric="loss").to_delete(steps) == [10, 20, 30, 50, 70, 80, 90]
    assert RetentionPolicy(keep_best=2, best_metric="loss", best_mode="max").to_delete(steps) == [
        10, 20, 40, 50, 60, 70, 80, 90]  # keeps 100 (10) and 30 (9)
    combined = RetentionPolicy(keep_last=1, keep_every_n_steps=50, keep_best=1, best_metric="loss")
    assert combined.to_delete(steps) == [10, 20, 30, 60, 70, 80, 90]  # keeps 100 (last), 50 (every), 40 (best)
    # a step without the metric is not ranked by keep_best; the newest is kept anyway
    assert RetentionPolicy(keep_best=1, best_metric="loss").to_delete({1: {"loss": 1.0}, 2: None, 3: {}}) == [2]
    for bad in (dict(keep_last=0), dict(keep_every_n_steps=-1), dict(keep_best=1), dict(best_mode="median"),
                dict(keep_last=True)):
        with pytest.raises(CheckpointingException):
            RetentionPolicy(**bad)


# ----------------------------------------------------------------------------- save / retention / load


def _train_and_resume(rank, world, root, async_save):
    seen = []
    with CheckpointManager(root, save_interval_steps=10, keep_last=2, keep_every_n_steps=40, keep_best=1,
                           best_metric="loss", best_mode="min", async_save=async_save) as mgr:
        for step in range(0, 101, 5):
            saved = mgr.save(step, _state(rank, world, step), metrics={"loss": abs(step - 30) + 0.5})
            assert saved == (step % 10 == 0), step
            seen.append(mgr.all_steps())
        mgr.wait_until_finished()
        final = (mgr.all_steps(), mgr.latest_step(), mgr.best_step(), mgr.metrics(100), mgr.metrics(10))
        _check_loaded(mgr.load(_state(rank, world, 0, fill=False)), rank, 100)
        _check_loaded(mgr.load(_state(rank, world, 0, fill=False), step=30), rank, 30)
        assert mgr.load_common(40)["step"] == 40
        if rank == 0:
            assert _complete(root) == _dirs(root) == [f"iter_{s:07d}" for s in final[0]]
    with CheckpointManager(root, keep_last=1) as again:  # resumes; the new policy applies at its first save
        resumed = (again.all_steps(), again.metrics(30))
        _check_loaded(again.load(_state(rank, world, 0, fill=False)), rank, 100)
    return final, resumed


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_retention_resume(pool12, tmp_path, async_save):
    root = str(tmp_path / "run")
    results = pool12.run(_train_and_resume, root, async_save)
    assert all(r == results[0] for r in results)  # every rank agrees
    (steps, latest, best, m100, m10), (resumed, m30) = results[0]
    assert steps == [0, 30, 40, 80, 90, 100]  # best (30), every 40 (0, 40, 80), last 2 (90, 100)
    assert (latest, best, m100, m10) == (100, 30, {"loss": 70.5}, None)
    assert resumed == steps and m30 == {"loss": 0.5}
    assert (tmp_path / "run" / TRACKER_FNAME).read_text() == "100"
    index = json.loads((tmp_path / "run" / INDEX_FNAME).read_text())
    assert sorted(map(int, index["steps"])) == steps
    assert not (tmp_path / "run" / LOCK_FNAME).exists()  # released by close
    # the metrics travel in the checkpoint too (what rebuilds a lost index)
    assert dc.load_content_metadata(str(tmp_path / "run" / "iter_0000030"))[CONTENT_KEY] == {
        "step": 30, "metrics": {"loss": 0.5}}


def _async_counts_only_when_finalized(rank, world, root):
    with CheckpointManager(root, async_save=True) as mgr:
        assert mgr.save(1, _state(rank, world, 1))
        pending = (mgr.latest_step(), mgr.should_save(1), mgr.should_save(2))
        mgr.wait_until_finished()
        return pending, mgr.latest_step()


def test_async_save_counts_once_finalized(pool12, tmp_path):
    for pending, latest in pool12.run(_async_counts_only_when_finalized, str(tmp_path)):
        assert pending == (None, False, True) and latest == 1


# ----------------------------------------------------------------------------- bad input


def _open(rank, world, root, kw):
    CheckpointManager(root, **kw).close()


def test_root_that_is_a_file(pool12, tmp_path):
    (tmp_path / "f").write_text("x")
    assert_all_raise(pool12.run_expect_error(_open, str(tmp_path / "f"), {}), pool12.world_size, "is a file")


@pytest.mark.parametrize("kw, msg", [(dict(keep_best=2), "best_metric"), (dict(best_mode="up"), "best_mode"),
                                     (dict(save_interval_steps=0), "save_interval_steps")])
def test_bad_arguments(pool12, tmp_path, kw, msg):
    assert_all_raise(pool12.run_expect_error(_open, str(tmp_path), kw), pool12.world_size, msg)
    assert not (tmp_path / LOCK_FNAME).exists()


def _save_steps(rank, world, root, steps, kw=None):
    with CheckpointManager(root, **(kw or {})) as mgr:
        for step in steps:
            mgr.save(step, _state(rank, world, step), force=True)
        return mgr.all_steps()


def _resume(rank, world, root):
    with CheckpointManager(root) as mgr:
        loaded = mgr.load(_state(rank, world, 0, fill=False))
        mgr.wait_until_finished()
        return mgr.all_steps(), loaded["step"]


def test_unrelated_files_are_ignored_and_kept(pool12, tmp_path):
    root = tmp_path / "run"
    (root / "logs").mkdir(parents=True)
    (root / "logs" / "events").write_text("x")
    (root / "iter_0000007").write_text("a file, not a checkpoint")
    (root / "iter_12").mkdir()  # not Megatron-LM's name of a step
    (root / "notes.txt").write_text("x")
    (root / "iter_0000050" / "mp_rank_00").mkdir(parents=True)  # a legacy Megatron-LM checkpoint: not ours
    assert pool12.run(_save_steps, str(root), [10, 20], {"keep_last": 1})[0] == [20]
    assert pool12.run(_resume, str(root))[0] == ([20], 20)
    names = sorted(p.name for p in root.iterdir())
    assert names == [INDEX_FNAME, "iter_0000007", "iter_0000020", "iter_0000050", "iter_12", TRACKER_FNAME,
                     "logs", "notes.txt"]
    assert (root / "iter_0000050" / "mp_rank_00").is_dir()


@pytest.mark.parametrize("tracker", [None, "garbage\n", "\xff\xfe", "30", "release"], ids=[
    "missing", "garbage", "binary", "names-incomplete", "release"])
def test_tracker_damaged_missing_or_naming_an_incomplete_checkpoint(pool12, tmp_path, tracker):
    root = tmp_path / "run"
    pool12.run(_save_steps, str(root), [10, 20])
    (root / "iter_0000030").mkdir()  # an interrupted save: no metadata.json
    (root / "iter_0000030" / "__0_0.distcp").write_bytes(b"partial")
    (root / "iter_0000030" / ".save_claim").write_text(json.dumps(  # of a save of a run on another host
        {"save_id": "0" * 32, "host": "another-host", "pid": 1}))
    if tracker is None:
        (root / TRACKER_FNAME).unlink()
    else:
        (root / TRACKER_FNAME).write_bytes(tracker.encode("latin-1"))
    assert pool12.run(_resume, str(root))[0] == ([10, 20], 20)  # the newest complete one
    # repaired for Megatron-LM (a release tracker is Megatron-LM's own choice: kept)
    assert (root / TRACKER_FNAME).read_text() == ("release" if tracker == "release" else "20")
    assert not (root / "iter_0000030").exists()  # the leftover is removed in the background


@pytest.mark.parametrize("damage", ["missing", "garbage", "wrong-schema"])
def test_index_rebuilt_from_the_checkpoints(pool12, tmp_path, damage):
    root = tmp_path / "run"
    kw = dict(keep_best=1, best_metric="acc", best_mode="max")
    pool12.run(_save_metrics, str(root), {10: 0.5, 20: 0.9, 30: 0.7}, kw)
    index = root / INDEX_FNAME
    if damage == "missing":
        index.unlink()
    else:
        index.write_text("{not json" if damage == "garbage" else json.dumps({"steps": [1, 2]}))
    results = pool12.run(_save_metrics, str(root), {40: 0.6}, kw)
    assert results[0] == ([20, 40], 20, {"acc": 0.9})  # the best survived the lost index
    assert json.loads(index.read_text())["steps"]["20"] == {"metrics": {"acc": 0.9}}


def _save_metrics(rank, world, root, accs, kw):
    with CheckpointManager(root, **kw) as mgr:
        for step, acc in accs.items():
            mgr.save(step, _state(rank, world, step), metrics={"acc": acc})
        return mgr.all_steps(), mgr.best_step(), mgr.metrics(mgr.best_step())


def _two_managers(rank, world, root):
    with CheckpointManager(root) as first:
        first.save(1, _state(rank, world, 1))
        try:
            CheckpointManager(root)
        except CheckpointingException as e:
            err = str(e)
        else:
            raise AssertionError("a second manager on the root was not refused")
        first.save(2, _state(rank, world, 2))
    with CheckpointManager(root) as after:  # released: a later manager may use it
        return err, after.all_steps()


def test_two_managers_on_one_root_are_refused(pool12, tmp_path):
    for err, steps in pool12.run(_two_managers, str(tmp_path)):
        assert "used by another CheckpointManager" in err and LOCK_FNAME in err
        assert steps == [1, 2]


def test_second_process_refused_while_first_holds_the_root(tmp_path):
    """A manager in another live process holds the root: refused; once it is gone, taken over."""
    script = ("import sys, time; import dist_checkpointing as dc; m = dc.CheckpointManager(sys.argv[1]); "
              "print('held', flush=True); time.sleep(60)")
    proc = Launched(["-c", script, str(tmp_path)],
                    env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        assert proc.wait_for_output("held\n", slack(60)), proc.output()
        with pytest.raises(CheckpointingException, match=f"pid {proc.pid}"):
            CheckpointManager(str(tmp_path))
    finally:
        proc.kill()
        proc.wait()
    with CheckpointManager(str(tmp_path)) as mgr:  # the lock of the dead process is stale
        assert mgr.all_steps() == []
    assert not (tmp_path / LOCK_FNAME).exists()


def _step_twice(rank, world, root):
    with CheckpointManager(root, save_interval_steps=5) as mgr:
        assert mgr.save(10, _state(rank, world, 10))
        again = mgr.save(10, _state(rank, world, 99))  # not a save step any more: nothing happens
        try:
            mgr.save(10, _state(rank, world, 99), force=True)
        except CheckpointingException as e:
            forced = str(e)
        _check_loaded(mgr.load(_state(rank, world, 0, fill=False)), rank, 10)
        return again, forced, mgr.all_steps()


def test_step_saved_twice(pool12, tmp_path):
    for again, forced, steps in pool12.run(_step_twice, str(tmp_path)):
        assert again is False and "step 10 is already saved" in forced and steps == [10]


def _backwards(rank, world, root):
    with CheckpointManager(root) as mgr:
        mgr.save(20, _state(rank, world, 20))
        assert not mgr.should_save(10)
        mgr.save(10, _state(rank, world, 10))


def test_steps_going_backwards(pool12, tmp_path):
    excs = pool12.run_expect_error(_backwards, str(tmp_path))
    assert_all_raise(excs, pool12.world_size, "step 10 is older than the newest checkpoint 20")
    assert _dirs(tmp_path) == ["iter_0000020"]


def _missing_metric(rank, world, root, metrics):
    with CheckpointManager(root, keep_best=1, best_metric="loss") as mgr:
        mgr.save(5, _state(rank, world, 5), metrics={"loss": 1.0})
        try:
            mgr.save(10, _state(rank, world, 10), metrics=metrics)
        finally:
            assert mgr.all_steps() == [5]


@pytest.mark.parametrize("metrics, msg", [
    (None, "keep_best needs metrics['loss']"), ({"acc": 1.0}, "keep_best needs metrics['loss']"),
    ({"loss": "low"}, "keep_best needs metrics['loss']"), ({"loss": float("nan")}, "keep_best needs metrics['loss']"),
    ([1.0], "must be a JSON object"), ({"loss": 1.0, "obj": object()}, "must be a JSON object")])
def test_metric_missing_for_keep_best_or_not_json(pool12, tmp_path, metrics, msg):
    excs = pool12.run_expect_error(_missing_metric, str(tmp_path), metrics)
    assert_all_raise(excs, pool12.world_size, msg, "step 10")
    assert _dirs(tmp_path) == ["iter_0000005"]


def _different_steps(rank, world, root):
    with CheckpointManager(root) as mgr:
        mgr.save(10 + rank, _state(rank, world, 10))


def test_ranks_disagreeing_on_the_step(pool2, tmp_path):
    excs = pool2.run_expect_error(_different_steps, str(tmp_path))
    assert_all_raise(excs, 2, "the ranks pass different steps to save")
    assert "rank 0: step 10" in str(excs[0]) and "rank 1: step 11" in str(excs[1])
    assert _dirs(tmp_path) == []


def _no_checkpoint(rank, world, root, step):
    with CheckpointManager(root) as mgr:
        mgr.load(_state(rank, world, 0, fill=False), step=step)


@pytest.mark.parametrize("step, msg", [(None, "no complete checkpoint"), (3, "step 3 is not a complete checkpoint"),
                                       (-1, "non-negative integer")])
def test_load_without_that_checkpoint(pool12, tmp_path, step, msg):
    assert_all_raise(pool12.run_expect_error(_no_checkpoint, str(tmp_path), step), pool12.world_size, msg)


# ----------------------------------------------------------------------------- failed saves


@contextlib.contextmanager
def _writes_fail_on(rank: int, failing_rank: int):
    """Data-file writes of ``failing_rank`` fail (a forked async writer inherits this)."""
    orig = torch_dist_writing.write_file

    def fail(*args, **kwargs):
        raise OSError(5, "injected write failure")

    if rank == failing_rank:
        torch_dist_writing.write_file = fail
    try:
        yield
    finally:
        torch_dist_writing.write_file = orig


def _failed_save_keeps_good(rank, world, root, async_save):
    with CheckpointManager(root, keep_last=1, async_save=async_save) as mgr:
        mgr.save(10, _state(rank, world, 10))
        mgr.wait_until_finished()
        with _writes_fail_on(rank, world - 1):
            try:
                mgr.save(20, _state(rank, world, 20))
                mgr.wait_until_finished()
            except CheckpointingException as e:
                err = str(e)
            else:
                raise AssertionError("the save did not fail")
        mgr.wait_until_finished()
        after_failure = (mgr.all_steps(), _dirs(root) if rank == 0 else None)
        _check_loaded(mgr.load(_state(rank, world, 0, fill=False)), rank, 10)
        assert mgr.save(20, _state(rank, world, 20))  # the step can be saved again
        mgr.wait_until_finished()
        return err, after_failure, mgr.all_steps()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_failed_save_deletes_nothing_good(pool12, tmp_path, async_save):
    results = pool12.run(_failed_save_keeps_good, str(tmp_path), async_save)
    for rank, (err, (steps, dirs), final) in enumerate(results):
        assert "injected write failure" in err, err
        assert steps == [10] and final == [20]
        if rank == 0:
            assert dirs == ["iter_0000010"]  # the failed save's leftover is gone, the good one kept
    assert _complete(tmp_path) == _dirs(tmp_path) == ["iter_0000020"]


# ----------------------------------------------------------------------------- Megatron-LM layout


def _hand_written_root(rank, world, root):
    for step in (100, 200):
        dc.save(_state(rank, world, step), os.path.join(root, f"iter_{step:07d}"))
    if rank == 0:
        Path(root, TRACKER_FNAME).write_text("200\n")
    with CheckpointManager(root, save_interval_steps=100, keep_last=2) as mgr:
        found = (mgr.all_steps(), mgr.latest_step(), mgr.metrics(200))
        _check_loaded(mgr.load(_state(rank, world, 0, fill=False)), rank, 200)
        mgr.save(300, _state(rank, world, 300), metrics={"loss": 1.5})
        mgr.wait_until_finished()
        return found, mgr.all_steps()


def test_megatron_lm_root_written_by_hand_is_resumed(pool12, tmp_path):
    root = tmp_path / "megatron"
    root.mkdir()
    for found, steps in pool12.run(_hand_written_root, str(root)):
        assert found == ([100, 200], 200, None) and steps == [200, 300]
    # Megatron-LM's reading of our root: the tracker's bare number names a complete iter_ dir
    step = int((root / TRACKER_FNAME).read_text())
    assert step == 300 and dc.check_is_distributed_checkpoint(str(root / f"iter_{step:07d}"))


def _fail_during_a_save(rank, world, root):
    """Training fails while step 1's async save is in flight: the manager closes with abort."""
    try:
        with CheckpointManager(root, async_save=True) as mgr:
            mgr.save(1, _state(rank, world, 1))
            raise RuntimeError("training failed")
    except RuntimeError:
        pass


def _abort_on_error(rank, world, root):
    _fail_during_a_save(rank, world, root)
    with CheckpointManager(root) as mgr:  # the lock was released; the unfinalized save is a leftover
        mgr.wait_until_finished()
        return mgr.all_steps()


def test_exception_in_the_with_block_releases_the_root(pool12, tmp_path):
    assert pool12.run(_abort_on_error, str(tmp_path)) == [[]] * pool12.world_size
    assert _dirs(tmp_path) == []


def _abort_while_writing(rank, world, root):
    """An error while the writer is still writing (slowed): once the manager has closed,
    nothing more is written into the dropped save's directory."""
    step_dir = Path(root) / "iter_0000001"
    with slow_writes(0.3):
        _fail_during_a_save(rank, world, root)
        if world > 1:  # the listing shows every rank's files: every manager has closed first
            torch.distributed.barrier()
        after_close = sorted(os.listdir(step_dir))
        time.sleep(0.6)  # a writer still running would add its next file by now
        return after_close, sorted(os.listdir(step_dir))


def test_an_aborted_save_writes_nothing_after_close(pool12, tmp_path):
    for after_close, later in pool12.run(_abort_while_writing, str(tmp_path)):
        assert after_close == later
    assert pool12.run(_abort_on_error, str(tmp_path)) == [[]] * pool12.world_size  # removed as a leftover
    assert _dirs(tmp_path) == []
