"""Save/load through real gloo process groups: layouts, in-place loading, bad input."""

from __future__ import annotations

import json

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.storage import storage_for

from .conftest import get_pool


def _global(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 + len(key)).to(dtype)


def _gpt_state(rank: int, world: int, tp: int, fill: bool = True) -> dict:
    """A small GPT-like sharded state for a TP x DP layout (zeros when ``fill`` is False)."""
    tp_rank, dp_rank = rank % tp, rank // tp

    def chunk(key, shape, axis, dtype=torch.float32, layer=None):
        full = _global(key, shape, dtype)
        if layer is not None:
            full = full[layer]
        n = full.shape[axis] // tp
        local = full.narrow(axis, tp_rank * n, n).clone()
        return local if fill else torch.zeros_like(local)

    layers = 3
    sd = {
        "embedding.weight": ShardedTensor.from_rank_offsets(
            "embedding.weight", chunk("embedding.weight", (32, 8), 0), (0, tp_rank, tp), replica_id=dp_rank),
        "layers": {
            "qkv": [
                ShardedTensor.from_rank_offsets(
                    "decoder.qkv", chunk("decoder.qkv", (layers, 24, 8), 0, layer=i), (0, i, layers),
                    (1, tp_rank, tp), replica_id=dp_rank, prepend_axis_num=1)
                for i in range(layers)
            ],
            "fc2": ShardedTensor.from_rank_offsets(
                "decoder.fc2", chunk("decoder.fc2", (8, 16), 1, torch.bfloat16), (1, tp_rank, tp),
                replica_id=dp_rank),
        },
        "final_norm": ShardedTensor.from_rank_offsets(
            "final_norm", _global("final_norm", (8,)) if fill else torch.zeros(8), replica_id=rank),
        "rng": ShardedObject("rng", {"rank": rank, "seed": 7 + rank} if fill else None, (1, world), (0, rank)),
        "iteration": 17,
        "args": {"lr": 0.5},
    }
    return sd


def _check_gpt(loaded: dict, rank: int, world: int, tp: int) -> None:
    expected = _gpt_state(rank, world, tp, fill=True)
    for path, get in [
        ("embedding.weight", lambda d: d["embedding.weight"]),
        ("fc2", lambda d: d["layers"]["fc2"]),
        ("final_norm", lambda d: d["final_norm"]),
    ]:
        exp = get(expected).data
        got = get(loaded)
        assert got.dtype == exp.dtype and torch.equal(got, exp), path
    for i, st in enumerate(expected["layers"]["qkv"]):
        assert torch.equal(loaded["layers"]["qkv"][i], st.data)
    assert loaded["rng"] == {"rank": rank, "seed": 7 + rank}
    assert loaded["iteration"] == 17 and loaded["args"] == {"lr": 0.5}


def _save_then_load(rank, world, ckpt, save_tp, load_tp):
    dc.save(_gpt_state(rank, world, save_tp), ckpt)
    request = _gpt_state(rank, world, load_tp, fill=False)
    targets = [request["embedding.weight"].data, request["layers"]["qkv"][0].data]
    loaded = dc.load(request, ckpt)
    assert loaded["embedding.weight"] is targets[0] and loaded["layers"]["qkv"][0] is targets[1]
    _check_gpt(loaded, rank, world, load_tp)
    return storage_for(ckpt).list()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_save_load_reshard_tp(world, ckpt_location):
    pool = get_pool(world)
    layouts = [(t, l) for t in (1, 2, 4) for l in (1, 2, 4) if t <= world and l <= world and world % t == 0 and world % l == 0]
    for save_tp, load_tp in layouts:
        files = pool.run(_save_then_load, ckpt_location(f"s{save_tp}_l{load_tp}"), save_tp, load_tp)[0]
        assert CONFIG_FNAME in files and ".metadata" in files and "common.pt" in files


def _no_mutation(rank, world, ckpt):
    built = []

    def build(key, data, replica_id, flattened_range):
        built.append(key)
        return {"a": ShardedTensor.from_rank_offsets(key + ".a", data[:2].clone(), replica_id=rank),
                "b": ShardedTensor.from_rank_offsets(key + ".b", data[2:].clone(), replica_id=rank)}

    def merge(loaded):
        return torch.cat([loaded["a"], loaded["b"]])

    data = torch.arange(5.0)
    factory = ShardedTensorFactory("fac", data, build, merge, replica_id=rank)
    nonpersistent = LocalNonpersistentObject({"local": rank})
    sd = {"f": factory, "np": nonpersistent, "x": 1, "nested": [ShardedObject("o", rank, (world,), (rank,))]}
    snapshot = dict(sd), list(sd["nested"])
    dc.save(sd, ckpt)
    assert sd["f"] is factory and sd["np"] is nonpersistent and sd["nested"] == snapshot[1] and dict(sd) == snapshot[0]
    loaded = dc.load({"f": ShardedTensorFactory("fac", torch.zeros(5), build, merge, replica_id=rank),
                      "np": LocalNonpersistentObject("kept"), "nested": [ShardedObject("o", None, (world,), (rank,))]},
                     ckpt)
    assert torch.equal(loaded["f"], data)
    assert loaded["np"] == "kept" and loaded["x"] == 1 and loaded["nested"] == [rank]
    return True


def test_save_does_not_mutate_and_factories_roundtrip(pool, ckpt_location):
    assert all(pool.run(_no_mutation, ckpt_location("ckpt")))


def test_save_into_existing_empty_dir_and_missing_dir(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    sd = {"t": ShardedTensor.from_rank_offsets("t", torch.ones(3))}
    dc.save(sd, empty)
    dc.save(sd, tmp_path / "a" / "b" / "missing")
    assert dc.check_is_distributed_checkpoint(empty) and dc.check_is_distributed_checkpoint(tmp_path / "a/b/missing")


# ----------------------------------------------------------------------------- bad input


def _assert_all_checkpointing_errors(excs, *fragments):
    if len(excs) == 1:  # world 1: errors are not prefixed with the failing rank
        fragments = tuple(f for f in fragments if not f.startswith("rank "))
    for e in excs:
        assert isinstance(e, CheckpointingException), repr(e)
        for frag in fragments:
            assert frag in str(e), (frag, str(e))


def _save_into(rank, world, ckpt):
    dc.save({"t": ShardedTensor.from_rank_offsets("t", torch.ones(2), (0, rank, world))}, ckpt)


def test_non_empty_save_dir_refused_untouched(pool, ckpt_location):
    ckpt = ckpt_location("busy")
    storage = storage_for(ckpt)
    storage.make_root()
    storage.write_atomic("precious.txt", b"keep me")
    excs = pool.run_expect_error(_save_into, ckpt)
    _assert_all_checkpointing_errors(excs, "not empty", ckpt)
    assert storage.list() == ["precious.txt"] and storage.read_bytes("precious.txt") == b"keep me"


def _load_from(rank, world, ckpt):
    dc.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(2), (0, rank, world))}, ckpt)


def test_load_nonexistent_and_non_checkpoint_dir(pool, tmp_path):
    excs = pool.run_expect_error(_load_from, str(tmp_path / "nope"))
    _assert_all_checkpointing_errors(excs, "does not exist", "nope")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "file.bin").write_bytes(b"x")
    excs = pool.run_expect_error(_load_from, str(tmp_path / "plain"))
    _assert_all_checkpointing_errors(excs, "not a distributed checkpoint", "plain")


def _request_missing_on_one_rank(rank, world, ckpt):
    key = "absent.weight" if rank == world - 1 else "t"
    dc.load({"x": ShardedTensor.from_rank_offsets(key, torch.zeros(2), (0, rank, world))}, ckpt)


def _request_wrong_shape(rank, world, ckpt):
    dc.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(3), (0, rank, world))}, ckpt)


def _request_wrong_dtype(rank, world, ckpt):
    """Another dtype is cast by default (as Megatron-Core does); ``strict_dtypes`` refuses it."""
    from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    dtype = torch.float64
    dc.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(2, dtype=dtype), (0, rank, world))}, ckpt,
            sharded_strategy=TorchDistLoadShardedStrategy(strict_dtypes=True))


def _request_missing_object(rank, world, ckpt):
    dc.load({"o": ShardedObject("nothing", None, (1,), (0,), replica_id=rank)}, ckpt)


def test_load_bad_requests_raise_on_every_rank(pool, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pool.run(_save_into, ckpt)
    excs = pool.run_expect_error(_request_missing_on_one_rank, ckpt)
    _assert_all_checkpointing_errors(excs, "absent.weight", f"rank {pool.world_size - 1}")
    excs = pool.run_expect_error(_request_wrong_shape, ckpt)
    _assert_all_checkpointing_errors(excs, "Global shape mismatch", "'t'")
    excs = pool.run_expect_error(_request_wrong_dtype, ckpt)
    _assert_all_checkpointing_errors(excs, "Dtype mismatch", "'t'", "float64")
    excs = pool.run_expect_error(_request_missing_object, ckpt)
    _assert_all_checkpointing_errors(excs, "nothing/shard_0_1")


def _save_with_bad_data_on_last_rank(rank, world, ckpt):
    st = ShardedTensor.from_rank_offsets("t", torch.ones(2), (0, rank, world))
    if rank == world - 1:
        st.data = torch.ones(3)  # disagrees with local_shape after construction
    dc.save({"t": st}, ckpt)


def _save_with_unpicklable_object_on_last_rank(rank, world, ckpt):
    data = (lambda: None) if rank == world - 1 else {"ok": rank}
    dc.save({"t": ShardedTensor.from_rank_offsets("t", torch.ones(2), (0, rank, world)),
             "o": ShardedObject("o", data, (world,), (rank,))}, ckpt)


def test_save_bad_data_raises_everywhere_and_leaves_no_checkpoint(pool, tmp_path):
    ckpt = tmp_path / "bad"
    excs = pool.run_expect_error(_save_with_bad_data_on_last_rank, str(ckpt))
    _assert_all_checkpointing_errors(excs, "'t'", "local_shape", f"rank {pool.world_size - 1}")
    assert not dc.check_is_distributed_checkpoint(ckpt)
    ckpt2 = tmp_path / "bad2"
    excs = pool.run_expect_error(_save_with_unpicklable_object_on_last_rank, str(ckpt2))
    _assert_all_checkpointing_errors(excs, "o/shard_", f"rank {pool.world_size - 1}")
    assert not dc.check_is_distributed_checkpoint(ckpt2)
    with pytest.raises(CheckpointingException, match="incomplete checkpoint|not a distributed checkpoint"):
        dc.load_common_state_dict(ckpt2)


def _save_conflicting_shapes(rank, world, ckpt):
    dc.save({"t": ShardedTensor("t", torch.ones(1), torch.float32, (1,), (world + rank,), (rank,), None)}, ckpt)


def test_save_inconsistent_global_shapes_across_ranks(pool2, tmp_path):
    excs = pool2.run_expect_error(_save_conflicting_shapes, str(tmp_path / "c"))
    _assert_all_checkpointing_errors(excs, "'t'", "global shape")


def test_invalid_rank_offsets_raise():
    for offsets in [(0, 2, 2), (1, 0, 2), (0, 0, 0), (0, 0)]:
        with pytest.raises(CheckpointingException):
            ShardedTensor.from_rank_offsets("k", torch.ones(2), offsets)


def test_unknown_backend_in_metadata_json(tmp_path):
    ckpt = tmp_path / "ckpt"
    dc.save({"t": ShardedTensor.from_rank_offsets("t", torch.ones(2))}, ckpt)
    cfg = json.loads((ckpt / CONFIG_FNAME).read_text())
    cfg["sharded_backend"] = "zarr_from_the_future"
    (ckpt / CONFIG_FNAME).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointingException, match="zarr_from_the_future"):
        dc.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(2))}, ckpt)
    cfg["sharded_backend"], cfg["sharded_backend_version"] = "torch_dist", 99
    (ckpt / CONFIG_FNAME).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointingException, match="99"):
        dc.load_tensors_metadata(ckpt)


def test_corrupted_metadata_and_truncated_data_are_clear_errors(tmp_path):
    ckpt = tmp_path / "ckpt"
    dc.save({"t": ShardedTensor.from_rank_offsets("t", torch.arange(1000.0))}, ckpt)
    data_file = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    raw = data_file.read_bytes()
    data_file.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointingException, match="distcp"):
        dc.load_plain_tensors(ckpt)
    (ckpt / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointingException, match=".metadata"):
        dc.load_plain_tensors(ckpt)


def _request_dtype_disagreeing_across_ranks(rank, world, ckpt):
    dtype = torch.float64 if rank == 0 else torch.float32
    dc.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(2, dtype=dtype), (0, rank, world))}, ckpt)


def test_load_request_disagreeing_across_ranks(pool2, pool4, tmp_path):
    for p in (pool2, pool4):
        ckpt = str(tmp_path / f"w{p.world_size}")
        p.run(_save_into, ckpt)
        excs = p.run_expect_error(_request_dtype_disagreeing_across_ranks, ckpt)
        _assert_all_checkpointing_errors(excs, "'t'", "disagree", "rank 0", "float64")


def _load_with_bad_data_on_last_rank(rank, world, ckpt):
    st = ShardedTensor.from_rank_offsets("t", torch.zeros(2), (0, rank, world))
    if rank == world - 1:
        st.data = torch.zeros(2, dtype=torch.float64)  # disagrees with the declared dtype
    dc.load({"t": st}, ckpt)


def test_load_request_data_disagreeing_with_metadata(pool, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pool.run(_save_into, ckpt)
    excs = pool.run_expect_error(_load_with_bad_data_on_last_rank, ckpt)
    _assert_all_checkpointing_errors(excs, "'t'", "dtype", f"rank {pool.world_size - 1}")


def test_contiguous_tensors_with_odd_strides_round_trip(tmp_path):
    # A one-element column of a (1, N) matrix and an empty strided slice are contiguous but
    # keep a non-unit stride under reshape(-1): their bytes must still be written and read.
    w = torch.arange(6.0).reshape(1, 6)
    state = {
        "col": dc.ShardedTensor.from_rank_offsets("col", w[:, 0]),
        "empty": dc.ShardedTensor.from_rank_offsets("empty", torch.arange(6.0)[1:1:2]),
        "common_col": w[:, 3],
    }
    dc.save(state, tmp_path / "c")
    out = dc.load({"col": dc.ShardedTensor.from_rank_offsets("col", torch.full((1,), -1.0)),
                   "empty": dc.ShardedTensor.from_rank_offsets("empty", torch.zeros(0))}, tmp_path / "c")
    assert out["col"].tolist() == [0.0] and out["empty"].numel() == 0 and out["common_col"].tolist() == [3.0]
