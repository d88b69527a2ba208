"""Megatron-Core's ``zarr`` checkpoints load (read only, without the zarr package).

``mcore_v0_15/zarr_tp2_dp2`` was written by Megatron-Core 0.15.3's own zarr backend
(``tests/fixtures/make_zarr_fixture.py``): TP2 x DP2, five dtypes, distributed-optimizer
state, ShardedObjects, common state. The geometry (edge chunks, any request region,
flattened requests) is covered by Hypothesis on arrays written here in the same layout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Optional, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor, StrictHandling
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from dist_checkpointing.strategies.zarr import DTYPES, ZarrLoadShardedStrategy

from .conftest import FIXTURES, get_pool
from .helpers import assert_all_raise
from .zarr_layout import write_array, write_checkpoint

FIXTURE = FIXTURES / "mcore_v0_15" / "zarr_tp2_dp2"
CKPT = FIXTURE / "checkpoint"
OPTIMIZER = {"optimizer.state.exp_avg.embedding.word_embeddings.weight": 0,
             "optimizer.state.exp_avg_sq.decoder.layers.0.mlp.linear_fc2.weight": 1}  # key -> TP axis when saved


def _expected() -> dict:
    return torch.load(FIXTURE / "expected.pt", weights_only=False)


# ----------------------------------------------------------------------------- the Megatron-Core fixture


def _load_fixture(rank: int, world: int, tp: int, axis_choice: str, dp_parts: int) -> list:
    """Request every tensor split over ``tp`` ranks (rank % tp) along the first or last
    axis, optimizer state flattened and split into ``dp_parts`` slices (rank // tp picks
    one), this rank's object; return the keys that came back wrong."""
    exp = _expected()
    tp_rank, dp_rank = rank % tp, rank // tp
    request, expected = {}, {}
    for key, full in exp["tensors"].items():
        axes = list(range(full.dim())) if axis_choice == "first" else list(reversed(range(full.dim())))
        axis = next((a for a in axes if full.shape[a] % tp == 0), None)  # one that splits evenly
        split_tp, split_rank = (tp, tp_rank) if axis is not None else (1, 0)
        axis = axis if axis is not None else 0
        n = full.shape[axis] // split_tp
        chunk = full.narrow(axis, split_rank * n, n)
        if key in OPTIMIZER:
            numel = chunk.numel()
            bounds = [numel * i // dp_parts for i in range(dp_parts + 1)]
            rng = slice(bounds[dp_rank % dp_parts], bounds[dp_rank % dp_parts + 1])
            request[key] = ShardedTensor.from_rank_offsets_flat(
                key, torch.zeros(rng.stop - rng.start, dtype=full.dtype), tuple(chunk.shape), (axis, split_rank, split_tp),
                flattened_range=rng, replica_id=dp_rank)
            expected[key] = chunk.flatten()[rng]
        else:
            request[key] = ShardedTensor.from_rank_offsets(key, torch.zeros_like(chunk), (axis, split_rank, split_tp),
                                                           replica_id=dp_rank if split_tp > 1 else rank)
            expected[key] = chunk
    obj_rank = rank % exp["world"]
    request["state"] = ShardedObject("rank_state", None, (exp["world"],), (obj_rank,), replica_id=rank)
    loaded = dc.load(request, str(CKPT), strict=StrictHandling.RAISE_ALL if world == 4 else "assume_ok_unexpected")
    wrong = [k for k, v in expected.items() if not (loaded[k].dtype == v.dtype and torch.equal(loaded[k], v))]
    wrong += [] if loaded["state"] == exp["objects"][f"rank_state/shard_{obj_rank}_{exp['world']}"] else ["state"]
    wrong += [] if (loaded["iteration"], loaded["args"].lr) == (40, 3e-4) else ["common"]
    return wrong


@pytest.mark.parametrize("world, tp, axis, dp_parts", [
    (4, 2, "first", 2),   # as saved (RAISE_ALL: nothing missing, nothing unexpected)
    (4, 4, "last", 1),    # resharded along the other axis; flattened state in another grid
    (2, 1, "first", 2),   # TP1 x DP2
    (1, 1, "last", 3),    # one process, flattened state in thirds
], ids=["as-saved", "tp4-last-axis", "tp1-dp2", "world1-thirds"])
def test_megatron_zarr_checkpoint_loads_under_any_layout(world, tp, axis, dp_parts):
    assert get_pool(world).run(_load_fixture, tp, axis, dp_parts) == [[]] * world


def test_metadata_readers_and_dtype_casts():
    exp = _expected()
    metadata = dc.load_tensors_metadata(str(CKPT))  # the .sync lock directories are not arrays
    assert {k: (tuple(v.global_shape), v.dtype) for k, v in metadata.items()} == \
        {k: (tuple(t.shape), t.dtype) for k, t in exp["tensors"].items()}
    sharded = dc.load_sharded_metadata(str(CKPT))
    assert sorted(k for k in sharded if k not in metadata) == sorted(exp["objects"])
    plain = dc.load_plain_tensors(str(CKPT))
    assert all(torch.equal(plain[k], t) for k, t in exp["tensors"].items())
    assert dc.load_common_state_dict(str(CKPT))["iteration"] == 40
    # a bf16 array requested in float32 is cast (as torch_dist does); strict_dtypes refuses
    key = "decoder.layers.0.mlp.linear_fc2.weight"
    out = dc.load({"w": ShardedTensor.from_rank_offsets(key, torch.zeros(16, 32))}, str(CKPT))
    assert out["w"].dtype == torch.float32 and torch.equal(out["w"], exp["tensors"][key].float())
    for strict in (ZarrLoadShardedStrategy(strict_dtypes=True), TorchDistLoadShardedStrategy(strict_dtypes=True)):
        with pytest.raises(CheckpointingException, match=f"Dtype mismatch for key {key!r}"):
            dc.load({"w": ShardedTensor.from_rank_offsets(key, torch.zeros(16, 32))}, str(CKPT), sharded_strategy=strict)


def test_strict_modes_report_missing_and_unexpected_keys():
    key = "embedding.word_embeddings.weight"
    request = {"w": ShardedTensor.from_rank_offsets(key, torch.zeros(64, 16)),
               "x": ShardedTensor.from_rank_offsets("not.in.checkpoint", torch.zeros(2))}
    out, missing, unexpected = dc.load(request, str(CKPT), strict=StrictHandling.RETURN_ALL)
    assert unexpected == {"not.in.checkpoint"} and "x" not in out
    assert missing == set(_expected()["tensors"]) - {key} | {"rank_state"}
    with pytest.raises(CheckpointingException, match="not.in.checkpoint"):
        dc.load(request, str(CKPT))


# ----------------------------------------------------------------------------- arrays written here


@st.composite
def _geometry(draw) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[Tuple[int, ...], Tuple[int, ...]], str, Optional[slice]]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, s + 2)) for s in shape)  # may exceed the shape: a padded edge
    separator = draw(st.sampled_from([".", "/"]))
    if draw(st.booleans()):  # any region
        offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
        sizes = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
        return shape, chunks, (offsets, sizes), separator, None
    # a flattened request: a slice of one chunk of a regular grid (Megatron-Core's rule)
    fragments = [draw(st.sampled_from([f for f in range(1, s + 1) if s % f == 0])) for s in shape]
    sizes = tuple(s // f for s, f in zip(shape, fragments))
    offsets = tuple(draw(st.integers(0, f - 1)) * n for f, n in zip(fragments, sizes))
    start = draw(st.integers(0, math.prod(sizes) - 1))
    return shape, chunks, (offsets, sizes), separator, slice(start, draw(st.integers(start + 1, math.prod(sizes))))


@settings(max_examples=60, deadline=None)
@given(geometry=_geometry(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.bool]))
def test_any_region_of_any_chunking_loads(tmp_path_factory, geometry, dtype):
    shape, chunks, (offsets, sizes), separator, rng = geometry
    root = tmp_path_factory.mktemp("zarr")
    write_checkpoint(root)
    full = (torch.arange(math.prod(shape)).reshape(shape) % 97).to(dtype)
    write_array(root, "w", full, chunks, separator)
    region = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    strategy = ZarrLoadShardedStrategy(thread_count=2)
    if rng is None:
        sh = ShardedTensor("w", torch.zeros(sizes, dtype=dtype), dtype, sizes, shape, offsets, (1,) * len(shape))
        expected = region
    else:
        sh = ShardedTensor("w", torch.zeros(rng.stop - rng.start, dtype=dtype), dtype, sizes, shape, offsets,
                           tuple(s // n for s, n in zip(shape, sizes)), flattened_range=rng)
        expected = region.flatten()[rng]
    assert torch.equal(dc.load({"w": sh}, str(root), sharded_strategy=strategy)["w"], expected)
    shutil.rmtree(root)


def test_scalar_array_and_legacy_object_name(tmp_path):
    write_checkpoint(tmp_path)
    write_array(tmp_path, "step", torch.tensor(7, dtype=torch.int64), [])
    (tmp_path / "obj").mkdir()
    torch.save({"a": 1}, tmp_path / "obj" / "shard_0.1_2.pt")  # early Megatron-Core: the unique key's last "." part dropped
    torch.save({"a": 2}, tmp_path / "obj" / "shard_1.1_2.pt")
    out = dc.load({"s": ShardedTensor("step", torch.zeros((), dtype=torch.int64), torch.int64, (), (), (), ()),
                   "o": ShardedObject("obj", None, (2, 2), (0, 1)), "p": ShardedObject("obj", None, (2, 2), (1, 1))},
                  str(tmp_path))
    assert out["s"].item() == 7 and out["o"] == {"a": 1} and out["p"] == {"a": 2}
    # listed as Megatron-Core lists them: the missing last size is one more than the largest offset on it
    listed = dc.load_sharded_metadata(str(tmp_path))
    assert sorted(listed) == ["obj/shard_0.1_2.2", "obj/shard_1.1_2.2", "step"]
    assert dc.load(dict(listed), str(tmp_path), strict=StrictHandling.RAISE_ALL)["obj/shard_1.1_2.2"] == {"a": 2}


# ----------------------------------------------------------------------------- bad input

_BAD = {
    "compressed": ({"compressor": {"id": "blosc"}}, None, "compressed or filtered"),
    "filtered": ({"filters": [{"id": "delta"}]}, None, "compressed or filtered"),
    "fortran": ({"order": "F"}, None, "order 'F'"),
    "big-endian": ({"dtype": ">f4"}, None, "dtype '>f4'"),
    "zarr-v3": ({"zarr_format": 3}, None, "not a zarr version 2"),
    "bad-chunks": ({"chunks": [0, 4]}, None, "not a shape and a chunk shape"),
    "bad-separator": ({"dimension_separator": "-"}, None, "dimension_separator"),
    "not-json": (None, lambda d: (d / ".zarray").write_text("{not json"), "not valid JSON"),
    "deep-json": (None, lambda d: (d / ".zarray").write_text("[" * 30000 + "]" * 30000), "not valid JSON"),
    "truncated-chunk": (None, lambda d: (d / "1.0").write_bytes((d / "1.0").read_bytes()[:10]), "w/1.0"),
    "missing-chunk": (None, lambda d: (d / "0.0").unlink(), "w/0.0"),
}


def _load_bad(rank: int, world: int, root: str) -> None:
    dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4), (0, rank, world))}, root)


@pytest.mark.parametrize("case", sorted(_BAD))
def test_damaged_arrays_raise_naming_the_array_on_every_rank(tmp_path, case):
    overrides, damage, says = _BAD[case]
    write_checkpoint(tmp_path)
    write_array(tmp_path, "w", torch.arange(32.0).reshape(8, 4), (4, 4), **(overrides or {}))
    if damage is not None:
        damage(tmp_path / "w")
    excs = get_pool(2).run_expect_error(_load_bad, str(tmp_path))
    assert_all_raise(excs, 2, says)
    assert "'w'" in str(excs[0]) or "/w/" in str(excs[0])


@pytest.mark.parametrize("key", ["../outside", "/abs", "a/../../b", "a//b", "."])
def test_keys_outside_the_checkpoint_are_refused(tmp_path, key):
    write_checkpoint(tmp_path)
    with pytest.raises(CheckpointingException, match="is not a name inside the zarr checkpoint"):
        dc.load({"w": ShardedTensor.from_rank_offsets(key, torch.zeros(2))}, str(tmp_path))


def test_shape_mismatch_names_the_key(tmp_path):
    write_checkpoint(tmp_path)
    write_array(tmp_path, "w", torch.arange(8.0), (4,))
    with pytest.raises(CheckpointingException, match="Global shape mismatch for key 'w'.*\\(8,\\).*\\(6,\\)"):
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, str(tmp_path))


def test_a_claimed_shape_is_backed_before_an_offline_read_allocates_it(tmp_path):
    write_checkpoint(tmp_path)
    write_array(tmp_path, "w", torch.arange(8.0), (4,))
    zarray = json.loads((tmp_path / "w" / ".zarray").read_text())
    (tmp_path / "w" / ".zarray").write_text(json.dumps({**zarray, "shape": [10**12], "chunks": [4 * 10**11]}))
    with pytest.raises(CheckpointingException, match="chunk file .*w/0 holds 16 bytes"):
        dc.load_plain_tensors(str(tmp_path))
    (tmp_path / "w" / ".zarray").write_text(json.dumps({**zarray, "shape": [10**12], "chunks": [1]}))
    with pytest.raises(CheckpointingException, match="1000000000000 chunks of \\(1,\\) \\(more than 1048576"):
        dc.load_plain_tensors(str(tmp_path))


def test_offline_tools_inspect_validate_and_export(tmp_path):
    from safetensors.torch import load_file

    from dist_checkpointing.tools import export_checkpoint, inspect_checkpoint, validate_checkpoint

    exp = _expected()
    info = inspect_checkpoint(str(CKPT))
    assert info.sharded_backend == "zarr" and {t.key: t.chunks for t in info.tensors} == \
        {k: (1 if k == "decoder.final_layernorm.weight" else 2) for k in exp["tensors"]}
    assert sorted(info.objects) == sorted(exp["objects"]) and "embedding.word_embeddings.weight/0.0" in info.files
    report = validate_checkpoint(str(CKPT))
    assert report.ok and (report.checked_tensors, report.checked_objects) == (len(exp["tensors"]), 4), report.problems
    files = export_checkpoint(str(CKPT), str(tmp_path / "out"))
    exported = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert all(torch.equal(exported[k], t) for k, t in exp["tensors"].items())
    # a truncated chunk file is a problem naming it, before anything is read
    damaged = tmp_path / "damaged"
    shutil.copytree(CKPT, damaged)
    chunk = damaged / "embedding.word_embeddings.weight" / "1.0"
    chunk.write_bytes(chunk.read_bytes()[:100])
    report = validate_checkpoint(str(damaged))
    assert not report.ok and any("embedding.word_embeddings.weight/1.0" in p for p in report.problems), report.problems


def test_a_zarr_checkpoint_in_an_object_store(s3_server, no_aws_env):
    """On S3 with explicit client options (no usable environment): loads, strict key checks
    and the object listing of ``load_sharded_metadata`` (each object prefix opened with
    the same options)."""
    pytest.importorskip("obstore")
    from dist_checkpointing.storage import storage_for

    options = {"endpoint": s3_server.endpoint_url, "access_key_id": s3_server.access_key,
               "secret_access_key": s3_server.secret_key, "region": s3_server.region,
               "client_options": {"allow_http": True}}
    url = f"s3://{s3_server.bucket}/zarr-{os.getpid()}"
    store = storage_for(url, options)
    for path in sorted(p for p in CKPT.rglob("*") if p.is_file()):
        store.write_atomic(path.relative_to(CKPT).as_posix(), path.read_bytes())
    exp = _expected()
    assert sorted(dc.load_sharded_metadata(url, storage_options=options)) == sorted([*exp["tensors"], *exp["objects"]])
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t)) for k, t in exp["tensors"].items()}
    request["o"] = ShardedObject("rank_state", None, (4,), (3,))
    out, missing, unexpected = dc.load(request, url, strict=StrictHandling.RETURN_ALL, storage_options=options)
    assert (missing, unexpected) == (set(), set())
    assert all(torch.equal(out[k], t) for k, t in exp["tensors"].items())
    assert out["o"] == exp["objects"]["rank_state/shard_3_4"] and out["iteration"] == 40


def _load_fully_parallel(rank: int, world: int, base: str) -> list:
    """``--ckpt-fully-parallel-load``: the checkpoint's own strategy wrapped (Megatron-Core's
    tools), or a ``torch_dist`` one (Megatron-LM's trainer passes it whatever the backend)."""
    from dist_checkpointing.serialization import get_default_load_sharded_strategy
    from dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    exp = _expected()
    strategy = FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(str(CKPT)) if base == "default" else
        TorchDistLoadShardedStrategy(cache_metadata=True))
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t), replica_id=rank)
               for k, t in exp["tensors"].items()}  # every rank wants everything: the reads are spread
    out = dc.load(request, str(CKPT), sharded_strategy=strategy)
    return [k for k, t in exp["tensors"].items() if not torch.equal(out[k], t)]


@pytest.mark.parametrize("base", ["default", "torch_dist"])
def test_fully_parallel_load_wraps_the_zarr_strategy(base):
    assert get_pool(2).run(_load_fully_parallel, base) == [[], []]


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=8)
_FIELDS = {"zarr_format": st.just(2) | _JSON, "shape": st.lists(st.integers(-1, 2**40), max_size=3) | _JSON,
           "chunks": st.lists(st.integers(-1, 2**40), max_size=3) | _JSON, "dtype": st.sampled_from(sorted(DTYPES)) | _JSON,
           "compressor": st.none() | _JSON, "filters": st.none() | _JSON, "order": st.just("C") | _JSON,
           "dimension_separator": st.sampled_from([".", "/"]) | _JSON, "fill_value": _JSON}


@settings(max_examples=200, deadline=None)
@given(header=st.fixed_dictionaries({}, optional=_FIELDS) | _JSON)
def test_any_zarray_header_is_read_or_refused(tmp_path_factory, header):
    """Whatever a ``.zarray`` holds, reading it gives a checked array or a
    CheckpointingException naming it: never another error."""
    from dist_checkpointing.storage import PosixStorage
    from dist_checkpointing.strategies.zarr import MAX_CHUNKS, read_array

    root = tmp_path_factory.mktemp("hdr")
    (root / "w").mkdir()
    (root / "w" / ".zarray").write_text(json.dumps(header))
    try:
        array = read_array(PosixStorage(root), "w")
    except CheckpointingException as e:
        assert "'w'" in str(e) or "w/.zarray" in str(e)
        return
    assert len(array.shape) == len(array.chunks) and all(c > 0 for c in array.chunks)
    assert math.prod(-(-s // c) for s, c in zip(array.shape, array.chunks)) <= MAX_CHUNKS
