"""dist_checkpointing: save and load the sharded training state of parallel models.

A drop-in for Megatron-Core's ``megatron.core.dist_checkpointing``: change the import
prefix and model code written for it works unchanged.

The public names below are imported with the package, as they always were, except in the
``dist-ckpt`` command's own process (``dist-ckpt …`` or ``python -m dist_checkpointing …``):
there each is imported on first use, so that a subcommand imports only what it needs
(``--help`` imports neither torch nor the library).
"""

import os
import sys

from .compat import moved as _moved
from .compat.lazy import lazy_exports

_moved.install()  # module paths of earlier versions (e.g. dist_checkpointing.convert) still import

__version__ = "0.1.0"

# public name -> the module (relative to this package) that defines it
_EXPORTS = {
    "CheckpointingConfig": ".core", "CheckpointingException": ".core",
    "CheckpointManager": ".manager",
    **{name: ".mapping" for name in (
        "LocalNonpersistentObject", "ShardedObject", "ShardedStateDict", "ShardedTensor", "ShardedTensorFactory",
        "StateDict", "apply_factories", "apply_factory_merges", "is_main_replica")},
    **{name: ".serialization" for name in (
        "check_is_distributed_checkpoint", "load", "load_common_state_dict", "load_content_metadata",
        "load_plain_tensors", "load_sharded_metadata", "load_tensors_metadata", "remove_sharded_tensors", "save")},
    "register_safe_globals": ".pickling.safe_globals",
    "StrictHandling": ".validation",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


def _is_command_line() -> bool:
    """Whether this process is the ``dist-ckpt`` command: the console script, or
    ``python -m dist_checkpointing[.…]`` (``sys.argv[0]`` is ``-m`` while the module to run is
    being imported; ``sys.orig_argv`` names it)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 != "-m":
        return os.path.basename(argv0) in ("dist-ckpt", "dist-ckpt.exe", "dist-ckpt-script.py")
    args = list(getattr(sys, "orig_argv", []))
    for i, arg in enumerate(args[1:], 1):
        if arg.startswith("-m"):
            module = arg[2:] or (args[i + 1] if i + 1 < len(args) else "")
            return module == __name__ or module.startswith(__name__ + ".")
    return False


def _is_writer_process() -> bool:
    """Whether this process is a persistent writer (:mod:`.runtime.persistent_worker`,
    whose parent sets this variable): it imports only what its calls need."""
    return "DIST_CKPT_WORKER_FDS" in os.environ


if not _is_command_line() and not _is_writer_process():
    # Import torch's distributed checkpointing now rather than on the first save/load: importing
    # it after init_process_group can make the process abort at exit (torch 2.13, gloo).
    import torch.distributed.checkpoint  # noqa: F401

    for _name in _EXPORTS:
        __getattr__(_name)
    del _name
