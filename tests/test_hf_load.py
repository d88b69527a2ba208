"""Hugging Face safetensors checkpoints as load sources: real files written by the
``safetensors`` package, loaded straight into sharded layouts (no import copy)."""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from pathlib import Path
from typing import Dict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.mapping import ShardedTensorFactory
from dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from dist_checkpointing.strategies.safetensors.load import SafetensorsLoadShardedStrategy
from dist_checkpointing.strategies.torch_dist.load import TorchDistLoadShardedStrategy

from .conftest import get_pool
from .faulty_storage import FaultyStorage
from .helpers import assert_all_raise

safetensors_torch = pytest.importorskip("safetensors.torch")

INDEX = "model.safetensors.index.json"


def write_hf(directory: Path, tensors: Dict[str, torch.Tensor], files: int = 1) -> Path:
    """``tensors`` as a Hugging Face checkpoint: ``model.safetensors``, or ``files`` shard
    files and their index, written by the safetensors package."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    if files == 1:
        safetensors_torch.save_file({k: tensors[k].contiguous() for k in keys}, str(directory / "model.safetensors"),
                                    metadata={"format": "pt"})
        return directory
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = keys[i::files]
        safetensors_torch.save_file({k: tensors[k].contiguous() for k in part}, str(directory / name),
                                    metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return directory


def model(seed: int = 0) -> Dict[str, torch.Tensor]:
    """A small GPT-2/Llama-style model as Hugging Face names it."""
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(64, 16, generator=g, dtype=torch.float32).bfloat16(),
           "model.norm.weight": torch.randn(16, generator=g)}
    for i in range(2):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = torch.randn(16, 16, generator=g)
        out[p + "self_attn.k_proj.weight"] = torch.randn(8, 16, generator=g)
        out[p + "self_attn.v_proj.weight"] = torch.randn(8, 16, generator=g)
        out[p + "self_attn.o_proj.weight"] = torch.randn(16, 16, generator=g)
        out[p + "mlp.down_proj.weight"] = torch.randn(16, 40, generator=g)
        out[p + "input_layernorm.weight"] = torch.randn(16, generator=g)
    out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("files", [1, 3])
def test_row_column_uneven_and_nd_shards(tmp_path, files):
    t = {"w": torch.arange(48 * 20, dtype=torch.float32).reshape(48, 20),
         "c": torch.arange(4 * 6 * 10, dtype=torch.int32).reshape(4, 6, 10),
         "s": torch.tensor(3.5), "e": torch.empty(0, 4), "b": torch.arange(7, dtype=torch.bfloat16)}
    d = write_hf(tmp_path / "hf", t, files)
    w = t["w"]
    for rank in range(4):
        req = {
            "row": ShardedTensor.from_rank_offsets("w", torch.empty(12, 20), (0, rank, 4)),
            "col": ShardedTensor.from_rank_offsets("w", torch.empty(48, 5), (1, rank, 4)),
            "grid": ShardedTensor.from_rank_offsets("w", torch.empty(24, 10), (0, rank // 2, 2), (1, rank % 2, 2)),
            "mid": ShardedTensor.from_rank_offsets("c", torch.empty(4, 3, 10, dtype=torch.int32), (1, rank % 2, 2)),
            "s": ShardedTensor.from_rank_offsets("s", torch.empty(())),
            "e": ShardedTensor.from_rank_offsets("e", torch.empty(0, 4)),
            "b": ShardedTensor.from_rank_offsets("b", torch.empty(7, dtype=torch.float64)),  # cast
        }
        # uneven: rows [rank*13, ...) of different lengths
        lo, hi = [0, 13, 20, 41, 48][rank], [0, 13, 20, 41, 48][rank + 1]
        req["uneven"] = ShardedTensor("w", torch.empty(hi - lo, 20), torch.float32, (hi - lo, 20), (48, 20), (lo, 0),
                                      (1, 1))
        got = dc.load(req, d, validate_access_integrity=False)  # (several requests of one key)
        assert torch.equal(got["row"], w[rank * 12:(rank + 1) * 12])
        assert torch.equal(got["col"], w[:, rank * 5:(rank + 1) * 5])
        r, c = rank // 2, rank % 2
        assert torch.equal(got["grid"], w[r * 24:(r + 1) * 24, c * 10:(c + 1) * 10])
        assert torch.equal(got["mid"], t["c"][:, (rank % 2) * 3:(rank % 2 + 1) * 3])
        assert got["s"].item() == 3.5 and got["e"].shape == (0, 4)
        assert got["b"].dtype == torch.float64 and torch.equal(got["b"], t["b"].double())
        assert torch.equal(got["uneven"], w[lo:hi])


def test_flattened_requests_and_strict_dtypes(tmp_path):
    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    d = write_hf(tmp_path / "hf", {"w": w})
    # a distributed-optimizer slice of the TP chunk rows 4..8: its elements 5..17
    flat = ShardedTensor.from_rank_offsets_flat("w", torch.empty(12), (4, 6), (0, 1, 2), flattened_range=slice(5, 17))
    got = dc.load({"f": flat}, d)
    assert torch.equal(got["f"], w[4:].reshape(-1)[5:17])
    strict = SafetensorsLoadShardedStrategy(strict_dtypes=True)
    with pytest.raises(CheckpointingException, match="Dtype mismatch for key 'w'"):
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 6, dtype=torch.float16))}, d,
                sharded_strategy=strict)


def megatron_request(tp_rank: int, tp: int) -> dict:
    """Megatron-style keys for ``model()``'s tensors (TP-sharded as Megatron shards them)."""
    req = {"embedding.word_embeddings.weight": ShardedTensor.from_rank_offsets(
               "embedding.word_embeddings.weight", torch.empty(64 // tp, 16), (0, tp_rank, tp)),
           "decoder.final_layernorm.weight": ShardedTensor.from_rank_offsets(
               "decoder.final_layernorm.weight", torch.empty(16), replica_id=tp_rank),
           "output_layer.weight": ShardedTensor.from_rank_offsets(
               "output_layer.weight", torch.empty(64 // tp, 16, dtype=torch.bfloat16), (0, tp_rank, tp))}
    for i in range(2):
        p = f"decoder.layers.{i}."
        req[p + "self_attention.linear_proj.weight"] = ShardedTensor.from_rank_offsets(
            p + "self_attention.linear_proj.weight", torch.empty(16, 16 // tp), (1, tp_rank, tp))
        req[p + "mlp.linear_fc2.weight"] = ShardedTensor.from_rank_offsets(
            p + "mlp.linear_fc2.weight", torch.empty(16, 40 // tp), (1, tp_rank, tp))
    return req


def megatron_to_hf(key: str) -> str:
    """The worked example of the user guide: Megatron-style key -> Hugging Face key."""
    fixed = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
             "decoder.final_layernorm.weight": "model.norm.weight",
             "output_layer.weight": "lm_head.weight"}
    if key in fixed:
        return fixed[key]
    layer, rest = key[len("decoder.layers."):].split(".", 1)
    return f"model.layers.{layer}." + {"self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                                        "mlp.linear_fc2.weight": "mlp.down_proj.weight"}[rest]


@pytest.mark.parametrize("as_dict", [False, True])
def test_key_map_dict_or_callable(tmp_path, as_dict):
    hf = model()
    d = write_hf(tmp_path / "hf", hf, files=2)
    for tp_rank in range(2):
        req = megatron_request(tp_rank, 2)
        key_map = {k: megatron_to_hf(k) for k in req} if as_dict else megatron_to_hf
        got = dc.load(req, d, key_map=key_map)
        assert torch.equal(got["embedding.word_embeddings.weight"],
                           hf["model.embed_tokens.weight"][tp_rank * 32:(tp_rank + 1) * 32].float())
        assert torch.equal(got["output_layer.weight"], hf["lm_head.weight"][tp_rank * 32:(tp_rank + 1) * 32])
        assert torch.equal(got["decoder.layers.1.mlp.linear_fc2.weight"],
                           hf["model.layers.1.mlp.down_proj.weight"][:, tp_rank * 20:(tp_rank + 1) * 20])
        assert set(got) == set(req)
    with pytest.raises(CheckpointingException, match="not a string key"):
        dc.load(megatron_request(0, 2), d, key_map=lambda k: None)


def test_missing_and_unexpected_keys_follow_strict_modes(tmp_path):
    d = write_hf(tmp_path / "hf", {"a": torch.ones(3), "b": torch.zeros(2)})
    req = {"a": ShardedTensor.from_rank_offsets("a", torch.empty(3)),
           "x": ShardedTensor.from_rank_offsets("x", torch.empty(3))}
    with pytest.raises(CheckpointingException, match="'x' not found in checkpoint"):
        dc.load(req, d)
    got, missing, unexpected = dc.load(req, d, strict="return_all")
    assert missing == {"b"} and unexpected == {"x"} and torch.equal(got["a"], torch.ones(3)) and "x" not in got
    with pytest.raises(CheckpointingException, match="x"):
        dc.load(req, d, strict="raise_unexpected")


def test_a_factory_over_several_hf_keys_fuses_qkv(tmp_path):
    """Megatron's fused QKV from Hugging Face's three projections: a ShardedTensorFactory
    whose build names the three keys and whose merge concatenates them (TP=2: each rank
    takes its rows of each)."""
    hf = model()
    d = write_hf(tmp_path / "hf", hf)
    p = "model.layers.0.self_attn."
    for tp_rank in range(2):
        def build(key, data, replica_id, flattened_range, tp_rank=tp_rank):
            q, k, v = torch.split(data, [8, 4, 4])
            return {name: ShardedTensor.from_rank_offsets(p + f"{name}_proj.weight", part, (0, tp_rank, 2),
                                                          replica_id=replica_id)
                    for name, part in (("q", q), ("k", k), ("v", v))}

        def merge(loaded):
            return torch.cat([loaded["q"], loaded["k"], loaded["v"]])

        fused = ShardedTensorFactory("decoder.layers.0.self_attention.linear_qkv.weight", torch.empty(16, 16),
                                     build, merge)
        got = dc.load({"qkv": fused}, d)["qkv"]
        rows = slice(tp_rank * 8, (tp_rank + 1) * 8), slice(tp_rank * 4, (tp_rank + 1) * 4)
        expected = torch.cat([hf[p + "q_proj.weight"][rows[0]], hf[p + "k_proj.weight"][rows[1]],
                              hf[p + "v_proj.weight"][rows[1]]])
        assert torch.equal(got, expected)


def test_readers_metadata_common_state_and_tools(tmp_path):
    hf = model()
    d = write_hf(tmp_path / "hf", hf, files=2)
    meta = dc.load_tensors_metadata(d)
    assert sorted(meta) == sorted(hf)
    assert all(meta[k].global_shape == tuple(v.shape) and meta[k].dtype == v.dtype for k, v in hf.items())
    plain = dc.load_plain_tensors(d)
    assert all(torch.equal(plain[k], v) for k, v in hf.items())
    assert dc.load_common_state_dict(d) == {}
    assert not dc.check_is_distributed_checkpoint(d)  # (it has no metadata.json)
    from dist_checkpointing.tools import inspect_checkpoint, validate_checkpoint

    info = inspect_checkpoint(d)
    assert info.sharded_backend == "safetensors" and len(info.tensors) == len(hf)
    report = validate_checkpoint(d)
    assert report.ok, report
    from dist_checkpointing.cli import main

    assert main(["validate", str(d)]) == 0 and main(["inspect", str(d)]) == 0
    (d / "model-00001-of-00002.safetensors").write_bytes(b"\x00" * 16)  # damaged: validate says so
    assert main(["validate", str(d)]) != 0
    with pytest.raises(CheckpointingException, match="ShardedObject"):
        dc.load({"o": ShardedObject("rng", None, (1,), (0,))}, d)


def test_incomplete_and_inconsistent_directories_are_refused(tmp_path):
    t = {"a": torch.ones(4), "b": torch.ones(2)}
    d = write_hf(tmp_path / "hf", t, files=2)
    req = {"a": ShardedTensor.from_rank_offsets("a", torch.empty(4))}
    os.rename(d / INDEX, tmp_path / "index")
    with pytest.raises(CheckpointingException, match="incomplete safetensors checkpoint"):
        dc.load(req, d)
    index = json.loads((tmp_path / "index").read_text())
    for weight_map, match in (({"a": "model-00009-of-00009.safetensors"}, "does not exist"),
                              ({"a": "../x.safetensors"}, "not a file of the checkpoint"),
                              ({"a": "model-00002-of-00002.safetensors"}, "has no such tensor"),
                              ({"a": 3}, "not a .safetensors file name")):
        (d / INDEX).write_text(json.dumps({**index, "weight_map": weight_map}))
        with pytest.raises(CheckpointingException, match=match):
            dc.load(req, d)
    (d / INDEX).write_text("[1, 2]")
    with pytest.raises(CheckpointingException, match="no \"weight_map\""):
        dc.load(req, d)


def raw_file(header: object, data: bytes = b"", length: int = None) -> bytes:
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(encoded) if length is None else length) + encoded + data


_GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
HOSTILE = {
    "huge header length": raw_file(_GOOD, bytes(8), length=1 << 62),
    "header past the file": raw_file(_GOOD, bytes(8), length=10_000),
    "shorter than a length": b"\x01\x02",
    "non-UTF-8": raw_file(b'{"a\xff": 1}'),
    "not JSON": raw_file(b"{nope"),
    "not an object": raw_file([1, 2]),
    "unknown dtype": raw_file({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1)),
    "no dtype": raw_file({"a": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
    "duplicate key": raw_file(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                              b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', bytes(8)),
    "overlapping ranges": raw_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
    "gap": raw_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16)),
    "absurd offsets": raw_file({"a": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]}}, bytes(8)),
    "size not of its shape": raw_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
    "negative offset": raw_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, bytes(8)),
    "float shape": raw_file({"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, bytes(8)),
    "truncated data": raw_file(_GOOD, bytes(4)),
    "trailing bytes": raw_file(_GOOD, bytes(12)),
    "lone surrogate key": raw_file(b'{"\\ud800": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', bytes(8)),
    "bad __metadata__": raw_file({"__metadata__": {"x": 1}, **_GOOD}, bytes(8)),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_refused_naming_the_file(tmp_path, case):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "model.safetensors").write_bytes(HOSTILE[case])
    with pytest.raises(CheckpointingException, match="model.safetensors"):
        dc.load({"a": ShardedTensor.from_rank_offsets("a", torch.empty(2))}, d)
    with pytest.raises(CheckpointingException):
        dc.load_tensors_metadata(d)


def test_the_good_header_of_the_hostile_cases_loads(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "model.safetensors").write_bytes(raw_file(_GOOD, struct.pack("<2f", 1.5, 2.5)))
    got = dc.load({"a": ShardedTensor.from_rank_offsets("a", torch.empty(2))}, d)
    assert got["a"].tolist() == [1.5, 2.5]


_HYPO_DIR = tempfile.TemporaryDirectory(prefix="hf_hypothesis_")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=3), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int16]))
def test_any_request_reads_the_slice_of_the_stored_tensor(shape, data, dtype):
    """Hypothesis: any box of a stored tensor, in any dtype, reads as that slice (cast)."""
    full = (torch.arange(math.prod(shape)) % 251).reshape(shape).to(dtype)
    d = Path(_HYPO_DIR.name) / f"{'x'.join(map(str, shape))}_{str(dtype)[6:]}"
    if not d.exists():
        write_hf(d, {"t": full})
    offsets = [data.draw(st.integers(0, s - 1)) for s in shape]
    sizes = [data.draw(st.integers(1, s - o)) for s, o in zip(shape, offsets)]
    out_dtype = data.draw(st.sampled_from([dtype, torch.float64]))
    sh = ShardedTensor("t", torch.empty(sizes, dtype=out_dtype), out_dtype, tuple(sizes), tuple(shape),
                       tuple(offsets), (1,) * len(shape))
    got = dc.load({"t": sh}, d)["t"]
    expected = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].to(out_dtype)
    assert torch.equal(got, expected)


# ----------------------------------------------------------------------------- several ranks


def wide_model() -> Dict[str, torch.Tensor]:
    """Rows as wide as a real model's (runs of >= 4 KiB per rank at TP 4)."""
    g = torch.Generator().manual_seed(1)
    out = {"emb": torch.randn(256, 1024, generator=g).bfloat16(), "norm": torch.randn(1024, generator=g)}
    for i in range(2):
        out[f"o.{i}"] = torch.randn(32, 4096, generator=g)
        out[f"down.{i}"] = torch.randn(32, 8192, generator=g).bfloat16()
    return out


def _tp_load_rank(rank: int, world: int, directory: str, parallel: bool) -> dict:
    """TP = world (row-parallel ``emb``, column-parallel ``o`` / ``down``, replicated
    ``norm``), or with ``parallel`` every tensor replicated (DP = world) and read through
    the fully parallel wrapper."""
    storage = FaultyStorage(directory)
    hf = wide_model()
    if parallel:
        req = {k: ShardedTensor.from_rank_offsets(k, torch.empty(v.shape, dtype=v.dtype), replica_id=rank)
               for k, v in hf.items()}
        # as Megatron-LM passes it whatever the checkpoint: made a safetensors strategy
        strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(thread_count=2))
        got = dc.load(req, storage, sharded_strategy=strategy)
        expected = hf
    else:
        req = {k: ShardedTensor.from_rank_offsets(k, torch.empty(v.chunk(world, 0 if k == "emb" else 1)[rank].shape,
                                                                 dtype=v.dtype), (0 if k == "emb" else 1, rank, world))
               for k, v in hf.items() if k != "norm"}
        req["norm"] = ShardedTensor.from_rank_offsets("norm", torch.empty(1024), replica_id=rank)
        got = dc.load(req, storage)
        expected = {k: v if k == "norm" else v.chunk(world, 0 if k == "emb" else 1)[rank] for k, v in hf.items()}
    return {"ok": all(torch.equal(got[k], v) for k, v in expected.items()), "bytes": storage.bytes_read}


@pytest.mark.parametrize("world", [2, 4])
def test_tp_shards_read_only_their_bytes(tmp_path, world):
    hf = wide_model()
    d = write_hf(tmp_path / "hf", hf, files=3)
    headers = sum(8 + int.from_bytes((d / n).read_bytes()[:8], "little") for n in os.listdir(d)
                  if n.endswith(".safetensors"))
    total = sum(v.numel() * v.element_size() for v in hf.values())
    norm = hf["norm"].numel() * 4
    results = get_pool(world).run(_tp_load_rank, str(d), False)
    assert all(r["ok"] for r in results)
    share = (total - norm) / world + norm  # (every rank reads the replicated norm)
    for r in results:
        assert r["bytes"] <= 1.1 * share + headers, (r["bytes"], share, headers)
    results = get_pool(world).run(_tp_load_rank, str(d), True)
    assert all(r["ok"] for r in results)
    assert sum(r["bytes"] for r in results) <= 1.1 * total + world * headers  # each byte read once in all
    assert max(r["bytes"] for r in results) <= 1.1 * total / world + headers + 8192 * 32 * 2  # (balanced by tensors)


@pytest.mark.parametrize("case, fragment", [("overlapping ranges", "an overlap"), ("huge header length", "header length"),
                                            ("non-UTF-8", "not UTF-8"), ("unknown dtype", "'F4'"),
                                            ("absurd offsets", "but the file holds 101 bytes")])
def test_a_hostile_header_fails_on_every_rank(tmp_path, case, fragment):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "model.safetensors").write_bytes(HOSTILE[case])
    results = get_pool(2).run(_raises_rank, str(d))
    assert_all_raise(results, 2, fragment, "model.safetensors")


def _raises_rank(rank: int, world: int, directory: str) -> BaseException:
    try:
        dc.load({"a": ShardedTensor.from_rank_offsets("a", torch.empty(2), replica_id=rank)}, directory)
    except CheckpointingException as e:
        return e
    raise AssertionError("no error")


@pytest.mark.parametrize("min_run", [1, 1 << 30], ids=["runs", "spans"])
def test_every_box_reads_right_as_runs_or_as_spans(tmp_path, monkeypatch, min_run):
    """The reader's two ways (a read per run; one span with the gaps) give the same values
    for boxes of a 4-D tensor, in the stored dtype (read in place) and cast."""
    import dist_checkpointing.strategies.safetensors.reader as reader

    monkeypatch.setattr(reader, "MIN_RUN_BYTES", min_run)
    full = torch.arange(3 * 4 * 5 * 6, dtype=torch.int32).reshape(3, 4, 5, 6)
    d = write_hf(tmp_path / "hf", {"t": full})
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        offsets = [int(torch.randint(0, s, (1,), generator=g)) for s in full.shape]
        sizes = [int(torch.randint(1, s - o + 1, (1,), generator=g)) for s, o in zip(full.shape, offsets)]
        for dtype in (torch.int32, torch.float64):
            sh = ShardedTensor("t", torch.empty(sizes, dtype=dtype), dtype, tuple(sizes), tuple(full.shape),
                               tuple(offsets), (1,) * 4)
            got = dc.load({"t": sh}, d)["t"]
            assert torch.equal(got, full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].to(dtype))
