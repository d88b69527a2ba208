"""Megatron-Core 0.19.2 (and the Megatron-LM trainer modules its wheel ships) on this package,
in a test rank or subprocess: the switch, then Megatron's packages without their
``__init__`` (which imports all of Megatron-Core, models and triton kernels: seconds).

Megatron-LM's ``megatron/training/async_utils.py`` is imported unchanged; what it imports
from the rest of the trainer (``get_args``, ``print_rank_0``, the deletion workers of
``checkpointing.py``) is given by :func:`megatron19` as small stand-ins, because the trainer's
other modules import the whole of Megatron-Core and its CUDA-only parts.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from typing import Any, Tuple

ARGS = argparse.Namespace()  # what the stand-in of megatron.training.get_args returns


def _bare_package(site: str, name: str) -> None:
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(site, *name.split("."))]
        sys.modules[name] = module


def _stand_in(name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def megatron19(site: str) -> Tuple[Any, Any]:
    """``(megatron.training.async_utils, megatron.core.dist_checkpointing)`` with the switch
    installed (the second is this package)."""
    import numpy as np

    np.product = np.prod  # removed from NumPy 2, still used by Megatron-Core
    if site not in sys.path:
        sys.path.append(site)
    import dist_checkpointing.megatron as dm

    dm.install()
    for name in ("megatron", "megatron.core", "megatron.training"):
        _bare_package(site, name)
    for name in ("megatron.core.tensor_parallel", "megatron.core.utils", "megatron.core.parallel_state"):
        __import__(name)  # in this order, as megatron/core/__init__.py would
    training = sys.modules["megatron.training"]
    training.get_args = lambda: ARGS
    _stand_in("megatron.training.utils", print_rank_0=lambda *a, **k: None)
    _stand_in("megatron.training.checkpointing", finalize_deletion_processes=lambda blocking=False: None)
    import megatron.core.dist_checkpointing as mdc
    import megatron.training.async_utils as async_utils

    assert async_utils.__file__.startswith(site), async_utils.__file__
    return async_utils, mdc
