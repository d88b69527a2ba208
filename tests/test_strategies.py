"""Strategy registry, torch_dist options, and interoperability with plain PyTorch DCP."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
from dist_checkpointing.serialization import get_default_load_sharded_strategy, get_default_save_sharded_strategy
from dist_checkpointing.strategies import (
    LoadShardedStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
    register_default_strategy,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

from . import launch
from .conftest import get_pool
from .helpers import slack


class _WholeTensorSave(SaveShardedStrategy):
    """A toy backend: each whole (unsharded) main-replica tensor in its own torch.save file."""

    def save(self, sharded_state_dict, checkpoint_dir):
        for sh in nested_values(sharded_state_dict):
            if sh.replica_id == 0:
                torch.save(sh.data, Path(checkpoint_dir) / f"{sh.key}.pt")


class _WholeTensorLoad(LoadShardedStrategy):
    supported_backends = ("mybackend",)
    supported_versions = (1,)

    def load(self, sharded_state_dict, checkpoint_dir):
        return dict_list_map_outplace(
            lambda sh: torch.load(Path(checkpoint_dir) / f"{sh.key}.pt", weights_only=True), sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir):
        return {}


def test_builtin_strategies_need_no_import_side_effects():
    assert isinstance(get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1), TorchDistSaveShardedStrategy)
    assert isinstance(get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1), TorchDistLoadShardedStrategy)
    assert isinstance(get_default_save_sharded_strategy(), TorchDistSaveShardedStrategy)
    with pytest.raises(CheckpointingException, match="nobackend"):
        get_default_strategy(StrategyAction.SAVE_SHARDED, "nobackend", 1)


def test_user_strategy_used_by_save_and_picked_by_load(tmp_path):
    register_default_strategy(StrategyAction.SAVE_SHARDED, "mybackend", 1, _WholeTensorSave("mybackend", 1))
    register_default_strategy(StrategyAction.LOAD_SHARDED, "mybackend", 1, _WholeTensorLoad())
    ckpt = tmp_path / "ckpt"
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "step": 3}, ckpt,
            sharded_strategy=("mybackend", 1))
    assert json.loads((ckpt / CONFIG_FNAME).read_text())["sharded_backend"] == "mybackend"
    assert (ckpt / "w.pt").is_file()
    assert isinstance(get_default_load_sharded_strategy(ckpt), _WholeTensorLoad)
    loaded = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, ckpt)
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["step"] == 3


def _save_with_options(rank, world, ckpt, thread_count, hint):
    strategy = TorchDistSaveShardedStrategy(thread_count=thread_count, separation_hint=hint)
    sd = {f"model.w{i}": ShardedTensor.from_rank_offsets(f"model.w{i}", torch.full((4,), float(i + rank)), (0, rank, world))
          for i in range(4)}
    sd.update({f"optimizer.m{i}": ShardedTensor.from_rank_offsets(f"optimizer.m{i}", torch.full((4,), -float(i + rank)),
                                                                  (0, rank, world)) for i in range(3)})
    dc.save(sd, ckpt, sharded_strategy=strategy)
    loaded = dc.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(4), (0, rank, world)) for k in sd}, ckpt)
    for k, v in sd.items():
        assert torch.equal(loaded[k], v.data), k
    return True


def test_thread_count_and_separation_hint_files(pool2, tmp_path):
    ckpt = tmp_path / "ckpt"
    pool2.run(_save_with_options, str(ckpt), 3, "optimizer.")
    names = sorted(p.name for p in ckpt.iterdir() if p.suffix == ".distcp")
    for rank in range(2):
        assert [n for n in names if n.startswith(f"__{rank}_")] == [f"__{rank}_{i}.distcp" for i in range(3)]
        assert [n for n in names if n.startswith(f"optimizer.__{rank}_")] == [f"optimizer.__{rank}_{i}.distcp" for i in range(3)]
    dc.remove_sharded_tensors(ckpt, "optimizer.")
    assert not any(p.name.startswith("optimizer.") for p in ckpt.iterdir()), "separated files are deleted"
    assert set(dc.load_plain_tensors(ckpt)) == {f"model.w{i}" for i in range(4)}
    ckpt1 = tmp_path / "ckpt1"
    pool2.run(_save_with_options, str(ckpt1), 1, None)
    assert sorted(p.name for p in ckpt1.iterdir() if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]


def _cached_saves(rank, world, root):
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    for step in range(3):
        data = torch.full((3,), float(step * 10 + rank))
        dc.save({"w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world))}, f"{root}/s{step}",
                sharded_strategy=strategy)
    # a structure change must not reuse the cached metadata
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3), (0, rank, world)),
             "v": ShardedTensor.from_rank_offsets("v", torch.ones(2), (0, rank, world))}, f"{root}/s3",
            sharded_strategy=strategy)
    return True


def test_cached_metadata_repeated_saves(pool2, tmp_path):
    pool2.run(_cached_saves, str(tmp_path))
    for step in range(3):
        plain = dc.load_plain_tensors(tmp_path / f"s{step}")
        assert torch.equal(plain["w"], torch.tensor([step * 10.0] * 3 + [step * 10.0 + 1] * 3))
    assert set(dc.load_plain_tensors(tmp_path / "s3")) == {"w", "v"}


def _cached_saves_one_rank_changes(rank, world, root):
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    for step in range(3):
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.full((3,), float(step)), (0, rank, world))}
        if step == 1 and rank == world - 1:  # only the last rank's layout changes
            sd["extra"] = ShardedTensor.from_rank_offsets("extra", torch.full((2,), 7.0))
        dc.save(sd, f"{root}/s{step}", sharded_strategy=strategy)
    return True


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"world{w}")
def test_cached_metadata_notices_a_change_on_one_rank(world, tmp_path):
    get_pool(world).run(_cached_saves_one_rank_changes, str(tmp_path))
    for step in range(3):
        plain = dc.load_plain_tensors(tmp_path / f"s{step}")
        assert torch.equal(plain["w"], torch.full((3 * world,), float(step)))
        assert ("extra" in plain) == (step == 1), step
    assert torch.equal(dc.load_plain_tensors(tmp_path / "s1")["extra"], torch.full((2,), 7.0))


def _save_for_dcp(rank, world, ckpt):
    w = torch.arange(8.0 * world).reshape(world * 2, 4)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w[rank * 2:(rank + 1) * 2].clone(), (0, rank, world)),
             "b": ShardedTensor.from_rank_offsets("b", torch.arange(6, dtype=torch.bfloat16), replica_id=rank),
             "o": ShardedObject("o", {"r": rank}, (world,), (rank,))}, ckpt)


@pytest.mark.parametrize("world", [1, 4])
def test_plain_torch_dcp_loads_our_checkpoint(world, tmp_path):
    ckpt = tmp_path / "ckpt"
    get_pool(world).run(_save_for_dcp, str(ckpt))
    state = {"w": torch.zeros(world * 2, 4), "b": torch.zeros(6, dtype=torch.bfloat16)}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    assert torch.equal(state["w"], torch.arange(8.0 * world).reshape(world * 2, 4))
    assert torch.equal(state["b"], torch.arange(6, dtype=torch.bfloat16))


def test_metadata_only_readers_and_ranges(tmp_path):
    ckpt = tmp_path / "ckpt"
    dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2, 3), (0, 0, 1)),
             "o": ShardedObject("obj", [1, 2], (2,), (1,))}, ckpt, validate_access_integrity=False)
    meta = dc.load_sharded_metadata(ckpt)
    assert meta["a"].global_shape == (2, 3) and meta["a"].data is None
    assert meta["obj/shard_1_2"].global_offset == (1,)
    assert isinstance(get_default_load_sharded_strategy(ckpt), TorchDistLoadShardedStrategy)


def test_unsafe_object_needs_opt_in(tmp_path):
    ckpt = tmp_path / "ckpt"
    dc.save({"o": ShardedObject("o", _Custom(3), (1,), (0,))}, ckpt)
    with pytest.raises(CheckpointingException, match="allow_pickle"):
        dc.load({"o": ShardedObject("o", None, (1,), (0,))}, ckpt)
    loaded = dc.load({"o": ShardedObject("o", None, (1,), (0,))}, ckpt,
                     sharded_strategy=TorchDistLoadShardedStrategy(allow_pickle=True))
    assert loaded["o"].value == 3


class _Custom:
    def __init__(self, value):
        self.value = value


def test_mcore_planners_with_plain_dcp(tmp_path):
    from dist_checkpointing.strategies.torch import MCoreLoadPlanner, MCoreSavePlanner

    ckpt = tmp_path / "dcp"
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    dcp.save(state, checkpoint_id=str(ckpt), planner=MCoreSavePlanner(nd_flattened_global_shapes={"w": (6,)}),
             no_dist=True)
    from dist_checkpointing.strategies.torch import read_metadata

    assert read_metadata(ckpt).mcore_data == {"w": {"nd_reformulated_orig_global_shape": (6,)}}
    good = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))
    target = {"w": torch.zeros(2, 3)}
    dcp.load(target, checkpoint_id=str(ckpt), planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=(good,)),
             no_dist=True)
    assert torch.equal(target["w"], state["w"])
    bad = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3))
    # DCP wraps planner errors in its own CheckpointException, which carries ours
    with pytest.raises(BaseException) as excinfo:  # DCP's CheckpointException is a BaseException
        dcp.load({"w": torch.zeros(4, 3)}, checkpoint_id=str(ckpt),
                 planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=(bad,)), no_dist=True)
    failures = getattr(excinfo.value, "failures", {0: excinfo.value})
    assert any("Global shape mismatch for key 'w'" in str(f) for f in failures.values())


def _dcp_bridge(rank, world, plain_dir, ours_dir):
    from dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        MCoreSavePlanner,
        TorchDistLoadShardedStrategy,
        mcore_to_pyt_state_dict,
    )

    full = torch.arange(4.0 * world * 3).reshape(3, 4 * world)
    sd = {"layers": [ShardedTensor.from_rank_offsets("w", full[i, rank * 4:(rank + 1) * 4].clone(), (0, i, 3),
                                                     (1, rank, world), prepend_axis_num=1) for i in range(3)],
          "norm": ShardedTensor.from_rank_offsets("norm", torch.ones(5), replica_id=rank),
          "o": ShardedObject("o", {"r": rank}, (world,), (rank,))}
    # our state through plain DCP save, read back by our loader
    dcp.save(mcore_to_pyt_state_dict(sd), checkpoint_id=plain_dir, planner=MCoreSavePlanner())
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4 * world)), "o": ShardedObject("o", None, (world,), (0,))}
    loaded = TorchDistLoadShardedStrategy().load_local(request, plain_dir)
    assert torch.equal(loaded["w"], full) and loaded["o"] == {"r": 0}
    # our checkpoint read by plain DCP into a converted request at another layout
    dc.save(sd, ours_dir)
    cols = 4 * world // (2 if world > 1 else 1)
    col_rank = rank % 2 if world > 1 else 0
    req = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, cols), (1, col_rank, 4 * world // cols),
                                                replica_id=rank // 2)}
    req["o"] = ShardedObject("o", None, (world,), ((rank + 1) % world,))
    target = req["w"].data
    pyt = mcore_to_pyt_state_dict(req, is_loading=True)
    dcp.load(pyt, checkpoint_id=ours_dir, planner=MCoreLoadPlanner())
    assert torch.equal(target, full[:, col_rank * cols:(col_rank + 1) * cols])
    assert pyt[req["o"].unique_key] == {"r": (rank + 1) % world}
    return True


def test_mcore_to_pyt_state_dict_with_plain_dcp(pool, tmp_path):
    assert all(pool.run(_dcp_bridge, str(tmp_path / "plain"), str(tmp_path / "ours")))


def test_torch_sharded_tensor_bridge_needs_process_group():
    from dist_checkpointing.strategies.torch import sharded_tensor_to_torch_sharded_tensor

    with pytest.raises(CheckpointingException, match="process group"):
        sharded_tensor_to_torch_sharded_tensor([ShardedTensor.from_rank_offsets("w", torch.ones(2))])


def _blob_crcs(ckpt: Path) -> dict:
    """The zip CRC32 of every record of every tensor blob in ``ckpt``, by item."""
    import io
    import zipfile

    from dist_checkpointing.strategies.torch import read_metadata

    crcs = {}
    for index, info in read_metadata(ckpt).storage_data.items():
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            crcs[index.fqn] = {i.filename.split("/", 1)[1]: i.CRC for i in z.infolist()}
    return crcs


def test_writer_threads_skip_the_zip_crc_and_restore_the_switch(tmp_path):
    """Every writer thread skips torch.save's zip CRC32 (recent torch keeps that switch per
    thread: turning it off on the calling thread alone left the CRC on in the writer
    threads), and the caller's setting is back afterwards, also for a caller that turned
    the CRC off itself."""
    from torch.serialization import get_crc32_options, set_crc32_options

    sd = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.arange(1000.0) + i) for i in range(4)}
    ckpt = tmp_path / "ckpt"
    dc.save(sd, ckpt, sharded_strategy=TorchDistSaveShardedStrategy(thread_count=2),
            validate_access_integrity=False)
    assert len(list(ckpt.glob("*.distcp"))) == 2, "two writer threads, two files"
    crcs = _blob_crcs(ckpt)
    assert set(crcs) == set(sd)
    for key, records in crcs.items():
        data = [crc for name, crc in records.items() if name.startswith("data/")]
        assert data == [0], (key, records)
    assert get_crc32_options() is True
    try:
        set_crc32_options(False)
        dc.save(sd, tmp_path / "again", validate_access_integrity=False)
        assert get_crc32_options() is False
    finally:
        set_crc32_options(True)


def test_zip_crc_switch_is_restored_per_caller():
    """Callers on several threads, in and out of order: each ends with its own setting."""
    import threading

    from torch.serialization import get_crc32_options, set_crc32_options

    from dist_checkpointing.storage.zip_crc import zip_crc_disabled

    inside, release, seen = threading.Barrier(3), threading.Event(), []

    def caller(hold: bool) -> None:
        with zip_crc_disabled():
            seen.append(get_crc32_options())
            inside.wait()
            if hold:
                release.wait()
        if hold:  # the last to leave (an earlier one may still see a process-wide switch off)
            seen.append(("after", get_crc32_options()))

    threads = [threading.Thread(target=caller, args=(hold,)) for hold in (True, False)]
    for t in threads:
        t.start()
    with zip_crc_disabled():
        with zip_crc_disabled():
            assert get_crc32_options() is False
        assert get_crc32_options() is False
        inside.wait()
        threads[1].join()  # the second caller left before the first
    release.set()
    threads[0].join()
    assert seen == [False, False, ("after", True)], seen
    assert get_crc32_options() is True
    set_crc32_options(True)


def test_zip_crc_switch_kept_process_wide(monkeypatch):
    """With a torch that keeps the CRC switch process-wide (older versions), the switch is
    off while any writer is inside and comes back when the last one leaves, in any order."""
    import threading

    from dist_checkpointing.storage import zip_crc

    switch = {"on": True}
    monkeypatch.setattr(zip_crc, "get_crc32_options", lambda: switch["on"])
    monkeypatch.setattr(zip_crc, "set_crc32_options", lambda on: switch.__setitem__("on", on))
    monkeypatch.setattr(zip_crc, "_crc_switch_per_thread", None)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first() -> None:
        with zip_crc.zip_crc_disabled():
            first_in.set()
            second_in.wait()
        first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait()
    with zip_crc.zip_crc_disabled():
        second_in.set()
        first_out.wait()  # the first writer left while this one is still inside
        seen.append(switch["on"])
    thread.join()
    seen.append(switch["on"])
    assert zip_crc._crc_switch_per_thread is False, "a fresh thread saw the switch off: process-wide"
    assert seen == [False, True]


_FRESH_REGISTRY = """
from dist_checkpointing.strategies.registry import (StrategyAction, default_strategies, get_default_strategy,
                                                    register_default_strategy)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

assert ("torch_dist", 1) not in default_strategies["load_sharded"], "registered at import"
first = get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1)
assert type(first) is TorchDistLoadShardedStrategy
assert get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1) is first, "created once"
mine = TorchDistLoadShardedStrategy(thread_count=1)
register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, mine)
assert get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1) is mine, "a user registration wins"
print("ok")
"""


def test_builtin_strategies_created_on_first_lookup_and_overridable():
    # in a new process (launch.py: the library imported, nothing looked up yet)
    out = launch.run(["-c", _FRESH_REGISTRY], env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                     timeout=slack(120))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_read_compatibility_is_declared_as_data():
    from dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    for strategy, backend in ((TorchDistLoadShardedStrategy(), "torch_dist"), (TorchCommonLoadStrategy(), "torch")):
        assert strategy.supported_backends == (backend,) and strategy.supported_versions == (1,)
        strategy.check_backend_compatibility(backend)
        strategy.check_version_compatibility(1)
        with pytest.raises(CheckpointingException, match=f"{type(strategy).__name__} cannot read backend 'other'"):
            strategy.check_backend_compatibility("other")
        with pytest.raises(CheckpointingException, match="cannot read version 2"):
            strategy.check_version_compatibility(2)


class _WholeTensorLoadDescribed(_WholeTensorLoad):
    """The toy backend's loader, describing its tensors."""

    supported_backends = ("describedbackend",)

    def load_tensors_metadata(self, checkpoint_dir):
        return {p.stem: ShardedTensor.from_rank_offsets(p.stem, torch.load(p, weights_only=True))
                for p in Path(checkpoint_dir).glob("*.pt") if p.name != "common.pt"}


def test_tools_ask_the_strategy_of_another_backend(tmp_path):
    from dist_checkpointing.tools import inspect_checkpoint, validate_checkpoint

    register_default_strategy(StrategyAction.SAVE_SHARDED, "describedbackend", 1, _WholeTensorSave("describedbackend", 1))
    register_default_strategy(StrategyAction.LOAD_SHARDED, "describedbackend", 1, _WholeTensorLoadDescribed())
    ckpt = tmp_path / "ckpt"
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3)), "step": 3}, ckpt,
            sharded_strategy=("describedbackend", 1))
    info = inspect_checkpoint(ckpt)
    assert info.sharded_backend == "describedbackend" and info.common_keys == ["step"] and info.objects == {}
    assert [(t.key, t.shape, t.dtype, t.chunks, t.nbytes, t.flattened) for t in info.tensors] == [
        ("w", (2, 3), "torch.float32", 0, 24, False)]
    report = validate_checkpoint(ckpt)
    assert not report.ok and "cannot be validated by this tool" in report.problems[0]
    with pytest.raises(CheckpointingException, match="_WholeTensorLoadDescribed cannot read backend 'torch_dist'"):
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, _torch_dist_checkpoint(tmp_path / "td"),
                sharded_strategy=_WholeTensorLoadDescribed())


def _torch_dist_checkpoint(ckpt: Path) -> Path:
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, ckpt)
    return ckpt


def test_strategies_have_no_import_cycle():
    """No module of the package imports, directly or through others, a module that
    imports it back (imports inside functions included)."""
    import ast

    root = Path(dc.__file__).resolve().parent
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    state: dict = {}

    def visit(module, path):
        state[module] = "open"
        for target in graph[module]:
            assert state.get(target) != "open", f"import cycle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_files_of_small_records_are_written_by_one_thread(tmp_path, monkeypatch):
    """A save's files of small records are written one after another on one thread; files
    of large records each on its own (two threads taking turns for the GIL record by record
    made 4,800 records of 8 KiB in two files 2.6x slower than one thread)."""
    import threading

    from dist_checkpointing.strategies.torch_dist import records
    from dist_checkpointing.strategies.torch_dist import writing

    def save_and_watch(state, name):
        seen = {}
        write = writing.write_records
        monkeypatch.setattr(writing, "write_records", lambda storage, fname, *a, **k:
                            seen.setdefault(fname, threading.get_ident()) and write(storage, fname, *a, **k))
        dc.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}, tmp_path / name,
                TorchDistSaveShardedStrategy(thread_count=2))
        monkeypatch.setattr(writing, "write_records", write)
        out = dc.load({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in state.items()},
                      tmp_path / name)
        assert all(torch.equal(out[k], v) for k, v in state.items())
        return seen

    small = save_and_watch({f"s{i}": torch.randn(64) for i in range(200)}, "small")
    assert len(small) == 2 and len(set(small.values())) == 1, small
    large = save_and_watch({f"l{i}": torch.randn(records.SMALL_RECORD_BYTES // 2) for i in range(4)}, "large")
    assert len(large) == 2 and len(set(large.values())) == 2, large
    mixed = save_and_watch({"big": torch.randn(records.SMALL_RECORD_BYTES), **{f"s{i}": torch.randn(8) for i in range(3)}},
                           "mixed")
    assert len(mixed) == 2 and len(set(mixed.values())) == 2, mixed  # the big file has a thread of its own


def test_a_run_of_small_items_is_read_by_one_thread(tmp_path, monkeypatch):
    """Small items are read by one thread, larger ones in runs of at least BATCH_MIN_BYTES
    (threads taking turns for the GIL item by item made many small tensors load 3.3x slower)."""
    import threading

    from dist_checkpointing.strategies.torch_dist import load as load_mod
    from dist_checkpointing.strategies.torch_dist.reader import Reader

    state = {f"s{i}": torch.randn(64 + i) for i in range(300)}
    dc.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}, tmp_path / "c")
    threads = []
    read = Reader.read_tensor
    monkeypatch.setattr(Reader, "read_tensor", lambda self, r: threads.append(threading.get_ident()) or read(self, r))
    request = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in state.items()}
    out = dc.load(request, tmp_path / "c", TorchDistLoadShardedStrategy(thread_count=4))
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert len(threads) == 300 and len(set(threads)) == 1

    # runs: the small items together, the others in file order in runs of about a quarter
    # of a thread's share, at least BATCH_MIN_BYTES
    class Arg:
        def __init__(self, n):
            self.n = n

    monkeypatch.setattr(load_mod, "read_nbytes", lambda arg: arg.n)
    monkeypatch.setattr(load_mod, "SMALL_ITEM_BYTES", 5)
    monkeypatch.setattr(load_mod, "BATCH_MIN_BYTES", 10)
    tasks = [(None, Arg(n)) for n in [5, 1, 5, 5, 100, 1, 2, 30, 30, 6]]
    runs = load_mod._batches(tasks, 2)  # large: 181 bytes, target max(10, 181 // 8 = 22)
    assert [[a.n for _, a in run] for run in runs] == [[1, 1, 2], [5, 5, 5, 100], [30], [30], [6]]
    assert load_mod._batches(tasks, 1) == [tasks]
    monkeypatch.setattr(load_mod, "BATCH_MIN_BYTES", 1000)
    assert [[a.n for _, a in run] for run in load_mod._batches(tasks, 4)] == [[1, 1, 2], [5, 5, 5, 100, 30, 30, 6]]
    assert load_mod._batches([], 4) == [[]]
