"""Living with checkpoints: inspect, validate, export and import them, in one process with
no process group (the command line, ``python -m dist_checkpointing``, is a thin layer over
these functions).

Every function that reads tensor data holds at most one whole tensor at a time, in one
buffer sized for the largest tensor, so a checkpoint far larger than memory can be
validated and exported.

One module per tool: :mod:`.info` (inspect), :mod:`.validate`, :mod:`.export`,
:mod:`.importing` (import); :mod:`.output` writes their outputs safely.
"""

from ..compat.lazy import lazy_exports

# public name -> the module that defines it, imported on first use (the command line imports
# only the tool it runs)
_EXPORTS = {
    "export_checkpoint": ".export", "import_checkpoint": ".importing",
    **{name: ".info" for name in ("CheckpointInfo", "TensorInfo", "format_info", "human_size", "inspect_checkpoint")},
    **{name: ".output" for name in ("OutputExistsError", "PathLike", "Progress", "staging_dir",
                                    "temp_output_dir")},
    "ValidationReport": ".validate", "validate_checkpoint": ".validate",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
