"""Checkpoints written by Megatron-Core (tests/fixtures) load under other layouts."""

from __future__ import annotations

import shutil

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor

from .conftest import FIXTURES, get_pool

NON_FLAT = [
    "mcore_v0_15/gpt_tp2_dp2",
    "mcore_v0_15/gpt_tp2_dp2_fpsave",
    "mcore_v0_15/tp1_single",
    "mcore_v0_19/gpt_tp2_dp2",
    "mcore_v0_19/gpt_tp2_dp2_fpsave",
    "mcore_v0_19/tp1_single",
]
LAYOUTS = ["whole", "split_first", "split_last"]

pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason="tests/fixtures not present")


def _expected(name: str) -> dict:
    return torch.load(FIXTURES / name / "expected.pt", weights_only=True)


def _request_chunk(key, full, rank, world, layout, prepend):
    """(ShardedTensor request, expected local tensor) for one rank under ``layout``."""
    shape = tuple(full.shape[prepend:])
    axis = None
    if layout == "split_first" and shape and shape[0] % world == 0:
        axis = 0
    elif layout == "split_last" and shape and shape[-1] % world == 0:
        axis = len(shape) - 1
    if axis is None:
        local = torch.zeros(shape, dtype=full.dtype)
        return local, [], lambda g: g
    n = shape[axis] // world
    local_shape = list(shape)
    local_shape[axis] = n
    local = torch.zeros(local_shape, dtype=full.dtype)
    return local, [(axis + prepend, rank, world)], lambda g: g.narrow(axis, rank * n, n)


def _load_fixture(rank, world, name, layout):
    exp = _expected(name)
    ckpt = FIXTURES / name / "checkpoint"
    request, expected = {}, {}
    for key, full in exp["tensors"].items():
        prepend = 1 if "linear_qkv" in key else 0
        if prepend:
            request[key], expected[key] = [], []
            for layer in range(full.shape[0]):
                local, offs, sel = _request_chunk(key, full, rank, world, layout, prepend)
                request[key].append(ShardedTensor.from_rank_offsets(
                    key, local, (0, layer, full.shape[0]), *offs, replica_id=0 if rank == 0 else rank,
                    prepend_axis_num=1))
                expected[key].append(sel(full[layer]))
        else:
            local, offs, sel = _request_chunk(key, full, rank, world, layout, 0)
            request[key] = ShardedTensor.from_rank_offsets(key, local, *offs, replica_id=rank)
            expected[key] = sel(full)
    objects = sorted(exp["objects"])
    if objects:
        wanted = objects[(rank + 1) % len(objects)]
        request["obj"] = ShardedObject.empty_from_unique_key(wanted, replica_id=rank)
        expected["obj"] = exp["objects"][wanted]
    before = {k: v for k, v in request.items() if not isinstance(v, (list, ShardedObject))}
    loaded = dc.load(request, ckpt)
    for key, value in expected.items():
        got = loaded[key]
        if isinstance(value, list):
            assert len(got) == len(value)
            for g, v in zip(got, value):
                assert g.dtype == v.dtype and torch.equal(g, v), key
        elif isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and torch.equal(got, value), key
            assert got is before[key].data, "load must fill the request's own tensor"
        else:
            assert got == value, key
    for key, value in exp["common"].items():
        assert loaded[key] == value
    return True


@pytest.mark.parametrize("name", NON_FLAT)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fixture_loads_at_world4(name, layout):
    assert all(get_pool(4).run(_load_fixture, name, layout))


@pytest.mark.parametrize("name", ["mcore_v0_15/gpt_tp2_dp2", "mcore_v0_19/tp1_single"])
@pytest.mark.parametrize("world", [1, 2])
def test_fixture_loads_at_other_worlds(name, world):
    assert all(get_pool(world).run(_load_fixture, name, "split_last"))


@pytest.mark.parametrize("name", NON_FLAT + ["mcore_v0_15/distopt_flat"])
def test_offline_readers_on_fixture(name):
    exp = _expected(name)
    ckpt = FIXTURES / name / "checkpoint"
    assert dc.check_is_distributed_checkpoint(ckpt)
    common = dc.load_common_state_dict(ckpt)
    assert common == exp["common"]
    assert dc.load_content_metadata(ckpt) == exp["common"]["content_metadata"]
    if "flat" in name:
        return  # flattened keys arrive with flattened_range support
    meta = dc.load_tensors_metadata(ckpt)
    assert set(meta) == set(exp["tensors"])
    for key, full in exp["tensors"].items():
        assert meta[key].global_shape == tuple(full.shape) and meta[key].dtype == full.dtype
    plain = dc.load_plain_tensors(ckpt)
    assert set(plain) == set(exp["tensors"])
    for key, full in exp["tensors"].items():
        assert torch.equal(plain[key], full), key
    sharded_meta = dc.load_sharded_metadata(ckpt)
    for unique_key in exp["objects"]:
        assert isinstance(sharded_meta[unique_key], ShardedObject)


def test_fixture_resave_roundtrip(tmp_path):
    """What we load from Megatron-Core's checkpoint, we save and load back identically."""
    ckpt = FIXTURES / "mcore_v0_15/tp1_single/checkpoint"
    plain = dc.load_plain_tensors(ckpt)
    sd = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in plain.items()}
    sd.update(dc.load_common_state_dict(ckpt))
    dc.save(sd, tmp_path / "copy")
    again = dc.load_plain_tensors(tmp_path / "copy")
    for k, v in plain.items():
        assert torch.equal(again[k], v)
    assert dc.load_common_state_dict(tmp_path / "copy") == dc.load_common_state_dict(ckpt)


def test_remove_sharded_tensors_on_copy_of_fixture(tmp_path):
    src = FIXTURES / "mcore_v0_15/gpt_tp2_dp2/checkpoint"
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    dc.remove_sharded_tensors(dst, "decoder.layers")
    plain = dc.load_plain_tensors(dst)
    assert set(plain) == {"embedding.weight", "decoder.final_layernorm.weight"}
    assert torch.equal(plain["embedding.weight"], _expected("mcore_v0_15/gpt_tp2_dp2")["tensors"]["embedding.weight"])
