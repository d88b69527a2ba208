"""A tensor's record is exactly ``torch.save``'s blob (zip CRC off) written as prefix +
the tensor's bytes + suffix, and the persistent writer that writes async saves' records
imports no torch."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.storage import storage_for
from dist_checkpointing.storage.zip_crc import zip_crc_disabled
from dist_checkpointing.strategies.torch_dist.blob_template import blob_parts
from dist_checkpointing.strategies.torch_dist.writing import _exact_cpu_tensor, _tensor_record
from dist_checkpointing.runtime.persistent_worker import shared_worker
from dist_checkpointing.strategies.torch_dist.save import TorchDistSaveShardedStrategy

from .helpers import slack

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


def _torch_save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    with zip_crc_disabled():
        torch.save(_exact_cpu_tensor(t), buf)
    return buf.getvalue()


def _record_bytes(t: torch.Tensor) -> bytes:
    r = _tensor_record(t)
    return r.prefix + bytes(r.data) + r.suffix


def _random(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8,
                         generator=g).view(dtype).view(shape)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 7), min_size=0, max_size=4),
       seed=st.integers(0, 2**31 - 1))
def test_a_record_is_torch_saves_blob(dtype, shape, seed):
    t = _random(dtype, tuple(shape), seed)
    blob = _record_bytes(t)
    assert blob == _torch_save(t)
    back = torch.load(io.BytesIO(blob), weights_only=True)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def _views():
    x = torch.arange(24.0).view(6, 4)
    z = torch.randn(5, dtype=torch.complex64)
    return {"transposed": x.t(), "rows of a larger tensor": x[1:3], "a strided column": x[:, 1],
            "conjugate view": z.conj(), "negative conjugate view": (-z).conj(), "parameter": torch.nn.Parameter(x),
            "requires grad": x.clone().requires_grad_(), "size-1 and empty dims": torch.empty(1, 0, 3),
            "a scalar": torch.tensor(3.5), "large": torch.randn(300_000)}


@pytest.mark.parametrize("name", list(_views()))
def test_views_and_subclasses_save_their_values(name):
    t = _views()[name]
    blob = _record_bytes(t)
    assert blob == _torch_save(t)
    back = torch.load(io.BytesIO(blob), weights_only=True)
    assert type(back) is torch.Tensor and not back.requires_grad
    assert torch.equal(back, t.detach().resolve_conj().resolve_neg())


def test_templates_depend_only_on_dtype_and_shape():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    parts_a = blob_parts(a.dtype, a.shape, lambda: a)
    assert blob_parts(b.dtype, b.shape, lambda: pytest.fail("not cached")) is parts_a
    assert _record_bytes(b) == _torch_save(b)
    assert blob_parts(torch.float64, (3, 4), lambda: torch.empty(3, 4, dtype=torch.float64)) != parts_a


def _writer_has_torch() -> bool:
    job = shared_worker().submit(eval, ("'torch' in __import__('sys').modules",), what="probe")
    return job.result(slack(60))


def test_async_saves_persistent_writer_imports_no_torch(ckpt_location):
    """Its records are written without torch, and the checkpoint equals a synchronous save's, byte for byte."""
    state = {"w": _random(torch.bfloat16, (64, 33), 1), "b": torch.arange(7, dtype=torch.int64),
             "e": torch.empty(0, 5), "flag": torch.tensor(True)}

    def sharded():
        sd = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}
        sd["obj"] = ShardedObject("obj", {"step": 3, "note": "x" * 100}, (1,), (0,))
        return sd

    sync, async_ = ckpt_location("sync"), ckpt_location("async")
    dc.save(sharded(), sync, TorchDistSaveShardedStrategy())
    request = dc.save(sharded(), async_, TorchDistSaveShardedStrategy(async_snapshot="copy"), async_sharded_save=True)
    request.execute_sync()
    assert _writer_has_torch() is False
    for location in (sync, async_):
        out = dc.load_plain_tensors(location)
        assert all(torch.equal(out[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
                   for k, v in state.items())
    files = sorted(f for f in ckpt_location.list(sync) if f.endswith(".distcp"))
    assert files and files == sorted(f for f in ckpt_location.list(async_) if f.endswith(".distcp"))
    for f in files:
        assert storage_for(sync).read_bytes(f) == storage_for(async_).read_bytes(f), f
    assert "torch" in sys.modules  # this process has it; the writer does not


def test_a_reader_parses_each_layout_once_and_never_mixes_two(tmp_path, monkeypatch):
    """Blobs of one dtype and shape are parsed once per load; a blob of the same length but
    another shape or dtype (other bytes outside its data) is parsed on its own."""
    from dist_checkpointing.strategies.torch_dist import torch_blob

    state = {"a": torch.randn(2, 3), "b": torch.randn(3, 2), "c": torch.arange(6, dtype=torch.int32).view(2, 3),
             **{f"same{i}": torch.randn(2, 3) for i in range(20)}}
    dc.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}, tmp_path / "c",
            TorchDistSaveShardedStrategy(thread_count=1))
    parses = []
    parse = torch_blob.zipfile.ZipFile
    monkeypatch.setattr(torch_blob.zipfile, "ZipFile", lambda f: parses.append(1) or parse(f))
    request = {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in state.items()}
    out = dc.load(request, tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert len(parses) == 3  # (2, 3) float32, (3, 2) float32, (2, 3) int32: same length, other layouts


def test_an_arena_save_holds_no_source_tensor_once_copied(tmp_path):
    """Once `save` returns (the copies made), the background write needs only the arena:
    the request keeps offsets, dtypes and shapes, never the trainer's tensors."""
    import gc
    import weakref

    t = torch.randn(1000)
    ref = weakref.ref(t)
    sd = {"t": ShardedTensor.from_rank_offsets("t", t)}
    request = dc.save(sd, tmp_path / "c", TorchDistSaveShardedStrategy(async_snapshot="copy"), async_sharded_save=True)
    expected = t.clone()
    del sd, t
    gc.collect()
    assert ref() is None
    request.execute_sync()
    assert torch.equal(dc.load_plain_tensors(tmp_path / "c")["t"], expected)
