"""How the transport describes a state's leaves: each leaf's kind, shape, dtype, size and
FP8 format, one column per field (what the metadata carries), and the tensor whose
elements travel for it.

Owns: describing a state's leaves: kind (tensor, ShardedTensor, DTensor, value), shape,
dtype, wire size and FP8 format, one column per field (``_Columns``); the tensor whose
elements travel for each leaf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..tensors.fp8 import float8_dtype, is_float8tensor, per_tensor_layout
from ..core import check_key, key_problem
from ..mapping import ShardedTensor

try:  # DTensor is optional (older or stripped-down torch builds)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def check_state_keys(state: Any, path: Tuple[Any, ...] = ()) -> None:
    """Every string key of the dicts nested in ``state`` (through dicts, lists and tuples)
    passes :func:`~..core.key_problem`; raises :class:`CheckpointingException` naming the
    first that does not, with where it is."""
    if isinstance(state, dict):
        for key, value in state.items():
            if isinstance(key, str) and key_problem(key) is not None:
                check_key(key, f"The state's entry {''.join(f'[{p!r}]' for p in path + (key,))}")
            check_state_keys(value, path + (key,))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            check_state_keys(value, path + (i,))


@dataclass
class _TensorMeta:
    shape: Tuple[int, ...]
    dtype: torch.dtype  # the leaf's dtype (nominal dtype for FP8 tensors)
    nbytes: int  # bytes on the wire
    requires_grad: bool
    fp8: Optional[Tuple[torch.dtype, float]] = None  # (float8 format, scale_inv) of an FP8 tensor


@dataclass
class _Leaf:
    kind: str  # "tensor", "sharded_tensor", "dtensor" or "value"
    tensor: Optional[_TensorMeta] = None
    value: Any = None  # a ShardedTensor without data, a DTensor spec, or the value itself


@dataclass
class _Columns:
    """Every leaf's metadata, one list per field (what travels: pickling and unpickling
    lists is fast, thousands of objects are not). Value leaves: kind "value", shape and
    dtype ``None``, 0 bytes."""

    kinds: List[str]
    shapes: List[Optional[Tuple[int, ...]]]
    dtypes: List[Optional[torch.dtype]]
    nbytes: List[int]
    requires_grad: List[bool]
    fp8: List[Optional[Tuple[torch.dtype, float]]]
    values: List[Any]

    @classmethod
    def describe(cls, values: Sequence[Any]) -> Tuple["_Columns", List[Optional[torch.Tensor]]]:
        """The columns of a flattened state, and each leaf's wire source (see
        :func:`_wire_source`; ``None`` for values)."""
        c = cls([], [], [], [], [], [], [])
        tensors: List[Optional[torch.Tensor]] = []
        kinds, shapes, dtypes, nbytes = c.kinds.append, c.shapes.append, c.dtypes.append, c.nbytes.append
        grads, fp8s, extras, locals_ = c.requires_grad.append, c.fp8.append, c.values.append, tensors.append
        for value in values:
            if type(value) is torch.Tensor:  # the common case, inline
                kinds("tensor"), shapes(tuple(value.shape)), dtypes(value.dtype), nbytes(value.nbytes)
                grads(value.requires_grad), fp8s(None), extras(None), locals_(value)
                continue
            kind = _kind(value)
            local = _local_tensor(kind, value)
            kinds(kind if local is not None else "value")
            locals_(local)
            if local is None:
                shapes(None), dtypes(None), nbytes(0), grads(False), fp8s(None), extras(value)
                continue
            try:
                tensors[-1] = _wire_source(local)
                tm = _tensor_meta(local)
            except Exception as e:  # noqa: BLE001 - e.g. an FP8 layout that is not per-tensor scaled
                raise _LeafError(len(tensors) - 1, e) from e
            shapes(tm.shape), dtypes(tm.dtype), nbytes(tm.nbytes), grads(tm.requires_grad), fp8s(tm.fp8)
            extras(value.without_data() if kind == "sharded_tensor" else value._spec if kind == "dtensor" else None)
        return c, tensors


class _LeafError(Exception):
    """A leaf that cannot be described: its index in the flattened state, and why."""

    def __init__(self, index: int, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.index = index



class _LeafColumns(Sequence[_Leaf]):
    """Decoded metadata as leaf objects, each built on first access (the receiver's common
    paths read the columns directly)."""

    def __init__(self, columns: _Columns):
        self._c = columns
        self._leaves: List[Optional[_Leaf]] = [None] * len(columns.kinds)

    def __len__(self) -> int:
        return len(self._leaves)

    def __getitem__(self, i):  # type: ignore[override]
        leaf = self._leaves[i]
        if leaf is None:
            c = self._c
            tm = None if c.kinds[i] == "value" else _TensorMeta(
                c.shapes[i], c.dtypes[i], c.nbytes[i], c.requires_grad[i], c.fp8[i])
            leaf = self._leaves[i] = _Leaf(c.kinds[i], tm, c.values[i])
        return leaf


def _local_tensor(kind: str, value: Any) -> Optional[torch.Tensor]:
    if kind == "tensor":
        return value
    if kind == "sharded_tensor":
        return value.data
    if kind == "dtensor":
        return value._local_tensor
    return None


def _kind(value: Any) -> str:
    if type(value) is torch.Tensor:  # the common case first
        return "tensor"
    if isinstance(value, ShardedTensor) and isinstance(value.data, torch.Tensor):
        return "sharded_tensor"
    if DTensor is not None and isinstance(value, DTensor):
        return "dtensor"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "value"


def _wire_source(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose elements travel for a non-plain leaf tensor ``t``: an FP8
    tensor's raw data viewed as its float8 format, or ``t`` detached. (A plain tensor is
    its own wire source.)"""
    if is_float8tensor(t):
        return per_tensor_layout(t)[0].detach().view(float8_dtype(t))
    return t.detach()


def _wire_dtypes(c: "_Columns") -> List[Optional[torch.dtype]]:
    """Each leaf's dtype on the wire: its dtype, or an FP8 tensor's float8 format."""
    return [f[0] if f else d for d, f in zip(c.dtypes, c.fp8)]


def _tensor_meta(t: torch.Tensor) -> _TensorMeta:
    """A non-plain tensor's metadata (plain tensors are described inline, see
    :meth:`_Columns.describe`)."""
    fp8 = None
    if is_float8tensor(t):
        data, scale_inv = per_tensor_layout(t)
        fp8 = (float8_dtype(t), float(scale_inv.item()))
        nbytes = data.numel()
    else:
        nbytes = t.numel() * t.element_size()
    return _TensorMeta(tuple(t.shape), t.dtype, nbytes, bool(t.requires_grad), fp8)
