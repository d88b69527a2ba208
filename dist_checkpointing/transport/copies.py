"""Copying tensor bytes in and out of data messages: packing buckets, splitting them
into leaves, and the FP8 conversions at either end."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..tensors.fp8 import fill_float8_, is_float8tensor, per_tensor_layout
from .leaves import _Columns, _TensorMeta


def _is_on(t: torch.Tensor, device: torch.device) -> bool:
    return t.is_cpu if device.type == "cpu" else t.device == device

def _pieces(run: torch.Tensor, leaves: List[int], c: _Columns) -> List[torch.Tensor]:
    """Each leaf's values in ``run`` (a bucket's bytes of one dtype run, viewed as that
    dtype), shaped as the leaf (one ``torch.split`` for the run; only the pieces of
    tensors that are not 1-D get a second view)."""
    size = run.element_size()
    pieces = torch.split(run, [c.nbytes[i] // size for i in leaves])
    return [p if len(c.shapes[i]) == 1 else p.view(c.shapes[i]) for i, p in zip(leaves, pieces)]


def _pack(bucket: torch.Tensor, runs: List[Tuple[torch.dtype, int, int, List[int]]],
          sources: List[Optional[torch.Tensor]]) -> None:
    """Copy the wire sources of every run's leaves into ``bucket``: one ``torch.cat`` per
    run (the alignment gaps are zeroed)."""
    pos = 0
    with torch.no_grad():
        for dtype, start, end, leaves in runs:
            if start > pos:
                bucket[pos:start].zero_()
            pos = end
            pieces = [sources[i] for i in leaves]
            run = bucket[start:end].view(dtype)
            try:
                torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in pieces], out=run)
            except RuntimeError:  # e.g. pieces on another device: one copy each
                for piece, t in zip(torch.split(run, [t.numel() for t in pieces]), pieces):
                    piece.copy_(t.reshape(-1))


def _copy_all(dsts: List[torch.Tensor], srcs: List[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair, in one call where torch offers it."""
    if not dsts:
        return
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None:
        foreach_copy(dsts, srcs)
        return
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


def _wire_view(tm: _TensorMeta, dest: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor (wire dtype, leaf shape) that a leaf's wire values can be copied into
    as they are, or ``None`` when the destination needs a conversion (FP8 values into a
    plain high-precision tensor, plain values into an FP8 tensor)."""
    if tm.fp8 is None:
        return None if is_float8tensor(dest) else dest.detach()
    if is_float8tensor(dest):
        return per_tensor_layout(dest)[0].detach().view(tm.fp8[0])
    return dest.detach() if dest.dtype == tm.fp8[0] else None


def _convert(values: torch.Tensor, tm: _TensorMeta, dest: torch.Tensor) -> None:
    """Put a leaf's wire values into a destination of another kind: plain values into an
    FP8 tensor (quantized with its own scale), FP8 values into a plain tensor
    (dequantized with the sender's scale)."""
    if tm.fp8 is None:
        fill_float8_(dest, values)
    else:
        dest.detach().copy_((values.float() * tm.fp8[1]).to(tm.dtype))


def _finish_fp8(tm: _TensorMeta, dest: torch.Tensor) -> torch.Tensor:
    """An FP8 leaf: give the receiver's FP8 tensor the sender's scale, or turn newly
    received raw float8 values into the nominal dtype."""
    fmt, scale_inv = tm.fp8
    if is_float8tensor(dest):
        with torch.no_grad():
            per_tensor_layout(dest)[1].fill_(scale_inv)
        return dest
    if dest.dtype == fmt:
        return (dest.float() * scale_inv).to(tm.dtype)
    return dest
