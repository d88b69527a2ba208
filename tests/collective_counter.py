"""Counts, inside one rank process, the collective calls made through ``torch.distributed``
and the bytes this rank receives from them (tests only; no collective is faked)."""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator

import torch
import torch.distributed as dist


@dataclass
class CollectiveCount:
    """Calls per function and bytes received by this rank."""

    calls: Dict[str, int] = field(default_factory=dict)
    received: int = 0

    @property
    def n_calls(self) -> int:
        return sum(self.calls.values())


def _tensor_bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _objects_bytes(objs: Any) -> int:
    return sum(len(pickle.dumps(o)) for o in objs or [])


# what each function delivers to this rank, read from its arguments once it returned
_RECEIVED: Dict[str, Callable[..., int]] = {
    "all_to_all_single": lambda out, *a, **k: _tensor_bytes(out),
    "all_reduce": lambda t, *a, **k: _tensor_bytes(t),
    "broadcast": lambda t, *a, **k: _tensor_bytes(t),
    "recv": lambda t, *a, **k: _tensor_bytes(t),
    "irecv": lambda t, *a, **k: _tensor_bytes(t),  # counted when posted: its size is known then
    "all_gather": lambda out, *a, **k: sum(_tensor_bytes(t) for t in out),
    "gather": lambda t, gather_list=None, *a, **k: sum(_tensor_bytes(x) for x in gather_list or []),
    "reduce": lambda t, dst=0, *a, **k: _tensor_bytes(t) if dist.get_rank() == dst else 0,
    "send": lambda *a, **k: 0,
    "all_gather_object": lambda out, *a, **k: _objects_bytes(out),
    "gather_object": lambda obj, object_gather_list=None, *a, **k: _objects_bytes(object_gather_list),
    "broadcast_object_list": lambda box, *a, **k: _objects_bytes(box),
    "scatter_object_list": lambda box, *a, **k: _objects_bytes(box),
}


@contextmanager
def count_collectives() -> Iterator[CollectiveCount]:
    """Within the block, wrap the ``torch.distributed`` collectives to count them."""
    count = CollectiveCount()
    originals = {name: getattr(dist, name) for name in _RECEIVED}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            count.calls[name] = count.calls.get(name, 0) + 1
            count.received += _RECEIVED[name](*args, **kwargs)
            return result
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield count
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
