"""Fully parallel save and load: spread the writing and reading of replicated shards over
the ranks of a parallelization group (typically the data-parallel group).

* :class:`FullyParallelSaveStrategyWrapper` re-assigns the main replica of every shard
  held in the group so that each rank writes about the same number of bytes, then lets
  the wrapped strategy write as usual.
* :class:`FullyParallelLoadStrategyWrapper` has each shard the group needs read by one
  rank of the group (the rank that wrote it, when the layout and group are the same as at
  save time) and sends it to the other ranks that need it with one of three exchange
  algorithms (see :mod:`dist_checkpointing.exchange`).

Both plan with :func:`~dist_checkpointing.exchange.plan.plan_shards` (a per-rank cost flat in
the group size: nothing is gathered). Each call
also agrees over the whole world, with a 2-byte ``all_reduce``, whether any rank has a
problem or needs a new plan, so an error is raised on every rank and never leaves ranks
in different collectives. With ``do_cache_distribution=True`` a call whose state dict
has the same structure as the previous call's on every rank reuses the plan: that
``all_reduce`` is then its only extra collective.

Save: every shard whose main replica is in the group gets a new ``replica_id`` (0 on the
chosen rank, 1 on its other holders, on copies of the ShardedTensors); ShardedObjects keep
theirs. Sharding validation runs before the wrapper and is unaffected (a main replica
only moves between holders of the same shard). Load: (1) plan every shard any member
requests -- shards with their main replica in the group come first, so the rank that wrote
a shard reads it back; each rank reads its own ShardedObjects; (2) the wrapped strategy's
``load`` reads each rank's share (its collectives still run on every rank, so its errors are
agreed); (3) shards every member requests travel with ``exchange_algo``, the others point to
point from their reader (:func:`..exchange.tensors.exchange_point_to_point`); (4) requested
tensors are filled in place. FP8 requests are read as plain stand-ins of the nominal dtype
and quantized once at the end, each rank with its own scale.

A new plan costs: with ``do_cache_distribution=True`` a ``run_agreed`` over the world on the
local summaries; on a wrapper's first call one ``exchange_objects`` over the world checking
that the members of a group passed the same group; the plan inside the group (a 32-byte
``all_reduce`` and a byte per shard, or three ``exchange_objects`` and a 16-byte ``reduce``);
a ``run_agreed`` over the world on planning errors. Agreement runs over the world because the
wrapped strategy's collectives do.
"""

from __future__ import annotations

import copy
import hashlib
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist

from ..runtime.collectives import (
    all_gather_object,
    all_reduce_max_uint8,
    error_message,
    exchange_objects,
    get_rank,
    get_world_size,
    is_distributed,
    raise_if_any,
    run_agreed,
)
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_outplace, nested_values
from ..exchange.distribution import ShardDistribution, ShardId, local_tensor_summary, shard_id
from ..exchange.plan import ShardPlan, plan_shards
from ..exchange.tensors import check_exchange_algo, exchange_by_distribution, exchange_point_to_point
from ..tensors.fp8 import dequantize, fill_float8_, is_float8tensor
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from ..utils import _sharded_tensor_shard_id  # noqa: F401 - Megatron-Core's tests import it from here
from .async_strategies import check_async_strategy
from .base import AsyncSaveShardedStrategy, LoadShardedStrategy, SaveShardedStrategy, StoredItems


def _structure(sharded_state_dict: ShardedStateDict) -> List[tuple]:
    """What a plan depends on: every item's identity, shape, dtype and main-replica flag."""
    out: List[tuple] = []
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            out.append((shard_id(sh), sh.local_shape, sh.dtype, is_main_replica(sh.replica_id)))
        elif isinstance(sh, ShardedObject):
            out.append((sh.unique_key, is_main_replica(sh.replica_id)))
    return out


def _check_group(group: Optional[Any]) -> None:
    """Collectively (over the world) check that every rank is a member of the group it
    passed and that the members of each group passed the same group.

    Each rank sends a 16-byte digest of its group's member list to each member
    (``exchange_objects`` over the world: 8 bytes of counts per rank, then one digest per
    member) and compares what it receives with its own; the verdict is agreed with a
    1-byte ``all_reduce``, the messages travel only when something is wrong."""
    me, world = dist.get_rank(), dist.get_world_size()
    try:
        members: Tuple[int, ...] = tuple(range(world) if group is None else dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - not a group this rank belongs to
        members = ()
    digest = hashlib.blake2b(repr(members).encode(), digest_size=16).digest()
    outgoing: List[Optional[bytes]] = [None] * world
    for member in members:
        outgoing[member] = digest
    received = exchange_objects(outgoing)

    def verdict() -> None:
        if me not in members:
            raise CheckpointingException(f"rank {me} is not a member of the parallelization group it passed")
        others = sorted(r for r, d in enumerate(received) if d is not None and d != digest)
        absent = sorted(r for r in members if received[r] is None)
        if others or absent:
            raise CheckpointingException(
                f"rank {me} passed group {list(members)} but "
                + "; ".join(([f"rank(s) {others} passed another group that contains it"] if others else [])
                            + ([f"its member rank(s) {absent} passed a group without it"] if absent else [])))

    run_agreed(verdict, "Invalid parallelization group: checking it")


class _Planner:
    """Plan agreement and caching shared by the save and load wrappers."""

    def __init__(self) -> None:
        self._cached: Optional[Tuple[List[tuple], Any]] = None
        self._group_checked = False

    def plan(self, owner: Any, sharded_state_dict: ShardedStateDict, local: Callable[[], Any],
             compute: Callable[[Any], Any], what: str, check: Callable[[], None] = lambda: None) -> Any:
        """``compute(local())`` run collectively, or the cached plan when no rank's structure
        changed (``owner``: the wrapper, whose ``parallelization_group`` and
        ``do_cache_distribution`` apply). ``check()`` (the call's arguments), the item checks and
        ``local()`` (this rank's summary, no communication) run first and their errors are
        agreed before any group collective."""
        error: Optional[str] = None
        structure = summary = None
        try:
            check()
            for sh in nested_values(sharded_state_dict):
                if isinstance(sh, (ShardedTensor, ShardedObject)):
                    sh.validate_metadata_integrity()
            if owner.do_cache_distribution:
                structure = _structure(sharded_state_dict)
        except Exception as e:  # noqa: BLE001 - agreed on below
            error = error_message(e)
        reuse = owner.do_cache_distribution and self._cached is not None and self._cached[0] == structure
        if not reuse and error is None:
            try:
                summary = local()
            except Exception as e:  # noqa: BLE001 - agreed on below
                error = error_message(e)
        failed, replan = all_reduce_max_uint8([int(error is not None), int(not reuse)])
        if failed:
            raise_if_any(all_gather_object(error), what)
        if not replan:
            return self._cached[1]
        if owner.do_cache_distribution:  # ranks that could reuse their plan summarize now
            summary = run_agreed(lambda: local() if summary is None else summary, what)
        if not self._group_checked:
            _check_group(owner.parallelization_group)
            self._group_checked = True
        result = run_agreed(lambda: compute(summary), what)
        self._cached = (structure, result) if owner.do_cache_distribution else None
        return result

    def cached_result(self) -> Any:
        """The cached plan, or ``None``."""
        return self._cached[1] if self._cached is not None else None


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict, parallelization_group: Optional[Any],
    precomputed_distribution: Optional[ShardDistribution],
) -> ShardedStateDict:
    """A copy of the state dict whose ShardedTensors have their main replica where the
    distribution puts it (``replica_id`` 0 on the chosen rank, 1 on the other holders in
    the group; shards whose main replica is outside the group are left alone). The
    caller's ShardedTensors are not modified."""
    if precomputed_distribution is None:
        return sharded_state_dict
    me = get_rank(parallelization_group)
    seen = set()

    def apply(sh: Any) -> Any:
        if not isinstance(sh, ShardedTensor):
            return sh
        sid = shard_id(sh)
        if sid not in precomputed_distribution.shards_in_this_group:
            return sh
        main = precomputed_distribution.main_rank_for_shard[sid] == me and sid not in seen
        seen.add(sid)
        if main == is_main_replica(sh.replica_id):
            return sh
        out = copy.copy(sh)
        out.replica_id = 0 if main else 1
        return out

    return dict_list_map_outplace(apply, sharded_state_dict)


def _nominal_stand_in(sh: Any) -> Any:
    """For an FP8 request, a copy whose data is a plain tensor of the nominal dtype."""
    if isinstance(sh, ShardedTensor) and is_float8tensor(sh.data):
        stand_in = copy.copy(sh)
        stand_in.data = torch.empty(tuple(sh.data.shape), dtype=sh.dtype)
        return stand_in
    return sh


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Wraps a sharded save strategy so that the ranks of ``parallelization_group`` (the
    whole world by default) share the writing of the shards they hold.

    Args:
        strategy: the sharded save strategy that writes (sync or async).
        parallelization_group: the group to balance over, e.g. the data-parallel group.
        do_cache_distribution: reuse the distribution while the state dict's structure is
            unchanged on every rank (checked with one 2-byte ``all_reduce`` per save).
        backend, version: Megatron-Core 0.19's; the checkpoint records the wrapped
            strategy's format, so any other value than it (or these defaults) is refused.
    """

    def __init__(self, strategy: SaveShardedStrategy, parallelization_group: Optional[Any] = None,
                 do_cache_distribution: bool = False, backend: str = "torch_dist", version: int = 1):
        if not isinstance(strategy, SaveShardedStrategy):
            raise CheckpointingException(f"Not a sharded save strategy: {strategy!r}")
        if (backend, version) not in (("torch_dist", 1), (strategy.backend, strategy.version)):
            raise CheckpointingException(f"The wrapped strategy saves ({strategy.backend!r}, {strategy.version}), "
                                         f"not ({backend!r}, {version})")
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self._planner = _Planner()

    @property
    def cached_distribution(self) -> Optional[ShardDistribution]:
        """The distribution kept from the last save (with ``do_cache_distribution``): which
        group rank writes each shard this rank holds (shard ids as Megatron-Core's)."""
        distribution = self._planner.cached_result()
        return None if distribution is None else distribution.with_megatron_ids()

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    @property
    def last_written_files(self) -> Optional[Dict[str, int]]:  # type: ignore[override]
        return self.base_strategy.last_written_files

    def data_file_names(self, rank: int) -> List[str]:
        return self.base_strategy.data_file_names(rank)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict,
                                     check: Callable[[], None] = lambda: None) -> ShardedStateDict:
        """The state dict with main replicas re-assigned for balanced writing (collective;
        ``check()``'s error, like the items', is raised on every rank)."""
        if not is_distributed():
            check()
            return sharded_state_dict
        group = self.parallelization_group
        def compute(summary: Any) -> Optional[ShardDistribution]:
            if get_world_size(group) <= 1:
                return None
            return plan_shards(summary, group).distribution()

        distribution = self._planner.plan(
            self, sharded_state_dict, lambda: local_tensor_summary(sharded_state_dict, skip_empty=True), compute,
            "Planning the fully parallel save", check)
        return run_agreed(
            lambda: distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, group, distribution),
            "Assigning the main replicas")

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        start = time.perf_counter()
        parallelized = self.apply_saving_parallelization(sharded_state_dict)
        planned = time.perf_counter()
        self.base_strategy.save(parallelized, checkpoint_dir)
        #: seconds of the last save's phases (logged by ``save``)
        self.last_timings = {"plan": planned - start, "write": time.perf_counter() - planned}
        self.last_written_bytes = self.base_strategy.last_written_bytes

    @property
    def async_save_agreed(self) -> bool:  # type: ignore[override]
        """The wrapped strategy's (no collective follows its ``async_save`` here)."""
        return getattr(self.base_strategy, "async_save_agreed", False)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
                   async_strategy: Optional[str] = "nvrx") -> Any:
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(f"{self.base_strategy} cannot save asynchronously")
        request = self.base_strategy.async_save(
            self.apply_saving_parallelization(sharded_state_dict, lambda: check_async_strategy(async_strategy)),
            checkpoint_dir)
        self.last_written_bytes = self.base_strategy.last_written_bytes
        return request


def _assign_reads(sharded_state_dict: ShardedStateDict, plan: ShardPlan,
                  me: int) -> Tuple[List[Tuple[Any, Any]], Dict[Any, Any]]:
    """The shards and objects this rank reads (``(id, item)``) and the shards it receives (by id)."""
    # FP8 requests are read and exchanged as their nominal-dtype values; each rank
    # quantizes them with its own scale when ``load`` fills the result, never twice.
    work = dict_list_map_outplace(_nominal_stand_in, sharded_state_dict)

    # This rank reads the shards assigned to it and every object it requests; the rest
    # of the shards arrive by exchange.
    reads: List[Tuple[Any, Any]] = []
    unloaded: Dict[ShardId, ShardedTensor] = {}
    seen = set()
    for sh in nested_values(work):
        if isinstance(sh, ShardedTensor):
            ident: Any = shard_id(sh)
            mine = sh.is_empty_chunk() or plan.reader[ident] == me  # (an empty chunk: nothing to read)
        elif isinstance(sh, ShardedObject):
            ident, mine = sh.unique_key, True
        else:
            continue
        if ident in seen:
            continue
        seen.add(ident)
        if mine:
            reads.append((ident, sh))
        else:
            unloaded[ident] = sh
    return reads, unloaded


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Wraps a sharded load strategy so that each shard needed in ``parallelization_group``
    (the whole world by default) is read from storage by one rank of the group and sent
    to the others that need it.

    Args:
        strategy: the sharded load strategy that reads.
        parallelization_group: the group to share reading in, e.g. the data-parallel group.
        do_cache_distribution: reuse the plan while the request's structure is unchanged on
            every rank (checked with one 2-byte ``all_reduce`` per load).
        exchange_algo: ``'broadcast'`` (default; one shard or bucket in flight),
            ``'gather_rounds'`` (equal-sized all_gather rounds) or ``'gather_object'``
            (pickled, for debugging).

    Shards that every rank of the group requests travel with ``exchange_algo``; shards
    that only some ranks request travel point to point from their reader to those ranks.
    Each rank reads the ShardedObjects it requests itself (they are small; nothing about
    them is gathered).
    """

    def __init__(self, strategy: LoadShardedStrategy, parallelization_group: Optional[Any] = None,
                 do_cache_distribution: bool = False, exchange_algo: str = "broadcast"):
        check_exchange_algo(exchange_algo)
        if not isinstance(strategy, LoadShardedStrategy):
            raise CheckpointingException(f"Not a sharded load strategy: {strategy!r}")
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self._planner = _Planner()

    @property
    def cached_distribution(self) -> Optional[ShardDistribution]:
        """The distribution kept from the last load (with ``do_cache_distribution``): which
        group rank reads each shard this rank requests (Megatron-Core's type)."""
        plan = self._planner.cached_result()
        return None if plan is None else plan.distribution().with_megatron_ids()

    @property
    def cached_global_metadata(self) -> Any:
        """The global metadata the wrapped strategy read in its last load, if it keeps it."""
        return getattr(self.base_strategy, "cached_global_metadata", None)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def stored_items(self, checkpoint_dir: Union[str, Path]) -> StoredItems:
        return self.base_strategy.stored_items(checkpoint_dir)

    def key_mismatch(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
                     need_missing: bool) -> Optional[Tuple[Set[str], Set[str]]]:
        return self.base_strategy.key_mismatch(sharded_state_dict, checkpoint_dir, need_missing)

    def stored_file_problems(self, checkpoint_dir: Union[str, Path]) -> Tuple[List[str], List[str]]:
        return self.base_strategy.stored_file_problems(checkpoint_dir)

    def offline_reader(self) -> LoadShardedStrategy:
        return self.base_strategy.offline_reader()

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
        self.base_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)

    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        """The common state of checkpoints that keep it in the sharded backend."""
        return self.base_strategy.load_common(checkpoint_dir)

    def _compute_plan(self, summary: list) -> Optional[ShardPlan]:
        group = self.parallelization_group
        if get_world_size(group) <= 1:
            return None
        return plan_shards(summary, group)

    @property
    def stream_ckpt_dequant(self) -> bool:
        """The wrapped strategy's ``stream_ckpt_dequant`` (Megatron-Core 0.19's attribute)."""
        return getattr(self.base_strategy, "stream_ckpt_dequant", False)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
             async_strategy: Optional[str] = "mcore") -> StateDict:
        def check() -> None:  # Megatron-Core 0.19's argument; the wrapped strategy's default is used
            check_async_strategy(async_strategy)

        if not is_distributed():
            check()
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        start = time.perf_counter()
        plan = self._planner.plan(self, sharded_state_dict,
                                  lambda: local_tensor_summary(sharded_state_dict, skip_empty=True),
                                  self._compute_plan, "Planning the fully parallel load", check)
        if plan is None:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        group = self.parallelization_group
        me = get_rank(group)
        reads, unloaded = run_agreed(lambda: _assign_reads(sharded_state_dict, plan, me),
                                     "Assigning the fully parallel reads")
        planned = time.perf_counter()
        loaded = self.base_strategy.load({str(i): sh for i, (_, sh) in enumerate(reads)}, checkpoint_dir)
        read = time.perf_counter()
        loaded_tensors = {ident: loaded[str(i)] for i, (ident, sh) in enumerate(reads) if isinstance(sh, ShardedTensor)}
        objects = {ident: loaded[str(i)] for i, (ident, sh) in enumerate(reads) if isinstance(sh, ShardedObject)}

        whole = plan.whole_group
        tensors = exchange_by_distribution(
            {k: v for k, v in loaded_tensors.items() if k in whole},
            {k: v for k, v in unloaded.items() if k in whole}, plan.distribution(whole), group, self.exchange_algo)
        tensors.update(exchange_point_to_point(
            loaded_tensors, {k: v for k, v in unloaded.items() if k not in whole}, plan, group))
        tensors.update({k: v for k, v in loaded_tensors.items() if k not in whole})

        #: seconds of the last load's phases (logged by ``load``)
        self.last_timings = {"plan": planned - start, "read": read - planned, "exchange": time.perf_counter() - read}

        def fill(sh: Any) -> Any:
            if isinstance(sh, ShardedTensor):
                tensor = tensors[shard_id(sh)]
                if sh.data is None or tensor is sh.data:
                    return tensor
                if is_float8tensor(sh.data):
                    fill_float8_(sh.data, dequantize(tensor) if is_float8tensor(tensor) else tensor)
                    return sh.data
                with torch.no_grad():
                    sh.data.copy_(tensor)  # the request's own tensor, also for repeated shards
                return sh.data
            if isinstance(sh, ShardedObject):
                return objects[sh.unique_key]
            return sh

        return dict_list_map_outplace(fill, sharded_state_dict)


def with_base_strategy(strategy: LoadShardedStrategy,
                       convert: Callable[[LoadShardedStrategy], LoadShardedStrategy]) -> LoadShardedStrategy:
    """``convert(strategy)``, or for a fully parallel wrapper a copy wrapping ``convert`` of
    its base strategy (the wrapper itself where ``convert`` keeps the base as it is)."""
    if not isinstance(strategy, FullyParallelLoadStrategyWrapper):
        return convert(strategy)
    base = with_base_strategy(strategy.base_strategy, convert)
    if base is strategy.base_strategy:
        return strategy
    wrapped = copy.copy(strategy)
    wrapped.base_strategy = base
    return wrapped
