"""The one restricted-unpickling rule: a pickle may name only the globals of an allow-list
(a mapping ``(module, name) -> object``) and torch's dtypes; any other global is refused,
never imported, looked up or called. Every unpickler of stored bytes is a
:class:`RestrictedUnpickler` with its own allow-list (DCP metadata: :mod:`.safe_load`; the
header of a ``torch.save`` blob: :mod:`.blob_header`; plain data: :func:`loads_plain`);
``torch.load`` goes through :func:`.safe_load.safe_torch_load`.

Bytes pickled by this job's own processes are a trusted channel, not stored content
(:func:`.trusted.loads_trusted`).
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable, Mapping, Tuple

import torch

Allowed = Mapping[Tuple[str, str], Any]


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles ``data`` with only ``allowed`` globals (and torch dtypes where ``dtypes``);
    ``refuse(module, name)`` makes the exception raised for any other."""

    def __init__(self, data: bytes, allowed: Allowed, refuse: Callable[[str, str], Exception], dtypes: bool = True):
        super().__init__(io.BytesIO(data))
        self._allowed, self._refuse, self._dtypes = allowed, refuse, dtypes

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if self._dtypes and module in ("torch", "torch.distributed.checkpoint.metadata") and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)):
            return getattr(torch, name)
        raise self._refuse(module, name)


_PLAIN: Allowed = {("builtins", "slice"): slice}


def loads_plain(data: bytes) -> Any:
    """Unpickle plain data only (containers, strings, numbers, torch dtypes, slices); a
    pickle naming any other global raises ``pickle.UnpicklingError``."""
    return RestrictedUnpickler(data, _PLAIN, lambda m, n: pickle.UnpicklingError(f"{m}.{n} is not plain data")).load()
