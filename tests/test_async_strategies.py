"""Megatron-Core >= 0.16's async names on this package, without Megatron installed:
``get_async_strategy``, the NVRx helpers, the writers' priorities (``warmup_persistent_caller``,
``_set_process_qos``), the results queue, ``CachedMetadataFileSystemReader``, the strategies'
``async_strategy`` arguments and 0.19's constructor orders, and the async save of plain DCP
checkpoints (``FileSystemWriterAsync`` with ``state_dict_saver``) at world 1 and 2.
(tests/test_mcore19.py runs Megatron-LM's own trainer code over the same names.)"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing.runtime import process_qos
from dist_checkpointing.runtime.async_request import AsyncRequest
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, _set_process_qos
from dist_checkpointing.strategies.dcp.async_save import save_state_dict_async_finalize, save_state_dict_async_plan
from dist_checkpointing.strategies.dcp.async_writer import FileSystemWriterAsync
from dist_checkpointing.strategies.dcp.cached_reader import CachedMetadataFileSystemReader
from dist_checkpointing.strategies.filesystem_async import get_write_results_queue
from dist_checkpointing.runtime.forked_call import ForkedCall
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)
from dist_checkpointing.strategies.nvrx import has_nvrx_async_support, is_nvrx_min_version, make_nvrx_async_request
from dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy, get_async_strategy)

from . import launch
from .conftest import get_pool
from .helpers import slack

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- get_async_strategy


@pytest.mark.parametrize("name", ["mcore", "nvrx"])
def test_get_async_strategy_gives_this_librarys_machinery(name):
    got, table = get_async_strategy(name)
    assert got == name and table["AsyncCallsQueue"] is AsyncCallsQueue and table["AsyncRequest"] is AsyncRequest
    assert table["FileSystemWriterAsync"] is FileSystemWriterAsync
    assert table["save_state_dict_async_plan"] is save_state_dict_async_plan
    assert table["CachedMetadataFileSystemReader"] is CachedMetadataFileSystemReader
    assert get_async_strategy(name, "get_write_results_queue")[1] is get_write_results_queue
    with pytest.raises(CheckpointingException, match="CheckpointMetadataCache.*plans afresh"):
        get_async_strategy(name, "CheckpointMetadataCache")


@pytest.mark.parametrize("bad", ["torch", "", None, "NVRX"])
def test_get_async_strategy_refuses_other_names(bad):
    with pytest.raises(CheckpointingException, match="not supported"):
        get_async_strategy(bad)


def test_async_strategy_arguments_are_checked_before_anything_is_written(tmp_path):
    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.ones(3))}
    with pytest.raises(CheckpointingException, match="async_strategy"):
        TorchDistSaveShardedStrategy().async_save(sd, tmp_path / "c", "bogus")
    with pytest.raises(CheckpointingException, match="async_strategy"):
        FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()).async_save(sd, tmp_path / "c", "bogus")
    assert not (tmp_path / "c").exists()
    dc.save(sd, tmp_path / "ok")
    for strategy in (TorchDistLoadShardedStrategy(), FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())):
        with pytest.raises(CheckpointingException, match="async_strategy"):
            strategy.load(sd, tmp_path / "ok", "bogus")
        assert torch.equal(strategy.load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(3))},
                                         tmp_path / "ok", "nvrx")["a"], torch.ones(3))


def test_megatron_core_019_constructor_orders():
    load = TorchDistLoadShardedStrategy(True, False, "iter_0000010")
    assert (load.cache_metadata, load.stream_ckpt_dequant, load.checkpoint_name) == (True, False, "iter_0000010")
    assert FullyParallelLoadStrategyWrapper(load).stream_ckpt_dequant is False
    save = TorchDistSaveShardedStrategy("torch_dist", 1, True, 3, False, None, True)
    assert (save.thread_count, save.cpu_shm_mode) == (3, True)
    wrapper = FullyParallelSaveStrategyWrapper(save, None, True, "torch_dist", 1)
    assert (wrapper.backend, wrapper.version) == ("torch_dist", 1)
    with pytest.raises(CheckpointingException, match="saves \\('torch_dist', 1\\), not \\('zarr', 1\\)"):
        FullyParallelSaveStrategyWrapper(save, None, False, "zarr", 1)


# ----------------------------------------------------------------------------- NVRx helpers

_NVRX = {
    "core": "AsyncCallsQueue = AsyncRequest = object\n",
    "cached_metadata_filesystem_reader": "CachedMetadataFileSystemReader = object\n",
    "filesystem_async": "FileSystemWriterAsync = get_write_results_queue = object\n_results_queue = None\n",
    "state_dict_saver": "CheckpointMetadataCache = save_state_dict_async_finalize = save_state_dict_async_plan = 1\n",
}


def _fake_nvrx(root: Path, version: str, drop: str = "") -> None:
    """An installed NVIDIA Resiliency Extension as far as imports see it (the real one needs CUDA)."""
    pkg = root / "nvidia_resiliency_ext"
    (pkg / "checkpointing" / "async_ckpt").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "checkpointing" / "__init__.py").write_text("")
    (pkg / "checkpointing" / "async_ckpt" / "__init__.py").write_text("")
    for module, text in _NVRX.items():
        text = "\n".join(line for line in text.splitlines() if not drop or drop not in line)
        (pkg / "checkpointing" / "async_ckpt" / f"{module}.py").write_text(text + "\n")


@pytest.mark.parametrize("version,drop,expected", [
    (None, "", False), ("0.6.0", "", True), ("0.7.1", "", True), ("0.5.9", "", False),
    ("0.6.0", "CheckpointMetadataCache", False), ("0.6.0", "_results_queue", False)])
def test_has_nvrx_async_support(tmp_path, version, drop, expected):
    if version is not None:
        _fake_nvrx(tmp_path, version, drop)
    code = f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from dist_checkpointing.strategies.nvrx import has_nvrx_async_support, is_nvrx_min_version
        print(has_nvrx_async_support(), is_nvrx_min_version())
    """
    proc = launch.run(["-c", textwrap.dedent(code)], env=dict(os.environ), cwd=ROOT, timeout=slack(60))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2] == str(expected)
    assert has_nvrx_async_support() is False and is_nvrx_min_version() is False  # not installed here


def test_make_nvrx_async_request_builds_the_given_class():
    def fn(a, b):
        return a + b

    request = make_nvrx_async_request(AsyncRequest, fn, (1, 2), [print], preload_fn=list)
    assert isinstance(request, AsyncRequest)
    assert (request.async_fn, request.async_fn_args, request.finalize_fns, request.async_fn_kwargs,
            request.preload_fn) == (fn, (1, 2), [print], {}, list)


# ----------------------------------------------------------------------------- priorities and results queue


def _nice_after(cpu, io):
    _set_process_qos(cpu, io)
    return os.nice(0)


def test_set_process_qos_lowers_never_raises_priority():
    base = os.nice(0)
    assert ForkedCall(lambda: _nice_after(base + 3, None), "qos").result() == base + 3
    assert ForkedCall(lambda: (_nice_after(base + 3, None), _nice_after(base + 1, None))[1], "qos").result() == base + 3
    assert ForkedCall(lambda: _nice_after(42, 7), "qos").result() == base  # out of range: left as it is
    for bad in ("10", 1.5, True):
        with pytest.raises(CheckpointingException, match="cpu_priority"):
            _set_process_qos(bad, None)
        with pytest.raises(CheckpointingException, match="io_priority"):
            process_qos.set_writer_qos(None, bad)
    assert os.nice(0) == base


def test_forked_writers_take_the_writer_priorities():
    base = os.nice(0)
    try:
        process_qos.set_writer_qos(base + 2, 3)
        nice, io = ForkedCall(lambda: (os.nice(0), subprocess.run(
            ["ionice", "-p", str(os.getpid())], capture_output=True, text=True).stdout.strip()), "writer").result()
    finally:
        process_qos._writer_qos = None
    assert (nice, io) == (base + 2, "idle")
    assert os.nice(0) == base


def test_warmup_persistent_caller_starts_the_writer_at_the_priorities():
    code = """
        import os, subprocess
        from dist_checkpointing import CheckpointingException
        from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from dist_checkpointing.runtime.persistent_worker import shared_worker
        try:
            AsyncCallsQueue.warmup_persistent_caller(0, mp_mode="threads")
        except CheckpointingException as e:
            print("refused:", e)
        AsyncCallsQueue.warmup_persistent_caller(3, "forkserver", cpu_priority=os.nice(0) + 4, io_priority=3,
                                                 cpu_shm_mode=True)
        pid = shared_worker().pid
        print(pid != os.getpid(), os.getpriority(os.PRIO_PROCESS, pid) - os.nice(0),
              subprocess.run(["ionice", "-p", str(pid)], capture_output=True, text=True).stdout.strip())
    """
    proc = launch.run(["-c", textwrap.dedent(code)], env=dict(os.environ), cwd=ROOT, timeout=slack(120))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-2].startswith("refused: mp_mode must be one of") and lines[-1] == "True 4 idle", proc.stdout


def test_write_results_queue_is_made_once():
    queue = get_write_results_queue("fork")
    assert get_write_results_queue() is queue
    queue.put(1)
    assert queue.get(timeout=10) == 1
    with pytest.raises(CheckpointingException, match="mp_mode"):
        get_write_results_queue("threads")


# ----------------------------------------------------------------------------- CachedMetadataFileSystemReader


def test_cached_metadata_reader_reads_with_plain_dcp(tmp_path):
    def save(value: float) -> None:
        dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.full((4,), value))}, tmp_path / "c")

    save(1.0)
    out = {"a": torch.zeros(4)}
    dcp.load(out, storage_reader=CachedMetadataFileSystemReader(tmp_path / "c"))
    assert torch.equal(out["a"], torch.ones(4))
    first = CachedMetadataFileSystemReader(tmp_path / "c").read_metadata()
    assert CachedMetadataFileSystemReader(str(tmp_path / "c")).read_metadata() is first  # shared
    assert CachedMetadataFileSystemReader(tmp_path / "c", cache_metadata=False).read_metadata() is not first
    for name in os.listdir(tmp_path / "c"):
        os.remove(tmp_path / "c" / name)
    save(2.0)  # a rewritten checkpoint is never served stale
    second = CachedMetadataFileSystemReader(tmp_path / "c").read_metadata()
    assert second is not first
    CachedMetadataFileSystemReader.clear_metadata_cache()
    assert CachedMetadataFileSystemReader(tmp_path / "c").read_metadata() is not second
    (tmp_path / "c" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointingException, match=".metadata"):
        CachedMetadataFileSystemReader(tmp_path / "c").read_metadata()


# ----------------------------------------------------------------------------- async save of plain DCP checkpoints


def _dcp_async_rank(rank: int, world: int, root: str, fail_rank: int, hint, snapshot: str = "auto"):
    state = {f"w{rank}": torch.randn(40, 17), "opt.shared": torch.arange(9, dtype=torch.float64),
             "nested": {"b": torch.ones(3, dtype=torch.bfloat16)}, "step": 11,
             f"shm{rank}": torch.arange(6.0).share_memory_()}  # not isolated by a fork: copied
    expected = {k: v.clone() for k, v in state.items() if torch.is_tensor(v)}
    expected["nested.b"] = state["nested"]["b"].clone()
    writer = FileSystemWriterAsync(root, thread_count=3, separation_hint=hint, async_snapshot=snapshot)
    with pytest.raises(CheckpointingException, match="prepare_write_data"):
        writer.get_save_function_and_args()
    if rank == fail_rank:  # before the snapshot: a forked writer may start writing at once
        os.makedirs(f"{root}/__{rank}_0.distcp")
    planned = save_state_dict_async_plan(state, writer, None, 0)
    fn, preload, args = writer.get_save_function_and_args()
    assert preload is None
    with torch.no_grad():
        for v in (state[f"w{rank}"], state["opt.shared"], state["nested"]["b"], state[f"shm{rank}"]):
            v.add_(5)  # after the plan: not in the checkpoint
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(fn, args, [lambda: save_state_dict_async_finalize(*planned)]))
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except CheckpointingException as e:
        return str(e), os.path.exists(f"{root}/.metadata")
    finally:
        queue.close()
    files = sorted(os.listdir(root))
    out = {f"w{rank}": torch.zeros(40, 17), "opt.shared": torch.zeros(9, dtype=torch.float64),
           "nested": {"b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 0, f"shm{rank}": torch.zeros(6)}
    dcp.load(out, checkpoint_id=root)
    for k, v in expected.items():
        got = out["nested"]["b"] if k == "nested.b" else out[k]
        assert torch.equal(got, v), k
    assert out["step"] == 11
    return files


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("hint,snapshot", [(None, "auto"), ("opt.", "auto"), (None, "copy")])
def test_dcp_async_save_round_trip(tmp_path, world, hint, snapshot):
    files = get_pool(world).run(_dcp_async_rank, str(tmp_path / "c"), -1, hint, snapshot, timeout=120)[0]
    assert ".metadata" in files
    data = [f for f in files if f.endswith(".distcp")]
    assert all(f.startswith(("__", "opt.__")) for f in data), data
    assert any(f.startswith("opt.") for f in data) == (hint is not None), data


@pytest.mark.parametrize("snapshot", ["auto", "copy"])
def test_dcp_async_save_failure_is_raised_on_every_rank(tmp_path, snapshot):
    outcomes = get_pool(2).run(_dcp_async_rank, str(tmp_path / "c"), 1, None, snapshot, timeout=120)
    for error, metadata_written in outcomes:
        assert "rank 1" in error and "__1_0.distcp" in error and not metadata_written, outcomes


def _wrong_writer_rank(rank: int, world: int, root: str):
    writer = FileSystemWriterAsync(root) if rank == 0 else dcp.FileSystemWriter(root)
    with pytest.raises(CheckpointingException) as e:
        save_state_dict_async_plan({"a": torch.ones(2)}, writer)
    return str(e.value)


def test_dcp_async_plan_refusal_is_raised_on_every_rank(tmp_path):
    for error in get_pool(2).run(_wrong_writer_rank, str(tmp_path), timeout=120):
        assert "rank(s) [1]" in error and "needs a FileSystemWriterAsync" in error, error


class _FailingPlanner(dcp.DefaultSavePlanner):
    def resolve_data(self, write_item):
        raise OSError("the tensor cannot be read")


def _failing_snapshot_rank(rank: int, world: int, root: str):
    planner = _FailingPlanner() if rank == 1 else dcp.DefaultSavePlanner()
    with pytest.raises(CheckpointingException) as e:
        save_state_dict_async_plan({f"a{rank}": torch.ones(2)}, FileSystemWriterAsync(root), planner=planner)
    return str(e.value)


def test_dcp_async_snapshot_failure_is_raised_on_every_rank(tmp_path):
    for error in get_pool(2).run(_failing_snapshot_rank, str(tmp_path), timeout=120):
        assert "rank(s) [1]" in error and "the tensor cannot be read" in error, error


def test_dcp_async_writer_refusals(tmp_path):
    with pytest.raises(CheckpointingException, match="use_msc"):
        FileSystemWriterAsync(tmp_path, use_msc=True)
    with pytest.raises(CheckpointingException, match="async_snapshot"):
        FileSystemWriterAsync(tmp_path, async_snapshot="fork")
    with pytest.raises(CheckpointingException, match="needs a FileSystemWriterAsync"):
        save_state_dict_async_plan({"a": torch.ones(2)}, dcp.FileSystemWriter(tmp_path))
    writer = FileSystemWriterAsync(tmp_path / "w")
    save_state_dict_async_plan({"a": torch.ones(2)}, writer)
    with pytest.raises(CheckpointingException, match="no results of its write"):
        writer.retrieve_write_results()


def test_dcp_async_writer_is_a_plain_dcp_storage_writer(tmp_path):
    state = {"a": torch.randn(5, 5), "b": [1, 2]}
    dcp.save(state, storage_writer=FileSystemWriterAsync(tmp_path, thread_count=2))
    out = {"a": torch.zeros(5, 5), "b": None}
    dcp.load(out, checkpoint_id=tmp_path)
    assert torch.equal(out["a"], state["a"]) and out["b"] == [1, 2]


@pytest.mark.parametrize("snapshot,forked", [("auto", True), ("copy", False)])
def test_dcp_async_writer_forks_only_for_cpu_state_in_auto(tmp_path, snapshot, forked):
    from dist_checkpointing.strategies.dcp.async_writer import _collect_forked_write, write_dcp_files

    writer = FileSystemWriterAsync(tmp_path, async_snapshot=snapshot)
    planned = save_state_dict_async_plan({"a": torch.ones(3)}, writer)
    fn, _, args = writer.get_save_function_and_args()
    assert fn is (_collect_forked_write if forked else write_dcp_files)
    fn(*args)
    save_state_dict_async_finalize(*planned)
    out = {"a": torch.zeros(3)}
    dcp.load(out, checkpoint_id=str(tmp_path))
    assert torch.equal(out["a"], torch.ones(3))


def _bad_name_on_rank_1(rank: int, world: int, root: str, where: str):
    name = "bogus" if rank == 1 else "nvrx"
    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.ones(2), (0, rank, world))}
    with pytest.raises(CheckpointingException) as e:
        if where == "save":
            dc.save(sd, f"{root}/c", async_sharded_save=True, async_strategy=name)
        elif where == "strategy":
            TorchDistSaveShardedStrategy().async_save(sd, f"{root}/c", name)
        elif where == "save_wrapper":
            FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()).async_save(sd, f"{root}/c", name)
        elif where == "load":
            TorchDistLoadShardedStrategy().load(sd, f"{root}/saved", name)
        else:
            FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()).load(sd, f"{root}/saved", name)
    return str(e.value)


@pytest.mark.parametrize("where", ["save", "strategy", "save_wrapper", "load", "load_wrapper"])
def test_async_strategy_of_one_rank_refused_on_every_rank(tmp_path, where):
    pool = get_pool(2)
    if where.startswith("load"):
        pool.run(_save_two_ranks, str(tmp_path / "saved"), timeout=120)
    for error in pool.run(_bad_name_on_rank_1, str(tmp_path), where, timeout=120):
        assert "rank 1" in error and "async_strategy" in error and "'bogus'" in error, error
    assert not (tmp_path / "c" / "metadata.json").exists()


def _save_two_ranks(rank: int, world: int, root: str):
    dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2), (0, rank, world))}, root)
