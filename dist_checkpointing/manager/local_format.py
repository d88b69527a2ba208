"""What a local-tier copy's header records (:mod:`.local_tier`), and a rank's sharded state
dict rebuilt from a header and its flat buffer (for the offline conversion,
:mod:`.local_convert`).

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
"""

from __future__ import annotations

import io
import pickle
from dataclasses import fields
from operator import attrgetter
from typing import Any, Callable, Dict, List, Tuple

import torch

from ..core import CheckpointingException
from ..mapping import ShardedObject, ShardedStateDict
from ..sharded_tensor import ShardedTensor
from ..strategies.safe_pickle import safe_torch_load

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
    """The id of the leaf ``leaf`` found at ``path``."""
    if isinstance(leaf, ShardedTensor):
        return f"t:{leaf.key}@{','.join(map(str, leaf.global_offset))}"
    if isinstance(leaf, ShardedObject):
        return f"o:{leaf.unique_key}"
    return f"c:{path}"


#: the fields recorded of each ShardedTensor / ShardedObject (all but the data), by id prefix
_FIELDS = {kind: tuple(f.name for f in fields(cls) if f.name != "data")
           for kind, cls in (("t", ShardedTensor), ("o", ShardedObject))}
_GET_FIELDS = {kind: attrgetter(*names) for kind, names in _FIELDS.items()}


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (containers, strings, numbers, ``torch`` dtypes, slices):
    any other global a pickle names is refused, never looked up or called."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("builtins", "slice"):
            return slice
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


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


def decode_header(data: bytes, where: str) -> Dict[str, Any]:
    """The header ``data`` (:func:`encode_header`) of the copy described at ``where``: its
    plain parts with an unpickler that calls nothing, its values with the safe loader of
    ``common.pt`` (its allow-list). :class:`CheckpointingException` for anything else —
    a header of an earlier version (values pickled inline), damaged or hostile data —
    without running any of it."""
    try:
        header = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any malformed or refused pickle
        raise CheckpointingException(f"Local tier: the header of {where} is not one this version writes "
                                     f"(not loaded: {e})") from e
    if not isinstance(header, dict) or not isinstance(header.get("layout"), list) or not isinstance(
            header.get("values"), bytes):
        raise CheckpointingException(f"Local tier: the header of {where} is not one this version writes")
    header["values"] = safe_torch_load(header["values"], f"the values in the header of {where}")
    if not isinstance(header["values"], dict):
        raise CheckpointingException(f"Local tier: the header of {where} is malformed")
    return header


def rebuild(header: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> ShardedStateDict:
    """The sharded state dict a header describes, nested as it
    was saved, with ``tensors`` (by id: views of the flat buffer) as its tensors' data."""

    def visit(path: str, ident: str) -> Any:
        if ident.startswith("t:"):
            return ShardedTensor(data=tensors[ident], **dict(zip(header["fields"]["t"], header["sharded"][ident])))
        if ident.startswith("o:"):
            return ShardedObject(data=header["values"][ident],
                                 **dict(zip(header["fields"]["o"], header["sharded"][ident])))
        return tensors[ident] if ident in tensors else header["values"][ident]

    return walk(header["structure"], "", visit)
