"""Optimizer state <-> sharded state.

A ``torch.optim`` state dict keys its per-parameter state by the parameter's index in the
optimizer (``{'state': {0: {'exp_avg': ...}}, 'param_groups': [...]}``). These helpers
give each per-parameter state tensor the sharding of the model parameter it belongs to,
under the key ``f"optimizer.state.{state_key}.{model_key}"``, so optimizer state saved
under one parallel layout loads under any other — exactly like the model parameters.

Typical use (the same request builds both the save and the load state dict)::

    model_sd = model.sharded_state_dict()          # data are the parameters themselves
    optim_sd = sharded_optimizer_state_dict(optimizer, model_sd)
    save({'model': model_sd, 'optimizer': optim_sd}, ckpt_dir)
    ...
    loaded = load({'optimizer': sharded_optimizer_state_dict(optimizer, model_sd)}, ckpt_dir)
    optimizer.load_state_dict(loaded['optimizer'])

Per-parameter values whose shape is not the parameter's (Adam's 0-dim ``'step'``, Python
numbers) are left as they are and so become *common state*: saved once, from rank 0,
and given back to every rank on load. They must therefore be equal on every rank (true
of ``'step'`` when all ranks step together); pass ``exclude_keys`` to drop them instead.

Names and semantics follow ``megatron.core.dist_checkpointing.optimizer``.
"""

from __future__ import annotations

import logging
from copy import deepcopy
from dataclasses import replace
from typing import Any, Dict, Iterable, Sequence, Tuple, Union

import torch

from .core import CheckpointingException
from .dict_utils import nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

logger = logging.getLogger(__name__)

ShardedParam = Union[ShardedTensor, ShardedTensorFactory]

KEEP_VARS_HINT = (
    " Make sure state dict contains original torch.nn.Parameters (not pure torch.Tensors)"
    " by passing `keep_vars=True` to `.state_dict()`. If any transformation of the original"
    " parameter is needed, use a ShardedTensorFactory."
)
"""Appended to messages about a model state dict whose data are not the parameters
(Megatron-Core's layers append it to their own errors)."""

__all__ = [
    "KEEP_VARS_HINT",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
    "sharded_optimizer_state_dict",
]


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.Tensor]) -> Dict[int, int]:
    """Map ``id(param)`` to the param's index in the optimizer's order (the key of its
    entry in ``optimizer.state_dict()['state']``); the first occurrence of a param wins."""
    param_to_id: Dict[int, int] = {}
    for i, param in enumerate(optim_params_iter):
        param_to_id.setdefault(id(param), i)
    return param_to_id


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.Tensor]
) -> Dict[int, ShardedParam]:
    """Map optimizer param indices to the model's ShardedTensors / ShardedTensorFactories.

    A sharded param matches an optimizer param when its ``data`` *is* that param (same
    object: build the model sharded state dict from the parameters themselves, e.g. with
    ``keep_vars=True``). Sharded params anywhere in the nested dict are considered; those
    the optimizer does not track are logged at debug level.
    """
    param_to_id = get_optim_param_to_id_map(optim_params_iter)
    id_to_sharded_param: Dict[int, ShardedParam] = {}
    for sh in nested_values(model_sharded_state_dict):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
            continue
        param_id = param_to_id.get(id(sh.data))
        if param_id is None:
            logger.debug("%s is not tracked by the optimizer", sh)
        else:
            id_to_sharded_param[param_id] = sh
    if not id_to_sharded_param:
        logger.warning(
            "No model sharded parameter matches an optimizer parameter." + KEEP_VARS_HINT)
    return id_to_sharded_param


def _local_data_shape(model_param: ShardedTensor) -> Tuple[int, ...]:
    """Shape of the model param's local data: the chunk's, or the 1-D slice's if flat."""
    rng = model_param.flattened_range
    if rng is None:
        return model_param.local_shape
    return (rng.stop - rng.start,)


def make_sharded_optimizer_tensor(
    model_param: ShardedParam, optim_param: torch.Tensor, prefix: str
) -> ShardedParam:
    """The sharding of ``model_param`` applied to the optimizer tensor ``optim_param``.

    The key becomes ``f"{prefix}.{model_param.key}"``. For a ShardedTensor the dtype is
    ``optim_param``'s and its shape must be the model param's local shape (1-D with the
    slice's length for a flattened param, which gives a flattened optimizer tensor). For a
    ShardedTensorFactory only the key and the data are replaced.

    Raises:
        CheckpointingException: the shapes of ``optim_param`` and ``model_param`` differ.
    """
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=key, data=optim_param)
    expected = _local_data_shape(model_param)
    if tuple(optim_param.shape) != expected:
        raise CheckpointingException(
            f"Optimizer tensor {key!r}: shape {tuple(optim_param.shape)} does not match the "
            f"model parameter {model_param.key!r} (local shape {expected})"
        )
    return replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)


def _matches_param(value: Any, model_param: ShardedParam) -> bool:
    """Whether ``value`` is a tensor shaped like ``model_param``'s local data."""
    if not isinstance(value, torch.Tensor):
        return False
    if isinstance(model_param, ShardedTensorFactory):
        return value.shape == model_param.data.shape
    return tuple(value.shape) == _local_data_shape(model_param)


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: Dict[int, ShardedParam],
    exclude_keys: Sequence[str] = (),
) -> None:
    """Turn a ``torch.optim`` state dict into a sharded state dict, in place.

    Every per-parameter state tensor shaped like its parameter becomes a sharded optimizer
    tensor (:func:`make_sharded_optimizer_tensor` with prefix
    ``f"optimizer.state.{state_key}"``). Other values (Adam's 0-dim ``'step'``, Python
    numbers) stay as they are and end up in the common state, so they must be equal on
    every rank. Keys in ``exclude_keys`` (a sequence, or one key as a str) are dropped.
    ``param_groups`` is deep-copied and each group's ``'params'`` wrapped in a
    :class:`LocalNonpersistentObject`: on load the loading optimizer keeps its own param
    indices. The per-parameter dicts of the input are not modified
    (``optimizer.state_dict()`` shares them with the live optimizer).

    Raises:
        CheckpointingException: a param index has no entry in ``id_to_sharded_param_map``,
            or (via :func:`make_sharded_optimizer_tensor`) a factory's tensor is misshaped.
    """
    if isinstance(exclude_keys, str):  # Megatron passes exclude_keys="step"
        exclude_keys = (exclude_keys,)
    sharded_state: Dict[Any, Dict[str, Any]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        model_param = id_to_sharded_param_map.get(param_id)
        if model_param is None:
            raise CheckpointingException(
                f"Optimizer param id {param_id} does not match any model sharded parameter"
            )
        sharded_state[param_id] = {
            state_key: (
                make_sharded_optimizer_tensor(model_param, value, prefix=f"optimizer.state.{state_key}")
                if _matches_param(value, model_param)
                else value
            )
            for state_key, value in param_state.items()
            if state_key not in exclude_keys
        }
    optim_state_dict["state"] = sharded_state
    optim_state_dict["param_groups"] = deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])


def sharded_optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    model_sharded_state_dict: ShardedStateDict,
    exclude_keys: Sequence[str] = (),
) -> StateDict:
    """The sharded form of ``optimizer.state_dict()``, for saving and for load requests.

    For a load request, the optimizer's state must already hold tensors to load into
    (e.g. initialised with zeros); pass the result of ``load`` to
    ``optimizer.load_state_dict``.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    id_to_sharded_param = get_param_id_to_sharded_param_map(model_sharded_state_dict, params)
    state_dict = optimizer.state_dict()
    optim_state_to_sharding_state(state_dict, id_to_sharded_param, exclude_keys)
    return state_dict
