"""FP8 tensors: torch's native float8 dtypes need nothing special (their bytes are their
values); Transformer Engine's quantized tensors (``Float8Tensor``: uint8 ``_data`` plus a
per-tensor ``_scale_inv``, with ``dequantize()``) are tensor subclasses whose storage is not
their data, so they are converted at the edges:

* **saved** as their dequantized values in their nominal (high-precision) dtype, like
  Megatron-Core does: any reader (a model without FP8, a conversion tool, plain DCP)
  can read them, and they reshard like any other tensor;
* **loaded** by reading those values into a high-precision buffer and quantizing them
  into the request's ``_data`` with the request's own ``_scale_inv`` — computed here, not
  through Transformer Engine's quantizer, so the amax history is never written. With the
  scale the tensor was saved with, this restores the FP8 bytes exactly (the stored
  high-precision value is within far less than half an FP8 step of the FP8 value).

Transformer Engine is never imported here: its classes are recognised by name.

The edges: the save plan's payload is ``dequantize(t)`` (a fresh tensor, so an async save
snapshots it by construction); the load plan reads into a plain tensor of the nominal dtype
and a step after the reads calls :func:`fill_float8_` (``_data = float8(clamp(values /
_scale_inv))``, cached transposes invalidated); the fully parallel load reads and exchanges
plain stand-ins and quantizes once at the end; the exchange functions called directly send
``dequantize(t)``'s bytes and land a receiver's FP8 destination through a plain tensor. No
code path calls ``new_empty`` / ``empty_like`` on an FP8 tensor or views its storage.
Layouts other than one scale per tensor (MXFP8, block scales) fall back to
``t.copy_(values)`` on load.
"""

from __future__ import annotations

from typing import Any, Set, Tuple, Type

import torch

_TE_QUANTIZED_CLASSES = {
    "QuantizedTensor", "QuantizedTensorBase", "Float8Tensor", "Float8TensorBase",
    "MXFP8Tensor", "MXFP8TensorBase", "Float8BlockwiseQTensor", "Float8BlockwiseQTensorBase",
}
_registered: Set[Type[torch.Tensor]] = set()


def register_float8_tensor_class(cls: Type[torch.Tensor]) -> None:
    """Treat instances of ``cls`` (a tensor subclass following Transformer Engine's
    ``Float8Tensor`` interface: ``_data``, ``_scale_inv``, ``dequantize()``) as FP8 tensors."""
    _registered.add(cls)


def _unwrap(t: Any) -> Any:
    # A plain nn.Parameter around a quantized tensor (TE makes its FP8 parameters the
    # quantized class itself, which is covered by the class check).
    if type(t) is torch.nn.Parameter:
        return t.data
    return t


def is_float8tensor(t: Any) -> bool:
    """True for Transformer Engine's quantized tensors (FP8 weights), also wrapped in an
    ``nn.Parameter``, and for registered classes; False for everything else, including
    native ``torch.float8_*`` tensors (which need no conversion). Never imports TE."""
    t = _unwrap(t)
    if not isinstance(t, torch.Tensor) or type(t) is torch.Tensor:
        return False
    for cls in type(t).__mro__:
        if cls in _registered:
            return True
        if cls.__name__ in _TE_QUANTIZED_CLASSES and cls.__module__.startswith("transformer_engine"):
            return True
    return False


def dequantize(t: torch.Tensor) -> torch.Tensor:
    """The high-precision values of an FP8 tensor, as a plain tensor of its nominal dtype."""
    return _unwrap(t).dequantize().detach().to(t.dtype)


def float8_dtype(t: Any) -> torch.dtype:
    """The torch float8 dtype of an FP8 tensor's ``_data`` bytes."""
    fp8 = getattr(_unwrap(t), "_fp8_dtype", None)
    if isinstance(fp8, torch.dtype):
        return fp8
    name = str(fp8).upper()
    if "E5M2" in name:
        return torch.float8_e5m2
    if "E4M3" in name:
        return torch.float8_e4m3fn
    raise TypeError(f"Cannot tell the float8 format of {type(t).__name__} (_fp8_dtype={fp8!r})")


def per_tensor_layout(t: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """A per-tensor-scaled FP8 tensor's raw ``_data`` bytes and its one-element
    ``_scale_inv``; raises ``TypeError`` for any other layout (e.g. block scales)."""
    t = _unwrap(t)
    data, scale_inv = getattr(t, "_data", None), getattr(t, "_scale_inv", None)
    if not isinstance(data, torch.Tensor) or not isinstance(scale_inv, torch.Tensor) or scale_inv.numel() != 1:
        raise TypeError(f"{type(t).__name__} is not a per-tensor-scaled FP8 tensor")
    return data, scale_inv


def fill_float8_(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Quantize ``values`` into FP8 tensor ``t`` in place with ``t``'s current scale and
    return ``t``. Per-tensor-scaled tensors (``_data`` + one ``_scale_inv``) are written
    directly, saturating to the format's range, without calling Transformer Engine's
    quantizer (its amax history is left untouched); other quantized layouts (block
    scales) go through ``t.copy_(values)``."""
    target = _unwrap(t)
    try:
        data, scale_inv = per_tensor_layout(target)
    except TypeError:
        with torch.no_grad():
            target.copy_(values.to(target.device))
        return t
    fp8 = float8_dtype(target)
    limit = torch.finfo(fp8).max
    scaled = values.detach().to(torch.float32) * (1.0 / scale_inv.detach().to(device=values.device, dtype=torch.float32))
    quantized = scaled.clamp(-limit, limit).to(fp8).view(torch.uint8)
    with torch.no_grad():
        data.copy_(quantized.reshape(data.shape))
    if hasattr(target, "_reset_caches"):  # Transformer Engine 1.x: cached transposes
        target._reset_caches()
    elif hasattr(target, "_transpose_invalid"):
        target._transpose_invalid = True
    return t
