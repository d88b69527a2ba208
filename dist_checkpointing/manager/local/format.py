"""What a local-tier copy's header records (:mod:`.tier`), and a rank's sharded state
dict rebuilt from a header and its flat buffer (for the offline conversion,
:mod:`.convert`).

Each leaf of a ``sharded_state_dict`` has an id: ``t:{key}@{global offset}`` for a
ShardedTensor, ``o:{unique_key}`` for a ShardedObject, ``c:{path}`` for anything else.
The header (pickled into the marker, plain data only, its values ``torch.save``d inside
it and read back with the safe loader of ``common.pt``: :func:`decode_header`) holds:

* ``layout``: each tensor's ``(id, offset, nbytes, dtype, shape)`` in the flat buffer;
* ``values``: the ShardedObjects' data and the other non-tensor leaves, by id;
* ``format`` (:data:`HEADER_FORMAT`), ``structure`` (the state dict's nesting, each leaf
  replaced by its id), ``sharded`` (for each ShardedTensor and ShardedObject id, its
  fields but the data — key, dtype, shapes, offsets, fragmentations, replica id, prepended
  axes, flattened range — as a tuple) and ``fields`` (the names of those tuples' fields,
  by id prefix): what a normal save needs. Headers of earlier versions (values pickled
  inline) are refused, never unpickled.

Owns: the leaves' ids and the header: the layout, the values, and what a normal save needs —
the state dict's nesting (each leaf replaced by its id) and each ShardedTensor's and
ShardedObject's fields but the data (``format`` 2): plain data pickled and read back by an
unpickler that calls nothing (torch dtypes and slices only), the values ``torch.save``d
inside it and read with the safe loader of ``common.pt`` (``safe_torch_load``'s allow-list);
a header of an earlier version (values pickled inline) is refused unread; a rank's sharded
state dict rebuilt from a header and its buffer.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import fields
from operator import attrgetter
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...core import CheckpointingException
from ...dict_utils import extract_matching_values
from ...mapping import LocalNonpersistentObject, ShardedObject, ShardedStateDict
from ...tensors.sharded import ShardedTensor
from ...pickling.restricted import loads_plain
from ...pickling.safe_load import safe_torch_load

#: the header's format (2: it records what a normal save needs: ``structure``, ``fields``, ``sharded``)
HEADER_FORMAT = 2
Entry = Tuple[str, int, int, str, Tuple[int, ...]]  # id, offset, bytes, dtype name, shape


def walk(x: Any, path: str, visit: Callable[[str, Any], Any]) -> Any:
    """A copy of the nested dicts/lists ``x`` with each leaf replaced by ``visit(path, leaf)``."""
    if isinstance(x, dict):
        return {k: walk(v, f"{path}/{k}", visit) for k, v in x.items()}
    if isinstance(x, list):
        return [walk(v, f"{path}/{i}", visit) for i, v in enumerate(x)]
    return visit(path, x)


def leaf_id(path: str, leaf: Any) -> str:
    """The id of the leaf ``leaf`` found at ``path`` (``n:``: a LocalNonpersistentObject,
    never saved)."""
    if isinstance(leaf, ShardedTensor):
        return f"t:{leaf.key}@{','.join(map(str, leaf.global_offset))}"
    if isinstance(leaf, ShardedObject):
        return f"o:{leaf.unique_key}"
    if isinstance(leaf, LocalNonpersistentObject):
        return f"n:{path}"
    return f"c:{path}"


#: the fields recorded of each ShardedTensor / ShardedObject (all but the data), by id prefix
_FIELDS = {kind: tuple(f.name for f in fields(cls) if f.name != "data")
           for kind, cls in (("t", ShardedTensor), ("o", ShardedObject))}
_GET_FIELDS = {kind: attrgetter(*names) for kind, names in _FIELDS.items()}


def encode_header(sharded_state_dict: ShardedStateDict, layout: List[Entry], values: Dict[str, Any]) -> bytes:
    """The header of a snapshot of ``sharded_state_dict`` whose tensors lie in a flat buffer
    as ``layout`` says and whose other leaves are ``values``: the plain parts pickled, the
    values (any objects, tensors too) ``torch.save``d inside it, as ``common.pt`` is."""
    sharded: Dict[str, Tuple[Any, ...]] = {}

    def visit(path: str, leaf: Any) -> str:
        ident = leaf_id(path, leaf)
        if ident[0] in _GET_FIELDS:
            sharded[ident] = _GET_FIELDS[ident[0]](leaf)
        return ident

    structure = walk(sharded_state_dict, "", visit)
    saved = io.BytesIO()
    torch.save(values, saved)
    return pickle.dumps({"format": HEADER_FORMAT, "layout": layout, "values": saved.getvalue(),
                         "structure": structure, "fields": _FIELDS, "sharded": sharded})


def decode_header(data: bytes, where: str, length: int) -> Dict[str, Any]:
    """The header ``data`` (:func:`encode_header`) of the copy described at ``where``,
    whose flat buffer has ``length`` bytes: its
    plain parts with an unpickler that calls nothing, its values with the safe loader of
    ``common.pt`` (its allow-list); its layout checked (:func:`_layout_problem`).
    :class:`CheckpointingException` for anything else — a header of an earlier version
    (values pickled inline), damaged or hostile data — without running any of it."""
    try:
        header = loads_plain(data)
    except Exception as e:  # noqa: BLE001 - any malformed or refused pickle
        raise CheckpointingException(f"Local tier: the header of {where} is not one this version writes "
                                     f"(not loaded: {e})") from e
    if not isinstance(header, dict) or not isinstance(header.get("layout"), list) or not isinstance(
            header.get("values"), bytes):
        raise CheckpointingException(f"Local tier: the header of {where} is not one this version writes")
    problem = _layout_problem(header["layout"], length)
    if problem is not None:
        raise CheckpointingException(f"Local tier: the header of {where} is malformed: {problem}")
    header["values"] = safe_torch_load(header["values"], f"the values in the header of {where}")
    if not isinstance(header["values"], dict) or not all(isinstance(k, str) for k in header["values"]):
        raise CheckpointingException(f"Local tier: the header of {where} is malformed")
    return header


def dtype_of(name: Any) -> Optional[torch.dtype]:
    """The torch dtype a layout entry names (``"torch.float32"``), or ``None``."""
    if not isinstance(name, str) or not name.startswith("torch."):
        return None
    found = getattr(torch, name[len("torch."):], None)
    return found if isinstance(found, torch.dtype) else None


def _layout_problem(layout: List[Any], length: int) -> Optional[str]:
    """What is wrong with a layout for a flat buffer of ``length`` bytes (``None``: each
    entry an ``(id, offset, nbytes, dtype, shape)`` of the right types, its bytes those
    of its shape and dtype, inside the buffer, ids unique)."""
    seen = set()
    for n, entry in enumerate(layout):
        if not isinstance(entry, (tuple, list)) or len(entry) != 5:
            return f"layout entry {n} is not an (id, offset, bytes, dtype, shape) tuple"
        ident, offset, nbytes, dtype, shape = entry
        ints = (offset, nbytes, *shape) if isinstance(shape, (tuple, list)) else None
        if not isinstance(ident, str) or ident[:2] not in ("t:", "c:") or ident in seen:
            return f"layout entry {n} has a bad or repeated id"
        if ints is None or not all(type(v) is int and v >= 0 for v in ints):
            return f"layout entry {n} ({ident[2:]!r}) has a bad offset, size or shape"
        kind = dtype_of(dtype)
        if kind is None or math.prod(shape) * kind.itemsize != nbytes or offset + nbytes > length:
            return f"layout entry {n} ({ident[2:]!r}) does not describe {nbytes} bytes of its buffer of {length}"
        seen.add(ident)
    return None


def rebuild(header: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> ShardedStateDict:
    """The sharded state dict a header describes, nested as it
    was saved (but its LocalNonpersistentObjects), with ``tensors`` (by id: views of the
    flat buffer) as its tensors' data."""

    def visit(path: str, ident: str) -> Any:
        if ident.startswith("n:"):
            return _NOT_SAVED
        if ident.startswith("t:"):
            return ShardedTensor(data=tensors[ident], **dict(zip(header["fields"]["t"], header["sharded"][ident])))
        if ident.startswith("o:"):
            return ShardedObject(data=header["values"][ident],
                                 **dict(zip(header["fields"]["o"], header["sharded"][ident])))
        return tensors[ident] if ident in tensors else header["values"][ident]

    return extract_matching_values(walk(header["structure"], "", visit), lambda leaf: leaf is not _NOT_SAVED)[0]


_NOT_SAVED = object()  # a LocalNonpersistentObject's place in a header's structure
