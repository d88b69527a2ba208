"""Load strictness (:class:`StrictHandling`) and checks on what is saved and loaded (the
common state's comparison across ranks lives in :mod:`.integrity.common_state`).

**Sharding validation** (:func:`validate_sharding_integrity`, step 2 of a save; of a load
with ``allow_gaps=True``) proves, without exchanging any chunk list, that the main replicas
cover every global tensor exactly once. Each chunk ``[o, o+n) x ...`` gets an additive
fingerprint ``F = prod_axis sum_{i=o}^{o+n-1} r_axis^i (mod 2^61 - 1)`` with a fixed base per
axis: ``F`` of disjoint chunks adds up to ``F`` of their union, so the main replicas cover a
tensor exactly once iff their volumes add up to its size *and* their fingerprints to
``F(whole tensor)`` (up to a probability of about ``ndim / 2^61``).

1. Every rank summarises its items per key (``"tensor:<key>"`` / ``"object:<key>"``): kind,
   global shape and dtype (objects: the grid shape) and, over its main replicas, their
   number, volume and fingerprint sum (non-main replicas give shape and dtype only).
2. Each key is judged by one rank (``blake2b(key) mod world``). The summaries reach it in two
   hops, each a :func:`~.runtime.collectives.exchange_objects` (two ``all_to_all_single``):
   to an aggregating rank per key and block of ``ceil(sqrt(world))`` ranks, which adds up the
   block's volumes and fingerprints, then to the judge. A summary is the key plus ~35 bytes
   whatever the number of chunks; a key held by all of 8,192 ranks costs its judge 91
   messages. (A rank whose summaries cannot be pickled sends size -1: every rank raises.)
3. The verdict: a rank holds the key in two layouts; ranks disagree on shape/dtype; main
   replicas overlap (volume too large), leave gaps (too small), or both (right volume, wrong
   fingerprint); for objects, duplicate main replicas of a piece or pieces with none.
4. One 1-byte ``all_reduce`` (MAX): did any judge find a problem? Only then an
   ``all_gather_object`` of the problems, and every rank raises the same message.

Repeated saves: each rank keeps a 16-byte digest of its summaries from the last validation
that passed (per process group and mode); the 2-byte ``all_reduce`` that opens the check
says whether any rank's digest changed, and if none did the exchanges are skipped.

**Strict handling** finds missing keys without gathering key lists: every rank builds a
``uint8`` bitmap over the sorted checkpoint keys (1 where it requests the key) and one
``all_reduce`` (MAX) marks the keys some rank requests. The ``RAISE_*`` modes agree with a
1-byte ``all_reduce`` whether any rank has unexpected keys, and only then gather the lists,
so every rank raises the same message naming the ranks.

Owns: ``StrictHandling`` and the ``strict`` argument,
``determine_missing_and_unexpected_keys``, ``handle_mismatched_keys``;
``validate_sharding_integrity`` (exact-cover fingerprints; also Megatron-Core's form, every
rank's gathered metadata).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import pickle
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch.distributed as dist

from .runtime.collectives import (
    all_gather_object, all_reduce_max_uint8, exchange_objects, get_rank, get_world_size, run_agreed_with_flags,
)
from .core import CheckpointingException, check_key
from .integrity.manifest import MANIFEST_FNAME as INTEGRITY_FNAME  # noqa: F401 - Megatron-Core 0.19's names
from .integrity.manifest import save_integrity_manifest, verify_integrity_manifest  # noqa: F401
from .integrity.common_state import check_common_state_consistency
from .dict_utils import extract_matching_values, nested_values
from .mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """What ``load`` does with key mismatches between request and checkpoint.

    *Unexpected* keys are requested but absent from the checkpoint (per rank); *missing*
    keys are in the checkpoint but requested by no rank (global).
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        """Whether the mode needs the request compared with the checkpoint metadata."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        """Whether the mode needs every rank's request (to find missing keys)."""
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        """Whether ``load`` returns ``(state_dict, missing, unexpected)``."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """Accept a :class:`StrictHandling` or its string value."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError as e:
        raise CheckpointingException(
            f"Unknown strict mode {strict!r}; use one of {[m.value for m in StrictHandling]}"
        ) from e


# ----------------------------------------------------------------------------- sharding integrity

# Exact-cover fingerprints. A chunk [o, o+n) x ... of a global tensor is summarised by
# F = prod_axis sum_{i=o}^{o+n-1} r_axis^i  (mod P). F is additive over disjoint chunks, so
# the main replicas cover every element exactly once iff the volumes add up to the global
# size and the fingerprints add up to F(whole tensor); a gap hidden by an overlap of the
# same volume changes the sum except with probability ~ndim/P.
_P = (1 << 61) - 1


@functools.lru_cache(maxsize=None)
def _axis_constants(axis: int) -> Tuple[int, int]:
    """``(r, 1 / (r - 1) mod P)`` of an axis (the inverse is the costly part: computed once)."""
    r = (0x9E3779B97F4A7C15 * (axis + 1) + 0x632BE59BD9B4E019) % (_P - 2) + 2
    return r, pow(r - 1, _P - 2, _P)


def _geometric(axis: int, offset: int, n: int) -> int:
    if n <= 0:
        return 0
    r, inverse = _axis_constants(axis)
    return pow(r, offset, _P) * (pow(r, n, _P) - 1) % _P * inverse % _P


def region_fingerprint(offsets: Sequence[int], sizes: Sequence[int]) -> int:
    """Additive fingerprint of the elements of a region (see module comment)."""
    fp = 1
    for axis, (off, size) in enumerate(zip(offsets, sizes)):
        fp = fp * _geometric(axis, off, size) % _P
    return fp


@dataclass
class _KeySummary:
    """What one rank contributes to the verdict on one key (a few dozen bytes)."""

    kind: str  # "tensor" or "object"
    meta: Tuple  # (global_shape, dtype name) for tensors, (grid shape,) for objects
    other_meta: Optional[Tuple] = None  # a second layout of the key on the same rank
    n_main: int = 0
    volume: int = 0
    fingerprint: int = 0


def _summaries(items: Iterable[Any]) -> Dict[str, _KeySummary]:
    out: Dict[str, _KeySummary] = {}
    for sh in items:
        if isinstance(sh, ShardedBase):
            check_key(sh.key, type(sh).__name__)
        if isinstance(sh, ShardedTensor) and sh.flattened_range is not None:
            # flattened slices must tile every chunk: check them in the reformulated space
            shape, offsets, sizes = sh.reformulated_region()
            kind, meta = "tensor", (shape, str(sh.dtype), "flattened")
        elif isinstance(sh, ShardedTensor):
            kind, meta = "tensor", (tuple(sh.global_shape), str(sh.dtype))
            offsets, sizes = sh.global_region()
        elif isinstance(sh, ShardedObject):
            kind, meta = "object", (tuple(sh.global_shape),)
            offsets, sizes = sh.global_offset, (1,) * len(sh.global_offset)
        else:
            continue
        summary = out.setdefault(f"{kind}:{sh.key}", _KeySummary(kind, meta))
        if summary.meta != meta:
            summary.other_meta = meta
        if is_main_replica(sh.replica_id):
            summary.n_main += 1
            summary.volume += math.prod(sizes)
            summary.fingerprint = (summary.fingerprint + region_fingerprint(offsets, sizes)) % _P
    return out


# A summary as it travels: (meta, other_meta, n_main, volume, fingerprint)
_Wire = Tuple[Tuple, Optional[Tuple], int, int, int]


def _wire(summary: _KeySummary) -> _Wire:
    return summary.meta, summary.other_meta, summary.n_main, summary.volume, summary.fingerprint


@dataclass
class _Combined:
    """Summaries of one key from several ranks, combined: the sums, and the rank lists
    that the messages name. Combined first on an aggregating rank per block of ranks, then
    on the rank that judges the key."""

    layouts: Dict[Tuple, List[int]] = field(default_factory=dict)  # layout -> ranks holding the key so
    mixed: List[Tuple[int, Tuple, Tuple]] = field(default_factory=list)  # (rank, layout, other layout)
    holders: List[int] = field(default_factory=list)  # ranks holding main replicas
    volume: int = 0
    fingerprint: int = 0

    def add(self, rank: int, wire: _Wire) -> None:
        """Add one rank's summary."""
        meta, other_meta, n_main, volume, fingerprint = wire
        self.layouts.setdefault(meta, []).append(rank)
        if other_meta is not None:
            self.mixed.append((rank, meta, other_meta))
        if n_main:
            self.holders.append(rank)
        self.volume += volume
        self.fingerprint = (self.fingerprint + fingerprint) % _P

    def merge(self, wire: Tuple) -> None:
        """Add a combination made elsewhere (as :meth:`to_wire` sent it)."""
        layouts, mixed, holders, volume, fingerprint = wire
        for meta, ranks in layouts.items():
            self.layouts.setdefault(meta, []).extend(ranks)
        self.mixed.extend(mixed)
        self.holders.extend(holders)
        self.volume += volume
        self.fingerprint = (self.fingerprint + fingerprint) % _P

    def to_wire(self) -> Tuple:
        return self.layouts, self.mixed, self.holders, self.volume, self.fingerprint


def _verdict(name: str, combined: _Combined, allow_gaps: bool) -> Optional[str]:
    kind, key = name.split(":", 1)
    label = "ShardedTensor" if kind == "tensor" else "ShardedObject"
    if combined.mixed:
        detail = ", ".join(f"rank {r}: {meta} and {other}" for r, meta, other in sorted(combined.mixed))
        return f"{label} {key!r}: a rank holds it in two different layouts ({detail})"
    if len(combined.layouts) > 1:
        what = "global shape/dtype" if kind == "tensor" else "grid shape"
        per_rank = sorted(((r, meta) for meta, ranks in combined.layouts.items() for r in ranks), key=lambda x: x[0])
        detail = ", ".join(f"rank {r}: {meta}" for r, meta in per_rank)
        return f"{label} {key!r}: ranks disagree on the {what} ({detail})"
    grid = next(iter(combined.layouts))[0]
    total = math.prod(grid)
    volume, holders = combined.volume, sorted(combined.holders)
    unit = "elements" if kind == "tensor" else "pieces"
    if volume == total and combined.fingerprint == region_fingerprint((0,) * len(grid), grid) % _P:
        return None
    if allow_gaps and volume <= total:
        return None  # a partial request; overlaps that hide in it are not detectable here
    if volume > total:
        problem = f"main replicas overlap: they cover {volume} {unit} of {total} (two main replicas of one chunk?)"
    elif volume < total:
        problem = f"{total - volume} of {total} {unit} have no main replica (a chunk held by no main replica)"
    else:
        problem = f"main replicas overlap and leave gaps ({volume} {unit} of {total}, misplaced)"
    if kind == "object" and volume > total:
        problem = f"duplicate main replicas: {volume} pieces for a grid of {total}"
    elif kind == "object" and volume == total:
        problem = "some pieces have duplicate main replicas and others none"
    return f"{label} {key!r} of shape {grid}: {problem}; main replicas on ranks {holders}"


def _judge_of(name: str, world: int) -> int:
    """The rank that judges a key (spreads the keys evenly, the same on every rank)."""
    return int(hashlib.blake2b(name.encode(), digest_size=8).hexdigest(), 16) % world


def _aggregator_of(name: str, rank: int, world: int) -> int:
    """The rank that combines a key's summaries from ``rank``'s block of about
    sqrt(world) consecutive ranks before they go to the judge."""
    block = math.isqrt(max(world - 1, 0)) + 1
    return _judge_of(f"{name}#{rank // block}", world)


def _to_aggregators(local: Dict[str, _KeySummary], rank: int, world: int) -> List[Optional[Dict[str, _Wire]]]:
    """What ``rank`` sends each rank in the first exchange: its summaries, by aggregator."""
    out: List[Optional[Dict[str, _Wire]]] = [None] * world
    for name, summary in local.items():
        aggregator = _aggregator_of(name, rank, world)
        if out[aggregator] is None:
            out[aggregator] = {}
        out[aggregator][name] = _wire(summary)  # type: ignore[index]
    return out


def _to_judges(received: List[Optional[Dict[str, _Wire]]], world: int) -> List[Optional[Dict[str, Tuple]]]:
    """What an aggregator sends each rank in the second exchange: the summaries it
    received, combined per key, by judge."""
    partial: Dict[str, _Combined] = {}
    for source, summaries in enumerate(received):
        for name, wire in (summaries or {}).items():
            partial.setdefault(name, _Combined()).add(source, wire)
    out: List[Optional[Dict[str, Tuple]]] = [None] * world
    for name, combined in partial.items():
        judge = _judge_of(name, world)
        if out[judge] is None:
            out[judge] = {}
        out[judge][name] = combined.to_wire()  # type: ignore[index]
    return out


# This rank's layout digest (its summaries, rank and world size) at the last validation
# that passed, per group and mode: when no rank's digest changed since, the verdict is the
# same (it is a function of every rank's summaries), so the exchange is skipped.
_LAST_VALID: Dict[Tuple[Any, bool], bytes] = {}


def _memo_key(group: Optional[Any], allow_gaps: bool) -> Tuple[Any, bool]:
    return (None if group is None else tuple(dist.get_process_group_ranks(group))), allow_gaps


def _layout_digest(local: Dict[str, _KeySummary], group: Optional[Any]) -> bytes:
    listed = (get_rank(group), get_world_size(group), sorted(local.items()))
    return hashlib.blake2b(pickle.dumps(listed), digest_size=16).digest()


def _problems(combined: Dict[str, _Combined], allow_gaps: bool) -> List[str]:
    """The verdicts on the keys of ``combined`` that fail, by key."""
    problems = []
    for name in sorted(combined):
        try:
            verdict = _verdict(name, combined[name], allow_gaps)
        except Exception as e:  # noqa: BLE001 - every rank must reach the next collective
            verdict = f"{name}: cannot be validated ({type(e).__name__}: {e})"
        if verdict is not None:
            problems.append(verdict)
    return problems


def validate_sharding_integrity(sharded_items: Iterable[Any], group: Optional[Any] = None,
                                allow_gaps: bool = False, *, common_state_dict: Optional[Any] = None) -> None:
    """Check, collectively, that the main replicas of every global tensor cover it exactly
    once, that every ShardedObject grid has exactly one main replica per piece, and that
    all ranks agree on each key's global shape and dtype. Raises
    :class:`CheckpointingException` on every rank if any key fails.

    ``sharded_items`` are this rank's items — or, Megatron-Core's form, a list of every
    rank's item lists (``determine_global_metadata(sd)[1]``): then each rank judges every
    key itself from them, with no communication (the same verdict, raised on every rank
    that calls it). ``common_state_dict`` (Megatron-Core's argument) is first compared
    with rank 0's (collective, :func:`check_common_state_consistency`).

    Each key is judged by one rank (hash of its name); its summaries reach that rank
    combined per block of about sqrt(world) ranks by an aggregating rank (hash of the name
    and the block), so a key held by every rank costs its judge sqrt(world) messages, not
    world. Cost per rank, flat in the world size: a 2-byte ``all_reduce`` (summarising
    agreed; did any rank's layout change since the last validation that passed?). When
    one did: two ``exchange_objects`` (four ``all_to_all_single``: 8 bytes per rank of
    counts each time, then each rank receives only the summaries it combines — key name +
    ~35 bytes per rank — and the combinations of the keys it judges; never the chunk
    lists), and a 1-byte ``all_reduce`` of the verdict; otherwise nothing more (a repeated
    save of an unchanged layout). Only when some key fails, one ``all_gather_object`` of
    the problem messages follows. ``allow_gaps`` (load requests may be partial) only
    rejects disagreeing shapes/dtypes and more main replicas than elements.
    """
    if common_state_dict is not None:
        check_common_state_consistency(common_state_dict, group)
    sharded_items = list(sharded_items)
    if sharded_items and all(isinstance(items, (list, tuple)) for items in sharded_items):
        combined: Dict[str, _Combined] = {}
        for rank, items in enumerate(sharded_items):
            for name, summary in _summaries(items).items():
                combined.setdefault(name, _Combined()).add(rank, _wire(summary))
        problems = _problems(combined, allow_gaps)
        if problems:
            raise CheckpointingException("Sharding validation failed: " + "; ".join(problems))
        return
    key = _memo_key(group, allow_gaps)

    def summarize() -> Tuple[Dict[str, _KeySummary], bytes]:
        local = _summaries(sharded_items)
        return local, _layout_digest(local, group)

    (local, digest), (changed,) = run_agreed_with_flags(
        summarize, lambda result: [int(result is None or _LAST_VALID.get(key) != result[1])],
        "Summarizing the sharded items", group)
    if not changed:
        return
    _LAST_VALID.pop(key, None)
    world = get_world_size(group)
    received = exchange_objects(_to_aggregators(local, get_rank(group), world), group)
    combined = {}
    for partials in exchange_objects(_to_judges(received, world), group):
        for name, wire in (partials or {}).items():
            combined.setdefault(name, _Combined()).merge(wire)
    problems = _problems(combined, allow_gaps)
    if all_reduce_max_uint8([int(bool(problems))], group)[0]:
        everyone = [p for rank_problems in all_gather_object(problems, group) for p in rank_problems]
        raise CheckpointingException("Sharding validation failed: " + "; ".join(sorted(everyone)))
    _LAST_VALID[key] = digest


# ----------------------------------------------------------------------------- strict loading


def determine_missing_and_unexpected_keys(
    ckpt_keys: Set[str], local_keys: Set[str], need_missing: bool, group: Optional[Any] = None
) -> Tuple[Set[str], Set[str]]:
    """``(missing, unexpected)``: unexpected = requested here but not in the checkpoint;
    missing = in the checkpoint but requested by no rank (only when ``need_missing``).

    Missing keys cost one ``all_reduce`` (MAX) of a byte per checkpoint key: each rank marks
    the keys it requests in a bitmap over the sorted checkpoint keys.
    """
    unexpected = local_keys - ckpt_keys
    missing: Set[str] = set()
    if need_missing:
        ordered = sorted(ckpt_keys)
        requested = all_reduce_max_uint8([1 if k in local_keys else 0 for k in ordered], group)
        missing = {k for k, flag in zip(ordered, requested) if not flag}
    return missing, unexpected


def mismatch_message(missing: Set[str], unexpected_by_rank: Dict[Optional[int], List[str]]) -> str:
    """The key-mismatch report, worded as Megatron-Core words it (its tests and users grep
    ``Missing keys`` / ``Unexpected keys``): a title line, then the keys.
    ``unexpected_by_rank`` maps a rank (``None``: this rank) to its unexpected keys."""
    unexpected = {r: keys for r, keys in unexpected_by_rank.items() if keys}
    title = ""
    if missing:
        title += "Some keys found in the checkpoint are missing in the provided sharded state dict. "
    if unexpected:
        title += "Unexpected keys (not found in the checkpoint) encountered in the provided sharded state dict. "
    body = f"Missing keys (for all ranks): {sorted(missing)}. " if missing else ""
    for rank, keys in sorted(unexpected.items(), key=lambda item: -1 if item[0] is None else item[0]):
        who = "this rank" if rank is None else f"rank {rank}"
        body += f"Unexpected keys (for {who}): {sorted(keys)}. "
    return title + "\n" + body


def handle_mismatched_keys(strict: StrictHandling, missing: Set[str], unexpected: Set[str],
                           checkpoint_dir: Any, group: Optional[Any] = None) -> None:
    """Log or raise (collectively: on every rank) as ``strict`` says."""
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        if missing or unexpected:
            logger.warning(mismatch_message(missing, {None: sorted(unexpected)}))
    elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        # the key lists travel only when some rank has unexpected keys (a 1-byte flag otherwise)
        any_unexpected = all_reduce_max_uint8([int(bool(unexpected))], group)[0]
        per_rank = all_gather_object(sorted(unexpected), group) if any_unexpected else []
        if missing or any_unexpected:
            raise CheckpointingException(f"Strict load ({strict.value}) of {checkpoint_dir} failed: "
                                         + mismatch_message(missing, dict(enumerate(per_rank))))


# ----------------------------------------------------------------------------- Megatron-Core's helpers


def determine_global_metadata(sharded_state_dict: Any,
                              process_group: Optional[Any] = None) -> Tuple[List[Any], List[List[Any]]]:
    """``(local, global)``: this rank's sharded items without data, and those of every rank
    of ``process_group`` (default: all; one ``all_gather_object``: per-rank bytes grow with
    the world size, unlike :func:`validate_sharding_integrity`, which ``save`` uses; kept for
    Megatron-Core's callers)."""
    local = [item.without_data() for item in nested_values(sharded_state_dict)]
    return local, all_gather_object(local, process_group)


def adjust_non_strict_load(sharded_state_dict: Any, sharded_keys_to_remove: Set[str]) -> Any:
    """The sharded state dict without the sharded items whose key is in ``sharded_keys_to_remove``."""

    def unexpected(x: Any) -> bool:
        if not isinstance(x, ShardedBase):
            raise CheckpointingException(f"adjust_non_strict_load: expected only sharded items, got {type(x).__name__}")
        return x.key in sharded_keys_to_remove

    return extract_matching_values(sharded_state_dict, unexpected)[1]


def maybe_report_missing_and_unexpected_keys(missing_keys: Set[str], unexpected_keys: Set[str],
                                             raise_error: bool = True) -> None:
    """Raise a :class:`CheckpointingException` (or log a warning if not ``raise_error``)
    naming the missing and unexpected keys, when there are any."""
    if not missing_keys and not unexpected_keys:
        return
    parts = []
    if missing_keys:
        parts.append(f"Missing keys (in the checkpoint, requested by no rank): {sorted(missing_keys)}.")
    if unexpected_keys:
        parts.append(f"Unexpected keys (requested on this rank, not in the checkpoint): {sorted(unexpected_keys)}.")
    if raise_error:
        raise CheckpointingException(" ".join(parts))
    logger.warning(" ".join(parts))


def validate_sharded_objects_handling(sharded_strategy: Any, common_strategy: Any) -> None:
    """Refuse a pair of strategies neither of which can save or load ShardedObjects."""
    if not sharded_strategy.can_handle_sharded_objects and not common_strategy.can_handle_sharded_objects:
        raise CheckpointingException(
            f"Either the sharded strategy or the common strategy must handle ShardedObjects: neither "
            f"{sharded_strategy} nor {common_strategy} does (can_handle_sharded_objects=False)")
