"""Megatron-Core 0.19.2 and the Megatron-LM trainer modules its wheel ships, on this package,
in a test rank: the switch, then ``megatron.core`` and ``megatron.training`` imported as a
trainer imports them (the peer's triton lets 0.19 import on a CPU machine).

CPU and Python 3.11 shims (Megatron's source is not changed):

- ``typing.override`` (Python 3.12; the 0.19 trainer's config classes use it as a
  decorator) is the identity;
- ``torch.cuda.get_rng_state`` / ``set_rng_state`` (the trainer collects the CUDA RNG state
  in every checkpoint, even with ``--no-save-rng``) give and take a placeholder;
- the argument check's ``get_device_arch_version`` (a CUDA device query, at TP > 1) answers
  10 (no ``CUDA_DEVICE_MAX_CONNECTIONS`` requirement);
- the trainer's ``read_metadata`` (it reads ``latest_checkpointed_iteration.txt`` and
  agrees on it with an all-reduce of a CUDA tensor) reads the file and agrees on it with a
  CPU all-reduce.
"""

from __future__ import annotations

import argparse
import sys
import typing
from typing import Any, List, Tuple

import torch

ARGS = argparse.Namespace()  # the trainer's arguments for the async helpers (set_args)


def _read_tracker(path: str) -> Tuple[int, bool]:
    import torch.distributed as dist

    text = open(path).read().strip()
    if text == "release":
        return 0, True
    iteration = torch.tensor([int(text)])
    dist.all_reduce(iteration, op=dist.ReduceOp.MAX)
    return int(iteration), False


def megatron19(site: str) -> Tuple[Any, Any]:
    """``(megatron.training.async_utils, megatron.core.dist_checkpointing)`` with the switch
    installed (the second is this package); the trainer's arguments are :data:`ARGS`."""
    import numpy as np

    np.product = np.prod  # removed from NumPy 2, still used by Megatron-Core
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None
    if site not in sys.path:
        sys.path.append(site)
    import dist_checkpointing.megatron as dm

    dm.install()
    import megatron.core.dist_checkpointing as mdc
    import megatron.training.async_utils as async_utils
    import megatron.training.checkpointing as checkpointing
    from megatron.training.global_vars import set_args

    assert async_utils.__file__.startswith(site), async_utils.__file__
    checkpointing.read_metadata = _read_tracker
    import megatron.training.arguments as arguments

    arguments.get_device_arch_version = lambda: 10
    set_args(ARGS)
    return async_utils, mdc


def trainer_args(argv: List[str]) -> argparse.Namespace:
    """Megatron-LM's arguments parsed and validated from ``argv`` (as ``pretrain_gpt.py``
    would), set as the trainer's, with its micro-batch calculator."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args

    saved, sys.argv = sys.argv, ["pretrain_gpt.py", *argv]
    try:
        args = parse_args()
    finally:
        sys.argv = saved
    validate_args(args)
    set_args(args)
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size,
                                         args.data_parallel_size)
    return args
