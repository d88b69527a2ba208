"""FP8 checkpointing with real Transformer Engine ``Float8Tensor`` weights.

Skipped unless a GPU is available and ``transformer_engine`` imports. Single process, no
process group. A ``te.Linear`` built under ``fp8_model_init()`` holds its weight as a
``Float8Tensor`` (uint8 ``_data``, ``_scale_inv``, nominal dtype bf16). Saved, it is stored
as its dequantized bf16 values; loaded into another FP8 weight with the same scale, the FP8
bytes come back exactly, without going through TE's quantizer (amax history untouched).
"""

from __future__ import annotations

import importlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("Transformer Engine FP8 tests need a CUDA device", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch")

import dist_checkpointing as dc  # noqa: E402
from dist_checkpointing import ShardedTensor  # noqa: E402
from dist_checkpointing.tensors.fp8 import is_float8tensor  # noqa: E402


def _float8_tensor_class():
    for mod in ("transformer_engine.pytorch.tensor.float8_tensor", "transformer_engine.pytorch.float8_tensor"):
        try:
            return importlib.import_module(mod).Float8Tensor
        except (ImportError, AttributeError):
            continue
    return None


def _fp8_linear(seed: int):
    torch.manual_seed(seed)
    with te.fp8_model_init(enabled=True):
        return te.Linear(64, 32, bias=False, params_dtype=torch.bfloat16, device="cuda")


def _amax_histories(module) -> list:
    """Clones of every amax history tensor the module keeps (TE's delayed scaling)."""
    out = []
    for meta in getattr(module, "fp8_meta", {}).values():
        history = getattr(meta, "amax_history", None)
        if isinstance(history, torch.Tensor):
            out.append(history.detach().clone())
    return out


def _set_scale_inv(weight, scale_inv: torch.Tensor) -> None:
    with torch.no_grad():
        weight._scale_inv.copy_(scale_inv.to(weight._scale_inv.device))


def test_is_float8tensor_for_te_weights():
    w = _fp8_linear(0).weight
    cls = _float8_tensor_class()
    if cls is not None:
        assert isinstance(w, cls), type(w)
    assert is_float8tensor(w), type(w)
    assert w.dtype == torch.bfloat16
    for t in (torch.zeros(4, device="cuda"), w.dequantize(), torch.zeros(4, dtype=torch.float8_e4m3fn),
              torch.nn.Parameter(torch.zeros(4))):
        assert not is_float8tensor(t), type(t)


def test_te_fp8_weight_round_trip(tmp_path):
    src, dst = _fp8_linear(1), _fp8_linear(2)
    w = src.weight
    values = w.dequantize().detach().clone()
    saved_bytes = w._data.detach().clone()
    dc.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "ckpt")
    assert dc.load_tensors_metadata(tmp_path / "ckpt")["w"].dtype == torch.bfloat16

    _set_scale_inv(dst.weight, w._scale_inv)
    histories = _amax_histories(dst)
    target = dst.weight
    bf16 = torch.zeros(tuple(w.shape), dtype=torch.bfloat16, device="cuda")
    out = dc.load({"w": ShardedTensor.from_rank_offsets("w", target),
                   "bf": ShardedTensor.from_rank_offsets("w", bf16, replica_id=1)}, tmp_path / "ckpt")
    assert out["w"] is target
    assert torch.equal(target._data.view(torch.uint8).cpu(), saved_bytes.view(torch.uint8).cpu())
    assert torch.equal(out["bf"].cpu(), values.cpu())
    after = _amax_histories(dst)
    assert len(after) == len(histories)
    for before, now in zip(histories, after):
        assert torch.equal(before, now), "loading wrote the module's amax history"
