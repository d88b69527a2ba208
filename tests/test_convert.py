"""The way forward to Megatron-Core 0.19: saving in its layout
(``common_strategy=CommonStateObjectSaveStrategy()``) and ``convert_checkpoint`` /
``dist-ckpt convert`` (flattened keys rewritten whole, ``common.pt`` as the ``common_state``
object), checked with Megatron-Core 0.19's own loader and with ours.

Megatron-Core 0.19 is installed by the test session into ``.ci/mcore19_site``
(``MCORE19_SITE``, tests/peers.py), never into the library's environment; one subprocess
with it on its PYTHONPATH loads every checkpoint of this module (tests/megatron19_peer_load.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main as cli_main
from dist_checkpointing.tools.convert import convert_checkpoint
from dist_checkpointing.strategies import CommonStateObjectSaveStrategy
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.torch import original_global_shape, read_metadata

from .conftest import FIXTURES, get_pool
from .helpers import slack
from .peers import require

DISTOPT_015 = FIXTURES / "mcore_v0_15" / "distopt_flat"
ZARR_015 = FIXTURES / "mcore_v0_15" / "zarr_tp2_dp2"  # Megatron-Core 0.15's zarr backend
COMMON = {"step": 9, "args": {"lr": 0.1, "name": "tiny"}, "content_metadata": {"by": "dist_checkpointing"}}


def _full(world):
    rows = 4 * world
    return {"w": torch.arange(rows * 8.0).reshape(rows, 8),
            "q": torch.arange(3 * 4 * 2, dtype=torch.bfloat16).reshape(3, 4, 2),
            "opt": torch.arange(rows * 8.0).reshape(rows, 8) + 0.5}


def _state(rank, world, flat_opt):
    """TP=world along axis 0; ``opt`` as distributed-optimizer flat slices of each TP chunk."""
    full, rows = _full(world), 4
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", full["w"][rank * rows:(rank + 1) * rows].clone(), (0, rank, world)),
        "q": [ShardedTensor.from_rank_offsets("q", full["q"][i].clone(), (0, i, 3), replica_id=rank, prepend_axis_num=1)
              for i in range(3)],
        "o": ShardedObject("o", {"piece": rank}, (world,), (rank,)),
        "step": COMMON["step"], "args": dict(COMMON["args"]),
    }
    chunk = full["opt"][rank * rows:(rank + 1) * rows]
    if flat_opt:
        sd["opt"] = [ShardedTensor.from_rank_offsets_flat("opt", chunk.flatten()[a:b].clone(), (rows, 8), (0, rank, world),
                                                          replica_id=0, flattened_range=slice(a, b))
                     for a, b in ((0, 5), (5, rows * 8))]
    else:
        sd["opt"] = ShardedTensor.from_rank_offsets("opt", chunk.clone(), (0, rank, world))
    return sd


def _save(rank, world, ckpt, flat_opt, layout19, async_save=False):
    kwargs = {"common_strategy": CommonStateObjectSaveStrategy()} if layout19 else {}
    sd = _state(rank, world, flat_opt)
    if not async_save:
        dc.save(sd, ckpt, content_metadata=COMMON["content_metadata"], **kwargs)
        return
    queue = AsyncCallsQueue()
    try:
        request = dc.save(sd, ckpt, content_metadata=COMMON["content_metadata"], async_sharded_save=True, **kwargs)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()


def _expected_objects(world):
    return {f"o/shard_{r}_{world}": {"piece": r} for r in range(world)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints saved at TP2 (world 2): ``ours19`` (0.19 layout), ``ours19_async`` (the
    same, saved asynchronously), ``flat`` (default layout, flattened ``opt``) and its
    conversion ``converted``; plus Megatron-Core 0.15's own distributed-optimizer fixture
    converted (``mcore015_converted``) when the fixtures are there."""
    root = tmp_path_factory.mktemp("convert")
    paths = {name: root / name for name in ("ours19", "ours19_async", "flat", "converted", "mcore015_converted",
                                            "zarr_converted")}
    pool = get_pool(2)
    pool.run(_save, str(paths["ours19"]), False, True)
    pool.run(_save, str(paths["ours19_async"]), False, True, True)
    pool.run(_save, str(paths["flat"]), True, False)
    convert_checkpoint(paths["flat"], paths["converted"])
    if DISTOPT_015.is_dir():
        convert_checkpoint(DISTOPT_015 / "checkpoint", paths["mcore015_converted"])
    if ZARR_015.is_dir():
        convert_checkpoint(ZARR_015 / "checkpoint", paths["zarr_converted"])
    return paths


@pytest.fixture(scope="module")
def peer(ckpts, tmp_path_factory):
    """Megatron-Core 0.19 loads every checkpoint of :func:`ckpts` at TP4 (one subprocess):
    returns its stdout and stderr."""
    site = require("MCORE19_SITE")
    ours = {"tp": 4, "tensors": _full(2), "objects": _expected_objects(2), "common": COMMON}
    spec = [dict(ours, dir=str(ckpts[name])) for name in ("ours19", "ours19_async", "converted")]
    if DISTOPT_015.is_dir():
        exp = torch.load(DISTOPT_015 / "expected.pt", weights_only=True)
        spec.append({"dir": str(ckpts["mcore015_converted"]), "tp": 4, "tensors": exp["tensors"],
                     "objects": exp["objects"], "common": exp["common"]})
    if ZARR_015.is_dir():
        exp = torch.load(ZARR_015 / "expected.pt", weights_only=False)
        spec.append({"dir": str(ckpts["zarr_converted"]), "tp": 4, "tensors": exp["tensors"],
                     "objects": exp["objects"], "common": exp["common"]})
    spec_file = tmp_path_factory.mktemp("peer") / "spec.pt"
    torch.save(spec, spec_file)
    env = {**os.environ, "PYTHONPATH": site, "MASTER_PORT": str(29500 + os.getpid() % 500)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron19_peer_load.py")), str(spec_file)],
                          env=env, capture_output=True, text=True, timeout=slack(300))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, proc.stderr


@pytest.mark.parametrize("name", ["ours19", "ours19_async", "converted", "mcore015_converted", "zarr_converted"])
def test_megatron_core_019_loads_exactly(peer, ckpts, name):
    if not {"mcore015_converted": DISTOPT_015, "zarr_converted": ZARR_015}.get(name, FIXTURES).is_dir():
        pytest.skip(f"Megatron-Core fixtures not found in {FIXTURES}")
    stdout, stderr = peer
    assert f"OK {ckpts[name]}\n" in stdout, stdout + stderr[-4000:]
    assert "deprecated" not in stderr  # Megatron-Core's legacy common.pt path was not taken


def test_layout_on_disk(ckpts):
    """Exactly Megatron-Core 0.19's layout: its metadata.json, no common.pt, the common
    state object, and (converted) every tensor whole, none reformulated."""
    mcore19 = FIXTURES / "mcore_v0_19" / "tp1_single" / "checkpoint" / "metadata.json"
    for name in ("ours19", "ours19_async", "converted"):
        ckpt = ckpts[name]
        assert json.loads((ckpt / "metadata.json").read_text()) == {"sharded_backend": "torch_dist",
                                                                     "sharded_backend_version": 1}
        if mcore19.is_file():
            assert json.loads((ckpt / "metadata.json").read_text()) == json.loads(mcore19.read_text())
        assert not (ckpt / "common.pt").exists()
        assert "common_state/shard_0_1" in read_metadata(ckpt).state_dict_metadata
    metadata = read_metadata(ckpts["converted"])
    assert original_global_shape(read_metadata(ckpts["flat"]), "opt") == (8, 8)
    for key in ("w", "q", "opt"):
        md = metadata.state_dict_metadata[key]
        assert original_global_shape(metadata, key) is None and len(md.chunks) == 1
        assert tuple(md.chunks[0].sizes) == tuple(md.size) == tuple(_full(2)[key].shape)


def _load_other_layout(rank, world, ckpt):
    """TP1 ``w`` (whole, a replica on every rank) and ``opt`` as flat slices of it."""
    full = _full(2)
    n = full["opt"].numel()
    a, b = rank * n // world, (rank + 1) * n // world
    request = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 8), replica_id=rank),
        "opt": ShardedTensor.from_rank_offsets_flat("opt", torch.zeros(b - a), (8, 8), replica_id=0,
                                                    flattened_range=slice(a, b)),
        "o": ShardedObject("o", None, (2,), (1 - rank,)),
    }
    out = dc.load(request, ckpt)
    assert torch.equal(out["w"], full["w"]) and torch.equal(out["opt"], full["opt"].flatten()[a:b])
    assert out["o"] == {"piece": 1 - rank} and out["step"] == 9 and out["args"] == COMMON["args"]
    assert dc.load_content_metadata(ckpt) == COMMON["content_metadata"]


@pytest.mark.parametrize("name", ["ours19", "converted"])
def test_our_loader_reads_them(ckpts, name):
    get_pool(2).run(_load_other_layout, str(ckpts[name]))
    plain = dc.load_plain_tensors(ckpts[name])
    assert set(plain) == {"w", "q", "opt"} and all(torch.equal(plain[k], v) for k, v in _full(2).items())
    assert dc.load_common_state_dict(ckpts[name]) == COMMON


def test_converts_megatron_015_distributed_optimizer_fixture(ckpts):
    if not DISTOPT_015.is_dir():
        pytest.skip(f"Megatron-Core fixtures not found in {FIXTURES}")
    exp = torch.load(DISTOPT_015 / "expected.pt", weights_only=True)
    plain = dc.load_plain_tensors(ckpts["mcore015_converted"])
    assert set(plain) == set(exp["tensors"]) and all(torch.equal(plain[k], v) for k, v in exp["tensors"].items())
    assert dc.load_common_state_dict(ckpts["mcore015_converted"]) == exp["common"]


def test_converts_megatron_015_zarr_fixture(ckpts):
    """A zarr checkpoint becomes torch_dist: every tensor, object and the common state."""
    if not ZARR_015.is_dir():
        pytest.skip(f"Megatron-Core fixtures not found in {FIXTURES}")
    exp = torch.load(ZARR_015 / "expected.pt", weights_only=False)
    assert json.loads((ckpts["zarr_converted"] / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    plain = dc.load_plain_tensors(ckpts["zarr_converted"])
    assert set(plain) == set(exp["tensors"]) and all(torch.equal(plain[k], v) for k, v in exp["tensors"].items())
    assert dc.load_common_state_dict(ckpts["zarr_converted"]) == exp["common"]
    objects = dc.load({k: ShardedObject.empty_from_unique_key(k) for k in exp["objects"]}, ckpts["zarr_converted"])
    assert {k: objects[k] for k in exp["objects"]} == exp["objects"]


_MEASURE = """
import sys
from dist_checkpointing.tools.convert import convert_checkpoint
def peak_rss():  # VmHWM: this process image's own peak (ru_maxrss keeps the forking parent's)
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
before = peak_rss()
result = convert_checkpoint(sys.argv[1], sys.argv[2])
print(result.nbytes, peak_rss() - before)
"""


def test_memory_stays_near_the_largest_tensor(tmp_path):
    """8 flattened tensors of 24 MiB (192 MiB): the converting process grows by about one
    tensor (plus the writer's 48 MiB of write buffers), not by the checkpoint."""
    n, count = 6 << 20, 8  # float32 elements per tensor
    sd = {f"t{i}": [ShardedTensor.from_rank_offsets_flat(f"t{i}", piece, (n // 1024, 1024), replica_id=0,
                                                         flattened_range=slice(a, a + piece.numel()))
                    for a, piece in ((0, torch.full((n // 2,), float(i))), (n // 2, torch.full((n // 2,), -float(i))))]
          for i in range(count)}
    dc.save(sd, tmp_path / "src")
    del sd
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "src"), str(tmp_path / "dst")],
                          env=env, capture_output=True, text=True, timeout=slack(120))
    assert proc.returncode == 0, proc.stderr[-4000:]
    total, growth = map(int, proc.stdout.split())
    print(f"convert of {total >> 20} MiB: peak RSS +{growth >> 20} MiB")
    largest = 4 * n
    assert total == count * largest
    assert growth < largest + (80 << 20), f"peak RSS grew by {growth >> 20} MiB (largest tensor {largest >> 20} MiB)"
    t3 = dc.load_plain_tensors(tmp_path / "dst")["t3"].flatten()
    assert torch.equal(t3, torch.cat([torch.full((n // 2,), 3.0), torch.full((n // 2,), -3.0)]))


# ----------------------------------------------------------------------------- bad input


def test_refuses_overlap_non_checkpoints_and_existing_output(ckpts, tmp_path):
    src = ckpts["flat"]
    before = sorted(p.name for p in src.iterdir())
    for dst in (src, src / "inside", src.parent):
        with pytest.raises(CheckpointingException, match="source"):
            convert_checkpoint(src, dst, force=True)
    assert sorted(p.name for p in src.iterdir()) == before
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "metadata.json").write_text("not json")
    for bad in (tmp_path / "empty", tmp_path / "junk", tmp_path / "missing"):
        with pytest.raises(CheckpointingException, match=str(bad)):
            convert_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointingException, match="already exists"):
        convert_checkpoint(src, ckpts["converted"])
    with pytest.raises(CheckpointingException, match="layout 'mcore-0.20'"):
        convert_checkpoint(src, tmp_path / "out", layout="mcore-0.20")


def test_refuses_damaged_common_state(tmp_path):
    _save(0, 1, str(tmp_path / "src"), True, False)
    common = tmp_path / "src" / "common.pt"
    common.write_bytes(common.read_bytes()[:-10])
    with pytest.raises(CheckpointingException, match="common.pt"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


def _save_reserved_key(rank, world, ckpt):
    sd = {"common_state": ShardedObject("common_state", 1, (1,), (0,), replica_id=rank)}
    dc.save(sd, ckpt, common_strategy=CommonStateObjectSaveStrategy())


def test_save_refuses_reserved_key(tmp_path):
    errors = get_pool(2).run_expect_error(_save_reserved_key, str(tmp_path / "c"))
    assert all(isinstance(e, CheckpointingException) and "'common_state'" in str(e) for e in errors)


def test_cli_convert(ckpts, tmp_path, capsys):
    assert cli_main(["convert", str(ckpts["flat"]), str(tmp_path / "out")]) == 0
    assert "3 tensors (1 were flattened) and 3 objects" in capsys.readouterr().out
    assert dc.load_common_state_dict(tmp_path / "out") == COMMON
    assert cli_main(["convert", str(ckpts["flat"]), str(tmp_path / "out")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["convert", str(ckpts["flat"]), str(tmp_path / "out"), "--force"]) == 0


def test_converting_a_019_layout_checkpoint_copies_its_common_state_object(ckpts, tmp_path):
    result = convert_checkpoint(ckpts["ours19"], tmp_path / "again")
    assert (result.tensors, result.flattened, result.objects) == (3, 0, 3)
    assert dc.load_common_state_dict(tmp_path / "again") == COMMON
    assert all(torch.equal(dc.load_plain_tensors(tmp_path / "again")[k], v) for k, v in _full(2).items())
