"""The manager against a hostile or unlucky root (issue 29, items 3 and 6).

Deleting: only what a save of this library wrote, identified by content (the save id in the
claim, the checksum sidecars and ``.metadata``; the data files ``.metadata`` names), never a
tree by name, never through a link — on local roots, ``memory://`` and ``s3://`` (SeaweedFS),
at world 1 and 2. The lock: special files refused unopened on every rank (a FIFO would block
for ever: each case runs under a timeout), the takeover of a dead holder's lock won by
exactly one of many racing processes or threads; other files read from the root (tracker,
index, a save claim, a checkpoint's files) that are FIFOs fail or are skipped, never hang.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import List

import pytest

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, CheckpointManager
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.integrity.liveness import start_time
from dist_checkpointing.manager.layout import INDEX_FNAME, TRACKER_FNAME
from dist_checkpointing.manager.lock import LOCK_FNAME, RootLock
from dist_checkpointing.manager.ownership import checkpoint_files
from dist_checkpointing.storage import PosixStorage, storage_for

from .conftest import get_pool
from .helpers import assert_all_raise, slack
from .locations import _export_env
from .test_manager import _check_loaded, _save_steps, _state

TIMEOUT = 90  # a hang fails the test after this many seconds


# ----------------------------------------------------------------------------- locations


class Where:
    """A root of one kind (``posix``, ``memory``, ``s3``) and how to run a function on every rank."""

    def __init__(self, kind: str, root: str):
        self.kind, self.root = kind, root

    def loc(self, *names: str) -> str:
        return "/".join([self.root, *names]) if self.kind != "posix" else os.path.join(self.root, *names)

    def storage(self, *names: str):
        return storage_for(self.loc(*names))

    def run(self, world: int, fn, *args):
        if self.kind == "memory":  # per process: the test's own, world 1
            return [fn(0, 1, *args)]
        return get_pool(world).run(fn, *args, timeout=TIMEOUT)

    def run_expect_error(self, world: int, fn, *args) -> List[BaseException]:
        if self.kind == "memory":
            with pytest.raises(CheckpointingException) as info:
                fn(0, 1, *args)
            return [info.value]
        return get_pool(world).run_expect_error(fn, *args, timeout=TIMEOUT)

    def gone(self, *names: str) -> bool:
        return self.storage().kind("/".join(names)) is None if self.kind != "posix" else \
            not os.path.lexists(self.loc(*names))

    def listing(self, *names: str) -> List[str]:
        storage = self.storage(*names)
        return [n for n in storage.list() if storage.kind(n) is not None]  # SeaweedFS keeps emptied prefixes listed


# memory:// is per process: world 1 only there
@pytest.fixture(params=[("posix", 1), ("posix", 2), ("memory", 1), ("s3", 1), ("s3", 2)],
                ids=lambda p: f"{p[0]}-world{p[1]}")
def where_world(request, tmp_path):
    """A root of each kind and the world size to run at there."""
    kind, world = request.param
    return _where(request, tmp_path, kind), world


def _where(request, tmp_path, kind: str) -> Where:
    if kind == "posix":
        return Where("posix", str(tmp_path / "run"))
    if kind == "memory":
        pytest.importorskip("fsspec")
        return Where("memory", f"memory://hostile/{uuid.uuid4().hex[:12]}")
    pytest.importorskip("obstore")
    server = request.getfixturevalue("s3_server")
    _export_env(server.env())
    return Where("s3", f"s3://{server.bucket}/hostile-{uuid.uuid4().hex[:12]}")


def _resume_and_save(rank, world, root, step, kw=None):
    """Open the root (its leftovers are deleted), save ``step``, wait for the deletions."""
    with CheckpointManager(root, **(kw or {})) as mgr:
        mgr.save(step, _state(rank, world, step), force=True)
        mgr.wait_until_finished()
        return mgr.all_steps()


def _interrupted(where: Where, step_name: str, claim: dict) -> str:
    """What a save killed before its commit leaves in ``step_name``: its data files, ``common.pt``,
    ``.metadata``, their sidecars (all naming its save id) and its claim; returns the save id."""
    dc.save(_state(0, 1, 99), where.loc(step_name))
    storage = where.storage(step_name)
    storage.delete(CONFIG_FNAME)
    save_id = json.loads(storage.read_bytes(".metadata.checksum"))["save_id"]
    storage.write_atomic(".save_claim", json.dumps({"save_id": save_id, **claim}).encode())
    return save_id


_DEAD_ELSEWHERE = {"host": "another-host", "pid": 1}  # a crashed run's save on another node


def _write(where: Where, name: str, data: bytes) -> None:
    """A user's file ``name`` (``a/b`` for a file in a sub-directory) under the root."""
    if where.kind == "posix":
        path = Path(where.loc(name))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    else:
        where.storage().write_atomic(name, data)


# ----------------------------------------------------------------------------- 3. deleting what is not ours


def test_only_what_a_save_wrote_is_deleted(where_world):
    """Leftovers and retired checkpoints lose exactly the files a save of this library wrote:
    a user's files and directories named like ours stay, a leftover without a record of a
    save or with records of two saves stays whole, a plain leftover goes entirely."""
    where, world = where_world
    where.run(world, _save_steps, where.root, [1, 2])
    mine = {"notes.txt": b"notes", "x.distcp": b"mine", "mine.distcp/inner": b"inner"}
    # step 1 (complete, to be retired) and step 3 (an interrupted save) also hold a user's files
    _interrupted(where, "iter_0000003", _DEAD_ELSEWHERE)
    for step_name in ("iter_0000001", "iter_0000003"):
        for name, data in mine.items():
            _write(where, f"{step_name}/{name}", data)
    # step 4: only a user's files, named like ours, no record of a save
    named_like_ours = {"__0_0.distcp": b"u", "common.pt": b"u", ".metadata": b"u",
                       "common.pt.checksum": json.dumps({"algorithm": "xxh3_64"}).encode()}
    for name, data in named_like_ours.items():
        _write(where, f"iter_0000004/{name}", data)
    # step 6: an interrupted save whose sidecar names another save
    _interrupted(where, "iter_0000006", _DEAD_ELSEWHERE)
    storage6 = where.storage("iter_0000006")
    sidecar = json.loads(storage6.read_bytes("common.pt.checksum"))
    storage6.write_atomic("common.pt.checksum", json.dumps({**sidecar, "save_id": "f" * 32}).encode())
    before6 = where.listing("iter_0000006")
    _interrupted(where, "iter_0000007", _DEAD_ELSEWHERE)  # a plain leftover

    assert where.run(world, _resume_and_save, where.root, 8, {"keep_last": 1})[0] == [8]

    assert where.listing("iter_0000001") == ["mine.distcp", "notes.txt", "x.distcp"]  # the checkpoint's files gone
    assert where.listing("iter_0000003") == ["mine.distcp", "notes.txt", "x.distcp"]  # the save's files gone
    for step_name in ("iter_0000001", "iter_0000003"):
        for name, data in mine.items():
            assert where.storage(step_name).read_bytes(name) == data
    assert where.listing("iter_0000004") == sorted(named_like_ours)
    assert where.storage("iter_0000004").read_bytes("common.pt") == b"u"
    assert where.listing("iter_0000006") == before6
    assert where.gone("iter_0000002") and where.gone("iter_0000007")
    # the directories kept are never loaded: the newest complete step is still 8
    assert where.run(world, _resume_and_save, where.root, 9)[0] == [8, 9]


def test_a_deletion_killed_after_any_file_leaves_a_leftover_the_next_manager_removes(where_world):
    """Retiring a checkpoint deletes ``metadata.json`` first, then its files in an order that
    keeps a record of the save to the last; killed after any of them — or after the last,
    before the directory itself — what is left is removed by the next manager."""
    where, world = where_world
    where.run(world, _save_steps, where.root, [1])
    order = [n for n in checkpoint_files(where.storage("iter_0000001")).ours if n != CONFIG_FNAME]
    steps = list(range(10, 11 + len(order)))
    where.run(world, _save_steps, where.root, steps)
    for done, step in enumerate(steps):  # step 10: killed right after metadata.json; the last: all files
        storage = where.storage(f"iter_{step:07d}")
        storage.delete_many([CONFIG_FNAME] + order[:done])
    assert where.run(world, _resume_and_save, where.root, 99)[0] == [1, 99]
    assert all(where.gone(f"iter_{step:07d}") for step in steps), where.listing()


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "300"])


def test_leftover_of_a_running_save_is_kept(where_world):
    """A leftover whose claim names a save of another process of this host that still runs is
    neither deleted nor saved into (on every rank); once that process is gone it is a
    leftover like any other."""
    where, world = where_world
    where.run(world, _save_steps, where.root, [1])
    sleeper = _sleeper()
    try:
        claim = {"host": socket.gethostname(), "pid": sleeper.pid, "started": start_time(sleeper.pid)}
        _interrupted(where, "iter_0000002", claim)
        before = where.listing("iter_0000002")
        excs = where.run_expect_error(world, _resume_and_save, where.root, 2)
        assert_all_raise(excs, world, "iter_0000002", "did not write")
        assert where.listing("iter_0000002") == before
    finally:
        sleeper.kill()
        sleeper.wait()
    assert where.run(world, _resume_and_save, where.root, 2)[0] == [1, 2]


def _load_step(rank, world, root, step):
    with CheckpointManager(root) as mgr:
        _check_loaded(mgr.load(_state(rank, world, 0, fill=False), step=step), rank, step)
        return mgr.all_steps()


@pytest.mark.parametrize("world", [1, 2])
def test_links_are_never_followed(tmp_path, world):
    """A retired step that is a link is unlinked, its target (an archive) untouched; a link
    inside a retired step (to a file or a directory) is removed only if it is one of the
    checkpoint's files, and then only the link; a leftover that is a link, or a link inside
    a leftover (even named like a data file), is kept, and so is its target."""
    root, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    get_pool(world).run(_save_steps, str(root), [2])
    # step 1: a link to an archived checkpoint
    dc.save(_state(0, 1, 1), str(outside / "archive"))
    archived = sorted(os.listdir(outside / "archive"))
    (root / "iter_0000001").symlink_to(outside / "archive", target_is_directory=True)
    # step 2: its common.pt moved out and linked back; links of a user's to a file and a directory
    shutil.move(str(root / "iter_0000002" / "common.pt"), str(outside / "common_2.pt"))
    (root / "iter_0000002" / "common.pt").symlink_to(outside / "common_2.pt")
    (outside / "precious.txt").write_text("precious")
    (outside / "dir").mkdir()
    (outside / "dir" / "inner").write_text("inner")
    (root / "iter_0000002" / "extra").symlink_to(outside / "precious.txt")
    (root / "iter_0000002" / "mine.distcp").symlink_to(outside / "dir", target_is_directory=True)
    assert get_pool(world).run(_load_step, str(root), 2)[0] == [1, 2]  # loads through the link
    # step 3: a link to an interrupted save elsewhere; step 4: an interrupted save holding a link
    _interrupted(Where("posix", str(outside)), "leftover", _DEAD_ELSEWHERE)
    leftover = sorted(os.listdir(outside / "leftover"))
    (root / "iter_0000003").symlink_to(outside / "leftover", target_is_directory=True)
    _interrupted(Where("posix", str(root)), "iter_0000004", _DEAD_ELSEWHERE)
    (outside / "precious2").write_text("precious2")
    (root / "iter_0000004" / "__9_0.distcp").symlink_to(outside / "precious2")

    assert get_pool(world).run(_resume_and_save, str(root), 5, {"keep_last": 1})[0] == [5]

    assert not os.path.lexists(root / "iter_0000001")  # the link, not the archive
    assert sorted(os.listdir(outside / "archive")) == archived
    dc.load(_state(0, 1, 1, fill=False), str(outside / "archive"))
    assert sorted(os.listdir(root / "iter_0000002")) == ["extra", "mine.distcp"]
    assert (outside / "common_2.pt").stat().st_size > 0 and (outside / "precious.txt").read_text() == "precious"
    assert (outside / "dir" / "inner").read_text() == "inner"
    assert (root / "iter_0000003").is_symlink() and sorted(os.listdir(outside / "leftover")) == leftover
    assert os.listdir(root / "iter_0000004") == ["__9_0.distcp"] and (outside / "precious2").read_text() == "precious2"


# ----------------------------------------------------------------------------- 6. the lock


def _open_manager(rank, world, root):
    with CheckpointManager(root):
        pass


def _stale_record(host: str = None) -> dict:
    """The lock of a dead process of this host (a pid that no longer runs)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return {"host": host or socket.gethostname(), "pid": proc.pid, "started": "0", "token": uuid.uuid4().hex,
            "time": 0.0}


def _make_special(path: Path, kind: str, tmp_path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "dir":
        path.mkdir()
    elif kind == "symlink-to-stale-lock":
        (tmp_path / "elsewhere").write_text(json.dumps(_stale_record()))
        path.symlink_to(tmp_path / "elsewhere")
    else:  # a dangling link
        path.symlink_to(tmp_path / "missing")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["fifo", "socket", "dir", "symlink-to-stale-lock", "dangling-symlink"])
def test_special_lock_file_is_refused_on_every_rank(tmp_path, world, kind):
    """A ``.manager_lock`` that is not a regular file is refused unopened (a FIFO would block
    the constructor for ever: the pool's timeout fails the test instead), and left as it is."""
    root = tmp_path / "run"
    root.mkdir()
    _make_special(root / LOCK_FNAME, kind, tmp_path)
    excs = get_pool(world).run_expect_error(_open_manager, str(root), timeout=TIMEOUT)
    assert_all_raise(excs, world, str(root / LOCK_FNAME), "not a regular file")
    assert os.path.lexists(root / LOCK_FNAME)
    if kind == "symlink-to-stale-lock":
        assert json.loads((tmp_path / "elsewhere").read_text())["time"] == 0.0  # the target untouched


class _SlowDeletes(PosixStorage):
    """A storage whose deletes take a while (a network file system): widens the window
    between a racer's check of the stale lock and its delete."""

    def delete(self, name: str) -> None:
        time.sleep(0.05)
        super().delete(name)


def _race(storage, barrier) -> str:
    """Start with the other racers, take the lock: ``"won"`` or ``"refused: <why>"``."""
    lock = RootLock(storage)
    barrier.wait()
    try:
        lock.acquire()
        return "won"
    except CheckpointingException as e:
        return f"refused: {e}"


def _race_in_process(root: str, barrier, results) -> None:
    results.put(_race(_SlowDeletes(root), barrier))
    barrier.wait()  # stay alive (holding a lock, if won) until every racer has answered


@pytest.mark.parametrize("racers", [8])
def test_stale_lock_takeover_race_processes(tmp_path, racers):
    """Many processes of this host take over one dead holder's lock at once: exactly one
    wins, every other is refused naming the winner; five rounds (with slow deletes, as on a
    network file system: without the takeover mutex several racers win every round)."""
    ctx = mp.get_context("fork")
    root = tmp_path / "run"
    root.mkdir()
    for _ in range(5):
        (root / LOCK_FNAME).write_text(json.dumps(_stale_record()))
        barrier, results = ctx.Barrier(racers), ctx.Queue()
        procs = [ctx.Process(target=_race_in_process, args=(str(root), barrier, results)) for _ in range(racers)]
        for p in procs:
            p.start()
        answers = [results.get(timeout=slack(TIMEOUT)) for _ in procs]
        for p in procs:
            p.join(slack(TIMEOUT))
            assert p.exitcode == 0
        assert answers.count("won") == 1, answers
        assert all("used by another CheckpointManager" in a for a in answers if a != "won"), answers
        (root / LOCK_FNAME).unlink()


@pytest.mark.parametrize("kind", ["posix", "memory", "s3"])
def test_stale_lock_takeover_race_threads(tmp_path, request, kind):
    """The same with threads of one process, on each kind of root (the winner's pid is this
    process's, so the others find it running)."""
    if kind == "posix":
        root = Where("posix", str(tmp_path / "run"))
        os.makedirs(root.root)
    elif kind == "memory":
        pytest.importorskip("fsspec")
        root = Where("memory", f"memory://hostile/{uuid.uuid4().hex[:12]}")
    else:
        pytest.importorskip("obstore")
        server = request.getfixturevalue("s3_server")
        _export_env(server.env())
        root = Where("s3", f"s3://{server.bucket}/race-{uuid.uuid4().hex[:12]}")
    storage = root.storage()
    racers = 6
    for _ in range(4):
        storage.write_atomic(LOCK_FNAME, json.dumps(_stale_record()).encode())
        barrier, answers = threading.Barrier(racers), []

        def race() -> None:
            answers.append(_race(_SlowDeletes(root.root) if kind == "posix" else root.storage(), barrier))

        threads = [threading.Thread(target=race) for _ in range(racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in threads)
        assert answers.count("won") == 1, answers
        storage.delete(LOCK_FNAME)


def test_lock_of_a_live_or_remote_holder_is_not_taken_over(tmp_path):
    """The takeover is for a dead holder of this host only: a live one, or one on another
    host, is refused and its lock kept as it is."""
    root = tmp_path / "run"
    root.mkdir()
    for record in (_stale_record(host="another-host"), {**_stale_record(), "pid": os.getpid(), "started": None}):
        (root / LOCK_FNAME).write_text(json.dumps(record))
        with pytest.raises(CheckpointingException, match="used by another CheckpointManager"):
            RootLock(PosixStorage(str(root))).acquire()
        assert json.loads((root / LOCK_FNAME).read_text()) == record


# ----------------------------------------------------------------------------- other files read from the root


def _resume_steps(rank, world, root):
    with CheckpointManager(root) as mgr:
        loaded = mgr.load(_state(rank, world, 0, fill=False))
        mgr.wait_until_finished()
        return mgr.all_steps(), loaded["step"]


@pytest.mark.parametrize("world", [1, 2])
def test_fifos_in_the_root_never_block(tmp_path, world):
    """A FIFO as the tracker, the index, or a leftover's claim: the manager opens the root
    and resumes (the tracker and index rebuilt, the leftover left alone); a FIFO as a save
    claim or ``common.pt`` makes save and load raise on every rank. Each under a timeout."""
    root = tmp_path / "run"
    pool = get_pool(world)
    pool.run(_save_steps, str(root), [1, 2])
    for name in (TRACKER_FNAME, INDEX_FNAME):
        (root / name).unlink()
        os.mkfifo(root / name)
    (root / "iter_0000003").mkdir()
    os.mkfifo(root / "iter_0000003" / ".save_claim")
    assert pool.run(_resume_steps, str(root), timeout=TIMEOUT)[0] == ([1, 2], 2)
    assert (root / TRACKER_FNAME).read_text() == "2" and json.loads((root / INDEX_FNAME).read_text())
    assert os.listdir(root / "iter_0000003") == [".save_claim"]

    (root / "claimed").mkdir()
    os.mkfifo(root / "claimed" / ".save_claim")
    excs = pool.run_expect_error(_save_to, str(root / "claimed"), timeout=TIMEOUT)
    assert_all_raise(excs, world, "claimed")
    (root / "iter_0000002" / "common.pt").unlink()
    os.mkfifo(root / "iter_0000002" / "common.pt")
    excs = pool.run_expect_error(_load_plain, str(root / "iter_0000002"), timeout=TIMEOUT)
    assert_all_raise(excs, world, "common.pt")


def _save_to(rank, world, path):
    dc.save(_state(rank, world, 1), path)


def _load_plain(rank, world, path):
    dc.load(_state(rank, world, 0, fill=False), path)
