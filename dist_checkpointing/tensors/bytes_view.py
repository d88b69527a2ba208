"""A tensor's bytes as a flat ``uint8`` tensor — the one representation in which every
dtype can be hashed, written, sent and received bit-exact.

Owns: ``as_bytes``: a tensor's bytes as a flat ``uint8`` view (any dtype; contiguous tensors
with odd strides on size-1 dimensions too) — what is hashed, written, exchanged and sent;
``nbytes(shape, dtype)``.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in row-major order as a 1-D ``uint8`` tensor: a view of ``t`` when
    it is contiguous (also with odd strides on size-1 or empty dimensions, where
    ``reshape(-1)`` keeps a stride that ``view(torch.uint8)`` refuses), else of a
    contiguous copy. ``t`` must be a plain (non-subclass) tensor; use ``t.detach()`` for
    one that requires grad."""
    if not t.is_contiguous():
        t = t.contiguous()
    return torch.as_strided(t, (t.numel(),), (1,)).view(torch.uint8)


def nbytes(shape: Tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a flat ``memoryview``, without a copy."""
    return memoryview(as_bytes(t).numpy()).cast("B")
