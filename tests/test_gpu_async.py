"""Async saves of accelerator state (``async_snapshot`` "auto"/"stream"/"copy"/"fork" on
CUDA tensors): the side-stream staging into pinned arenas, its ordering with the trainer's
streams, every dtype and layout, the manager and the local tier, world 2 over gloo with
CUDA tensors on one GPU (both ranks share it). The GPU tests skip without CUDA; the others
(and every ``cpu`` parametrization) run everywhere and hold the CPU side to the same contract.

Ordering is made deterministic with a long GPU kernel (``torch.cuda._sleep``) queued on the
current stream before the save: the staging copies wait for it, so they are certainly still
in flight when the save returns and the trainer changes its tensors.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from typing import Dict, List

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointManager, ShardedObject, ShardedTensor
from dist_checkpointing.core import open_storage
from dist_checkpointing.serialization import get_default_save_sharded_strategy
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.torch_dist.save import TorchDistSaveShardedStrategy

from .conftest import get_pool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (run on the GPU machine)")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]
BUSY_S = 1.0  # the GPU kernel queued before a save: the copies cannot finish before it
MiB = 1 << 20


# ----------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=None)
def _cycles_per_s() -> float:
    """Clock cycles per second of ``torch.cuda._sleep`` on this GPU (measured once, after a
    spin that lets the clocks leave their idle state)."""
    torch.cuda._sleep(200_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 200_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000)


def _busy(seconds: float = BUSY_S) -> "torch.cuda.Event":
    """Queue a kernel that keeps the current CUDA stream busy for about ``seconds``; returns
    an event recorded after it (``query()``: whether it has ended). The tests that depend
    on the kernel still running check that event, not the duration."""
    torch.cuda._sleep(int(seconds * _cycles_per_s()))
    ended = torch.cuda.Event()
    ended.record()
    return ended


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (any dtype, any layout) as a CPU uint8 tensor."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _sharded(tensors: Dict[str, torch.Tensor], rank: int = 0, world: int = 1) -> Dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, t, (0, rank, world)) if world > 1 and t.dim() else
            ShardedTensor.from_rank_offsets(k, t, replica_id=rank) for k, t in tensors.items()}


def _load(tensors: Dict[str, torch.Tensor], ckpt: str, rank: int = 0, world: int = 1) -> Dict[str, torch.Tensor]:
    """The checkpoint's values, loaded in place into tensors like ``tensors`` (zeroed first)."""
    dest = {k: torch.zeros_like(t) for k, t in tensors.items()}
    out = dc.load(_sharded(dest, rank, world), ckpt)
    for k, t in dest.items():
        assert out[k].data_ptr() == t.data_ptr(), f"{k}: not loaded in place"
    return out


def _big_state(device: str, mib: int = 256, seed: int = 0) -> Dict[str, torch.Tensor]:
    """~``mib`` MiB in a few tensors of mixed dtypes (large enough that a device-to-host copy
    takes milliseconds)."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = mib * MiB // 16  # elements per tensor: 4 tensors of 2 or 4 bytes per element
    return {"w.bf16": torch.randn(n, device=device, generator=g).to(torch.bfloat16).view(-1, 1024),
            "w.fp32": torch.randn(n, device=device, generator=g).view(1024, -1),
            "exp_avg": torch.randn(n, device=device, generator=g),
            "exp_avg_sq": torch.rand(n // 2, device=device, generator=g).to(torch.bfloat16)}


def _strategy(mode: str) -> TorchDistSaveShardedStrategy:
    return get_default_save_sharded_strategy() if mode == "auto" else TorchDistSaveShardedStrategy(async_snapshot=mode)


# ----------------------------------------------------------------------------- CPU side (runs everywhere)


@pytest.mark.parametrize("mode, location, expected", [
    ("auto", "dir", "fork"),  # pure-CPU state: the copy-on-write fork
    ("auto", "memory://", "copy"),  # a storage a fork cannot write to: host copies instead
    ("fork", "memory://", "copy"),
    ("fork", "dir", "fork"),
    ("copy", "dir", "copy"),
    ("stream", "dir", "stream"),
    ("stream", "memory://", "stream"),
])
def test_snapshot_mode_of_cpu_state(tmp_path, mode, location, expected):
    strategy = TorchDistSaveShardedStrategy(async_snapshot=mode)
    files = strategy._plan_files(_sharded({"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.int64)}))
    where = str(tmp_path / "ckpt") if location == "dir" else f"memory://mode-{mode}"
    assert strategy._snapshot_mode(files, open_storage(where)) == expected


@cuda_only
def test_snapshot_mode_of_cuda_state(tmp_path):
    strategy = TorchDistSaveShardedStrategy()
    mixed = {"cpu": torch.arange(6.0), "gpu": torch.ones(3, device="cuda")}
    assert strategy._snapshot_mode(strategy._plan_files(_sharded(mixed)), open_storage(str(tmp_path))) == "stream"
    # S3-like storages (not fork_safe) change nothing for accelerator state
    assert strategy._snapshot_mode(strategy._plan_files(_sharded(mixed)), open_storage("memory://m")) == "stream"


def test_fork_snapshot_has_nothing_to_wait_for(tmp_path):
    t = torch.arange(1000.0)
    request = dc.save(_sharded({"t": t}), str(tmp_path / "c"), _strategy("fork"), async_sharded_save=True)
    assert request.staged is None  # the fork is the snapshot
    request.wait_for_staging()
    t.zero_()
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(request)
        queue.wait_for_staging()  # nothing to wait for: returns
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    finally:
        queue.close()
    assert torch.equal(_load({"t": t}, str(tmp_path / "c"))["t"], torch.arange(1000.0))


@pytest.mark.parametrize("mode", ["stream", "copy"])
def test_arena_snapshot_without_tensor_bytes(tmp_path, mode):
    # only objects and empty tensors: an arena of no bytes
    state = {**_sharded({"empty": torch.zeros(0, 4)}),
             "obj": ShardedObject("obj", {"step": 3}, (1,), (0,))}
    request = dc.save(state, str(tmp_path / "c"), _strategy(mode), async_sharded_save=True)
    assert request.staged is not None and request.staged.done()
    request.execute_sync()
    out = dc.load({**_sharded({"empty": torch.ones(0, 4)}), "obj": ShardedObject("obj", None, (1,), (0,))},
                  str(tmp_path / "c"))
    assert out["obj"] == {"step": 3} and out["empty"].shape == (0, 4)


def test_manager_exposes_wait_for_staging(tmp_path):
    with CheckpointManager(str(tmp_path / "root"), save_interval_steps=1, async_save=True) as m:
        m.save(1, _sharded({"t": torch.arange(4.0)}))
        m.wait_for_staging()
        m.wait_until_finished()


_CPU_ONLY_JOB = textwrap.dedent("""
    import sys, torch
    import dist_checkpointing as dc
    from dist_checkpointing import CheckpointManager, ShardedTensor
    from dist_checkpointing.strategies.torch_dist.save import TorchDistSaveShardedStrategy
    root, how = sys.argv[1], sys.argv[2]
    state = {"t": ShardedTensor.from_rank_offsets("t", torch.arange(1000.0))}
    if how == "copy":
        dc.save(state, root + "/c", TorchDistSaveShardedStrategy(async_snapshot="copy"),
                async_sharded_save=True).execute_sync()
    else:
        with CheckpointManager(root + "/m", save_interval_steps=100, local_dir=root + "/local",
                               local_interval=1) as m:
            m.save(1, state)
    print("cuda initialized:", torch.cuda.is_initialized())
""")


@cuda_only
@pytest.mark.parametrize("how", ["copy", "local_tier"])
def test_cpu_only_job_creates_no_cuda_context(tmp_path, how):
    # A CPU-only trainer on a GPU node (e.g. saving to S3: "auto" resolves to "copy") must not
    # get a CUDA context (hundreds of MiB on the current GPU, GPU 0 for every rank by default).
    out = subprocess.run([sys.executable, "-c", _CPU_ONLY_JOB, str(tmp_path), how], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cuda initialized: False" in out.stdout, out.stdout


# ----------------------------------------------------------------------------- dtypes and layouts


def _all_dtypes(device: str) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(48, 40, generator=g)
    out = {str(dt).split(".")[1]: base.to(dt) for dt in
           (torch.bfloat16, torch.float16, torch.float32, torch.float64)}
    out.update({str(dt).split(".")[1]: (base * 50).to(dt) for dt in
                (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)})
    out["bool"] = base > 0
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            out[name] = base.to(getattr(torch, name))
    out = {k: v.to(device) for k, v in out.items()}
    # non-contiguous layouts (made contiguous on their device, one at a time, when staged)
    out["transposed"] = out["float32"].t()
    out["strided"] = out["bfloat16"][:, ::3]
    out["fp8_transposed"] = out.get("float8_e4m3fn", out["int8"]).t()
    out["sliced"] = out["int64"][5:17, 3:30]
    out["scalar"] = torch.tensor(3.5, device=device)
    out["empty"] = torch.zeros(0, 7, device=device)
    return out


def _change(t: torch.Tensor) -> None:
    """Change every element of ``t`` in place (on the current stream)."""
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.dtype.is_floating_point and t.element_size() == 1:  # float8: change its bytes
        t.view(torch.uint8).add_(1)
    else:
        t.add_(1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["auto", "stream", "copy", "fork"])
def test_every_dtype_and_layout_is_bit_exact(tmp_path, device, mode):
    state = _all_dtypes(device)
    if device == "cuda":
        _busy(0.2)  # the copies are still waiting when the tensors change
    for t in state.values():  # work queued before the call: the copies must be ordered after it
        _change(t)
    expected = {k: v.clone() for k, v in state.items()}
    request = dc.save(_sharded(state), str(tmp_path / "c"), _strategy(mode), async_sharded_save=True)
    for t in state.values():  # right after the call, on the current stream, without waiting
        _change(t)
    request.execute_sync()
    loaded = _load(expected, str(tmp_path / "c"))
    for k, want in expected.items():
        assert _same_bytes(loaded[k], want), f"{mode} {device}: {k} is not the state at the call"
        if want.numel():
            assert not _same_bytes(state[k], want), f"{k} was not changed: the test cannot fail"


# ----------------------------------------------------------------------------- CUDA ordering (GPU)


@cuda_only
def test_default_on_cuda_is_stream_into_a_pinned_reused_arena(tmp_path):
    state = _big_state("cuda", 64)
    default = get_default_save_sharded_strategy()
    default.release()  # idle arenas of earlier tests
    queue = AsyncCallsQueue()
    try:
        for i in range(2):
            request = dc.save(_sharded(state), str(tmp_path / f"c{i}"), async_sharded_save=True)
            assert request.staged is not None, "the default did not stage into an arena (fork?)"
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            arenas = list(default._arenas.arenas)
            assert len(arenas) == 1 and arenas[0] is default._arenas.arenas[0], "the arena was not reused"
            if i == 0:
                first = arenas[0]
            assert arenas[0] is first, "the arena was not reused"
            assert arenas[0].pinned and arenas[0].flat.is_pinned(), "the staging arena is not page-locked"
    finally:
        queue.close()
    for i in range(2):
        loaded = _load(state, str(tmp_path / f"c{i}"))
        assert all(_same_bytes(loaded[k], v) for k, v in state.items())


@cuda_only
@pytest.mark.parametrize("mode", ["auto", "stream"])
def test_stream_save_returns_before_the_copies_and_orders_the_trainer(tmp_path, mode):
    # 256 MiB: the copies take milliseconds, and they wait for a 1 s kernel first
    state = _big_state("cuda", 256)
    strategy = _strategy(mode)
    request = dc.save(_sharded(state), str(tmp_path / "warm"), strategy, async_sharded_save=True)
    request.execute_sync()  # the arena exists: what follows is the steady state
    busy = _busy()
    for t in state.values():  # queued behind the kernel: the state at the call is this one
        t.mul_(2)
    expected = {k: v.clone() for k, v in state.items()}
    request = dc.save(_sharded(state), str(tmp_path / "c"), strategy, async_sharded_save=True)
    # the copies wait for the kernel: a call that waited for them would return after it
    assert not busy.query(), "the call returned after the queued kernel: it waited for the device"
    assert not request.staged.done(), "the copies finished before the queued kernel: not ordered after it"
    for t in state.values():  # the optimizer step, right away, on the current stream
        t.add_(1)
    request.execute_sync()
    loaded = _load(expected, str(tmp_path / "c"))
    torch.cuda.synchronize()
    for k, want in expected.items():
        assert _same_bytes(loaded[k], want), f"{k}: the checkpoint is not the state at the call"
        assert not _same_bytes(state[k], want)


@cuda_only
def test_copy_save_returns_after_the_copies(tmp_path):
    state = _big_state("cuda", 64)
    busy = _busy(0.5)
    assert not busy.query()
    request = dc.save(_sharded(state), str(tmp_path / "c"), _strategy("copy"), async_sharded_save=True)
    assert busy.query() and request.staged.done(), "'copy' returned before its copies (queued after the kernel)"
    request.execute_sync()


@cuda_only
@pytest.mark.parametrize("via", ["request", "queue"])
def test_wait_for_staging_then_change_from_another_stream(tmp_path, via):
    state = _big_state("cuda", 256, seed=1)
    expected = {k: v.clone() for k, v in state.items()}
    strategy = _strategy("stream")
    dc.save(_sharded(state), str(tmp_path / "warm"), strategy, async_sharded_save=True).execute_sync()
    other = torch.cuda.Stream()
    queue = AsyncCallsQueue()
    try:
        busy = _busy()
        request = dc.save(_sharded(state), str(tmp_path / "c"), strategy, async_sharded_save=True)
        assert not busy.query() and not request.staged.done()
        queue.schedule_async_request(request)
        if via == "request":
            request.wait_for_staging()
        else:
            queue.wait_for_staging()
        assert request.staged.done()
        with torch.cuda.stream(other):  # a stream the save's ordering does not cover
            for t in state.values():
                t.add_(1)
        other.synchronize()
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    loaded = _load(expected, str(tmp_path / "c"))
    for k, want in expected.items():
        assert _same_bytes(loaded[k], want), k
        assert not _same_bytes(state[k], want)


@cuda_only
def test_no_device_memory_beyond_one_tensor(tmp_path):
    state = _big_state("cuda", 128)
    strided = {"strided": torch.randn(4096, 2048, device="cuda")[:, ::2]}  # 16 MiB, non-contiguous
    strategy = _strategy("stream")
    dc.save(_sharded(state), str(tmp_path / "warm"), strategy, async_sharded_save=True).execute_sync()
    for name, sd, bound in (("contiguous", state, 0), ("strided", strided, 16 * MiB)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        request = dc.save(_sharded(sd), str(tmp_path / name), strategy, async_sharded_save=True)
        request.execute_sync()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra <= bound, f"{name}: {extra} bytes of device memory during the save (bound {bound})"


# ----------------------------------------------------------------------------- manager and local tier


@pytest.mark.parametrize("device", DEVICES)
def test_manager_async_save_is_the_state_at_the_call(tmp_path, device):
    state = _big_state(device, 64 if device == "cuda" else 4, seed=2)
    expected = {k: v.clone() for k, v in state.items()}
    with CheckpointManager(str(tmp_path / "root"), save_interval_steps=1, async_save=True) as m:
        if device == "cuda":
            _busy(0.3)
        m.save(1, _sharded(state))
        for t in state.values():  # no wait: later work on the current stream is ordered after the copies
            t.add_(1)
        m.wait_until_finished()
        loaded = m.load(_sharded({k: torch.zeros_like(v) for k, v in expected.items()}))
    for k, want in expected.items():
        assert _same_bytes(loaded[k], want), k


@pytest.mark.parametrize("device", DEVICES)
def test_local_tier_snapshot_is_the_state_at_the_call(tmp_path, device):
    state = _big_state(device, 64 if device == "cuda" else 4, seed=3)
    expected = {k: v.clone() for k, v in state.items()}
    root, local = str(tmp_path / "root"), str(tmp_path / "node{node}")
    with CheckpointManager(root, save_interval_steps=100, async_save=True, local_dir=local, local_interval=1) as m:
        if device == "cuda":
            _busy(0.3)
        m.save(1, _sharded(state))  # local tier only (the persistent interval is 100)
        for t in state.values():
            t.add_(1)
        m.wait_until_finished()
        assert m.local.complete == [1]
        if device == "cuda":
            assert m.local._arena.pinned, "the local tier's snapshot buffer is not page-locked"
    with CheckpointManager(root, save_interval_steps=100, async_save=True, local_dir=local, local_interval=1) as m:
        loaded = m.load(_sharded({k: torch.zeros_like(v) for k, v in expected.items()}))
        assert m.restored_from == ("local", 1)
    for k, want in expected.items():
        assert _same_bytes(loaded[k], want), k
        assert loaded[k].device.type == device


# ----------------------------------------------------------------------------- world 2 over gloo (CUDA: one GPU)


def _world2(rank: int, world: int, root: str, device: str) -> List[str]:
    """Each rank holds its half of every tensor (on the one GPU, for CUDA); an async save with
    the trainer changing its tensors right after, a two-tier local save with a replica on the
    other rank, and both loaded back in place; the keys that differ."""
    if device == "cuda":
        torch.cuda.set_device(0)
    full = _big_state(device, 64 if device == "cuda" else 4, seed=4)
    state = {k: v.chunk(world)[rank].clone() for k, v in full.items()}
    expected = {k: v.clone() for k, v in state.items()}
    queue = AsyncCallsQueue()
    try:
        if device == "cuda":
            _busy(0.3)
        request = dc.save(_sharded(state, rank, world), os.path.join(root, "async"), async_sharded_save=True)
        assert (request.staged is not None) == (device == "cuda")  # CPU state: the fork
        for t in state.values():
            t.add_(1)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    loaded = _load(expected, os.path.join(root, "async"), rank, world)
    bad = [k for k, v in expected.items() if not _same_bytes(loaded[k], v)]
    local = os.path.join(root, "node{node}")
    with CheckpointManager(os.path.join(root, "m"), save_interval_steps=100, async_save=True, local_dir=local,
                           local_interval=1, replication_factor=2, node_of_rank=[0, 1]) as m:
        m.save(1, _sharded(expected, rank, world))
        m.wait_until_finished()
    with CheckpointManager(os.path.join(root, "m"), save_interval_steps=100, async_save=True, local_dir=local,
                           local_interval=1, replication_factor=2, node_of_rank=[0, 1]) as m:
        loaded = m.load(_sharded({k: torch.zeros_like(v) for k, v in expected.items()}, rank, world))
        assert m.restored_from == ("local", 1)
    bad += [f"local:{k}" for k, v in expected.items() if not _same_bytes(loaded[k], v)]
    return bad


@pytest.mark.parametrize("device", DEVICES)
def test_world2_gloo_async_and_local_tier(tmp_path, device):
    assert get_pool(2).run(_world2, str(tmp_path), device, timeout=300) == [[], []]


# ----------------------------------------------------------------------------- transport of CUDA state over gloo (one GPU)


def _transport_state(device: str) -> Dict[str, object]:
    """Every dtype and layout (:func:`_all_dtypes`), many small tensors (buckets), large ones
    (alone), and two host tensors among them (a bucket that mixes devices)."""
    g = torch.Generator().manual_seed(11)
    sizes = torch.randint(1, 4000, (300,), generator=g).tolist()
    every = {}
    for k, v in _all_dtypes(device).items():  # the views, each on its own base (no aliasing)
        if not v.is_contiguous():
            base = torch.zeros(*v.shape[:-1], 2 * v.shape[-1], dtype=v.dtype, device=device)
            v = base[..., ::2].copy_(v)
        every[k] = v.clone() if v.is_contiguous() else v
    return {"all": every,
            "small": [torch.randn(n, generator=g).to(device) for n in sizes],
            "big": _big_state(device, 16, seed=3),
            "host": {"step": torch.tensor(7), "rng": torch.arange(5, dtype=torch.int64)},
            "lr": 0.1}


def _tensors(state: Dict[str, object]) -> List[torch.Tensor]:
    from torch.utils._pytree import tree_leaves
    return [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


def _transport_world2(rank: int, world: int, device: str, host_bounce: bool) -> List[str]:
    """Rank 0 sends its state (CUDA tensors: both ranks on the one GPU) with work still
    queued on its current stream that changes every tensor; rank 1 receives in place into
    its own tensors (non-contiguous ones included). The leaves that differ."""
    from datetime import timedelta

    from dist_checkpointing import transport

    if device == "cuda":
        torch.cuda.set_device(0)
    old = transport.wire.HOST_STAGING, transport.wire.BUCKET_BYTES
    transport.wire.HOST_STAGING, transport.wire.BUCKET_BYTES = host_bounce, 256 << 10  # several buckets
    try:
        state = _transport_state(device)
        expected = [t.clone() for t in _tensors(state)]
        for t in expected:  # what the sender's queued work makes of them
            _change(t)
        tp = transport.PGTransport(None, timedelta(seconds=120), torch.device("cpu"))
        if rank == 0:
            if device == "cuda":
                _busy(0.3)  # the changes below run after it: the transport must send their result
            for t in _tensors(state):
                _change(t)
            tp.send_checkpoint([1], state)
            return []
        mine = _transport_state(device)
        for t in _tensors(mine):
            t.zero_()
        mine["all"]["transposed"] = torch.zeros(48, 40, device=device).t()  # a non-contiguous destination
        own = _tensors(mine)
        tp = transport.PGTransport(None, timedelta(seconds=120), torch.device("cpu"), state_dict=lambda: mine)
        got = _tensors(tp.recv_checkpoint(0))
        bad = [f"leaf {i}: not in place" for i, (a, b) in enumerate(zip(got, own)) if a is not b]
        bad += [f"leaf {i} ({t.dtype}, {tuple(t.shape)})" for i, (t, want) in enumerate(zip(own, expected))
                if t.device != want.device or not _same_bytes(t, want)]
        return bad
    finally:
        transport.wire.HOST_STAGING, transport.wire.BUCKET_BYTES = old


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host_bounce", [False, True], ids=["pageable", "host_bounce"])
def test_transport_world2_gloo_every_dtype_bit_exact(device, host_bounce):
    """Transport over gloo at world 2 (CUDA: both ranks on the one GPU), with and without
    ``HOST_STAGING``: every dtype and layout arrives bit-exact in the receiver's own tensors,
    and the sender sends its tensors as its queued work leaves them."""
    assert get_pool(2).run(_transport_world2, device, host_bounce, timeout=300) == [[], []]


@cuda_only
def test_dcp_async_writer_copies_cuda_state_without_forking(tmp_path):
    """Megatron-LM's torch_dcp async save of CUDA state: host copies written by this process
    (never a fork of a process holding a CUDA context); the checkpoint is the state at the call."""
    import torch.distributed.checkpoint as dcp

    from dist_checkpointing.runtime.async_request import AsyncRequest
    from dist_checkpointing.strategies.dcp.async_save import save_state_dict_async_finalize, save_state_dict_async_plan
    from dist_checkpointing.strategies.dcp.async_writer import FileSystemWriterAsync, write_dcp_files

    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.arange(7.0, device="cuda"), "step": 3}
    expected = {k: v.clone().cpu() for k, v in state.items() if torch.is_tensor(v)}
    writer = FileSystemWriterAsync(tmp_path / "c")
    planned = save_state_dict_async_plan(state, writer)
    fn, _, args = writer.get_save_function_and_args()
    assert fn is write_dcp_files  # no forked writer
    state["w"].add_(1.0)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(fn, args, [lambda: save_state_dict_async_finalize(*planned)]))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    out = {"w": torch.zeros(1024, 1024), "b": torch.zeros(7), "step": 0}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"))
    assert torch.equal(out["w"], expected["w"]) and torch.equal(out["b"], expected["b"]) and out["step"] == 3
