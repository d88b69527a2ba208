"""A stand-in for Transformer Engine's ``Float8Tensor``, for tests without TE or a GPU.

``FakeFloat8Tensor`` follows the interface ``dist_checkpointing.tensors.fp8`` relies on: a tensor
subclass whose nominal ``dtype`` is high precision (e.g. bf16) while its values live in a
uint8 ``_data`` tensor (FP8 bytes) with one per-tensor ``_scale_inv``
(value = fp8(_data) * _scale_inv), its format in ``_fp8_dtype`` and a ``dequantize()``.

Like TE's quantizer, ``copy_`` into it quantizes *and records the amax* in
``amax_history`` (and counts itself in ``quantizer_calls``): the library must never go
through it, so tests assert both stay untouched. Any other op sees the dequantized
values (a plain tensor); ``detach`` keeps the subclass (so ``nn.Parameter(fake)`` is a
``FakeFloat8Tensor`` too, as with TE).

``_fp8_dtype`` is a torch float8 dtype, or, with ``te_style_dtype=True``, a TE-like enum
member (``TEDType.kFloat8E4M3``) that the library must recognise by name.

Registered with :func:`dist_checkpointing.tensors.fp8.register_float8_tensor_class` at import,
so importing this module in a rank process is enough.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from dist_checkpointing.tensors.fp8 import register_float8_tensor_class


class TEDType(enum.Enum):
    """Like ``transformer_engine_torch.DType``: ``str()`` gives ``'TEDType.kFloat8E4M3'``."""

    kFloat8E4M3 = 7
    kFloat8E5M2 = 8


_TO_TORCH = {TEDType.kFloat8E4M3: torch.float8_e4m3fn, TEDType.kFloat8E5M2: torch.float8_e5m2}
_TO_TE = {v: k for k, v in _TO_TORCH.items()}


def _torch_fp8(fp8_dtype: Any) -> torch.dtype:
    return _TO_TORCH.get(fp8_dtype, fp8_dtype)


class FakeFloat8Tensor(torch.Tensor):
    """Per-tensor-scaled FP8 tensor: ``_data`` (uint8), ``_scale_inv`` (1 element),
    ``_fp8_dtype``, nominal ``dtype``; ``amax_history`` written only by ``copy_``."""

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _fp8_dtype: Any
    amax_history: torch.Tensor
    quantizer_calls: list

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: Any, dtype: torch.dtype,
                amax_history: Optional[torch.Tensor] = None, quantizer_calls: Optional[list] = None):
        assert data.dtype == torch.uint8, data.dtype
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)
        t._data, t._scale_inv, t._fp8_dtype = data, scale_inv, fp8_dtype
        t.amax_history = amax_history if amax_history is not None else torch.zeros(4)
        t.quantizer_calls = quantizer_calls if quantizer_calls is not None else []
        return t

    # --------------------------------------------------------------- construction

    @classmethod
    def quantize(cls, values: torch.Tensor, scale_inv: float, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                 te_style_dtype: bool = False) -> "FakeFloat8Tensor":
        """``values`` quantized with ``scale = 1 / scale_inv`` (saturating), nominal dtype
        ``values.dtype``."""
        return cls(quantize_bytes(values, scale_inv, fp8_dtype), torch.tensor(float(scale_inv)),
                   _TO_TE[fp8_dtype] if te_style_dtype else fp8_dtype, values.dtype)

    @classmethod
    def from_bytes(cls, data: torch.Tensor, scale_inv: float, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                   dtype: torch.dtype = torch.bfloat16, te_style_dtype: bool = False) -> "FakeFloat8Tensor":
        """A tensor holding exactly the FP8 bytes ``data`` (uint8, copied)."""
        return cls(data.clone(), torch.tensor(float(scale_inv)), _TO_TE[fp8_dtype] if te_style_dtype else fp8_dtype,
                   dtype)

    @classmethod
    def empty_like_scaled(cls, shape, scale_inv: float, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                          dtype: torch.dtype = torch.bfloat16, fill_byte: int = 0) -> "FakeFloat8Tensor":
        """A load request: ``fill_byte`` everywhere, the given scale."""
        return cls.from_bytes(torch.full(tuple(shape), fill_byte, dtype=torch.uint8), scale_inv, fp8_dtype, dtype)

    # --------------------------------------------------------------- TE-like interface

    @property
    def fp8_torch_dtype(self) -> torch.dtype:
        return _torch_fp8(self._fp8_dtype)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        fp8 = self._data.view(self.fp8_torch_dtype).to(torch.float32)
        return (fp8 * self._scale_inv.to(torch.float32)).to(dtype or self.dtype)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105 - no dispatch for printing
        return (f"FakeFloat8Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, fp8={self._fp8_dtype}, "
                f"scale_inv={float(self._scale_inv)})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:
            a = args[0]
            return cls(a._data, a._scale_inv, a._fp8_dtype, a.dtype, a.amax_history, a.quantizer_calls)
        if func is torch.ops.aten.copy_.default and isinstance(args[0], cls):
            # What TE's quantizer does: record the amax, then quantize with the current scale.
            dst, src = args[0], args[1]
            src = src.dequantize() if isinstance(src, cls) else src
            dst.quantizer_calls.append("copy_")
            dst.amax_history[0] = src.detach().abs().max().float()
            dst._data.copy_(quantize_bytes(src, float(dst._scale_inv), dst.fp8_torch_dtype))
            return dst
        unwrap = lambda x: x.dequantize() if isinstance(x, cls) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def quantize_bytes(values: torch.Tensor, scale_inv: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Reference quantization: ``values / scale_inv`` saturated to the format's range, as
    FP8 bytes (uint8). Exact when ``scale_inv`` is a power of two."""
    lim = torch.finfo(fp8_dtype).max
    scaled = values.detach().to(torch.float32) / torch.tensor(float(scale_inv), dtype=torch.float32)
    return scaled.clamp(-lim, lim).to(fp8_dtype).view(torch.uint8)


register_float8_tensor_class(FakeFloat8Tensor)
