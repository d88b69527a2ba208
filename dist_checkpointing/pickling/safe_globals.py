"""What a checkpoint's pickled objects may hold by default: the safe allow-list.

Objects (ShardedObjects, ``common.pt``) are read with ``torch.load(weights_only=True)``;
:func:`allowed_globals` is what that unpickler may use on top of torch's own list:

* stdlib and NumPy types found in Megatron-LM training checkpoints (``argparse.Namespace``,
  ``types.SimpleNamespace``, ``pathlib`` paths, ``io.BytesIO``, ``signal.Signals``,
  ``torch.Generator``, NumPy arrays / dtypes / scalars);
* the plain Python values that ``torch.save``'s pickle (protocol 2) stores by naming a
  builtin or stdlib global (:data:`_PLAIN_VALUES`: ``b""``, ``frozenset``, ``slice``,
  ``range``, ``...``, ``datetime`` values, ``Decimal``, ``Fraction``, ``UUID``), each only
  through constructors that cannot be made to do more than rebuild the value;
* Megatron-Core and Transformer Engine classes, by name (:mod:`.stand_ins`): the real class
  when the user's process has already imported its module, else an inert stand-in;
* classes given to :func:`register_safe_globals` (and torch's own ``add_safe_globals``).

torch's unpickler only calls what is listed (a listed class is instantiated with
``__new__`` and filled by ``__setstate__`` or ``__dict__``); nothing is imported here.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import decimal
import fractions
import io
import pathlib
import signal
import sys
import threading
import types
import uuid
from typing import Any, Callable, Iterator, List, Tuple, Union

import numpy as np
import torch

from ..core import CheckpointingException
from .stand_ins import STAND_INS

try:  # NumPy >= 2
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
    from numpy._core.multiarray import scalar as _np_scalar
except ImportError:  # pragma: no cover - NumPy 1.x
    from numpy.core.multiarray import _reconstruct as _np_reconstruct
    from numpy.core.multiarray import scalar as _np_scalar

SafeGlobal = Union[Callable[..., Any], Tuple[Callable[..., Any], str]]

_NUMPY_DTYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                 np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128)


class UnsafeCall(CheckpointingException):
    """A pickle calls an allowed builtin in a way that could do more than rebuild a value."""


def _bytes(*args: Any) -> bytes:
    """``bytes`` as protocol 2 pickles it (``bytes()`` for ``b""``), refusing ``bytes(n)``:
    that would let a checkpoint allocate any number of bytes."""
    if args and isinstance(args[0], int):
        raise UnsafeCall(f"it calls builtins.bytes with a size ({args[0]})")
    return bytes(*args)


_SINGLETON_TYPES = {None: type(None), Ellipsis: type(Ellipsis), NotImplemented: type(NotImplemented)}


def _type(*args: Any) -> type:
    """``type(None)`` and the like, as pickled; no other use of ``type``."""
    if len(args) == 1 and (args[0] is None or args[0] is Ellipsis or args[0] is NotImplemented):
        return _SINGLETON_TYPES[args[0]]
    raise UnsafeCall("it calls builtins.type to read or create a class")


# Plain values a protocol-2 pickle stores through a global (torch's own list covers
# bytes with content, bytearray, set, complex, OrderedDict and Counter). A deque or a
# non-empty defaultdict cannot be listed: torch's unpickler fills only lists and dicts.
_PLAIN_VALUES: List[SafeGlobal] = [
    (_bytes, "builtins.bytes"), (_type, "builtins.type"), frozenset, slice, range,
    (Ellipsis, "builtins.Ellipsis"), (NotImplemented, "builtins.NotImplemented"),
    datetime.date, datetime.time, datetime.datetime, datetime.timedelta, datetime.timezone,
    decimal.Decimal, fractions.Fraction, uuid.UUID,
]

_STATIC: List[SafeGlobal] = _PLAIN_VALUES + [
    argparse.Namespace, types.SimpleNamespace, io.BytesIO, signal.Signals, torch._C.Generator,
    pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath,
    (pathlib.PureWindowsPath, "pathlib.WindowsPath"),  # cannot be instantiated on POSIX
    np.ndarray, np.dtype, _np_reconstruct, _np_scalar,
    # checkpoints written with NumPy 1.x name the reconstructors under numpy.core
    (_np_reconstruct, "numpy.core.multiarray._reconstruct"), (_np_scalar, "numpy.core.multiarray.scalar"),
] + [type(np.dtype(t)) for t in _NUMPY_DTYPES]

_REGISTERED: List[SafeGlobal] = []
# torch keeps its allow-list in one global set: one load at a time may extend it
_LOCK = threading.RLock()


def register_safe_globals(*classes: SafeGlobal) -> None:
    """Let the default (safe) loader unpickle these classes or functions.

    Each entry is a class / function, or ``(obj, "module.Name")`` to map a name a pickle
    uses onto ``obj`` (as ``torch.serialization.add_safe_globals`` accepts). Only register
    what is safe to call with arguments a checkpoint chooses: a class is created with
    ``__new__`` and filled by its ``__setstate__`` (or ``__dict__``).
    """
    for entry in classes:
        obj = entry[0] if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], str) else entry
        if not callable(obj):
            raise CheckpointingException(
                f"register_safe_globals takes classes, functions or (obj, 'module.Name') pairs, got {entry!r}")
        if entry not in _REGISTERED:
            _REGISTERED.append(entry)


def _name(entry: SafeGlobal) -> str:
    return entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"


def allowed_globals() -> List[SafeGlobal]:
    """The allow-list for one load: static types, Megatron / TE classes, registered ones.

    A Megatron / TE name resolves to the real class when its module is already imported
    (never importing it), else to the stand-in; a name the user gave torch's
    ``add_safe_globals`` keeps the user's class.
    """
    taken = {_name(e) for e in torch.serialization.get_safe_globals()} | {_name(e) for e in _REGISTERED}
    out: List[SafeGlobal] = list(_STATIC) + list(_REGISTERED)
    for full_name, stand_in in STAND_INS.items():
        if full_name not in taken:
            module, _, name = full_name.rpartition(".")
            real = getattr(sys.modules.get(module), name, None)
            out.append((real if isinstance(real, type) else stand_in, full_name))
    return out


@contextlib.contextmanager
def safe_globals_context() -> Iterator[None]:
    """Holds :data:`_LOCK` and extends torch's allow-list with :func:`allowed_globals`.

    Only the entries torch's list lacks are added, and only those are removed after:
    what the user registered with ``torch.serialization.add_safe_globals`` before stays
    registered (``torch.serialization.safe_globals`` removes every entry it was given on
    exit, also one the user had registered).
    """
    with _LOCK:
        present = set(torch.serialization.get_safe_globals())
        added = [entry for entry in allowed_globals() if entry not in present]
        with torch.serialization.safe_globals(added):
            yield
