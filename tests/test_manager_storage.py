"""CheckpointManager and storage: background deletion (in pieces, held while a save runs or
a load reads), ``Storage.delete_many``, and the manager on an ``s3://`` root against a real
SeaweedFS server (``tests/s3_server.py``; skipped without obstore)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, CheckpointManager
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.manager.layout import INDEX_FNAME, TRACKER_FNAME
from dist_checkpointing.manager.lock import LOCK_FNAME
from dist_checkpointing.manager.bookkeeping import Bookkeeper
from dist_checkpointing.storage import PosixStorage

from .test_manager import _check_loaded, _dirs, _state


# ----------------------------------------------------------------------------- background deletion


def test_posix_delete_many(tmp_path, monkeypatch):
    """``Storage.delete_many`` (added for the manager): the entries named (a large file in
    pieces, ``pause`` before each; a link itself, never its target; missing ones skipped),
    then ``remove_dir`` once the directory is empty."""
    from dist_checkpointing.storage import posix

    monkeypatch.setattr(posix, "DELETE_PIECE_BYTES", 1000)
    storage = PosixStorage(str(tmp_path / "d"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "big").write_bytes(b"x" * 3500)  # 3 truncations, then the unlink
    (tmp_path / "d" / "b").write_text("b")
    (tmp_path / "d" / "link").symlink_to(tmp_path / "keep")
    (tmp_path / "keep").write_text("k")
    sizes = []
    storage.delete_many(["big", "b", "link", "missing"], pause=lambda: sizes.append(
        (tmp_path / "d" / "big").stat().st_size if (tmp_path / "d" / "big").exists() else None))
    # a pause before each piece of the large file (3 truncations, its unlink), one per other entry found
    assert len(sizes) == 6 and sorted({s for s in sizes if s}, reverse=True) == [3500, 2500, 1500, 500]
    assert storage.list() == [] and (tmp_path / "keep").read_text() == "k"
    PosixStorage(str(tmp_path)).remove_dir("d")
    PosixStorage(str(tmp_path)).remove_dir("missing")
    assert sorted(os.listdir(tmp_path)) == ["keep"]


def test_deletion_waits_for_a_load_in_progress(tmp_path):
    for step in (1, 2):
        dc.save(_state(0, 1, step), str(tmp_path / f"iter_{step:07d}"))
    storage = PosixStorage(str(tmp_path))
    worker = Bookkeeper(storage, lambda name: PosixStorage(str(tmp_path / name)))
    try:
        with worker.loading("iter_0000001"):
            worker.delete("iter_0000001", committed=True)
            worker.delete("iter_0000002", committed=True)
            deadline = time.monotonic() + 10
            while (tmp_path / "iter_0000002").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not (tmp_path / "iter_0000002").exists()  # the others go on
            time.sleep(0.2)
            assert (tmp_path / "iter_0000001" / CONFIG_FNAME).exists()  # the one loading is untouched
            with pytest.raises(CheckpointingException, match="is being deleted"):
                with worker.loading("iter_0000001"):
                    pass
        worker.wait()
        assert not (tmp_path / "iter_0000001").exists()
    finally:
        worker.stop()


def test_deletion_runs_in_the_background(tmp_path):
    """A save returns while a slow deletion is still running (it never waits for it)."""
    release = threading.Event()
    orig = PosixStorage.delete_many

    def slow_delete_many(self, names, pause=None):
        release.wait(30)
        orig(self, names, pause)

    PosixStorage.delete_many = slow_delete_many
    try:
        with CheckpointManager(str(tmp_path), keep_last=1) as mgr:
            for step in (1, 2, 3):
                assert mgr.save(step, _state(0, 1, step))
            assert mgr.all_steps() == [3]
            deadline = time.monotonic() + 10
            while (tmp_path / "iter_0000001" / CONFIG_FNAME).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not (tmp_path / "iter_0000001" / CONFIG_FNAME).exists()  # the commit marker goes first
            assert (tmp_path / "iter_0000001").exists()  # the rest is still waiting
            release.set()
            mgr.wait_until_finished()
    finally:
        PosixStorage.delete_many = orig
    assert _dirs(tmp_path) == ["iter_0000003"]


# ----------------------------------------------------------------------------- object storage


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_on_s3(s3_server, monkeypatch, async_save):
    """The manager on an ``s3://`` root (sync and async saves): saves, retention deletes a prefix (metadata.json
    first), the tracker and index are objects, a leftover is removed, a new manager resumes."""
    pytest.importorskip("obstore")
    from dist_checkpointing.storage.s3 import S3Storage

    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    url = f"s3://{s3_server.bucket}/manager-{os.getpid()}-{time.monotonic_ns()}"
    root = S3Storage(url)

    def listing():  # SeaweedFS lists a prefix whose objects are all deleted until it drops it
        return [name for name in root.list() if root.kind(name) is not None]

    with CheckpointManager(url, keep_last=2, storage_options={}, async_save=async_save) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, _state(0, 1, step), metrics={"loss": float(step)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3] and mgr.metrics(3) == {"loss": 3.0}
        assert listing() == [LOCK_FNAME, INDEX_FNAME, "iter_0000002", "iter_0000003", TRACKER_FNAME]
        assert root.read_bytes(TRACKER_FNAME) == b"3"
        _check_loaded(mgr.load(_state(0, 1, 0, fill=False)), 0, 3)
    # an interrupted save of step 4 (of a run on another host), and a user's objects beside it
    root.write_atomic("iter_0000004/.save_claim", json.dumps({"save_id": "1" * 32, "host": "another-host"}).encode())
    root.write_atomic("iter_0000004/__0_0.distcp", b"partial")
    root.write_atomic("iter_0000001/notes.txt", b"mine")
    with CheckpointManager(url) as mgr:
        assert mgr.latest_step() == 3
        _check_loaded(mgr.load(_state(0, 1, 0, fill=False)), 0, 3)
        mgr.wait_until_finished()
        assert root.kind("iter_0000004") is None  # the leftover is gone
        assert mgr.save(4, _state(0, 1, 4))
    assert listing() == [INDEX_FNAME, "iter_0000001", "iter_0000002", "iter_0000003", "iter_0000004", TRACKER_FNAME]
    assert S3Storage(f"{url}/iter_0000001").list() == ["notes.txt"]  # a user's object is never deleted
