"""Living with checkpoints: inspect, validate, export and import them, in one process with
no process group (the command line, ``python -m dist_checkpointing``, is a thin layer over
these functions).

Every function that reads tensor data holds at most one whole tensor at a time, in one
buffer sized for the largest tensor, so a checkpoint far larger than memory can be
validated and exported.

One module per tool: :mod:`.info` (inspect), :mod:`.validate`, :mod:`.export`,
:mod:`.importing` (import); :mod:`.output` writes their outputs safely.
"""

from .export import export_checkpoint
from .importing import import_checkpoint
from .info import CheckpointInfo, TensorInfo, format_info, human_size, inspect_checkpoint
from .output import OutputExistsError, PathLike, Progress, staging_dir
from .validate import ValidationReport, validate_checkpoint

__all__ = [
    "CheckpointInfo", "OutputExistsError", "PathLike", "Progress", "TensorInfo", "ValidationReport", "export_checkpoint",
    "format_info", "human_size", "import_checkpoint", "inspect_checkpoint", "staging_dir", "validate_checkpoint",
]
