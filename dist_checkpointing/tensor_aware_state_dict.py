"""``MCoreTensorAwareStateDict``: a state dict split into its tensors and the rest, for
local (non-persistent) checkpointing, as Megatron-Core names it.

Megatron-LM's ``--non-persistent-ckpt-type local`` hands it to NVIDIA Resiliency
Extension's ``LocalCheckpointManager``, which saves the tensors and the rest of each
rank's part separately (``pop_tensors`` / ``insert_tensors``) and gives it back on load
(``to_state_dict``). With ``algo='fully_parallel'`` each shard replicated across the
parallelization group is kept by one rank only (the balanced assignment of
:mod:`.exchange`), and on load the ranks exchange the shards they need. When NVIDIA
Resiliency Extension is installed the class derives from its ``TensorAwareStateDict``;
it works without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace, dict_list_map_outplace, merge, nested_values
from .exchange.distribution import ShardDistribution, determine_main_replica_uniform_distribution, shard_id
from .exchange.tensors import exchange_by_distribution
from .mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, apply_factory_merges
from .state_dict_utils import load_preprocess, save_preprocess
from .utils import extract_sharded_base, zip_strict
from .validation import (
    StrictHandling,
    adjust_non_strict_load,
    determine_missing_and_unexpected_keys,
    handle_mismatched_keys,
    parse_strict_flag,
    validate_sharding_integrity,
)

try:  # NVIDIA Resiliency Extension's base class, when installed (its manager checks for it)
    from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict
except ImportError:
    class TensorAwareStateDict:  # type: ignore[no-redef]
        """Stands for NVIDIA Resiliency Extension's base class when it is not installed."""

ALGORITHMS = ("atomic", "fully_parallel")


def _object_id(sh: ShardedObject) -> Tuple[str, Tuple[int, ...], Tuple[int, ...]]:
    return sh.key, tuple(sh.global_offset), tuple(sh.global_shape)


def _check_algo(algo: str) -> None:
    if algo not in ALGORITHMS:
        raise NotImplementedError(f'Only "atomic" and "fully_parallel" sharding algorithms are supported, not {algo!r}')


def _distribution(fully_parallel: bool, sharded_part: ShardedStateDict, group: Optional[Any],
                  cached: Optional[ShardDistribution] = None) -> Optional[ShardDistribution]:
    if not fully_parallel:
        return None
    if cached is not None:
        return cached
    return determine_main_replica_uniform_distribution(sharded_part, group, True)


@dataclass
class MCoreTensorAwareStateDict(TensorAwareStateDict):
    """The common state of a rank and its sharded part (ShardedTensors and ShardedObjects)."""

    common: StateDict
    sharded_state_dict: ShardedStateDict
    _is_hollow: bool = False

    @classmethod
    def from_state_dict(cls, sharded_state_dict: ShardedStateDict, algo: str = "fully_parallel",
                        parallelization_group: Optional[Any] = None,
                        cached_metadata: Optional[ShardDistribution] = None,
                        ) -> Tuple["MCoreTensorAwareStateDict", Optional[ShardDistribution]]:
        """Split a sharded state dict (factories applied, non-persistent objects dropped;
        validated unless ``cached_metadata`` is given — collective). With
        ``'fully_parallel'`` the tensors of shards that another rank of
        ``parallelization_group`` keeps are dropped here. Returns the instance and the
        distribution to pass as ``cached_metadata`` next time (same layout)."""
        _check_algo(algo)
        fully_parallel = algo == "fully_parallel"
        sharded_part, common = save_preprocess(sharded_state_dict, cached_metadata is None)
        distribution = _distribution(fully_parallel, sharded_part, parallelization_group, cached_metadata)
        if distribution is not None:
            me = torch.distributed.get_rank(parallelization_group)
            for sh in nested_values(sharded_part):
                if isinstance(sh, ShardedTensor) and distribution.main_rank_for_shard.get(shard_id(sh), me) != me:
                    sh.data = None
        return cls(common=common, sharded_state_dict=sharded_part), distribution

    @property
    def is_hollow(self) -> bool:
        """True while the tensors are popped (and not inserted back)."""
        return self._is_hollow

    def _check_hollow(self, hollow: bool, what: str) -> None:
        if self._is_hollow != hollow:
            state = "hollow (its tensors are popped)" if self._is_hollow else "not hollow"
            raise CheckpointingException(f"MCoreTensorAwareStateDict.{what}: the state dict is {state}")

    @property
    def _sharded_tensors(self) -> Iterator[ShardedTensor]:
        for sh in nested_values(self.sharded_state_dict):
            if isinstance(sh, ShardedTensor) and (hasattr(sh, "orig_device") if self._is_hollow else sh.data is not None):
                yield sh

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors kept by this rank, in a fixed order."""
        self._check_hollow(False, "tensors")
        return (sh.data for sh in self._sharded_tensors)

    @property
    def common_state_dict(self) -> Dict[str, Any]:
        """The common (non-sharded) state."""
        return self.common

    def pop_tensors(self) -> List[torch.Tensor]:
        """Take the tensors out (their device type is remembered); the state dict is then hollow."""
        self._check_hollow(False, "pop_tensors")
        popped = []
        for sh in self._sharded_tensors:
            popped.append(sh.data)
            sh.orig_device = sh.data.device.type
            sh.data = None
        self._is_hollow = True
        return popped

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors back, in :meth:`pop_tensors`' order (the reverse of it)."""
        self._check_hollow(True, "insert_tensors")
        for sh, t in zip_strict(self._sharded_tensors, tensor_data):
            if sh.orig_device == t.device.type:
                del sh.orig_device
            sh.data = t
        self._is_hollow = False

    def init_tensors(self) -> None:
        """Allocate empty tensors (shape, dtype, original device) in place of popped ones."""
        self._check_hollow(True, "init_tensors")
        for sh in self._sharded_tensors:
            sh.init_data(sh.orig_device)
            del sh.orig_device
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by CPU copies (originals untouched), remembering devices."""
        self._check_hollow(False, "copy_tensors_to_cpu")
        for sh in self._sharded_tensors:
            if sh.data.device.type == "cpu":
                if not hasattr(sh, "orig_device"):
                    sh.data = sh.data.clone()
            else:
                if not hasattr(sh, "orig_device"):
                    sh.orig_device = sh.data.device.type
                sh.data = sh.data.detach().to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move the tensors back to the devices :meth:`copy_tensors_to_cpu` remembered."""
        self._check_hollow(False, "restore_tensor_device")
        for sh in self._sharded_tensors:
            if hasattr(sh, "orig_device"):
                sh.data = sh.data.to(sh.orig_device, non_blocking=non_blocking)
                del sh.orig_device

    def _insert_sharded_data(self, fully_parallel: bool, sharded_part: ShardedStateDict, group: Optional[Any],
                             exchange_algo: str) -> None:
        loaded = {shard_id(sh): sh.data for sh in self._sharded_tensors}
        distribution = _distribution(fully_parallel, sharded_part, group)
        if distribution is not None:
            unloaded = {shard_id(sh): sh for sh in nested_values(sharded_part)
                        if isinstance(sh, ShardedTensor) and shard_id(sh) not in loaded}
            loaded = exchange_by_distribution(loaded, unloaded, distribution, group, exchange_algo)
        objects = {_object_id(sh): sh.data for sh in nested_values(self.sharded_state_dict)
                   if isinstance(sh, ShardedObject)}

        def fill(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                if shard_id(x) not in loaded:
                    raise CheckpointingException(f"Local checkpoint has no shard {shard_id(x)} of {x.key!r}")
                return loaded[shard_id(x)]
            if isinstance(x, ShardedObject):
                if _object_id(x) not in objects:
                    raise CheckpointingException(f"Local checkpoint has no object {x.unique_key!r}")
                return objects[_object_id(x)]
            return x

        dict_list_map_inplace(fill, sharded_part)

    def to_state_dict(self, sharded_state_dict: ShardedStateDict, algo: str = "atomic",
                      exchange_algo: str = "broadcast", validate_access_integrity: bool = True,
                      parallelization_group: Optional[Any] = None,
                      strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
                      return_mismatch_keys: bool = False) -> Any:
        """The state dict that ``sharded_state_dict`` requests, filled from this one (the
        common state, the request's non-persistent objects, its tensors and objects,
        factories merged). Collective with ``'fully_parallel'``, validation or a strict
        mode that needs every rank's keys. ``strict`` as in :func:`~.serialization.load`;
        ``return_mismatch_keys`` also returns ``(missing, unexpected)`` keys."""
        self._check_hollow(False, "to_state_dict")
        _check_algo(algo)
        recreated = dict_list_map_outplace(lambda x: x, self.common)
        if not sharded_state_dict:
            return recreated
        request, nonpersistent, factories = load_preprocess(sharded_state_dict)
        merge(recreated, nonpersistent)
        sharded_part, _ = extract_sharded_base(request)
        strict = parse_strict_flag(strict)
        local_items = list(nested_values(sharded_part))
        if validate_access_integrity:
            validate_sharding_integrity(local_items, parallelization_group, allow_gaps=True)
        missing, unexpected = set(), set()
        if strict is not StrictHandling.ASSUME_OK_UNEXPECTED:
            ckpt_keys = {sh.key for sh in nested_values(self.sharded_state_dict)}
            missing, unexpected = determine_missing_and_unexpected_keys(
                ckpt_keys, {sh.key for sh in local_items},
                StrictHandling.requires_global_app_metadata(strict), parallelization_group)
            handle_mismatched_keys(strict, missing, unexpected, "the local checkpoint", parallelization_group)
            if unexpected:
                sharded_part = adjust_non_strict_load(sharded_part, unexpected)
            if strict is StrictHandling.IGNORE_ALL:  # as Megatron-Core: nothing reported
                missing, unexpected = set(), set()
        self._insert_sharded_data(algo == "fully_parallel", sharded_part, parallelization_group, exchange_algo)
        merge(recreated, apply_factory_merges(sharded_part, factories))
        if return_mismatch_keys:
            return recreated, missing, unexpected
        return recreated
