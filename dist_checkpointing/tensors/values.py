"""A tensor's values as a plain tensor: the one "materialize" step every save path takes
(sync writes, the fork's host copies, the staging arenas of ``copy``/``stream`` snapshots,
the local tier), so every snapshot mode accepts exactly what a sync save accepts and
writes the same bytes.

Owns: ``plain_values``: a tensor's values as a plain tensor (detached, FP8 dequantized,
conjugate and negative views resolved) — the one materialize step of every save path and
snapshot mode; ``is_plain_values``.
"""

from __future__ import annotations

import torch

from .fp8 import dequantize, is_float8tensor


def plain_values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a plain ``torch.Tensor`` on ``t``'s device: detached, Transformer
    Engine FP8 tensors dequantized to their nominal dtype (what the sync save stores), other
    subclasses (``nn.Parameter``, ...) seen as plain tensors, lazy conjugate and negative
    views resolved. A view of ``t`` (no copy) where ``t`` already is plain values; the
    layout is kept (may be non-contiguous)."""
    t = t.detach()
    if is_float8tensor(t):
        t = dequantize(t)
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    return t.resolve_conj().resolve_neg()


def is_plain_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds its values as they are (no FP8 quantization, no lazy
    conjugate or negative bit): its bytes can be copied as they lie."""
    return not is_float8tensor(t) and not t.is_conj() and not t.is_neg()
