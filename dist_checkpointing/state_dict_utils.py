"""Preparing a state dict for saving and loading, as Megatron-Core's
``dist_checkpointing.state_dict_utils`` names the steps (its local checkpointing and
``MCoreTensorAwareStateDict`` go through them).

Owns: ``save_preprocess`` / ``load_preprocess`` / ``filter_out_empty_flatten_tensor``
(Megatron-Core's names).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Tuple, Union

from .dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from .mapping import CommonStateDict, ShardedStateDict, ShardedTensor, ShardedTensorFactory, StateDict, apply_factories
from .utils import extract_nonpersistent, extract_sharded_base
from .validation import check_common_state_consistency, validate_sharding_integrity


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Optional[Callable[[CommonStateDict], StateDict]] = None,
) -> Tuple[ShardedStateDict, StateDict]:
    """``(sharded part, common state)`` of a state dict to save: factories applied (in
    place, as in Megatron-Core), non-persistent objects dropped, empty flattened slices
    dropped. With ``validate_access_integrity`` (collective) the sharding is validated
    and every rank's common state (after ``preprocess_common_before_consistancy_check``)
    is compared with rank 0's; a difference is logged as a warning."""
    apply_factories(sharded_state_dict)
    _, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_state_dict = extract_sharded_base(sharded_state_dict)
    sharded_part = filter_out_empty_flatten_tensor(sharded_part)
    if validate_access_integrity:
        validate_sharding_integrity(list(nested_values(sharded_part)))
        compared = common_state_dict
        if preprocess_common_before_consistancy_check is not None:
            compared = preprocess_common_before_consistancy_check(common_state_dict)
        check_common_state_consistency(compared)
    return sharded_part, common_state_dict


def load_preprocess(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict, Dict[Any, Any]]:
    """``(sharded state dict, non-persistent state, factories)`` of a load request, the
    request itself unchanged: the structure is copied, empty flattened slices dropped,
    factories applied (the factories are returned without data, keyed by position, for
    ``apply_factory_merges`` after the load) and LocalNonpersistentObjects unwrapped."""
    sharded_state_dict, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    sharded_state_dict = filter_out_empty_flatten_tensor(sharded_state_dict)
    factories, _ = extract_matching_values(sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory),
                                           return_lists_as_dicts=True)
    apply_factories(sharded_state_dict)
    dict_list_map_inplace(lambda f: replace(f, data=None), factories)  # merge_fn needs no data
    nonpersistent, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    return sharded_state_dict, nonpersistent, factories


def filter_out_empty_flatten_tensor(sharded_state_dict: Union[dict, list]) -> Union[dict, list]:
    """A copy of the structure without the ShardedTensors whose ``flattened_range`` is empty."""
    return extract_matching_values(sharded_state_dict, lambda v: not _empty_flat(v))[0]


def _empty_flat(v: Any) -> bool:
    return isinstance(v, ShardedTensor) and v.flattened_range is not None \
        and v.flattened_range.start == v.flattened_range.stop

