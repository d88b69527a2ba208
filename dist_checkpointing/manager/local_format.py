"""What a local-tier copy's header records (:mod:`.local_tier`), and a rank's sharded state
dict rebuilt from a header and its flat buffer (for the offline conversion,
:mod:`.local_convert`).

Each leaf of a ``sharded_state_dict`` has an id: ``t:{key}@{global offset}`` for a
ShardedTensor, ``o:{unique_key}`` for a ShardedObject, ``c:{path}`` for anything else.
The header (pickled into the marker) holds:

* ``layout``: each tensor's ``(id, offset, nbytes, dtype, shape)`` in the flat buffer;
* ``values``: the ShardedObjects' data and the other non-tensor leaves, by id;
* ``format`` (:data:`HEADER_FORMAT`), ``structure`` (the state dict's nesting, each leaf
  replaced by its id), ``sharded`` (for each ShardedTensor and ShardedObject id, its
  fields but the data — key, dtype, shapes, offsets, fragmentations, replica id, prepended
  axes, flattened range — as a tuple) and ``fields`` (the names of those tuples' fields,
  by id prefix): what a normal save needs. Markers written before conversion
  existed lack these three; restoring reads ``layout`` and ``values`` only.
"""

from __future__ import annotations

import pickle
from dataclasses import fields
from operator import attrgetter
from typing import Any, Callable, Dict, List, Tuple

import torch

from ..mapping import ShardedObject, ShardedStateDict
from ..sharded_tensor import ShardedTensor

#: the header's format; 2: it records what a normal save needs (``structure``, ``fields``, ``sharded``).
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


def encode_header(sharded_state_dict: ShardedStateDict, layout: List[Entry], values: Dict[str, Any]) -> bytes:
    """The pickled header of a snapshot of ``sharded_state_dict`` whose tensors lie in a
    flat buffer as ``layout`` says and whose other leaves are ``values``."""
    sharded: Dict[str, Tuple[Any, ...]] = {}

    def visit(path: str, leaf: Any) -> str:
        ident = leaf_id(path, leaf)
        if ident[0] in _GET_FIELDS:
            sharded[ident] = _GET_FIELDS[ident[0]](leaf)
        return ident

    structure = walk(sharded_state_dict, "", visit)
    return pickle.dumps({"format": HEADER_FORMAT, "layout": layout, "values": values, "structure": structure,
                         "fields": _FIELDS, "sharded": sharded})


def describes_sharding(header: Dict[str, Any]) -> bool:
    """Whether ``header`` records what a normal save needs (written since :data:`HEADER_FORMAT` 2)."""
    return header.get("format", 1) >= 2


def rebuild(header: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> ShardedStateDict:
    """The sharded state dict a header (:func:`describes_sharding`) describes, nested as it
    was saved, with ``tensors`` (by id: views of the flat buffer) as its tensors' data."""

    def visit(path: str, ident: str) -> Any:
        if ident.startswith("t:"):
            return ShardedTensor(data=tensors[ident], **dict(zip(header["fields"]["t"], header["sharded"][ident])))
        if ident.startswith("o:"):
            return ShardedObject(data=header["values"][ident],
                                 **dict(zip(header["fields"]["o"], header["sharded"][ident])))
        return tensors[ident] if ident in tensors else header["values"][ident]

    return walk(header["structure"], "", visit)
