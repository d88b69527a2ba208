"""Comparing every rank's common state with rank 0's before a save (only rank 0's is
saved): a digest per rank, and the differing keys named only when digests differ.

Every rank computes a 16-byte BLAKE2b digest of its (preprocessed) common state (dict keys
sorted, tensors by dtype, shape and bytes, other values pickled, or their ``repr``); one
32-byte ``all_reduce`` (MAX) of the digest and its complement (255 - b) tells every rank
whether all digests are equal (max = min byte by byte). Only if not, one
``broadcast_object`` of rank 0's digest and common state, and each differing rank logs the
differing key paths (:func:`..dict_utils.diff`, Megatron-Core's semantics and wording) on
the ``dist_checkpointing.validation`` logger. A difference never fails the save: rank 0's
common state is saved. If rank 0's state cannot be pickled it broadcasts ``None`` and the
differing ranks report the difference without the key details.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from typing import Any, Optional

import torch

from ..pickling.trusted import loads_trusted
from ..runtime.collectives import all_reduce_max_uint8, broadcast_object, error_message, get_rank, run_agreed
from ..dict_utils import diff
from ..tensors.bytes_view import as_bytes

logger = logging.getLogger("dist_checkpointing.validation")  # the logger users filter (as before the split)


def _fingerprint(obj: Any, h: "hashlib._Hash") -> None:
    if isinstance(obj, dict):
        h.update(b"d%d" % len(obj))
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _fingerprint(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        h.update(b"l%d" % len(obj))
        for v in obj:
            _fingerprint(v, h)
    elif isinstance(obj, torch.Tensor):
        h.update(f"t{obj.dtype}{tuple(obj.shape)}{obj.device.type}".encode())
        if obj.device.type != "meta":  # a meta tensor has no values to compare
            h.update(as_bytes(obj.detach().cpu().contiguous()).numpy().tobytes())
    else:
        try:
            h.update(pickle.dumps(obj))
        except Exception:  # noqa: BLE001 - unpicklable: compare by repr
            h.update(repr(obj).encode())


def common_state_digest(common: Any) -> str:
    """A digest of a (nested) common state; equal states have equal digests."""
    h = hashlib.blake2b(digest_size=16)
    _fingerprint(common, h)
    return h.hexdigest()


def check_common_state_consistency(common: Any, group: Optional[Any] = None) -> Optional[str]:
    """Compare every rank's common state with rank 0's (which is the one saved).

    Costs one 32-byte ``all_reduce`` (MAX of the 16-byte digest and of its complement: all
    digests are equal iff both agree); only when digests differ, rank 0's digest and state
    are broadcast so that each differing rank can name the keys. Returns (and logs as
    a warning) this rank's difference report, or ``None``. A digest that cannot be
    computed on some rank raises on every rank.
    """
    digest = run_agreed(lambda: common_state_digest(common), "Digesting the common state", group)
    mine = list(bytes.fromhex(digest))
    agreed = all_reduce_max_uint8(mine + [255 - b for b in mine], group)
    if agreed[:len(mine)] == [255 - b for b in agreed[len(mine):]]:  # max == min: one digest everywhere
        return None
    payload = None
    if get_rank(group) == 0:
        try:  # pickle here, so a failure cannot leave the other ranks waiting in the broadcast
            payload = pickle.dumps(common)
        except Exception:  # noqa: BLE001 - the others then report without key details
            payload = None
    digest0, payload = broadcast_object((digest, payload), group)
    if digest == digest0:
        return None
    rank = get_rank(group)
    # worded as Megatron-Core words it (its tests match the whole message)
    prefix = f"Rank {rank} common state dict differs from rank 0 common state dict."
    try:  # nothing collective follows: a failure here must not leave this rank behind
        rank0_common = loads_trusted(payload)  # rank 0's, over the process group
        only_rank0, only_here, different = diff(rank0_common, common)
        if not (only_rank0 or only_here or different):
            return None  # equal as Megatron-Core compares them (e.g. equal values of other dtypes)
        mismatched = [entry[:3] for entry in different]
        report = (f"{prefix} Keys only on rank 0: {only_rank0}, Keys only on {rank}: {only_here}, "
                  f"Mismatched keys: {mismatched}")
    except Exception as e:  # noqa: BLE001 - unpicklable or incomparable: report without details
        reason = "cannot be pickled" if payload is None else f"cannot be compared here ({error_message(e)})"
        report = f"{prefix} Rank 0's common state {reason}, so the differing keys are unknown"
    logger.warning(report)
    return report
