"""A receiver's own state, described while the sender describes its own: the local tensor
of every leaf, the kinds, shapes and dtypes compared with the sender's metadata, and the
plan the sender makes for a state like it."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten

from . import wire
from .leaves import _Columns, _kind, _local_tensor
from .plan import _plan_messages
from .wire import _Meta, _pickle_treespec


class _OwnState:
    """A receiver's own state, flattened (while the sender encodes its metadata): the local
    tensor of every leaf, and the kinds, shapes and dtypes to compare with the sender's."""

    def __init__(self, state: Any):
        self.state = state
        self.values, self.spec = tree_flatten(state)
        self.kinds = [_kind(v) for v in self.values]
        self.locals = [_local_tensor(k, v) for k, v in zip(self.kinds, self.values)]
        try:
            self.spec_pickle: Optional[bytes] = _pickle_treespec(self.spec)
        except Exception:  # noqa: BLE001 - e.g. a local class in the structure: compared as objects
            self.spec_pickle = None
        self.shapes = [None if t is None else tuple(t.shape) for t in self.locals]
        self.dtypes = [None if t is None else t.dtype for t in self.locals]
        # The data messages the sender plans for a state like this one, with this process's
        # sizes (planned here while the sender describes its state; see plan_into).
        self.sizes = (wire.BUCKET_BYTES, wire.ALONE_BYTES)
        self.planned: Optional[Tuple[List[Tuple[int, List[int]]], List[int]]] = None
        if all(t is None or type(t) is torch.Tensor for t in self.locals):
            self.nbytes = [0 if t is None else t.nbytes for t in self.locals]
            n = len(self.locals)
            self.planned = _plan_messages(
                _Columns(self.kinds, self.shapes, self.dtypes, self.nbytes, [], [None] * n, []), *self.sizes)

    def plan_into(self, meta: _Meta) -> bool:
        """Give ``meta`` the plan made for this state, if it is the sender's: the plan is
        a function of the leaves' sizes and wire dtypes and the two sizes alone
        (:func:`.plan._plan_messages`). False: ``meta`` must be planned."""
        if (self.planned is None or (meta.bucket_bytes, meta.alone_bytes) != self.sizes or meta.fp8_leaves
                or meta.columns.nbytes != self.nbytes or meta.wire != self.dtypes):
            return False
        meta.messages, meta.offsets = self.planned
        return True
