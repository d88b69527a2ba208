"""The persistent worker (one process started once, running calls in order), the shared
staging arenas it reads in place, and the staging contract of async saves on the CPU.
GPU behaviour (side-stream copies, pinned arenas) is in tests/test_gpu_async.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import xxhash

from dist_checkpointing import CheckpointingException
from dist_checkpointing.runtime.persistent_worker import PersistentWorker
from dist_checkpointing.runtime.arenas import ALIGN, ArenaPool, StagingArena, arena_layout, stage

from . import launch
from .worker_calls import arena_digest, boom, die, has_torch, pid_and_args
from .helpers import slack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not reaped yet) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def worker():
    w = PersistentWorker("test-worker", tensors=False)  # its calls (worker_calls) import no torch
    yield w
    w.close()


def test_calls_run_in_order_in_another_process(worker):
    jobs = [worker.submit(pid_and_args, (i, "x"), {"k": i}) for i in range(5)]
    results = [job.result(timeout=slack(60)) for job in jobs]
    pids = {pid for pid, _, _ in results}
    assert pids == {worker.pid} and worker.pid != os.getpid()
    assert worker.submit(has_torch).result(timeout=slack(60)) is False  # a worker without tensors has no torch
    assert [(args, kwargs) for _, args, kwargs in results] == [((i, "x"), {"k": i}) for i in range(5)]


def test_errors_name_the_call_and_the_worker_goes_on(worker):
    with pytest.raises(CheckpointingException, match=r"Writing x failed in the persistent worker: ValueError: boom 3"):
        worker.submit(boom, (3,), what="Writing x").result(timeout=slack(60))
    pid = worker.pid
    assert worker.submit(pid_and_args).result(timeout=slack(60))[0] == pid  # the same worker
    with pytest.raises(CheckpointingException, match="cannot send it to the persistent worker"):
        worker.submit(pid_and_args, (lambda: 0,))  # not picklable: refused here, not in the worker


def test_a_dead_worker_fails_its_calls_and_a_new_one_starts(worker):
    old = worker.submit(pid_and_args).result(timeout=slack(60))[0]
    with pytest.raises(CheckpointingException, match=r"died \(exit code 7\)"):
        worker.submit(die).result(timeout=slack(60))
    deadline = time.monotonic() + slack(30)
    while worker.process is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # the result collector notices the exit
    new = worker.submit(pid_and_args).result(timeout=slack(60))[0]
    assert new != old and not _alive(old)
    os.kill(new, signal.SIGKILL)  # killed from outside: the same
    with pytest.raises(CheckpointingException, match=r"died \(exit code -9\)"):
        job = worker.submit(pid_and_args)
        job.result(timeout=slack(60))
        raise AssertionError("the call ran in a killed worker")


def test_arenas_are_handed_over_once_and_read_in_place(worker):
    arena = StagingArena(3 * 4096 + 5)
    try:
        data = torch.randint(0, 255, (arena.size,), dtype=torch.uint8)
        arena.flat.copy_(data)
        worker.share_arena(arena.id, arena.fd, arena.size)
        expected = xxhash.xxh3_64_intdigest(data.numpy())
        assert worker.submit(arena_digest, (arena.id, arena.size)).result(timeout=slack(60)) == expected
        arena.flat[:10] = 0  # the worker sees this process's writes: shared, not copied
        data[:10] = 0
        worker.share_arena(arena.id, arena.fd, arena.size)  # already there: nothing sent
        assert worker.submit(arena_digest, (arena.id, arena.size)).result(timeout=slack(60)) == \
            xxhash.xxh3_64_intdigest(data.numpy())
        worker.forget_arena(arena.id)
        with pytest.raises(CheckpointingException, match=f"Staging arena {arena.id} was not handed"):
            worker.submit(arena_digest, (arena.id, 1)).result(timeout=slack(60))
    finally:
        arena.release()


def test_stage_copies_cpu_tensors_at_the_call():
    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, 5, dtype=torch.bfloat16).t(),
               torch.zeros(0, dtype=torch.int64), torch.tensor(7, dtype=torch.int16),
               torch.randn(4, requires_grad=True)]
    offsets, size = arena_layout(tensors)
    assert all(o % ALIGN == 0 for o in offsets) and size % ALIGN == 0
    arena = StagingArena(size)
    try:
        staged = stage(arena, tensors, offsets)
        assert staged.done()  # nothing left in flight for CPU tensors
        copies = [arena.view(o, t.dtype, tuple(t.shape)) for o, t in zip(offsets, tensors)]
        expected = [t.detach().clone() for t in tensors]
        for t in tensors:
            with torch.no_grad():
                t.add_(1) if t.numel() else None
        for copy, want in zip(copies, expected):
            assert torch.equal(copy, want)
        assert not arena.pinned  # no accelerator here
    finally:
        arena.release()


def test_arena_pool_reuses_idle_arenas_and_never_one_in_use():
    freed = []
    pool = ArenaPool(on_release=freed.append)
    a, done_a = pool.take(1000)
    b, done_b = pool.take(1000)
    assert b is not a  # a is being written
    done_a()
    done_a()  # idempotent
    a2, done_a2 = pool.take(900)
    assert a2 is a  # idle and big enough: reused
    done_a2()
    done_b()
    c, held = pool.take(5000)  # larger than both idle arenas: they are freed, a new one made
    assert c not in (a, b) and freed == [a, b] and pool.arenas == [c]
    pool.release()  # in use: kept
    assert pool.arenas == [c]
    held()
    pool.release()
    assert pool.arenas == [] and freed == [a, b, c]


_NO_MAIN_GUARD = """
import os, sys, torch
sys.path.insert(0, {root!r})
import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.torch_dist.save import TorchDistSaveShardedStrategy
from dist_checkpointing.runtime.persistent_worker import shared_worker
print("module ran", os.getpid(), flush=True)
t = torch.arange(1000.0)
ckpt = sys.argv[1]
req = dc.save({{"t": ShardedTensor.from_rank_offsets("t", t)}}, ckpt,
              TorchDistSaveShardedStrategy(async_snapshot="copy"), async_sharded_save=True)
t.zero_()
req.execute_sync()
out = dc.load({{"t": ShardedTensor.from_rank_offsets("t", torch.empty(1000))}}, ckpt)
assert torch.equal(out["t"], torch.arange(1000.0))
print("worker", shared_worker().pid, flush=True)
if len(sys.argv) > 2:
    import time
    time.sleep(600)  # the test kills this process
"""


def test_a_script_without_main_guard_is_not_run_again(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_NO_MAIN_GUARD.format(root=ROOT))
    out = launch.run([str(script), str(tmp_path / "ckpt")], timeout=slack(180))  # as `python train.py ckpt`
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("module ran") == 1, out.stdout  # multiprocessing's spawn would run it twice
    assert "worker" in out.stdout


def test_the_workerdies_with_its_parent(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_NO_MAIN_GUARD.format(root=ROOT))
    proc = launch.Launched([str(script), str(tmp_path / "ckpt"), "wait"])  # as `python train.py ckpt wait`
    try:
        assert proc.wait_for_output("worker", slack(180)), proc.output()
        worker_pid = int(proc.output()[0].split("worker")[1].split()[0])
        assert _alive(worker_pid)
        proc.kill()  # SIGKILL: no atexit, no goodbye
        proc.wait()
        deadline = time.monotonic() + slack(10)
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid), "the worker outlived its trainer"
    finally:
        proc.kill()
        proc.wait()
