"""Saving straight to safetensors (``sharded_strategy=("safetensors", 1)``): real ranks,
the files read back by the ``safetensors`` package and re-loaded under another layout."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Dict

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.storage import storage_for
from dist_checkpointing.strategies.safetensors.save import SafetensorsSaveShardedStrategy

from .conftest import get_pool
from .faulty_storage import FaultyStorage
from .helpers import assert_all_raise
from .test_hf_load import megatron_to_hf

safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

INDEX = "model.safetensors.index.json"


def full_state() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"embedding.word_embeddings.weight": torch.randn(24, 8, generator=g).bfloat16(),
            "decoder.layers.0.self_attention.linear_proj.weight": torch.randn(8, 12, generator=g),
            "decoder.layers.0.mlp.linear_fc2.weight": torch.randn(8, 16, generator=g),
            "decoder.final_layernorm.weight": torch.randn(8, generator=g),
            "output_layer.weight": torch.randn(24, 8, generator=g).bfloat16()}


def sharded_state(rank: int, world: int, key_map_on_request: bool = False) -> dict:
    """TP = world: row-parallel embedding/output, column-parallel proj; fc2 as distributed-
    optimizer slices (flattened ranges of the column shard); a replicated norm; common state."""
    full = full_state()
    tp = world
    emb, out = full["embedding.word_embeddings.weight"], full["output_layer.weight"]
    proj, fc2 = full["decoder.layers.0.self_attention.linear_proj.weight"], full["decoder.layers.0.mlp.linear_fc2.weight"]
    fc2_chunk = fc2.chunk(tp, 1)[rank].contiguous().reshape(-1)
    half = fc2_chunk.numel() // 2
    state = {
        "emb": ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight", emb.chunk(tp, 0)[rank].clone(),
                                               (0, rank, tp)),
        "out": ShardedTensor.from_rank_offsets("output_layer.weight", out.chunk(tp, 0)[rank].clone(), (0, rank, tp)),
        "proj": ShardedTensor.from_rank_offsets("decoder.layers.0.self_attention.linear_proj.weight",
                                                proj.chunk(tp, 1)[rank].clone(), (1, rank, tp)),
        "fc2": [ShardedTensor.from_rank_offsets_flat("decoder.layers.0.mlp.linear_fc2.weight", fc2_chunk[s].clone(),
                                                     (8, 16 // tp), (1, rank, tp), flattened_range=s)
                for s in (slice(0, half), slice(half, fc2_chunk.numel()))],
        "norm": ShardedTensor.from_rank_offsets("decoder.final_layernorm.weight", full["decoder.final_layernorm.weight"].clone(),
                                                replica_id=rank),
        "iteration": 7,
    }
    return state


def _save_rank(rank: int, world: int, directory: str, max_file_bytes: int, key_map: bool,
               storage_options: dict = None) -> None:
    strategy = SafetensorsSaveShardedStrategy(max_file_bytes=max_file_bytes,
                                              key_map=megatron_to_hf if key_map else None)
    dc.save(sharded_state(rank, world), directory, sharded_strategy=strategy, storage_options=storage_options)


def stored_files(directory: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, read by the safetensors package."""
    out: Dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        part = safetensors_torch.load_file(str(path))
        assert not set(part) & set(out)
        out.update(part)
    return out


@pytest.mark.parametrize("key_map", [False, True], ids=["own_keys", "hf_keys"])
def test_saved_files_are_hugging_face_files_and_reload_resharded(pool, tmp_path, key_map):
    world = pool.world_size
    d = tmp_path / "st"
    pool.run(_save_rank, str(d), 700, key_map)
    full = full_state()
    expected = {megatron_to_hf(k) if key_map else k: v for k, v in full.items()}
    got = stored_files(d)
    assert sorted(got) == sorted(expected)
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
    index = json.loads((d / INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in full.values())
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert files == sorted(set(index["weight_map"].values())) and len(files) >= min(world, len(full))
    assert json.loads((d / "metadata.json").read_text())["sharded_backend"] == "safetensors"
    # another layout: TP 2 over 1 process, under the keys it was saved with
    for tp_rank in range(2):
        req = {k: ShardedTensor.from_rank_offsets(k, torch.empty(v.chunk(2, 1)[0].shape, dtype=v.dtype), (1, tp_rank, 2))
               for k, v in full.items() if v.dim() == 2}
        loaded = dc.load(req, d, key_map=megatron_to_hf if key_map else None)
        assert all(torch.equal(loaded[k], full[k].chunk(2, 1)[tp_rank]) for k in req)
        assert loaded["iteration"] == 7


def test_files_are_cut_by_max_file_bytes_and_a_big_limit_gives_one_file_per_writer(tmp_path):
    get_pool(2).run(_save_rank, str(tmp_path / "small"), 200, False)
    assert len(list((tmp_path / "small").glob("*.safetensors"))) >= 4
    get_pool(1).run(_save_rank, str(tmp_path / "one"), 1 << 30, False)
    assert [p.name for p in (tmp_path / "one").glob("*.safetensors")] == ["model.safetensors"]
    assert stored_files(tmp_path / "one").keys() == full_state().keys()


def _refused_rank(rank: int, world: int, directory: str, case: str) -> BaseException:
    state = sharded_state(rank, world)
    strategy = SafetensorsSaveShardedStrategy()
    location = directory
    if case == "object":
        state["rng"] = ShardedObject("rng", {"seed": rank}, (world,), (rank,))
    elif case == "gap":
        del state["fc2"][1]
    elif case == "write fault" and rank == 1:
        location = FaultyStorage(directory, "create", "model-*")
    elif case == "bad key":
        state["norm"] = ShardedTensor.from_rank_offsets("__metadata__", torch.ones(2), replica_id=rank)
    try:
        dc.save(state, location, sharded_strategy=strategy, validate_access_integrity=case != "gap")
    except CheckpointingException as e:
        return e
    raise AssertionError("the save did not fail")


@pytest.mark.parametrize("case, fragment", [("object", "ShardedObject 'rng"), ("gap", "linear_fc2.weight"),
                                            ("write fault", "injected create fault"),
                                            ("bad key", "__metadata__")])
def test_refused_saves_fail_on_every_rank_and_leave_no_index(tmp_path, case, fragment):
    d = tmp_path / "st"
    results = get_pool(2).run(_refused_rank, str(d), case)
    assert_all_raise(results, 2, fragment)
    assert not (d / INDEX).exists() and not (d / "metadata.json").exists()


def test_a_save_into_an_existing_checkpoint_is_refused(tmp_path):
    d = tmp_path / "st"
    get_pool(1).run(_save_rank, str(d), 1 << 20, False)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(Exception, match="not empty|already|exists"):
        get_pool(1).run(_save_rank, str(d), 1 << 20, False)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_save_to_and_load_from_an_object_store(tmp_path, s3_server, s3_env):
    pytest.importorskip("obstore")
    from .test_s3_tools import _options

    url = f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:10]}"
    get_pool(2).run(_save_rank, url, 700, True, _options(s3_server))
    storage = storage_for(url)
    names = storage.list()
    assert INDEX in names and "metadata.json" in names
    got = {}
    for name in names:
        if name.endswith(".safetensors"):
            got.update(safetensors_torch.load(storage.read_bytes(name)))
    full = full_state()
    assert all(torch.equal(got[megatron_to_hf(k)], v) for k, v in full.items())
    req = {k: ShardedTensor.from_rank_offsets(k, torch.empty(v.shape, dtype=v.dtype)) for k, v in full.items()}
    loaded = dc.load(req, url, key_map=megatron_to_hf)
    assert all(torch.equal(loaded[k], v) for k, v in full.items()) and loaded["iteration"] == 7
    # a Hugging Face directory uploaded as is loads from its prefix, each rank its ranges
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors_torch.save_file({megatron_to_hf(k): v for k, v in full.items()}, str(hf / "model.safetensors"))
    prefix = f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:10]}"
    storage_for(prefix).write_atomic("model.safetensors", (hf / "model.safetensors").read_bytes())
    for tp_rank in range(2):
        w = full["decoder.layers.0.self_attention.linear_proj.weight"]
        req = {"proj": ShardedTensor.from_rank_offsets("decoder.layers.0.self_attention.linear_proj.weight",
                                                       torch.empty(8, 6), (1, tp_rank, 2))}
        loaded = dc.load(req, prefix, key_map=megatron_to_hf)
        assert torch.equal(loaded["proj"], w.chunk(2, 1)[tp_rank])


def test_export_with_a_key_map_is_the_reverse_of_a_load_with_it(tmp_path):
    from dist_checkpointing.tools import export_checkpoint

    full = full_state()
    dc.save({k: ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in full.items()}, tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", key_map=megatron_to_hf, max_shard_bytes=600)
    got = stored_files(tmp_path / "hf")
    assert sorted(got) == sorted(megatron_to_hf(k) for k in full)
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    assert sorted(index["weight_map"]) == sorted(got)
    req = {k: ShardedTensor.from_rank_offsets(k, torch.empty(v.shape, dtype=v.dtype)) for k, v in full.items()}
    loaded = dc.load(req, tmp_path / "hf", key_map=megatron_to_hf)
    assert all(torch.equal(loaded[k], v) for k, v in full.items())
    with pytest.raises(CheckpointingException, match="the one name 'x'"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf2", key_map=lambda k: "x")
    assert not (tmp_path / "hf2").exists()


def _fine_tune_rank(rank: int, world: int, root: str, hf: str) -> bool:
    from dist_checkpointing.manager import CheckpointManager

    manager = CheckpointManager(root)
    try:
        state = sharded_state(rank, world)
        expected = state["proj"].data.clone()
        state["proj"].data.zero_()
        loaded = manager.load_from(state, hf, key_map=megatron_to_hf, strict="assume_ok_unexpected")
        ok = manager.restored_from == ("outside", hf) and torch.equal(loaded["proj"], expected)
        manager.save(1, sharded_state(rank, world))
        return ok and manager.latest_step() == 1
    finally:
        manager.close()


def test_a_run_starts_from_a_hugging_face_model_through_the_manager(tmp_path):
    full = full_state()
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors_torch.save_file({megatron_to_hf(k): v for k, v in full.items()}, str(hf / "model.safetensors"))
    assert get_pool(2).run(_fine_tune_rank, str(tmp_path / "run"), str(hf)) == [True, True]
