"""The staging arenas of async saves on every path (issue 42 and the staging classes of 43):
no collective and no host wait after the copies are queued, every arena unpinned and closed
exactly once whatever drops it, failed registrations contained, the pool's holds atomic,
every path out of a refused save releasing what it reserved, the trainer's working directory
never moving a checkpoint, and every snapshot mode writing what a sync save writes.

CPU tests stand in for the CUDA runtime where pinning is what is tested (a fake ``cudart``
that records registrations: no collective is faked); the GPU tests at the end do it for real
and skip without CUDA."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import CheckpointManager, CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.manager.local import snapshot as local_snapshot
from dist_checkpointing.manager.local.tier import LocalTier
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from dist_checkpointing.runtime import arenas as staging
from dist_checkpointing.runtime.async_callers import TemporalAsyncCaller, _ThreadCall
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from dist_checkpointing.runtime.arenas import ArenaPool, StagingArena
from dist_checkpointing.strategies.torch_dist import save as torch_dist_save
from dist_checkpointing.strategies.torch_dist.save import TorchDistSaveShardedStrategy

from .collective_counter import _RECEIVED
from .conftest import get_pool
from .fp8_fake import FakeFloat8Tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (run on the GPU machine)")
MiB = 1 << 20


def _sharded(tensors: Dict[str, torch.Tensor], rank: int = 0, world: int = 1) -> Dict[str, Any]:
    return {k: ShardedTensor.from_rank_offsets(k, t, (0, rank, world)) if world > 1 and t.dim() else
            ShardedTensor.from_rank_offsets(k, t, replica_id=rank) for k, t in tensors.items()}


def _state(rank: int = 0, mib: int = 1, device: str = "cpu") -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    n = mib * MiB // 8
    return {"a": torch.randn(n, generator=g).to(device), "b": torch.randn(n // 2, generator=g).to(device).view(-1, 4)}


def _staging_fds() -> int:
    """Open staging memfds of this process."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "dist_ckpt_staging" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n


class _FakeCudart:
    """Stands in for the CUDA runtime's host registration (``code``: what cudaHostRegister
    returns); records what was registered and whether the last error was cleared."""

    def __init__(self, code: int = 0):
        self.code, self.registered, self.unregistered, self.cleared = code, [], [], 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.code == 0:
            self.registered.append(ptr)
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0

    def cudaGetLastError(self) -> int:
        self.cleared += 1
        return 0


@pytest.fixture
def fake_pinning(monkeypatch):
    """Pinning as if CPU tensors needed it, through a fake runtime (restored after)."""
    fake = _FakeCudart()
    monkeypatch.setattr(staging, "_cudart", lambda: fake)
    monkeypatch.setattr(staging, "PINNED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(staging, "_warned", threading.Event())
    torch_dist_save.ARENAS.release()
    yield fake
    torch_dist_save.ARENAS.release()


# ----------------------------------------------------------------------------- no wait after the copies


class _AfterCopies:
    """Counts, inside one rank, the collectives (on the default group, or on any group) and
    host waits for copies that the calling thread makes after its first copy was queued into
    a staging arena (background threads wait as they please)."""

    def __init__(self, monkeypatch: Any, default_group_only: bool = False):
        self._armed = False
        self._thread = threading.get_ident()
        self.events: List[str] = []
        self.default_group_only = default_group_only
        for module in (staging, local_snapshot):
            real = module.stage_into

            def queued(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                if threading.get_ident() == self._thread:
                    self._armed = True
                return _real(*args, **kwargs)
            monkeypatch.setattr(module, "stage_into", queued)
        for name in [*_RECEIVED, "barrier"]:
            monkeypatch.setattr(dist, name, self._wrap(name, getattr(dist, name)))
        real_wait = staging.Staged.wait

        def wait(staged: Any) -> None:
            if self.armed:
                self.events.append("Staged.wait")
            real_wait(staged)
        monkeypatch.setattr(staging.Staged, "wait", wait)

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if self.armed and (group is None or not self.default_group_only):
                self.events.append(name)
            return fn(*args, **kwargs)
        return counted

    @property
    def armed(self) -> bool:
        return self._armed and threading.get_ident() == self._thread

    def during(self, call: Any) -> List[str]:
        self._armed, self.events = False, []
        try:
            call()
        finally:
            armed, self._armed = self._armed, False
        assert armed, "no copy was queued: the test cannot fail"
        return list(self.events)


def _no_wait_after_copies(rank: int, world: int, root: str, how: str) -> List[str]:
    with pytest.MonkeyPatch.context() as mp:
        counter = _AfterCopies(mp, default_group_only=how == "manager")
        state = _sharded(_state(rank), rank, world)
        strategy = TorchDistSaveShardedStrategy(async_snapshot="stream")
        if how == "fully_parallel":
            strategy = FullyParallelSaveStrategyWrapper(strategy)
        if how == "manager":
            mp.setattr(get_default_save_sharded_strategy(), "async_snapshot", "stream")
            with CheckpointManager(os.path.join(root, "m"), save_interval_steps=1, async_save=True,
                                   local_dir=os.path.join(root, "node{node}"), local_interval=1,
                                   local_snapshot="copy", node_of_rank=list(range(world))) as m:
                events = counter.during(lambda: m.save(1, state))
                m.wait_until_finished()
            return events
        box: List[Any] = []
        events = counter.during(lambda: box.append(dc.save(state, os.path.join(root, how), strategy,
                                                           async_sharded_save=True)))
    box[0].execute_sync()
    return events


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how", ["save", "fully_parallel", "manager"])
def test_no_collective_nor_wait_after_the_copies_are_queued(tmp_path, world, how):
    """On NCCL every collective reads its flags back with a host sync that waits for the
    queued copies: between the first queued copy and ``save`` returning there is none (for
    the manager: none on the default group; the local tier agrees over its own gloo group)."""
    assert get_pool(world).run(_no_wait_after_copies, str(tmp_path), how, timeout=120) == [[]] * world


# ----------------------------------------------------------------------------- arenas released exactly once


def test_arena_unpinned_and_closed_once_whatever_drops_it(fake_pinning):
    gc.collect()
    before = _staging_fds()
    arena = StagingArena(4096)
    arena.pin_for([torch.ones(3)])
    assert arena.pinned and fake_pinning.registered == [arena.flat.data_ptr()]
    fd = arena.fd
    arena.release()
    arena.release()  # once only
    assert fake_pinning.unregistered == fake_pinning.registered
    with pytest.raises(OSError):
        os.fstat(fd)
    # dropped without release(): collected, unpinned, closed
    dropped = StagingArena(4096)
    dropped.pin_for([torch.ones(3)])
    del dropped
    gc.collect()
    assert len(fake_pinning.unregistered) == 2 and _staging_fds() == before


def test_pinned_memory_bounded_with_a_new_strategy_per_save(tmp_path, fake_pinning):
    gc.collect()
    before = _staging_fds()
    state = _state(0, 2)
    for i in range(20):  # a new strategy for every save, run with execute_sync()
        strategy = TorchDistSaveShardedStrategy(async_snapshot="stream")
        request = dc.save(_sharded(state), str(tmp_path / f"c{i}"), strategy, async_sharded_save=True)
        request.execute_sync()
    pinned = len(fake_pinning.registered) - len(fake_pinning.unregistered)
    assert pinned == 1 and len(torch_dist_save.ARENAS.arenas) == 1, \
        f"after 20 saves: {pinned} arenas pinned, {len(torch_dist_save.ARENAS.arenas)} kept"
    torch_dist_save.ARENAS.release()
    assert fake_pinning.registered == fake_pinning.unregistered and _staging_fds() == before


def test_local_tier_dropped_without_close_unpins(tmp_path, fake_pinning):
    gc.collect()
    before = _staging_fds()
    tier = LocalTier(str(tmp_path / "node"), 1, snapshot="copy", job={"root": str(tmp_path), "run": "0" * 32})
    tier.save(1, _sharded(_state(0)))
    tier.finalize()
    assert tier._arena.pinned and len(fake_pinning.registered) == 1
    del tier
    gc.collect()
    assert fake_pinning.unregistered == fake_pinning.registered and _staging_fds() == before


def test_failed_registration_is_cleared_warned_once_and_falls_back(tmp_path, monkeypatch, caplog):
    fake = _FakeCudart(code=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(staging, "_cudart", lambda: fake)
    monkeypatch.setattr(staging, "PINNED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(staging, "_warned", threading.Event())
    torch_dist_save.ARENAS.release()
    state = _state(0)
    try:
        with caplog.at_level(logging.WARNING, logger="dist_checkpointing"):
            for i in range(3):
                dc.save(_sharded(state), str(tmp_path / f"c{i}"), TorchDistSaveShardedStrategy(async_snapshot="stream"),
                        async_sharded_save=True).execute_sync()
                torch_dist_save.ARENAS.release()  # a new arena, a new registration attempt
    finally:
        torch_dist_save.ARENAS.release()
    assert fake.cleared == 3, "the runtime's last error was not cleared after each failed registration"
    assert sum("Cannot pin" in r.getMessage() for r in caplog.records) == 1
    out = dc.load(_sharded({k: torch.zeros_like(v) for k, v in state.items()}), str(tmp_path / "c2"))
    assert all(torch.equal(out[k], v) for k, v in state.items())


# ----------------------------------------------------------------------------- the pool's holds


def test_arena_pool_never_gives_one_arena_to_two_threads():
    pool = ArenaPool()
    in_use: set = set()
    lock = threading.Lock()
    clashes: List[int] = []

    def worker(seed: int) -> None:
        for i in range(300):
            arena, done = pool.take(1024 * (1 + (seed + i) % 3))
            with lock:
                if arena.id in in_use:
                    clashes.append(arena.id)
                in_use.add(arena.id)
            with lock:
                in_use.discard(arena.id)
            done()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clashes == [] and pool.held() == 0
    pool.release()
    assert pool.arenas == []


# ----------------------------------------------------------------------------- every path out of a save releases


def _refused_saves(rank: int, world: int, root: str, mode: str) -> Dict[str, int]:
    """One good save on a queue, then three refused because the last rank holds an
    unpicklable object (at world 1: this rank): this rank's holds, arenas and staging memory
    after them. ``root`` may be a ``memory://`` URL (written from the queue's thread)."""
    def state(bad: bool) -> Dict[str, Any]:
        sd: Dict[str, Any] = _sharded(_state(rank, 4), rank, world)
        sd["obj"] = ShardedObject("obj", (lambda: 0) if bad else {"ok": 1}, (world,), (rank,))
        return sd

    torch_dist_save.ARENAS.release()  # idle arenas of earlier tests
    gc.collect()
    before = _staging_fds()
    queue = AsyncCallsQueue()
    strategy = TorchDistSaveShardedStrategy(async_snapshot=mode)
    where = (lambda name: f"{root}/{name}") if root.startswith("memory://") else (lambda name: os.path.join(root, name))
    queue.schedule_async_request(dc.save(state(False), where("good"), strategy, async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    refused = 0
    for i in range(3):
        try:
            dc.save(state(rank == world - 1), where(f"bad{i}"), strategy, async_sharded_save=True)
        except CheckpointingException as e:
            refused += "Cannot serialize ShardedObject" in str(e)
    held = torch_dist_save.ARENAS.held()
    queue.close()
    return {"refused": refused, "held": held, "arenas": len(torch_dist_save.ARENAS.arenas),
            "fds": max(0, _staging_fds() - before)}  # new ones (an older one may go)


@pytest.mark.parametrize("mode, where, world", [  # memory:// is one process's store: world 1
    *[(mode, "dir", world) for mode in ("stream", "copy", "fork") for world in (1, 2)],
    ("stream", "memory", 1), ("copy", "memory", 1)])
def test_refused_saves_release_their_staging(tmp_path, mode, where, world):
    root = str(tmp_path) if where == "dir" else f"memory://refused-{mode}-{world}"
    assert get_pool(world).run(_refused_saves, root, mode, timeout=120) == \
        [{"refused": 3, "held": 0, "arenas": 0, "fds": 0}] * world


def _refused_local_saves(rank: int, world: int, root: str) -> Dict[str, int]:
    gc.collect()
    before = _staging_fds()
    tier = LocalTier(os.path.join(root, "node{rank}"), 1, snapshot="copy", node_of_rank=list(range(world)),
                     job={"root": root, "run": "0" * 32})
    refused = 0
    try:
        for step in range(1, 4):
            sd: Dict[str, Any] = _sharded(_state(rank, 4), rank, world)
            sd["extra"] = (lambda: 0) if rank == world - 1 else 1  # unpicklable on the last rank
            try:
                tier.save(step, sd)
            except CheckpointingException:
                refused += 1
        kept = int(tier._arena is not None) + int(tier._pending is not None)
    finally:
        tier.close()
    return {"refused": refused, "kept": kept, "fds": max(0, _staging_fds() - before)}


def test_refused_local_tier_saves_release_their_staging(tmp_path):
    out = get_pool(2).run(_refused_local_saves, str(tmp_path), timeout=120)
    assert [o["refused"] for o in out] == [3, 3] and all(o["kept"] <= 1 and o["fds"] == 0 for o in out), out


def _staging_fails_on_one_rank(rank: int, world: int, root: str) -> List[Any]:
    """A copy that fails part-way on the last rank (after the agreement): every rank raises at
    finalization, the arena is released, the earlier checkpoint stays complete."""
    sd = _sharded(_state(rank), rank, world)
    strategy = TorchDistSaveShardedStrategy(async_snapshot="stream")
    dc.save(sd, os.path.join(root, "before"), strategy, async_sharded_save=True).execute_sync()
    with pytest.MonkeyPatch.context() as mp:
        if rank == world - 1:
            real = staging._stage_one
            calls = []

            def breaks(*args: Any) -> None:
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("injected copy failure")
                real(*args)
            mp.setattr(staging, "_stage_one", breaks)
        request = dc.save(sd, os.path.join(root, "after"), strategy, async_sharded_save=True)
    error = None
    try:
        request.execute_sync()
    except CheckpointingException as e:
        error = str(e)
    committed = os.path.exists(os.path.join(root, "after", CONFIG_FNAME))
    loaded = dc.load(_sharded({k: torch.zeros_like(v.data) for k, v in _state(rank).items()}, rank, world),
                     os.path.join(root, "before"))
    intact = all(torch.equal(loaded[k], v) for k, v in _state(rank).items())
    return [error is not None and "injected copy failure" in error, committed, torch_dist_save.ARENAS.held(), intact]


def test_a_copy_failing_after_the_agreement_fails_the_save_on_every_rank(tmp_path):
    assert get_pool(2).run(_staging_fails_on_one_rank, str(tmp_path), timeout=120) == [[True, False, 0, True]] * 2


def test_local_tier_save_waits_for_the_write_in_flight(tmp_path):
    tier = LocalTier(str(tmp_path / "node"), 1, snapshot="copy", job={"root": str(tmp_path), "run": "0" * 32})
    try:
        first = _state(0)
        tier.save(1, _sharded(first))
        second = {k: v + 1 for k, v in first.items()}
        tier.save(2, _sharded(second))  # the arena of step 1's write is not overwritten under it
        tier.finalize()
        assert tier.complete == [1, 2]
    finally:
        tier.close()


def test_temporal_caller_never_forks_a_staged_request(tmp_path):
    state = _state(0)
    request = dc.save(_sharded(state), str(tmp_path / "c"), TorchDistSaveShardedStrategy(async_snapshot="stream"),
                      async_sharded_save=True)
    caller = TemporalAsyncCaller()
    caller.schedule_async_call(request)
    assert isinstance(caller.process, _ThreadCall), "a request staged in this process was forked"
    assert caller.is_current_async_call_done(blocking=True, no_dist=True)
    for fn in request.finalize_fns:
        fn()
    out = dc.load(_sharded({k: torch.zeros_like(v) for k, v in state.items()}), str(tmp_path / "c"))
    assert all(torch.equal(out[k], v) for k, v in state.items())


# ----------------------------------------------------------------------------- what a sync save accepts


def _odd_values() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, 8, dtype=torch.complex64, generator=g)
    big = torch.randn(64, 32, generator=g)
    return {"conj": z.conj(), "neg_conj": (-z).conj(), "neg_view": z.conj().imag, "param": torch.nn.Parameter(big[:4]),
            "strided": big[:, ::3], "transposed_conj": z.t().conj(), "view_of_larger": big[10:12],
            "fp8": FakeFloat8Tensor.quantize(torch.randn(16, 8, generator=g).to(torch.bfloat16), 0.05)}


def _data_bytes(ckpt: str) -> Dict[str, bytes]:
    return {n: open(os.path.join(ckpt, n), "rb").read() for n in sorted(os.listdir(ckpt)) if n.endswith(".distcp")}


@pytest.mark.parametrize("mode", ["stream", "copy", "fork"])
def test_every_snapshot_mode_writes_what_a_sync_save_writes(tmp_path, mode):
    state = _odd_values()
    dc.save(_sharded(state), str(tmp_path / "sync"), TorchDistSaveShardedStrategy())
    dc.save(_sharded(state), str(tmp_path / mode), TorchDistSaveShardedStrategy(async_snapshot=mode),
            async_sharded_save=True).execute_sync()
    assert _data_bytes(str(tmp_path / mode)) == _data_bytes(str(tmp_path / "sync"))


def test_local_tier_snapshot_of_odd_values_is_their_values(tmp_path):
    state = _odd_values()
    root, local = str(tmp_path / "root"), str(tmp_path / "node{node}")
    with CheckpointManager(root, save_interval_steps=100, local_dir=local, local_interval=1) as m:
        m.save(1, {k: v for k, v in state.items() if k != "fp8"})
        m.wait_until_finished()
    with CheckpointManager(root, save_interval_steps=100, local_dir=local, local_interval=1) as m:
        want = {k: v.detach().resolve_conj().resolve_neg() for k, v in state.items() if k != "fp8"}
        out = m.load({k: torch.zeros_like(v) for k, v in want.items()})
        assert m.restored_from == ("local", 1)
    for k, v in want.items():
        assert torch.equal(out[k], v), k


def test_stage_into_dequantizes_fp8_as_the_sync_save_does():
    fp8 = FakeFloat8Tensor.quantize(torch.randn(16, 8).to(torch.bfloat16), 0.05)
    offsets, size = staging.arena_layout([fp8])
    flat = torch.zeros(size, dtype=torch.uint8)
    staging.stage_into(flat, False, [fp8], offsets).wait()
    assert torch.equal(staging.flat_view(flat, 0, torch.bfloat16, (16, 8)), fp8.dequantize())
    assert fp8.quantizer_calls == []


# ----------------------------------------------------------------------------- relative paths


_CHDIR_JOB = textwrap.dedent("""
    import os, sys, torch
    import dist_checkpointing as dc
    from dist_checkpointing import CheckpointManager, ShardedTensor
    from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from dist_checkpointing.strategies.torch_dist.save import TorchDistSaveShardedStrategy
    base, mode = sys.argv[1], sys.argv[2]
    for d in ("start", "work", "elsewhere"):
        os.makedirs(os.path.join(base, d), exist_ok=True)
    os.chdir(os.path.join(base, "start"))
    AsyncCallsQueue.warmup_persistent_caller(0)  # the writer starts here
    t = torch.arange(1000.0)
    os.chdir(os.path.join(base, "work"))
    if mode == "manager":
        with CheckpointManager("root", save_interval_steps=1, async_save=True, local_dir="local{node}",
                               local_interval=1) as m:
            m.save(1, {"t": ShardedTensor.from_rank_offsets("t", t)})
            os.chdir(os.path.join(base, "elsewhere"))
            m.save(2, {"t": ShardedTensor.from_rank_offsets("t", t)})
            m.wait_until_finished()
        assert os.listdir(os.path.join(base, "work", "local0"))
        ckpt = os.path.join(base, "work", "root", "iter_0000002")
    else:
        strategy = TorchDistSaveShardedStrategy(async_snapshot=mode)
        request = dc.save({"t": ShardedTensor.from_rank_offsets("t", t)}, "ckpt", strategy, async_sharded_save=True)
        os.chdir(os.path.join(base, "elsewhere"))  # a launcher or a notebook moves on
        request.execute_sync()
        ckpt = os.path.join(base, "work", "ckpt")
    out = dc.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(1000))}, ckpt)
    assert torch.equal(out["t"], t)
    assert not os.listdir(os.path.join(base, "start")) and not os.listdir(os.path.join(base, "elsewhere"))
    print("OK")
""")


@pytest.mark.parametrize("mode", ["copy", "stream", "fork", "manager"])
def test_relative_checkpoint_dir_survives_a_changed_working_directory(tmp_path, mode):
    out = subprocess.run([sys.executable, "-c", _CHDIR_JOB, str(tmp_path), mode], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_commit_refuses_a_local_checkpoint_missing_a_written_file(tmp_path):
    ckpt = str(tmp_path / "c")
    request = dc.save(_sharded(_state(0)), ckpt, TorchDistSaveShardedStrategy(async_snapshot="copy"),
                      async_sharded_save=True)
    request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
    data = [n for n in os.listdir(ckpt) if n.endswith(".distcp")]
    os.remove(os.path.join(ckpt, data[0]))
    with pytest.raises(CheckpointingException, match=f"{data[0]} is not there"):
        for fn in request.finalize_fns:
            fn()
    assert not os.path.exists(os.path.join(ckpt, CONFIG_FNAME))


# ----------------------------------------------------------------------------- on a GPU


def _busy(seconds: float) -> "torch.cuda.Event":
    from .test_gpu_async import _busy as busy
    return busy(seconds)


def _load_cpu(state: Dict[str, torch.Tensor], ckpt: str) -> Dict[str, torch.Tensor]:
    return dc.load(_sharded({k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}), ckpt)


@cuda_only
def test_gpu_sources_freed_and_reused_right_after_the_call(tmp_path):
    state = _state(0, 64, "cuda")
    expected = {k: v.cpu() for k, v in state.items()}
    strategy = TorchDistSaveShardedStrategy(async_snapshot="stream")
    dc.save(_sharded(state), str(tmp_path / "warm"), strategy, async_sharded_save=True).execute_sync()
    _busy(0.5)
    request = dc.save(_sharded(state), str(tmp_path / "c"), strategy, async_sharded_save=True)
    shapes = {k: (v.shape, v.dtype) for k, v in state.items()}
    del state  # freed by the trainer; its memory is handed out again at once
    reuse = [torch.full(s, 7.0, dtype=d, device="cuda") for s, d in shapes.values()]
    request.execute_sync()
    out = _load_cpu(expected, str(tmp_path / "c"))
    assert all(torch.equal(out[k], v) for k, v in expected.items()) and reuse


@cuda_only
def test_gpu_second_save_stages_while_the_first_write_is_in_flight(tmp_path):
    first, second = _state(0, 64, "cuda"), _state(1, 64, "cuda")
    want = [{k: v.cpu() for k, v in s.items()} for s in (first, second)]
    strategy = TorchDistSaveShardedStrategy(async_snapshot="stream")
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(dc.save(_sharded(first), str(tmp_path / "c0"), strategy, async_sharded_save=True))
        queue.schedule_async_request(dc.save(_sharded(second), str(tmp_path / "c1"), strategy, async_sharded_save=True))
        for t in (*first.values(), *second.values()):
            t.add_(1)
        assert torch_dist_save.ARENAS.held() >= 1
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    for i, w in enumerate(want):
        out = _load_cpu(w, str(tmp_path / f"c{i}"))
        assert all(torch.equal(out[k], v) for k, v in w.items()), i


@cuda_only
def test_gpu_failed_registration_does_not_poison_the_next_kernel(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "_warned", threading.Event())
    torch_dist_save.ARENAS.release()
    real = torch.cuda.cudart()

    class Refusing:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            real.cudaHostRegister(ptr, size, flags)
            return real.cudaHostRegister(ptr, size, flags)  # already registered: a real runtime error

    registered: List[int] = []
    monkeypatch.setattr(staging, "_cudart", lambda: Refusing())
    state = _state(0, 16, "cuda")
    arena, done = torch_dist_save.ARENAS.take(64 * MiB)
    done()
    registered.append(arena.flat.data_ptr())
    try:
        request = dc.save(_sharded(state), str(tmp_path / "c"), TorchDistSaveShardedStrategy(async_snapshot="stream"),
                          async_sharded_save=True)
        x = torch.randn(1024, device="cuda") * 2  # a kernel launch: no stale error surfaces
        torch.cuda.synchronize()
        request.execute_sync()
    finally:
        for ptr in registered:
            real.cudaHostUnregister(ptr)
        torch_dist_save.ARENAS.release()
    out = _load_cpu({k: v.cpu() for k, v in state.items()}, str(tmp_path / "c"))
    assert all(torch.equal(out[k], v.cpu()) for k, v in state.items()) and x.numel() == 1024


@cuda_only
def test_gpu_pinning_counted_and_released_with_strategies_per_save(tmp_path):
    torch_dist_save.ARENAS.release()
    start = dict(staging.PIN_COUNTS)
    state = _state(0, 16, "cuda")
    for i in range(20):
        dc.save(_sharded(state), str(tmp_path / f"c{i}"), TorchDistSaveShardedStrategy(async_snapshot="stream"),
                async_sharded_save=True).execute_sync()
    pinned = (staging.PIN_COUNTS["registered"] - start["registered"]) - \
        (staging.PIN_COUNTS["unregistered"] - start["unregistered"])
    assert pinned == 1, f"{pinned} arenas pinned after 20 saves"
    torch_dist_save.ARENAS.release()
    assert staging.PIN_COUNTS["registered"] - start["registered"] == \
        staging.PIN_COUNTS["unregistered"] - start["unregistered"]


@cuda_only
def test_gpu_side_stream_pool_does_not_grow_with_non_contiguous_tensors(tmp_path):
    strided = {f"s{i}": torch.randn(2048, 2048, device="cuda")[:, ::2] for i in range(4)}  # 8 MiB each
    strategy = TorchDistSaveShardedStrategy(async_snapshot="stream")
    dc.save(_sharded(strided), str(tmp_path / "warm"), strategy, async_sharded_save=True).execute_sync()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for i in range(3):
        dc.save(_sharded(strided), str(tmp_path / f"c{i}"), strategy, async_sharded_save=True).execute_sync()
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() <= reserved, "device memory reserved grew with the staging temporaries"
    out = _load_cpu({k: v.cpu() for k, v in strided.items()}, str(tmp_path / "c2"))
    assert all(torch.equal(out[k], v.cpu()) for k, v in strided.items())


@cuda_only
@pytest.mark.skipif(HAS_CUDA and torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_two_devices(tmp_path):
    state = {"d0": torch.randn(1 << 20, device="cuda:0"), "d1": torch.randn(1 << 20, device="cuda:1")}
    want = {k: v.cpu() for k, v in state.items()}
    request = dc.save(_sharded(state), str(tmp_path / "c"), TorchDistSaveShardedStrategy(async_snapshot="stream"),
                      async_sharded_save=True)
    for t in state.values():
        t.add_(1)
    request.execute_sync()
    out = _load_cpu(want, str(tmp_path / "c"))
    assert all(torch.equal(out[k], v) for k, v in want.items())


_NCCL_WORLD1 = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {root!r})
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor
    from tests.test_gpu_async import _busy
    dist.init_process_group("nccl", init_method="file://" + sys.argv[1] + "/store", rank=0, world_size=1)
    torch.cuda.set_device(0)
    state = {{"w": torch.randn(64 << 20, device="cuda")}}
    dc.save({{"w": ShardedTensor.from_rank_offsets("w", state["w"])}}, sys.argv[1] + "/warm",
            async_sharded_save=True).execute_sync()
    busy = _busy(1.0)
    state["w"].mul_(2)
    want = state["w"].clone()
    request = dc.save({{"w": ShardedTensor.from_rank_offsets("w", state["w"])}}, sys.argv[1] + "/c",
                      async_sharded_save=True)
    returned_early = not busy.query()
    state["w"].add_(1)
    request.execute_sync()
    dest = torch.zeros(64 << 20, device="cuda")
    out = dc.load({{"w": ShardedTensor.from_rank_offsets("w", dest)}}, sys.argv[1] + "/c")
    print("returned before the queued kernel:", returned_early, "| state at the call:", torch.equal(out["w"], want))
    dist.destroy_process_group()
""")


@cuda_only
def test_gpu_nccl_world1_stream_save_does_not_wait_for_the_copies(tmp_path):
    out = subprocess.run([sys.executable, "-c", _NCCL_WORLD1.format(root=ROOT), str(tmp_path)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "returned before the queued kernel: True | state at the call: True" in out.stdout, out.stdout
