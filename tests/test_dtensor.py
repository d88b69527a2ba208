"""DTensor leaves (FSDP2 / torchtitan state) on a CPU device mesh over gloo: saved as
sharded tensors, loaded into any layout — other placements, other meshes, other world
sizes, Megatron-style ShardedTensors — and the reverse; values exact."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

from .conftest import get_pool

pytest.importorskip("torch.distributed.tensor")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

_MESHES: dict = {}


def _mesh(shape):
    """The CPU device mesh of ``shape`` over the pool's ranks (one per shape and process)."""
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def _full(key: str, shape) -> torch.Tensor:
    """The global value of ``key``: distinct, exact values."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape) + 1000 * len(key)


# Global shapes: 5 and 7 rows do not split evenly over 2 or 4 ranks (the last rank's shard is
# short or empty); "stack" is a list.
SHAPES = {"s0": (8, 3), "s1": (3, 8), "rep": (4, 2), "uneven": (5, 3), "stack.0": (2, 3), "stack.1": (3,),
          "m2.rs": (6, 4), "m2.ss": (6, 5), "m2.same": (7, 2), "m2.strided": (8, 2)}

# key -> (mesh shape, placements) per layout; the 2-D keys use a (2, 2) mesh at world 4.
LAYOUTS = {
    "a4": {"s0": ((4,), [Shard(0)]), "s1": ((4,), [Shard(1)]), "rep": ((4,), [Replicate()]),
           "uneven": ((4,), [Shard(0)]), "stack.0": ((4,), [Shard(0)]), "stack.1": ((2, 2), [Shard(0), Shard(0)]),
           "m2.rs": ((2, 2), [Replicate(), Shard(0)]),
           "m2.ss": ((2, 2), [Shard(0), Shard(1)]), "m2.same": ((2, 2), [Shard(0), Shard(0)]),
           "m2.strided": ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)])},
    "b4": {"s0": ((2, 2), [Shard(1), Replicate()]), "s1": ((4,), [Shard(0)]), "rep": ((2, 2), [Shard(0), Shard(1)]),
           "uneven": ((2, 2), [Shard(1), Shard(0)]), "stack.0": ((4,), [Shard(1)]), "stack.1": ((4,), [Shard(0)]),
           "m2.rs": ((4,), [Shard(1)]),
           "m2.ss": ((2, 2), [Shard(1), Shard(0)]), "m2.same": ((4,), [Replicate()]),
           "m2.strided": ((2, 2), [Shard(0), Shard(0)])},
    "c2": {"s0": ((2,), [Shard(1)]), "s1": ((2,), [Replicate()]), "rep": ((2,), [Shard(0)]),
           "uneven": ((2,), [Shard(0)]), "stack.0": ((2,), [Shard(0)]), "stack.1": ((2,), [Replicate()]),
           "m2.rs": ((2,), [Shard(0)]),
           "m2.ss": ((2,), [Shard(1)]), "m2.same": ((2,), [Shard(0)]), "m2.strided": ((2,), [Shard(1)])},
}


def _nest(flat: dict) -> dict:
    """``{"m2.rs": v, "stack.0": w}`` -> ``{"m2": {"rs": v}, "stack": [w]}``: the dotted path
    is the checkpoint key."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    out["stack"] = [out["stack"][i] for i in sorted(out["stack"])]
    return out


def _get(tree, key: str):
    for p in key.split("."):
        tree = tree[int(p)] if isinstance(tree, list) else tree[p]
    return tree


def _dtensors(layout: str, fill: bool) -> dict:
    flat = {}
    for key, (mesh_shape, placements) in LAYOUTS[layout].items():
        full = _full(key, SHAPES[key]) if fill else torch.zeros(SHAPES[key])
        flat[key] = distribute_tensor(full, _mesh(mesh_shape), placements, src_data_rank=None)
    return _nest(flat)


def _save_layout(rank, world, ckpt, layout, fully_parallel=False):
    sd = _dtensors(layout, fill=True)
    sd["step"] = 7
    dc.save(sd, ckpt, sharded_strategy=FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
            if fully_parallel else None)


def _load_layout(rank, world, ckpt, layout, fully_parallel=False):
    request = _dtensors(layout, fill=False)
    before = {key: _get(request, key) for key in SHAPES}
    loaded = dc.load(request, ckpt, sharded_strategy=FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
                     if fully_parallel else None)
    assert loaded["step"] == 7
    for key, (mesh_shape, placements) in LAYOUTS[layout].items():
        node = _get(loaded, key)
        assert isinstance(node, DTensor) and tuple(node.placements) == tuple(placements), key
        assert node is before[key], key  # the request's own DTensor, filled in place
        expected = distribute_tensor(_full(key, SHAPES[key]), _mesh(mesh_shape), placements, src_data_rank=None)
        assert torch.equal(node.to_local(), expected.to_local()), (key, rank)
    return True


def test_dtensor_layouts_roundtrip_and_reshard(tmp_path):
    """Saved fully parallel at world 4 (empty shards included), loaded in the same layout,
    in another at world 4 (fully parallel) and at world 2; saved at world 2, loaded at 4."""
    pool4, pool2 = get_pool(4), get_pool(2)
    ckpt = str(tmp_path / "a4")
    pool4.run(_save_layout, ckpt, "a4", True)
    plain = dc.load_plain_tensors(ckpt)
    assert set(plain) == set(SHAPES)
    for key, shape in SHAPES.items():
        assert torch.equal(plain[key], _full(key, shape)), key
    assert all(pool4.run(_load_layout, ckpt, "a4"))
    assert all(pool4.run(_load_layout, ckpt, "b4", True))
    assert all(pool2.run(_load_layout, ckpt, "c2"))
    ckpt2 = str(tmp_path / "c2")
    pool2.run(_save_layout, ckpt2, "c2")
    assert all(pool4.run(_load_layout, ckpt2, "b4"))


# A model trained with FSDP2 (``fully_shard``: every parameter a DTensor Shard(0) over 4
# ranks, uneven and empty shards included) resumes under Megatron-style TP=2 (ShardedTensors:
# column-parallel fc1 split on dim 0, row-parallel fc2 split on dim 1, fc2's bias replicated
# on both TP ranks), and the reverse.
TP_AXIS = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(OrderedDict(fc1=torch.nn.Linear(6, 10), act=torch.nn.ReLU(), fc2=torch.nn.Linear(10, 6)))


def _fsdp_model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    fully_shard(model, mesh=_mesh((4,)))
    return model


def _megatron_state(rank: int, seed: int, fill: bool) -> dict:
    sd = {}
    for key, full in _model(seed).state_dict().items():
        full = full if fill else torch.zeros_like(full)
        name = f"model.{key}"  # the DTensors' dotted path in {"model": model.state_dict()}
        axis = TP_AXIS[key]
        if axis is None:
            sd[key] = ShardedTensor.from_rank_offsets(name, full.clone(), replica_id=rank)
        else:
            sd[key] = ShardedTensor.from_rank_offsets(name, full.chunk(2, axis)[rank].clone(), (axis, rank, 2))
    return {"model": sd}


def _save_fsdp(rank, world, ckpt):
    dc.save({"model": _fsdp_model(seed=1).state_dict()}, ckpt)


def _load_fsdp(rank, world, ckpt, seed):
    model = _fsdp_model(seed=3)
    loaded = dc.load({"model": model.state_dict()}, ckpt)
    model.load_state_dict(loaded["model"])
    x = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    return torch.equal(model(x), _model(seed)(x))


def _save_megatron(rank, world, ckpt):
    dc.save(_megatron_state(rank, seed=2, fill=True), ckpt)


def _load_megatron(rank, world, ckpt, seed):
    loaded = dc.load(_megatron_state(rank, seed=3, fill=False), ckpt)
    expected = _megatron_state(rank, seed, fill=True)["model"]
    return all(torch.equal(loaded["model"][key], expected[key].data) for key in TP_AXIS)


def test_fsdp2_model_resumes_under_megatron_tp_and_back(tmp_path):
    pool4, pool2 = get_pool(4), get_pool(2)
    pool4.run(_save_fsdp, str(tmp_path / "fsdp"))
    assert all(pool2.run(_load_megatron, str(tmp_path / "fsdp"), 1))
    assert all(pool4.run(_load_fsdp, str(tmp_path / "fsdp"), 1))
    pool2.run(_save_megatron, str(tmp_path / "tp"))
    assert all(pool4.run(_load_fsdp, str(tmp_path / "tp"), 2))


def _save_partial(rank, world, ckpt):
    dt = DTensor.from_local(torch.ones(2, 2), _mesh((world,)), [Partial()], run_check=False)
    dc.save({"layers": [{"weight": dt}], "step": 1}, ckpt)


def _save_scattered(rank, world, ckpt):
    # Shard(0) then _StridedShard(0): each rank holds rows 0,2 / 1,3 / ... of its half.
    dt = distribute_tensor(torch.zeros(8, 2), _mesh((2, world // 2)), [Shard(0), _StridedShard(0, split_factor=2)],
                           src_data_rank=None)
    dc.save({"scattered": dt}, ckpt)


def _save_in_tuple(rank, world, ckpt):
    dt = distribute_tensor(torch.zeros(4), _mesh((world,)), [Shard(0)], src_data_rank=None)
    dc.save({"pair": (dt, 1)}, ckpt)


def test_unexpressible_dtensors_refused_on_every_rank(tmp_path):
    pool = get_pool(4)
    excs = pool.run_expect_error(_save_partial, str(tmp_path / "partial"))
    assert all(isinstance(e, CheckpointingException) and "'layers.0.weight'" in str(e) and "Partial" in str(e)
               for e in excs), excs
    excs = pool.run_expect_error(_save_scattered, str(tmp_path / "scattered"))
    assert all(isinstance(e, CheckpointingException) and "'scattered'" in str(e) and "scattered along dim 0" in str(e)
               for e in excs), excs
    excs = pool.run_expect_error(_save_in_tuple, str(tmp_path / "tuple"))
    assert all(isinstance(e, CheckpointingException) and "DTensor" in str(e) and "tuple" in str(e)
               for e in excs), excs
    assert not any((tmp_path / name / "metadata.json").exists() for name in ("partial", "scattered", "tuple"))
