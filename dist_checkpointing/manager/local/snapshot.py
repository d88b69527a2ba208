"""The local tier's snapshot of one rank's state (:mod:`.tier`): every tensor in one
flat, 64-byte aligned uint8 buffer (taken on the training thread, or by a forked child
into shared memory), the pickled header (:mod:`.format`), the checksums, and the
state as it travels between ranks on restore and is filled into the caller's tensors."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from ...tensors.bytes_view import as_bytes
from ...core import CheckpointingException, malformed
from ...integrity.checksums import new_hasher
from ...dict_utils import extract_matching_values, merge
from ...mapping import LocalNonpersistentObject, ShardedObject, ShardedStateDict
from ...tensors.sharded import ShardedTensor
from ...tensors.values import is_plain_values
from ...runtime.forked_call import ForkedCall
from ...runtime.memory_maps import not_isolated_by_fork
from ...runtime.arenas import Staged, stage_into
from .format import Entry, dtype_of, encode_header, leaf_id, walk

#: test-only fault: a rank whose environment sets this has its forked snapshot die.
FAIL_SNAPSHOT_ENV = "DIST_CKPT_LOCAL_FAIL_SNAPSHOT"

_ALIGN = 64  # each tensor's offset in the flat buffer (a uint8 slice can be viewed as any dtype)

def slot(flat: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The tensor ``entry`` describes, a view of ``flat``."""
    _, offset, nbytes, dtype, shape = entry
    return flat[offset:offset + nbytes].view(dtype_of(dtype)).view(shape)


class Snapshot:
    """This rank's state as one flat uint8 buffer (every tensor, aligned) and a header: the
    layout of the buffer and the other values, pickled. The constructor plans the layout
    only; :meth:`take` copies the tensors in."""

    def __init__(self, sharded_state_dict: ShardedStateDict):
        self.tensors: List[torch.Tensor] = []
        values: Dict[str, Any] = {}
        self.layout: List[Entry] = []
        self.size = 0

        def visit(path: str, leaf: Any) -> None:
            ident = leaf_id(path, leaf)
            if isinstance(leaf, ShardedTensor):
                if leaf.data is None:
                    raise CheckpointingException(f"Local tier: ShardedTensor {leaf.key!r} has no data")
                self._add(ident, leaf.data.detach())
            elif isinstance(leaf, torch.Tensor):
                self._add(ident, leaf.detach())
            elif isinstance(leaf, LocalNonpersistentObject):
                return  # not saved: the request's own object is put back on restore
            elif hasattr(leaf, "build") and hasattr(leaf, "merge_fn"):  # a ShardedTensorFactory
                raise CheckpointingException(f"Local tier: ShardedTensorFactory {getattr(leaf, 'key', path)!r} "
                                             f"at {path} is not supported; apply the factory first")
            else:
                values[ident] = leaf.data if isinstance(leaf, ShardedObject) else leaf

        walk(sharded_state_dict, "", visit)
        self.header = encode_header(sharded_state_dict, self.layout, values)
        self.flat: Optional[torch.Tensor] = None  # set by take()
        self.checksum: Optional[int] = None  # of the tensor bytes (set by take() when forked)

    def _add(self, ident: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.layout.append((ident, self.size, nbytes, str(t.dtype), tuple(t.shape)))
        self.tensors.append(t)
        self.size += -(-nbytes // _ALIGN) * _ALIGN

    def take(self, buffer: torch.Tensor, fork: bool, pinned: bool = False) -> Union[ForkedCall, Staged]:
        """Copy the tensors into ``buffer`` (at least :attr:`size` bytes). ``fork``: in a
        forked child, which sees the tensors as they are now (copy-on-write; ``buffer``
        must be shared memory), except tensors in memory a fork does not isolate (shared
        or file-backed mappings), copied here first: returns the child at once; its result
        is the checksum of the tensor bytes. Else from this thread (:func:`...runtime.arenas.stage_into`:
        CPU tensors at once, accelerator tensors on a side stream that later work on the
        current stream waits for; ``pinned``: ``buffer`` is page-locked): returns the
        copies' handle."""
        self.flat = buffer[:self.size]
        if not fork:
            tensors, self.tensors = self.tensors, []
            return stage_into(self.flat, pinned, tensors, [entry[1] for entry in self.layout])
        here = not_isolated_by_fork(self.tensors)
        for entry, t, now in zip(self.layout, self.tensors, here):
            if now:
                slot(self.flat, entry).copy_(t)
        tensors, self.tensors = self.tensors, []
        pairs = [(self.flat.numpy()[offset:offset + nbytes], None if now else as_bytes(t).numpy())
                 for (_, offset, nbytes, _, _), t, now in zip(self.layout, tensors, here) if nbytes]

        def copy_and_hash() -> int:  # in the child: numpy copies (no torch thread pool after a fork)
            if os.environ.get(FAIL_SNAPSHOT_ENV):
                os._exit(3)
            hasher = new_hasher()
            for dst, src in pairs:
                for start in range(0, len(dst), _HASH_CHUNK):  # hashed while hot in the cache
                    if src is not None:
                        np.copyto(dst[start:start + _HASH_CHUNK], src[start:start + _HASH_CHUNK])
                    hasher.update(dst[start:start + _HASH_CHUNK])
            return hasher.intdigest()

        return ForkedCall(copy_and_hash, "Local tier snapshot")


_HASH_CHUNK = 1 << 20


def can_fork(snap: Snapshot) -> bool:
    """Whether ``snap`` can be taken in a forked child: every tensor a plain CPU tensor
    whose bytes are its values (no lazy conjugate or negative view) and ``os.fork``
    available."""
    return hasattr(os, "fork") and all(t.device.type == "cpu" and type(t) is torch.Tensor and is_plain_values(t)
                                       for t in snap.tensors)


def tensors_checksum(tensors: Sequence[torch.Tensor]) -> int:
    """xxh3-64 of the bytes of ``tensors`` (CPU), one after the other."""
    hasher = new_hasher()
    for t in tensors:
        hasher.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return hasher.intdigest()


def flat_checksum(flat: torch.Tensor, layout: List[Entry]) -> int:
    """xxh3-64 of the tensor bytes of ``flat`` in layout order (padding excluded)."""
    return tensors_checksum([flat[offset:offset + nbytes] for _, offset, nbytes, _, _ in layout])


def tensor_views(flat: torch.Tensor, layout: List[Entry]) -> Dict[str, torch.Tensor]:
    """The tensors of ``flat`` (views), by id."""
    return {e[0]: slot(flat, e) for e in sorted(layout)}


def wire_state(flat: torch.Tensor, content: Dict[str, Any]) -> Dict[str, Any]:
    """What a holder sends to restore a rank (after its header, :func:`restore_header`): its
    tensors, views of ``flat``, by id (``content``: the decoded header)."""
    return {"tensors": tensor_views(flat, content["layout"])}


def restore_header(header: bytes, length: int, flat_sum: int) -> Dict[str, Any]:
    """The first message to a rank restored from a holder: its copy's encoded header, the
    length of its flat buffer and its checksum — what the receiver needs to prepare
    :func:`receiving_state`."""
    return {"header": header, "length": length, "checksum": flat_sum}


class LayoutMismatch(CheckpointingException):
    """The state to load into does not match the saved one (not a damaged copy)."""


def sharded_targets(sharded_state_dict: ShardedStateDict) -> Dict[str, Any]:
    """The request's ShardedTensors and ShardedObjects, by id (its other leaves are not
    loaded from the copy: the saved common state is, as ``dist_checkpointing.load`` does)."""
    out: Dict[str, Any] = {}

    def visit(path: str, leaf: Any) -> None:
        if isinstance(leaf, (ShardedTensor, ShardedObject)):
            out[leaf_id(path, leaf)] = leaf

    walk(sharded_state_dict, "", visit)
    return out


def target_tensor(leaf: ShardedTensor, entry: Entry, rank: int) -> torch.Tensor:
    """The request's tensor for the layout ``entry``: an error if its shape or dtype differ."""
    ident, _, _, dtype, shape = entry
    tensor = leaf.data
    if not isinstance(tensor, torch.Tensor) or str(tensor.dtype) != dtype or tuple(tensor.shape) != tuple(shape):
        got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise LayoutMismatch(f"Local tier: rank {rank}: {ident[2:]!r} was saved as {tuple(shape)} {dtype}, "
                             f"the state to load into has {got}")
    return tensor


def check_ids(targets: Dict[str, Any], header: Dict[str, Any], rank: int) -> None:
    """Every sharded item requested is in the copy (a ShardedTensor of the same key and offset
    as a tensor of its layout, a ShardedObject as a value)."""
    tensors = {e[0] for e in header["layout"]}
    missing = sorted(i for i in targets if i not in (tensors if i.startswith("t:") else header["values"]))
    if missing:
        raise LayoutMismatch(f"Local tier: rank {rank} saved no {missing[0][2:]!r}")


def receiving_state(sharded_state_dict: ShardedStateDict, header: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """The receiver's side of :func:`wire_state`: a tensor for every tensor of the copy
    (``header``, decoded and checked against the length it came with) — the request's own
    where it asks for it (filled in place), else a new one."""
    targets = sharded_targets(sharded_state_dict)
    check_ids(targets, header, rank)
    return {"tensors": {e[0]: target_tensor(targets[e[0]], e, rank) if e[0] in targets
                        else torch.empty(tuple(e[4]), dtype=dtype_of(e[3])) for e in sorted(header["layout"])}}


def loaded_result(sharded_state_dict: ShardedStateDict, header: Dict[str, Any], tensors: Dict[str, torch.Tensor],
                  rank: int) -> Any:
    """What ``dist_checkpointing.load`` returns for the request ``sharded_state_dict`` from
    the copy described by ``header`` (decoded) whose tensors are ``tensors`` (by id): the
    request's sharded items loaded (ShardedTensors' own tensors, filled in place;
    ShardedObjects' saved objects), its LocalNonpersistentObjects unwrapped, and the saved
    common state merged in (the request's own common values are not used)."""
    with malformed(f"Local tier: rank {rank}'s copy"):  # a header of the wrong shape: a damaged copy
        return _loaded_result(sharded_state_dict, header, tensors, rank)


def _loaded_result(sharded_state_dict: ShardedStateDict, header: Dict[str, Any], tensors: Dict[str, torch.Tensor],
                   rank: int) -> Any:
    values = header["values"]
    nonpersistent, rest = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))
    sharded, _ = extract_matching_values(rest, lambda v: isinstance(v, (ShardedTensor, ShardedObject)))

    def load_leaf(path: str, leaf: Any) -> Any:
        return leaf.data if isinstance(leaf, ShardedTensor) else values[leaf_id(path, leaf)]

    saved, _ = extract_matching_values(walk(header["structure"], "", lambda path, ident: ident),
                                       lambda ident: isinstance(ident, str) and ident.startswith("c:"))
    common = walk(saved, "", lambda path, ident: tensors[ident] if ident in tensors else values[ident])
    result = merge(walk(sharded, "", load_leaf), walk(nonpersistent, "", lambda path, leaf: leaf.unwrap()))
    try:
        return merge(common, result)
    except ValueError as e:
        raise LayoutMismatch(f"Local tier: rank {rank}: the request does not fit the saved state: {e}") from e


def fill_received(sharded_state_dict: ShardedStateDict, received: Dict[str, Any], header: Dict[str, Any],
                  flat_sum: int, rank: int, what: str) -> Any:
    """``sharded_state_dict`` loaded from a :func:`wire_state` received into
    :func:`receiving_state`; its checksum verified."""
    if tensors_checksum([received["tensors"][e[0]] for e in header["layout"]]) != flat_sum:
        raise CheckpointingException(f"Local tier: {what} arrived damaged")
    return loaded_result(sharded_state_dict, header, received["tensors"], rank)
