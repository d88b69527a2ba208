"""Async saves: ``save(..., async_sharded_save=True)``, AsyncRequest, AsyncCallsQueue,
the forked writer (ForkedCall) and ForkHostCopies, through real gloo process groups.

An async save snapshots the state when ``save`` returns (fork, copy-on-write), writes
it in a child process, and is complete (``metadata.json``) only once an
``AsyncCallsQueue`` has finalized it on every rank.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.strategies import async_utils
from dist_checkpointing.runtime import forked_call, persistent_worker
from dist_checkpointing.strategies.torch_dist import save as torch_dist_save
from dist_checkpointing.strategies.torch_dist import writing as torch_dist_writing
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest, ForkedCall
from dist_checkpointing.strategies.base import SaveCommonStrategy, SaveShardedStrategy
from dist_checkpointing.strategies.common import TorchCommonSaveStrategy
from dist_checkpointing.runtime.snapshot import ForkHostCopies
from dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy, read_metadata

from .conftest import get_pool
from .faulty_storage import FaultyStorage
from .helpers import assert_all_raise, slack, slow_writes

ASYNC_THREAD = "dist_checkpointing-async"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ERR_TIMEOUT = 60.0


# ----------------------------------------------------------------------------- helpers


def _values(key: str, shape, dtype, gen: int) -> torch.Tensor:
    """Deterministic global values of ``key`` for generation ``gen``."""
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n, dtype=torch.float64).reshape(shape)
    if dtype == torch.bool:
        return (base.long() + gen + len(key)) % 3 == 0
    return (base * 0.25 + len(key) + 100 * gen).to(dtype)


def _state(rank: int, world: int, gen: int = 0, fill: bool = True) -> dict:
    """A TP x DP sharded state with several dtypes, a prepended axis, a flattened
    (distributed-optimizer) slice, per-rank and replicated ShardedObjects and common
    state. ``fill=False`` gives the matching load request (zeros / None)."""
    tp = 2 if world >= 2 else 1
    tp_rank, dp_rank, dp = rank % tp, rank // tp, world // tp

    def chunk(key, shape, axis, dtype=torch.float32, layer=None):
        full = _values(key, shape, dtype, gen)
        if layer is not None:
            full = full[layer]
        n = full.shape[axis] // tp
        local = full.narrow(axis, tp_rank * n, n).clone()
        return local if fill else torch.zeros_like(local)

    # distributed-optimizer style: the TP chunk (8, 6) is flattened and split over DP
    flat_chunk = _values("opt.exp_avg", (8 * tp, 6), torch.float32, gen).narrow(0, tp_rank * 8, 8).flatten()
    step = 48 // dp
    start, stop = dp_rank * step, (48 if dp_rank == dp - 1 else (dp_rank + 1) * step)
    flat = flat_chunk[start:stop].clone() if fill else torch.zeros(stop - start)
    ids = _values("ids", (3 * world,), torch.int64, gen).narrow(0, 3 * rank, 3).clone()
    return {
        "emb": ShardedTensor.from_rank_offsets("emb", chunk("emb", (16, 6), 0), (0, tp_rank, tp), replica_id=dp_rank),
        "layers": [
            ShardedTensor.from_rank_offsets("dec.qkv", chunk("dec.qkv", (2, 12, 4), 0, layer=i), (0, i, 2),
                                            (1, tp_rank, tp), replica_id=dp_rank, prepend_axis_num=1)
            for i in range(2)
        ],
        "fc": ShardedTensor.from_rank_offsets("fc", chunk("fc", (4, 8), 1, torch.bfloat16), (1, tp_rank, tp),
                                              replica_id=dp_rank),
        "ids": ShardedTensor.from_rank_offsets("ids", ids if fill else torch.zeros_like(ids), (0, rank, world)),
        "mask": ShardedTensor.from_rank_offsets(
            "mask", _values("mask", (5,), torch.bool, gen) if fill else torch.zeros(5, dtype=torch.bool),
            replica_id=rank),
        "opt": {"exp_avg": ShardedTensor.from_rank_offsets_flat("opt.exp_avg", flat, (8, 6), (0, tp_rank, tp),
                                                                 flattened_range=slice(start, stop))},
        "rng": ShardedObject("rng", {"rank": rank, "gen": gen, "state": list(range(rank, rank + 4))} if fill else None,
                             (world,), (rank,)),
        "sched": ShardedObject("sched", {"step": 10 + gen} if fill else None, (1,), (0,), replica_id=rank),
        "iteration": 17 + gen,
        "args": {"lr": 0.5, "name": "gpt"},
        "plain": torch.arange(3) + gen,
    }


def _leaves(d, prefix=""):
    if isinstance(d, dict):
        for k in sorted(d):
            yield from _leaves(d[k], f"{prefix}/{k}")
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _leaves(v, f"{prefix}/{i}")
    else:
        yield prefix, d


def _unwrap(d):
    """The values a load returns for the sharded state dict ``d``."""
    if isinstance(d, dict):
        return {k: _unwrap(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_unwrap(v) for v in d]
    return d.data if isinstance(d, (ShardedTensor, ShardedObject)) else d


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _check_loaded(loaded: dict, rank: int, world: int, gen: int, where: str = "") -> None:
    """``loaded`` holds exactly generation ``gen`` of this rank's state (tensor bytes,
    dtypes, shapes, objects, common state)."""
    expected = dict(_leaves(_unwrap(_state(rank, world, gen))))
    got = dict(_leaves(loaded))
    assert sorted(got) == sorted(expected), (where, sorted(got), sorted(expected))
    for path, exp in expected.items():
        val = got[path]
        if isinstance(exp, torch.Tensor):
            assert isinstance(val, torch.Tensor), f"{where}{path}"
            assert val.dtype == exp.dtype and val.shape == exp.shape, f"{where}{path}: {val.dtype} {val.shape}"
            assert _bytes(val) == _bytes(exp), f"{where}{path}: {val} != {exp}"
        else:
            assert val == exp, f"{where}{path}: {val!r} != {exp!r}"


def _load_check(ckpt, rank, world, gen, where=""):
    _check_loaded(dc.load(_state(rank, world, gen, fill=False), ckpt), rank, world, gen, where)


def _mutate(sd: dict) -> None:
    """Change, in place, every tensor and ShardedObject payload of ``sd`` (and the
    mutable common state)."""
    for _, v in _leaves(sd):
        if isinstance(v, ShardedTensor):
            if v.data.dtype == torch.bool:
                v.data.logical_not_()
            else:
                v.data.add_(1000).fill_(-7)
        elif isinstance(v, ShardedObject):
            v.data.clear()
            v.data["mutated"] = True
        elif isinstance(v, torch.Tensor):
            v.fill_(-1)
    sd["args"]["lr"] = 99.0


def _async_threads(ignore=()):
    return [t for t in threading.enumerate()
            if t.name.startswith(ASYNC_THREAD) and t.is_alive() and t not in ignore]


def _child_gone(pid: int) -> bool:
    """For our own (reaped) writer children: no such process any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _proc_gone(pid: int) -> bool:
    """For processes we cannot reap (orphans): gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _proc_gone(pid):
            return True
        time.sleep(0.05)
    return _proc_gone(pid)


def _strategy_call(request: AsyncRequest):
    """``(async_fn, args)`` as the sharded strategy made them (``save`` chains rank 0's
    ``common.pt`` write before them)."""
    fn, args = request.async_fn, request.async_fn_args
    while isinstance(fn, async_utils._Chained):
        fn, args = fn.fn, fn.args
    return fn, args


def _writer(request: AsyncRequest) -> ForkedCall:
    writer = _strategy_call(request)[1][0]
    assert isinstance(writer, ForkedCall)
    return writer


def _error_of(fn, *args, **kwargs) -> str:
    """The message of the CheckpointingException that ``fn(*args, **kwargs)`` raises. For
    rank functions: unlike pytest.raises' ``Failed``, the AssertionError raised when it
    does not raise travels back to the test."""
    try:
        fn(*args, **kwargs)
    except CheckpointingException as e:
        return str(e)
    raise AssertionError(f"{getattr(fn, '__qualname__', fn)} did not raise CheckpointingException")


def _incomplete_error(ckpt) -> str:
    """``load`` of an unfinalized checkpoint raises CheckpointingException (every rank)."""
    return _error_of(dc.load, {"emb": ShardedTensor.from_rank_offsets("emb", torch.zeros(16, 6))}, ckpt)


# ----------------------------------------------------------------------------- 1. async == sync


def _sync_and_async(rank, world, sync_dir, async_dir):
    dc.save(_state(rank, world), sync_dir)
    queue = AsyncCallsQueue()
    try:
        request = dc.save(_state(rank, world), async_dir, async_sharded_save=True)
        assert isinstance(request, AsyncRequest)
        assert queue.schedule_async_request(request) == 0
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    finally:
        queue.close()
    from_sync = dc.load(_state(rank, world, fill=False), sync_dir)
    from_async = dc.load(_state(rank, world, fill=False), async_dir)
    _check_loaded(from_sync, rank, world, 0, "sync ")
    _check_loaded(from_async, rank, world, 0, "async ")
    a, b = dict(_leaves(from_sync)), dict(_leaves(from_async))
    for path in a:  # the two loads agree with each other too (bytes, objects, common state)
        if isinstance(a[path], torch.Tensor):
            assert _bytes(a[path]) == _bytes(b[path]) and a[path].dtype == b[path].dtype, path
        else:
            assert a[path] == b[path], path
    common_sync, common_async = dc.load_common_state_dict(sync_dir), dc.load_common_state_dict(async_dir)
    assert sorted(common_sync) == sorted(common_async)
    assert torch.equal(common_sync.pop("plain"), common_async.pop("plain"))
    assert common_sync == common_async


def _sharded_md_summary(ckpt):
    fields = ("key", "global_shape", "dtype", "global_offset", "local_shape", "axis_fragmentations",
              "prepend_axis_num", "flattened_range", "replica_id")
    return {k: (type(v).__name__,) + tuple(repr(getattr(v, f, None)) for f in fields)
            for k, v in dc.load_sharded_metadata(ckpt).items()}


def _dcp_summary(ckpt):
    md = read_metadata(ckpt)
    items = {}
    for key, m in md.state_dict_metadata.items():
        if hasattr(m, "chunks"):
            items[key] = (str(m.properties.dtype), tuple(m.size),
                          sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks))
        else:
            items[key] = type(m).__name__
    storage = {(idx.fqn, tuple(idx.offset) if idx.offset is not None else None): info.relative_path
               for idx, info in md.storage_data.items()}
    return items, storage, dict(getattr(md, "mcore_data", {}) or {})


def test_async_equals_sync(pool, tmp_path):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    pool.run(_sync_and_async, str(sync_dir), str(async_dir))
    assert dc.check_is_distributed_checkpoint(async_dir)
    assert _sharded_md_summary(async_dir) == _sharded_md_summary(sync_dir)
    items_a, storage_a, mcore_a = _dcp_summary(async_dir)
    items_s, storage_s, mcore_s = _dcp_summary(sync_dir)
    assert items_a == items_s and storage_a == storage_s and mcore_a == mcore_s
    assert "opt.exp_avg" in items_a and "rng/shard_0_%d" % pool.world_size in items_a
    assert sorted(os.listdir(async_dir)) == sorted(os.listdir(sync_dir))
    assert sorted(dc.load_plain_tensors(async_dir)) == sorted(dc.load_plain_tensors(sync_dir))
    for key, t in dc.load_plain_tensors(async_dir).items():
        assert _bytes(t) == _bytes(dc.load_plain_tensors(sync_dir)[key]), key


# ----------------------------------------------------------------------------- 2. staging at call time


def _mutate_after_save(rank, world, dir_a, dir_b):
    queue = AsyncCallsQueue()
    try:
        # (a) mutated before scheduling
        sd_a = _state(rank, world, gen=0)
        request_a = dc.save(sd_a, dir_a, async_sharded_save=True)
        _mutate(sd_a)
        queue.schedule_async_request(request_a)
        # (b) mutated between scheduling and finalizing
        sd_b = _state(rank, world, gen=1)
        request_b = dc.save(sd_b, dir_b, async_sharded_save=True)
        queue.schedule_async_request(request_b)
        _mutate(sd_b)
        time.sleep(0.05)
        _mutate(sd_b)
        assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
    finally:
        queue.close()
    assert sd_a["rng"].data == {"mutated": True}  # the caller's objects did change
    _load_check(dir_a, rank, world, 0, "mutated before scheduling: ")
    _load_check(dir_b, rank, world, 1, "mutated after scheduling: ")


def test_state_is_snapshotted_when_save_returns(pool2, ckpt_location):
    pool2.run(_mutate_after_save, ckpt_location("a"), ckpt_location("b"))


def _shared_memory_mutation(rank, world, ckpt):
    expected = torch.arange(1 << 16, dtype=torch.float32)
    t = expected.clone().share_memory_()
    queue = AsyncCallsQueue()
    try:
        with slow_writes(0.3):
            request = dc.save({"t": ShardedTensor.from_rank_offsets("t", t, (0, rank, world))}, ckpt,
                              async_sharded_save=True)
        t.fill_(-1)  # allowed as soon as save returns
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    loaded = dc.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(1 << 16), (0, rank, world))}, ckpt)["t"]
    assert torch.equal(loaded, expected), f"the checkpoint holds values written after save returned: {loaded[:4]}"


def test_shared_memory_tensors_are_snapshotted_too(tmp_path):
    """A tensor in shared memory (``share_memory_()``, e.g. for a multi-process data or
    optimizer pipeline) is MAP_SHARED: a fork does not copy it on write, so the writer must
    not rely on copy-on-write for it."""
    get_pool(1).run(_shared_memory_mutation, str(tmp_path / "shm"))


# ----------------------------------------------------------------------------- 3. complete only after finalize


def _completion(rank, world, ckpt):
    queue = AsyncCallsQueue()
    try:
        assert queue.get_num_unfinalized_calls() == 0
        assert queue.maybe_finalize_async_calls() == [] and queue.maybe_finalize_async_calls(blocking=True) == []
        request = dc.save(_state(rank, world), ckpt, async_sharded_save=True)
        assert not dc.check_is_distributed_checkpoint(ckpt) and CONFIG_FNAME not in os.listdir(ckpt)
        msg_before = _incomplete_error(ckpt)
        assert queue.schedule_async_request(request) == 0
        assert queue.get_num_unfinalized_calls() == 1
        _writer(request).result()  # this rank's data files are written, nothing finalized
        msg_written = _incomplete_error(ckpt)
        assert not dc.check_is_distributed_checkpoint(ckpt) and CONFIG_FNAME not in os.listdir(ckpt)
        assert queue.get_num_unfinalized_calls() == 1
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        assert queue.get_num_unfinalized_calls() == 0
        assert dc.check_is_distributed_checkpoint(ckpt)
        _load_check(ckpt, rank, world, 0)
        assert queue.maybe_finalize_async_calls(blocking=True) == []
    finally:
        queue.close()
    return msg_before, msg_written


def test_checkpoint_complete_only_after_finalize(pool2, tmp_path):
    ckpt = tmp_path / "c"
    for msg_before, msg_written in pool2.run(_completion, str(ckpt)):
        # when save returns, the writers may not have written a data file yet (nor rank 0
        # common.pt): then the directory is not a checkpoint at all (docs/format.md)
        assert str(ckpt) in msg_before and ("incomplete checkpoint" in msg_before
                                            or "metadata.json is missing" in msg_before), msg_before
        assert "incomplete checkpoint" in msg_written and str(ckpt) in msg_written, msg_written


def _gated(gate, finished, log, idx):
    assert gate.wait(30), f"gate {idx} never opened"
    log.append(("run", idx))
    finished.set()


def _poll_finalize(queue, timeout=30.0):
    """Non-blocking finalization, repeated (in lockstep on every rank) until it finalizes something."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = queue.maybe_finalize_async_calls(blocking=False)
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("nothing finalized")


def _nonblocking_order(rank, world):
    for persistent in (False, True):
        queue = AsyncCallsQueue(persistent=persistent)
        gates = [threading.Event() for _ in range(3)]
        finished = [threading.Event() for _ in range(3)]
        log = []
        try:
            for i in range(3):
                req = AsyncRequest(_gated, (gates[i], finished[i], log, i))
                req.add_finalize_fn(lambda i=i: log.append(("fin", i)))
                assert queue.schedule_async_request(req) == i
            assert queue.get_num_unfinalized_calls() == 3
            assert queue.maybe_finalize_async_calls(blocking=False) == []
            if not persistent:  # calls run concurrently: 2 finishes while 1 is still blocked
                gates[2].set()
                gates[0].set()
                assert finished[2].wait(10) and finished[0].wait(10)
                first = _poll_finalize(queue)
                assert first == [0], first
                assert queue.maybe_finalize_async_calls(blocking=False) == []  # 1 is not done, 2 must wait
                assert queue.get_num_unfinalized_calls() == 2
                assert ("fin", 2) not in log
                gates[1].set()
                rest = _poll_finalize(queue)
                assert rest == [1, 2], rest
            else:  # one worker thread: calls run one after another
                gates[0].set()
                got = _poll_finalize(queue)
                assert got == [0], got  # 1 and 2 are still gated
                gates[1].set()
                gates[2].set()
                got += queue.maybe_finalize_async_calls(blocking=True)
                assert got == [0, 1, 2], got
            assert queue.get_num_unfinalized_calls() == 0
            assert [e for e in log if e[0] == "fin"] == [("fin", 0), ("fin", 1), ("fin", 2)]
            if persistent:
                assert [e for e in log if e[0] == "run"] == [("run", 0), ("run", 1), ("run", 2)]
        finally:
            for g in gates:
                g.set()
            queue.close()
    return True


def test_nonblocking_finalize_returns_finished_calls_in_order(pool2):
    assert pool2.run(_nonblocking_order) == [True, True]


# ----------------------------------------------------------------------------- 4. persistent worker reuse


def _reuse_worker(rank, world, root):
    unrelated = set(_async_threads())  # left by queues of other tests that were never closed

    def live():
        return _async_threads(ignore=unrelated)

    queue = AsyncCallsQueue(persistent=True)
    pids, idents = [], set()
    dirs = [os.path.join(root, f"p{i}") for i in range(4)]

    def one_thread():
        threads = live()
        assert [t.name for t in threads] == [ASYNC_THREAD], [t.name for t in threads]
        idents.add(threads[0].ident)

    try:
        for i in range(3):  # three in flight at once
            request = dc.save(_state(rank, world, gen=i), dirs[i], async_sharded_save=True)
            pids.append(_writer(request).pid)
            assert queue.schedule_async_request(request) == i
            one_thread()
        assert queue.get_num_unfinalized_calls() == 3
        assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1, 2]
        one_thread()
        request = dc.save(_state(rank, world, gen=3), dirs[3], async_sharded_save=True)
        pids.append(_writer(request).pid)
        assert queue.schedule_async_request(request) == 3
        one_thread()
        assert queue.maybe_finalize_async_calls(blocking=True) == [3]
        one_thread()
    finally:
        queue.close()
    assert len(idents) == 1  # the very same thread served every save
    assert live() == []
    for pid in pids:
        assert _child_gone(pid), f"writer {pid} still alive after close()"
    for i, d in enumerate(dirs):
        _load_check(d, rank, world, i, f"save {i}: ")

    # a thread per request
    queue = AsyncCallsQueue(persistent=False)
    pids = []
    try:
        for i in range(2):
            request = dc.save(_state(rank, world, gen=10 + i), os.path.join(root, f"np{i}"), async_sharded_save=True)
            pids.append(_writer(request).pid)
            queue.schedule_async_request(request)
        assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
    finally:
        queue.close()
    deadline = time.monotonic() + 5
    while live() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live() == [], [t.name for t in live()]
    assert all(_child_gone(pid) for pid in pids)
    for i in range(2):
        _load_check(os.path.join(root, f"np{i}"), rank, world, 10 + i)


def test_persistent_worker_is_reused_and_stopped(pool2, tmp_path):
    pool2.run(_reuse_worker, str(tmp_path))


# ----------------------------------------------------------------------------- 5. failures on every rank


def _big_state(rank, world, mb):
    # rank-private keys; the killed rank writes ``mb`` MB, the others a little
    n = (mb << 18) if rank == 1 else 1024
    return {"big": ShardedTensor.from_rank_offsets(f"big{rank}", torch.ones(n)),
            "o": ShardedObject("o", {"r": rank}, (world,), (rank,))}


def _fails_then_saves_again(rank, world, ckpt, state, sabotage, check, good, gen, slow: float = 0.0) -> str:
    """An async save of ``state`` into ``ckpt`` (its writer first sleeping ``slow`` s),
    ``sabotage(request)`` before it is scheduled: the call fails (its message returned,
    after ``check()``), nothing is left unfinalized and ``ckpt`` is no checkpoint; then the
    same queue saves generation ``gen`` into ``good``, which loads back."""
    queue = AsyncCallsQueue()
    try:
        with slow_writes(slow):  # the forked writer keeps it; this process does not
            request = dc.save(state, ckpt, async_sharded_save=True)
        sabotage(request)
        queue.schedule_async_request(request)
        msg = _error_of(queue.maybe_finalize_async_calls, blocking=True)
        assert queue.get_num_unfinalized_calls() == 0
        assert not dc.check_is_distributed_checkpoint(ckpt)
        check()
        request = dc.save(_state(rank, world, gen=gen), good, async_sharded_save=True)
        assert queue.schedule_async_request(request) == 1
        assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    finally:
        queue.close()
    _load_check(good, rank, world, gen)
    return msg


def _killed_writer(rank, world, ckpt, good):
    def kill(request):
        if rank == 1:
            os.kill(_writer(request).pid, signal.SIGKILL)

    def check():
        assert CONFIG_FNAME not in os.listdir(ckpt)
        assert "incomplete" in _incomplete_error(ckpt)

    # rank 1's writer is killed while it waits, never after it has written everything
    return _fails_then_saves_again(rank, world, ckpt, _big_state(rank, world, 32), kill, check, good, 5,
                                   slow=600.0 if rank == 1 else 0.0)


def test_killed_writer_fails_on_every_rank(pool2, tmp_path):
    msgs = pool2.run(_killed_writer, str(tmp_path / "killed"), str(tmp_path / "good"), timeout=_ERR_TIMEOUT)
    for rank, msg in enumerate(msgs):
        assert "rank 1" in msg and "SIGKILL" in msg, f"rank {rank}: {msg}"


def _destination_gone(rank, world, root, how, who):
    ckpt = os.path.join(root, f"{how}_{who}")

    def remove(request):
        if who == "all" or rank == 0:
            while os.path.lexists(ckpt):  # a writer may add a file while rmtree runs
                shutil.rmtree(ckpt, ignore_errors=True)
            if how == "file":
                with open(ckpt, "w") as f:
                    f.write("not a directory")

    good = os.path.join(root, f"good_{how}_{who}")
    return _fails_then_saves_again(rank, world, ckpt, _state(rank, world), remove, lambda: None, good, 2)


@pytest.mark.parametrize("how,who", [("rmtree", "rank0"), ("rmtree", "all"), ("file", "rank0")])
def test_destination_removed_during_write(pool2, tmp_path, how, who):
    msgs = pool2.run(_destination_gone, str(tmp_path), how, who, timeout=_ERR_TIMEOUT)
    cause = "No such file or directory" if how == "rmtree" else ("Not a directory", "No such file or directory")
    for rank, msg in enumerate(msgs):
        causes = cause if isinstance(cause, tuple) else (cause,)
        assert any(c in msg for c in causes), f"rank {rank}: {msg}"
    assert len(set(msgs)) == 1, msgs  # the same agreed error everywhere


def _common_write_fails(rank, world, root):
    """common.pt is written in the background (rank 0): a failure there fails the call on
    every rank, while the data files are still written and waited for."""
    ckpt = os.path.join(root, "blocked")

    def block(request):
        if rank == 0:  # common.pt cannot replace a non-empty directory
            os.makedirs(os.path.join(ckpt, "common.pt", "x"))

    def check():
        assert any(f.endswith(".distcp") for f in os.listdir(ckpt))  # the writers were not cut short

    return _fails_then_saves_again(rank, world, ckpt, _state(rank, world), block, check, os.path.join(root, "good"), 1)


def test_common_state_write_failure_in_background(pool2, tmp_path):
    msgs = pool2.run(_common_write_fails, str(tmp_path), timeout=_ERR_TIMEOUT)
    assert len(set(msgs)) == 1, msgs
    assert "rank 0" in msgs[0] and "common.pt" in msgs[0], msgs[0]


class _RecordingCommon(TorchCommonSaveStrategy):
    """The torch common strategy, recording when ``save_common`` runs; with ``staged=False``
    it keeps the base class's ``stage_common`` (write at once), as a user strategy would."""

    def __init__(self, staged: bool):
        super().__init__("torch", 1)
        self.staged, self.writes = staged, []

    def save_common(self, common_state_dict, checkpoint_dir):
        self.writes.append(threading.get_ident())
        super().save_common(common_state_dict, checkpoint_dir)

    def stage_common(self, common_state_dict, checkpoint_dir):
        if self.staged:
            return super().stage_common(common_state_dict, checkpoint_dir)
        return SaveCommonStrategy.stage_common(self, common_state_dict, checkpoint_dir)


@pytest.mark.parametrize("staged", [True, False])
def test_common_state_of_an_async_save(tmp_path, staged):
    """The torch strategy serializes the common state in ``save`` and writes it on the
    queue's thread; a common strategy without ``stage_common`` writes it in ``save``."""
    common = _RecordingCommon(staged)
    state = {"t": ShardedTensor.from_rank_offsets("t", torch.arange(8.0)), "args": {"lr": 0.5}, "step": [3]}
    queue = AsyncCallsQueue()
    try:
        request = dc.save(state, tmp_path / "c", common_strategy=common, async_sharded_save=True)
        state["args"]["lr"], state["step"][0] = 9.0, 9  # after save returns: not in the checkpoint
        assert (common.writes == []) == staged
        assert os.path.exists(tmp_path / "c" / "common.pt") != staged
        queue.schedule_async_request(request)
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    finally:
        queue.close()
    assert common.writes == ([] if staged else [threading.get_ident()])  # unstaged: in save, this thread
    loaded = dc.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(8))}, tmp_path / "c")
    assert loaded["args"] == {"lr": 0.5} and loaded["step"] == [3] and torch.equal(loaded["t"], torch.arange(8.0))


# ----------------------------------------------------------------------------- 6. bad input


class _SyncOnlyStrategy(SaveShardedStrategy):
    def save(self, sharded_state_dict, checkpoint_dir):
        raise AssertionError("must not be called")


def _bad_input(rank, world, root):
    queue = AsyncCallsQueue()
    assert queue.maybe_finalize_async_calls() == [] and queue.maybe_finalize_async_calls(blocking=True) == []
    _error_of(queue.schedule_async_request, lambda: None)
    queue.close()
    queue.close()  # twice is fine
    assert queue.maybe_finalize_async_calls(blocking=True) == []
    assert "closed" in _error_of(queue.schedule_async_request, AsyncRequest(None))
    assert queue.get_num_unfinalized_calls() == 0

    # a closed queue refuses an async save too; nothing is left running
    request = dc.save(_state(rank, world), os.path.join(root, "closed"), async_sharded_save=True)
    assert "closed" in _error_of(queue.schedule_async_request, request)
    _writer(request).result()  # the writer may be waited for without a queue
    assert not dc.check_is_distributed_checkpoint(os.path.join(root, "closed"))

    frozen = AsyncRequest(None).freeze()
    assert frozen.is_frozen
    _error_of(frozen.add_finalize_fn, lambda: None)
    _error_of(frozen.add_pre_finalize_fn, lambda: None)
    assert frozen.finalize_fns == []


def test_bad_input(pool2, tmp_path):
    pool2.run(_bad_input, str(tmp_path))


def _sync_only_strategy(rank, world, ckpt):
    dc.save(_state(rank, world), ckpt, sharded_strategy=_SyncOnlyStrategy("sync_only", 1), async_sharded_save=True)


def test_async_save_needs_an_async_strategy(pool2, tmp_path):
    ckpt = tmp_path / "sync_only"
    excs = pool2.run_expect_error(_sync_only_strategy, str(ckpt), timeout=_ERR_TIMEOUT)
    assert_all_raise(excs, 2, "async")
    assert not ckpt.exists() or list(ckpt.iterdir()) == []


# ----------------------------------------------------------------------------- 7. AsyncRequest API


def test_async_request_finalize_order_and_execute_sync():
    log = []
    req = AsyncRequest(lambda a, b=0: log.append(("async", a, b)), (1,), [lambda: log.append("f1")],
                       async_fn_kwargs={"b": 2})
    req.add_finalize_fn(lambda: log.append("f2"))
    req.add_pre_finalize_fn(lambda: log.append("p1"))
    req.add_pre_finalize_fn(lambda: log.append("p2"))
    req.add_finalize_fn(lambda: log.append("f3"))
    req.execute_sync()
    assert log == [("async", 1, 2), "p2", "p1", "f1", "f2", "f3"]

    frozen = req.freeze()
    assert frozen.is_frozen and not req.is_frozen and frozen is not req
    req.add_finalize_fn(lambda: log.append("late"))  # the frozen copy is not affected
    assert len(frozen.finalize_fns) == 5 and len(req.finalize_fns) == 6

    log.clear()
    AsyncRequest(None, finalize_fns=[lambda: log.append("only")]).execute_sync()
    assert log == ["only"]


def test_async_steps_run_before_async_fn_which_runs_even_if_one_fails():
    log = []
    req = AsyncRequest(lambda a, b=0: log.append(("async", a, b)), (1,), async_fn_kwargs={"b": 2})
    req.add_async_step(lambda: log.append("s1"))
    req.add_async_step(lambda: log.append("s2"))
    req.add_finalize_fn(lambda: log.append("fin"))
    req.execute_sync()
    assert log == ["s2", "s1", ("async", 1, 2), "fin"]

    def fail(what):
        raise OSError(f"{what} failed")

    for fn_fails in (False, True):
        log.clear()
        req = AsyncRequest((lambda: fail("async_fn")) if fn_fails else (lambda: log.append("async")))
        req.add_async_step(lambda: fail("step"))
        req.add_finalize_fn(lambda: log.append("fin"))
        msg = _error_of(req.execute_sync)
        assert "step failed" in msg and "async_fn" not in msg, msg  # the step's error wins
        assert log == ([] if fn_fails else ["async"])  # async_fn ran; nothing finalized

    log.clear()
    req = AsyncRequest(None)
    req.add_async_step(lambda: log.append("only"))
    req.execute_sync()
    assert log == ["only"]
    _error_of(req.freeze().add_async_step, lambda: None)


class _Resource:
    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


def test_queue_without_process_group_and_resources():
    """No process group: the queue works locally and close() releases the resources."""
    log, res = [], _Resource()
    queue = AsyncCallsQueue()
    req = AsyncRequest(lambda: log.append("run"), resources=[res])
    req.add_finalize_fn(lambda: log.append("fin"))
    assert queue.schedule_async_request(req) == 0
    assert queue.schedule_async_request(AsyncRequest(None)) == 1
    assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
    assert log == ["run", "fin"] and res.released == 0
    queue.close()
    assert res.released == 1
    queue.close()
    assert res.released == 1


def _raise_on(rank, bad_rank, what):
    if rank == bad_rank:
        raise ValueError(f"{what} boom on {rank}")


def _user_requests(rank, world):
    queue = AsyncCallsQueue()
    log = []
    msgs = []
    try:
        # async_fn fails on rank 1 only
        req = AsyncRequest(_raise_on, (rank, 1, "async_fn"))
        req.add_finalize_fn(lambda: log.append("must not run"))
        queue.schedule_async_request(req)
        msgs.append(_error_of(queue.maybe_finalize_async_calls, blocking=True))
        assert log == [] and queue.get_num_unfinalized_calls() == 0
        # a finalize step fails on rank 0 only: every rank raises, later steps are skipped
        req = AsyncRequest(lambda: None)
        req.add_finalize_fn(lambda: _raise_on(rank, 0, "finalize"))
        req.add_finalize_fn(lambda: log.append("after failing finalize"))
        queue.schedule_async_request(req)
        msgs.append(_error_of(queue.maybe_finalize_async_calls, blocking=True))
        assert log == []
        # the queue keeps working
        req = AsyncRequest(lambda: log.append("ok"))
        req.add_finalize_fn(lambda: log.append("fin"))
        assert queue.schedule_async_request(req) == 2
        assert queue.maybe_finalize_async_calls(blocking=True) == [2]
        assert log == ["ok", "fin"]
    finally:
        queue.close()
    return msgs


def test_user_async_request_errors_on_every_rank(pool2):
    for rank, (async_msg, fin_msg) in enumerate(pool2.run(_user_requests, timeout=_ERR_TIMEOUT)):
        assert "rank 1" in async_msg and "async_fn boom on 1" in async_msg, f"rank {rank}: {async_msg}"
        assert "rank 0" in fin_msg and "finalize boom on 0" in fin_msg, f"rank {rank}: {fin_msg}"


def _execute_sync_save(rank, world, ckpt):
    request = dc.save(_state(rank, world, gen=4), ckpt, async_sharded_save=True)
    assert not dc.check_is_distributed_checkpoint(ckpt)
    request.execute_sync()
    torch.distributed.barrier()
    assert dc.check_is_distributed_checkpoint(ckpt)
    _load_check(ckpt, rank, world, 4)


def test_async_save_request_execute_sync(pool2, tmp_path):
    pool2.run(_execute_sync_save, str(tmp_path / "c"))


def _failing_commit(rank, world, root, how):
    """metadata.json cannot be written (rank 0 only writes it): finalization must fail on
    every rank, through the queue and through execute_sync alike."""
    ckpt = os.path.join(root, how)
    location = FaultyStorage(ckpt, "write_atomic", CONFIG_FNAME) if rank == 0 else ckpt
    request = dc.save(_state(rank, world), location, async_sharded_save=True)
    error = None
    queue = AsyncCallsQueue()
    try:
        if how == "queue":
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
        else:
            request.execute_sync()
    except Exception as e:  # noqa: BLE001 - compared across ranks by the test
        error = f"{type(e).__name__}: {e}"
    finally:
        queue.close()
    torch.distributed.barrier()
    assert not dc.check_is_distributed_checkpoint(ckpt)
    return error


@pytest.mark.parametrize("how", ["queue", "execute_sync"])
def test_failing_commit_raises_on_every_rank(pool2, tmp_path, how):
    errors = pool2.run(_failing_commit, str(tmp_path), how, timeout=_ERR_TIMEOUT)
    for error in errors:
        assert error is not None and "injected write_atomic fault" in error and CONFIG_FNAME in error, \
            f"errors by rank ({how}): {errors}"
        assert error.startswith("CheckpointingException"), f"errors by rank ({how}): {errors}"


def _save_from_short_lived_thread(rank, world, ckpt):
    box = {}

    def helper():
        box["req"] = dc.save(_state(rank, world), ckpt, async_sharded_save=True)
        time.sleep(0.2)  # some other work, then the helper thread ends; the write goes on

    with slow_writes(0.6):
        thread = threading.Thread(target=helper)
        thread.start()
        thread.join()
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(box["req"])
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    finally:
        queue.close()
    _load_check(ckpt, rank, world, 0)


def test_async_save_started_from_a_thread_that_exits(tmp_path):
    """save() may be called from a helper thread that ends before the write does; the
    writer must not die with that thread (PR_SET_PDEATHSIG fires on the death of the
    forking *thread*, not of the process)."""
    get_pool(1).run(_save_from_short_lived_thread, str(tmp_path / "c"), timeout=_ERR_TIMEOUT)


# ----------------------------------------------------------------------------- 8. nothing left at exit

_SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    import torch
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.strategies import async_utils, forked_call, persistent_worker
    from dist_checkpointing.strategies.torch_dist import writing as torch_dist_writing
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    ckpt, mode = sys.argv[1], sys.argv[2]
    if mode != "exit":  # a writer that is still busy when the parent goes away
        orig = torch_dist_writing.write_file
        def slow(*args, **kwargs):
            time.sleep(60)
            return orig(*args, **kwargs)
        torch_dist_writing.write_file = slow
    state = {{"t": ShardedTensor.from_rank_offsets("t", torch.arange(1 << 20, dtype=torch.float32))}}
    request = dc.save(state, ckpt, async_sharded_save=True)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    fn, args = request.async_fn, request.async_fn_args
    while isinstance(fn, async_utils._Chained):  # common.pt is written first
        fn, args = fn.fn, fn.args
    print(args[0].pid, flush=True)
    if mode == "sigkill":
        time.sleep(120)
    elif mode == "slow_exit":
        time.sleep(0.5)  # the program goes on a little, then ends without finalizing
""").format(root=_ROOT)


@contextlib.contextmanager
def _script(ckpt, mode):
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(ckpt), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), (line, proc.stderr.read() if proc.poll() is not None else "")
        pids.append(int(line))
        yield proc, pids[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pid in pids:  # never leave our writer behind, even when the test fails
            if not _proc_gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_no_writer_left_after_exit_without_finalize(tmp_path):
    ckpt = tmp_path / "exit"
    with _script(ckpt, "exit") as (proc, pid):
        assert proc.wait(timeout=slack(30)) == 0, proc.stderr.read()
        assert _wait_gone(pid, 5.0), f"writer {pid} outlived its parent"
    assert not dc.check_is_distributed_checkpoint(ckpt) and not (ckpt / CONFIG_FNAME).exists()


def test_writer_dies_with_sigkilled_parent(tmp_path):
    ckpt = tmp_path / "killed"
    with _script(ckpt, "sigkill") as (proc, pid):
        assert not _proc_gone(pid)  # busy writing (for a minute)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=slack(10))
        assert _wait_gone(pid, 5.0), f"writer {pid} outlived its SIGKILLed parent"
    assert not dc.check_is_distributed_checkpoint(ckpt)


def test_exit_kills_a_busy_writer(tmp_path):
    """ForkedCall promises the writer is killed at interpreter exit if still running: an
    unfinalized save whose write takes long (or hangs) must not hold the exit up."""
    ckpt = tmp_path / "busy"
    with _script(ckpt, "slow_exit") as (proc, pid):
        try:
            proc.wait(timeout=slack(5))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the interpreter did not exit within 5 s: it waits for the busy writer {pid}")
        assert _wait_gone(pid, 5.0), f"writer {pid} outlived its parent"
    assert not dc.check_is_distributed_checkpoint(ckpt)


# ----------------------------------------------------------------------------- 9. fully parallel + async


def _replicated_state(rank, world, fill=True):
    sizes = [64, 48, 40, 32, 24, 16, 12, 8]
    sd = {f"w{i}": ShardedTensor.from_rank_offsets(
        f"w{i}", (torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) + i) if fill else torch.zeros(n, 4),
        replica_id=rank) for i, n in enumerate(sizes)}
    sd["sched"] = ShardedObject("sched", {"step": 3} if fill else None, (1,), (0,), replica_id=rank)
    sd["iteration"] = 9
    return sd


def _fully_parallel_async(rank, world, ckpt):
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    queue = AsyncCallsQueue()
    try:
        sd = _replicated_state(rank, world)
        request = dc.save(sd, ckpt, sharded_strategy=strategy, async_sharded_save=True)
        for v in sd.values():
            if isinstance(v, ShardedTensor):
                v.data.fill_(-5)
        queue.schedule_async_request(request)
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    finally:
        queue.close()
    loaded = dc.load(_replicated_state(rank, world, fill=False), ckpt)
    expected = _replicated_state(rank, world)
    for key, v in expected.items():
        if isinstance(v, ShardedTensor):
            assert torch.equal(loaded[key], v.data), key
    assert loaded["sched"] == {"step": 3} and loaded["iteration"] == 9


@pytest.mark.parametrize("world", [2, 4])
def test_fully_parallel_async_save(world, ckpt_location):
    ckpt = ckpt_location("fp")
    get_pool(world).run(_fully_parallel_async, ckpt)
    files = ckpt_location.list(ckpt)
    for rank in range(world):
        assert any(f.startswith(f"__{rank}_") and f.endswith(".distcp") for f in files), (rank, sorted(files))
    writers = {info.relative_path.split("_")[2] for info in read_metadata(ckpt).storage_data.values()}
    assert writers == {str(r) for r in range(world)}, writers


# ----------------------------------------------------------------------------- 10. ForkHostCopies


def test_fork_host_copies_reuse_buffers():
    copies = ForkHostCopies()
    a = torch.arange(6.0).reshape(2, 3)
    b = torch.ones(4, dtype=torch.int32)
    first = copies.copy([("a", a), ("b", b)])
    assert [tuple(t.shape) for t in first] == [(2, 3), (4,)]
    assert first[0].data_ptr() != a.data_ptr() and torch.equal(first[0], a) and torch.equal(first[1], b)
    a.fill_(-1)
    assert torch.equal(first[0], torch.arange(6.0).reshape(2, 3))  # a copy, not a view

    second = copies.copy([("a", a * 2), ("b", b * 3)])
    assert second[0] is first[0] and second[1] is first[1]  # same slots, shapes, dtypes: reused
    assert torch.equal(second[0], torch.full((2, 3), -2.0)) and torch.equal(second[1], b * 3)

    grad = torch.ones(2, 3, requires_grad=True)
    third = copies.copy([("a", grad.t()), ("b", b)])  # shape change: a new buffer
    assert third[0] is not first[0] and third[1] is first[1]
    assert tuple(third[0].shape) == (3, 2) and third[0].is_contiguous() and not third[0].requires_grad and torch.equal(third[0], grad.t())

    fourth = copies.copy([("a", torch.zeros(3, 2, dtype=torch.float64))])  # dtype change; b unused
    assert fourth[0] is not third[0] and fourth[0].dtype == torch.float64
    fifth = copies.copy([("a", torch.ones(3, 2, dtype=torch.float64)), ("b", b)])
    assert fifth[0] is fourth[0] and fifth[1] is not first[1]  # b's buffer was dropped
    assert torch.equal(fifth[1], b)

    copies.release()
    sixth = copies.copy([("a", torch.ones(3, 2, dtype=torch.float64)), ("b", b)])
    assert sixth[0] is not fifth[0] and sixth[1] is not fifth[1]
    assert copies.copy([]) == []
    seventh = copies.copy([("b", b)])
    assert seventh[0] is not sixth[1]


def test_overlapping_writes_do_not_share_write_buffers(tmp_path):
    # The writer's write buffers are shared mappings: forked writers must not reuse the
    # parent's pooled ones, or two saves in flight (or a sync save during an async one)
    # write into each other's buffers and the checkpoints come out corrupted.
    import dist_checkpointing as dc_
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue as Queue

    def state(val):
        return {f"t{i}": dc_.ShardedTensor.from_rank_offsets(f"t{i}", torch.full((2 << 20,), float(val)))
                for i in range(3)}

    dc_.save(state(0), tmp_path / "sync0")  # fills the buffer pool
    queue = Queue()
    for v in (1, 2):
        queue.schedule_async_request(dc_.save(state(v), tmp_path / f"a{v}", async_sharded_save=True))
    dc_.save(state(3), tmp_path / "sync3")  # a sync save while the writers run
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    for v, name in ((1, "a1"), (2, "a2"), (3, "sync3")):
        out = dc_.load(state(-9), tmp_path / name)
        assert all(torch.all(t == v) for t in out.values()), name


def _faults_writing_adopted_buffer(map_in: bool) -> int:
    """In a forked child: adopt one pooled buffer, optionally map it in as a writer does
    before its first use, then write one byte per page; the minor page faults that took."""
    import resource

    from dist_checkpointing.storage import buffers as fa

    buf = fa.reserve_write_buffers(1)
    page_bytes = memoryview(buf[0])
    page_bytes[::4096] = b"\x01" * len(range(0, len(page_bytes), 4096))  # touched in the parent

    def child() -> int:
        fa.adopt_write_buffers(buf)
        if map_in:
            fa.POOL.map_in(buf[0])
            fa.POOL.map_in(buf[0])  # once only: the second call does nothing
        view = np.frombuffer(buf[0], dtype=np.uint8)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        view[::4096] = 2
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    try:
        return ForkedCall(child, "adopted buffer").result()
    finally:
        page_bytes.release()
        fa.return_write_buffers(buf)


def test_forked_writer_maps_its_write_buffers_in_before_use():
    # A fork does not copy the page tables of shared mappings: the child's first write to
    # each page of an inherited buffer would fault. map_in populates a buffer in one call.
    import mmap

    from dist_checkpointing.storage.buffers import _MADV_POPULATE_READ, WRITE_BUFFER_BYTES
    probe = mmap.mmap(-1, 4096)
    try:
        probe.madvise(_MADV_POPULATE_READ)
    except OSError:
        pytest.skip("the kernel has no MADV_POPULATE_READ (Linux < 5.14): pages fault in on first use")
    finally:
        probe.close()
    pages = WRITE_BUFFER_BYTES // 4096
    assert _faults_writing_adopted_buffer(map_in=False) >= pages // 2
    assert _faults_writing_adopted_buffer(map_in=True) < pages // 20


def test_writer_write_buffers_are_reserved_then_returned(tmp_path):
    # A forked writer gets file write buffers taken out of the pool (already touched,
    # so the child maps them instead of zero-filling new ones); nobody else uses them while
    # it writes, and they are back in the pool for the next save once it is done.
    import dist_checkpointing as dc_
    from dist_checkpointing.storage import buffers as fa
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue as Queue

    def state(val):
        return {f"t{i}": dc_.ShardedTensor.from_rank_offsets(f"t{i}", torch.full((1 << 20,), float(val)))
                for i in range(4)}

    fa.release_write_buffers()
    dc_.save(state(0), tmp_path / "sync0")  # fills the pool
    pooled = {id(b) for b in fa.POOL._free}
    assert pooled
    queue = Queue()
    try:
        request = dc_.save(state(1), tmp_path / "a1", async_sharded_save=True)
        reserved = {id(b) for b in _strategy_call(request)[1][1]["buffers"]}
        assert reserved and reserved <= pooled, "the writer should reuse the pooled (touched) buffers"
        assert not reserved & {id(b) for b in fa.POOL._free}, "reserved buffers must leave the pool"
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        assert reserved <= {id(b) for b in fa.POOL._free}, "the buffers go back to the pool"
        request = dc_.save(state(2), tmp_path / "a2", async_sharded_save=True)
        assert {id(b) for b in _strategy_call(request)[1][1]["buffers"]} == reserved  # reused by the next save
        queue.schedule_async_request(request)
    finally:
        queue.close()
    for v in (1, 2):
        out = dc_.load(state(-9), tmp_path / f"a{v}")
        assert all(torch.all(t == v) for t in out.values())


def test_forked_call_reports_before_exiting_and_is_reaped():
    from dist_checkpointing.strategies.async_utils import reap_exited_children

    calls = [ForkedCall(lambda v=v: {"value": v, "pid": os.getpid()}, "test") for v in range(3)]
    for v, call in enumerate(calls):
        assert call.result() == {"value": v, "pid": call.pid}
        assert call.result() == {"value": v, "pid": call.pid}  # the outcome is kept
    reap_exited_children(block=True)
    assert all(_child_gone(call.pid) for call in calls)
    failing = ForkedCall(lambda: 1 / 0, "failing call")
    with pytest.raises(CheckpointingException, match="ZeroDivisionError"):
        failing.result()
    reap_exited_children(block=True)
    assert _child_gone(failing.pid)


# ----------------------------------------------------------------------------- 8. arena snapshots


def _arena_snapshot(rank, world, root, mode):
    """``async_snapshot="copy"`` / ``"stream"``: the same checkpoint as a sync save, staged
    at call time into a shared arena, written by this process's persistent writer (another
    process, started once), arenas reused across saves and never shared by two writes in
    flight, and a failed write raised on every rank."""
    strategy = torch_dist_save.TorchDistSaveShardedStrategy(async_snapshot=mode)
    queue = AsyncCallsQueue()
    dirs = [os.path.join(root, f"{mode}{i}") for i in range(4)]
    try:
        dc.save(_state(rank, world), os.path.join(root, "sync"))
        sd0 = _state(rank, world, gen=0)
        first = dc.save(sd0, dirs[0], sharded_strategy=strategy, async_sharded_save=True)
        assert first.staged is not None and first.staged.done()  # CPU tensors: copied at the call
        first.wait_for_staging()
        _mutate(sd0)  # before scheduling
        sd1 = _state(rank, world, gen=1)
        second = dc.save(sd1, dirs[1], sharded_strategy=strategy, async_sharded_save=True)
        assert len(strategy._arenas.arenas) == 2, "two saves in flight share an arena"
        _mutate(sd1)
        queue.schedule_async_request(first)
        queue.schedule_async_request(second)
        queue.wait_for_staging()
        assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
        arenas = list(strategy._arenas.arenas)
        for gen in (2, 3):  # one at a time: an arena of the previous saves is reused
            request = dc.save(_state(rank, world, gen=gen), dirs[gen], sharded_strategy=strategy,
                              async_sharded_save=True)
            assert strategy._arenas.arenas == arenas, "staging arenas not reused"
            queue.schedule_async_request(request)
            assert queue.maybe_finalize_async_calls(blocking=True) == [gen]
        worker = persistent_worker.shared_worker()
        assert worker.pid is not None and worker.pid != os.getpid() and worker.process.poll() is None
        # a failing write: the destination is gone on rank 0 before the writer runs
        bad = os.path.join(root, f"{mode}-gone")
        request = dc.save(_state(rank, world), bad, sharded_strategy=strategy, async_sharded_save=True)
        if rank == 0:
            shutil.rmtree(bad)
        if world > 1:
            torch.distributed.barrier()  # nobody writes before it is gone
        queue.schedule_async_request(request)
        msg = _error_of(queue.maybe_finalize_async_calls, blocking=True)
        assert not dc.check_is_distributed_checkpoint(bad)
    finally:
        queue.close()
    assert strategy._arenas.arenas == [], "close() releases the arenas"
    for gen, d in enumerate(dirs):
        _load_check(d, rank, world, gen, f"{mode} save {gen}: ")
    assert _sharded_md_summary(dirs[0]) == _sharded_md_summary(os.path.join(root, "sync"))
    return msg


@pytest.mark.parametrize("mode", ["copy", "stream"])
def test_arena_snapshot(pool, tmp_path, mode):
    msgs = pool.run(_arena_snapshot, str(tmp_path), mode, timeout=_ERR_TIMEOUT)
    for rank, msg in enumerate(msgs):
        assert "rank 0" in msg and "No such file or directory" in msg, f"rank {rank}: {msg}"
    assert len(set(msgs)) == 1, msgs


def _memory_arena_snapshot(rank, world, mode):
    """A storage another process cannot open (``memory://``) is written from the queue's thread."""
    strategy = torch_dist_save.TorchDistSaveShardedStrategy(async_snapshot=mode)
    url = f"memory://arena-{mode}-{world}"
    queue = AsyncCallsQueue()
    try:
        sd = _state(rank, world)
        queue.schedule_async_request(dc.save(sd, url, sharded_strategy=strategy, async_sharded_save=True))
        _mutate(sd)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    _load_check(url, rank, world, 0, f"{mode} to memory: ")


@pytest.mark.parametrize("mode", ["copy", "stream"])
def test_arena_snapshot_of_a_storage_in_this_process(mode):
    get_pool(1).run(_memory_arena_snapshot, mode)


def test_async_snapshot_must_be_known():
    with pytest.raises(CheckpointingException, match="async_snapshot"):
        torch_dist_save.TorchDistSaveShardedStrategy(async_snapshot="spawn")


def test_idle_worker_does_not_keep_the_last_request_alive():
    # A finalized request (its arguments: e.g. an async save's staging copies) must be
    # freed, not kept alive by the persistent worker thread while it waits for the next.
    import gc
    import weakref

    class Payload:
        pass

    payload = Payload()
    ref = weakref.ref(payload)
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(AsyncRequest(lambda p: None, (payload,)))
        del payload
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        deadline = time.monotonic() + 5
        while ref() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert ref() is None, "the idle worker still holds the finalized request"
    finally:
        queue.close()


class _AbortsElsewhere:
    """Garbage whose finalizer, run in another process, aborts it (as a process group's C++
    destructor does in a forked child: it joins threads that process does not have)."""

    def __init__(self) -> None:
        self.pid, self.cycle = os.getpid(), self

    def __del__(self) -> None:
        if os.getpid() != self.pid:
            os.abort()


def _collect_eagerly() -> int:
    """In the child: allocate with the collection threshold at 1, as a writer's allocations
    may cross the parent's threshold."""
    gc.set_threshold(1)
    junk = [[i] for i in range(10000)]
    return len(junk)


def test_forked_writer_runs_no_finalizer_of_the_parents_garbage():
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.disable()
    try:
        _AbortsElsewhere()  # cyclic garbage, not collected yet at the fork
        gc.set_threshold(10 ** 9)
        gc.enable()
        assert ForkedCall(_collect_eagerly, "test").result() == 10000
    finally:
        gc.set_threshold(*threshold)
        gc.collect()  # here its finalizer does nothing
        (gc.enable if enabled else gc.disable)()


def test_forked_writer_that_does_not_start_is_forked_again(monkeypatch, tmp_path):
    # A child can (rarely) hang inside fork in a multi-threaded process; the parent waits
    # for its start byte, kills one that does not start in time and forks again.
    from dist_checkpointing.strategies import async_utils, forked_call, persistent_worker

    marker = tmp_path / "stalled"
    orig = forked_call._run_child

    def run_child(fn, read_fd, write_fd):
        if not marker.exists():  # the first child never starts
            marker.write_text("x")
            time.sleep(60)
        orig(fn, read_fd, write_fd)

    monkeypatch.setattr(forked_call, "_run_child", run_child)
    monkeypatch.setattr(forked_call, "FORK_START_TIMEOUT_S", 1.0)
    start = time.monotonic()
    call = ForkedCall(lambda: 42, "test")
    assert call.result() == 42 and marker.exists()
    assert time.monotonic() - start < 30

    def never_starts(fn, read_fd, write_fd):
        time.sleep(60)

    monkeypatch.setattr(forked_call, "_run_child", never_starts)
    monkeypatch.setattr(forked_call, "FORK_START_TIMEOUT_S", 0.3)
    with pytest.raises(CheckpointingException, match="No forked writer started"):
        ForkedCall(lambda: 1, "test")


# ----------------------------------------------------------------------------- finalize steps that differ by rank


def _rank0_steps_rank(rank: int, world: int, root: str, how: str, fail: bool):
    """Megatron-LM adds finalize steps on rank 0 only (the tracker file, loggers): a queue
    (or ``execute_sync``) must finalize such a request on every rank, a save's own collective
    finalization included, and raise a rank-0 step's error on every rank."""
    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.full((4,), float(rank)), (0, rank, world))}
    request = dc.save(sd, f"{root}/{how}", async_sharded_save=True)
    ran = []
    if rank == 0:
        request.add_finalize_fn(lambda: ran.append("tracker"))
        if fail:
            request.add_finalize_fn(lambda: 1 / 0)
        request.add_finalize_fn(lambda: ran.append("logger"))
    try:
        if how == "queue":
            queue = AsyncCallsQueue()
            queue.schedule_async_request(request)
            try:
                queue.maybe_finalize_async_calls(blocking=True)
            finally:
                queue.close(abort=True)
        else:
            request.execute_sync()
    except CheckpointingException as e:
        return str(e)
    out = dc.load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(4), (0, rank, world))}, f"{root}/{how}")
    assert torch.equal(out["a"], torch.full((4,), float(rank)))
    return ran


@pytest.mark.parametrize("how", ["queue", "execute_sync"])
def test_finalize_steps_on_rank_0_only(tmp_path, how):
    assert get_pool(2).run(_rank0_steps_rank, str(tmp_path), how, False, timeout=120) == [["tracker", "logger"], []]
    errors = get_pool(2).run(_rank0_steps_rank, str(tmp_path / "f"), how, True, timeout=120)
    assert all("rank 0" in e and "ZeroDivisionError" in e for e in errors), errors
