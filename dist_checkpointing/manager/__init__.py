"""The checkpoint manager: when to save, what to keep, where to resume — crash-safe.

* :mod:`.manager` — :class:`CheckpointManager`, the entry point;
* :mod:`.layout` — Megatron-LM's root layout (``iter_{step:07d}/``, the tracker), the index;
* :mod:`.retention` — the retention policies;
* :mod:`.bookkeeping` — rank 0's background thread: index and tracker writes, deletions;
* :mod:`.lock` — one manager per root;
* :mod:`.agreement` — how the ranks agree on a step and on rank 0's decisions;
* :mod:`.local` — two-tier mode's local tier (saving and replicating, restoring, the copies'
  files and headers, converting a step into a normal checkpoint offline);
* :mod:`.crash` — test-only crash points.
"""

from .local.convert import LocalConversion, convert_local_checkpoint
from .manager import CheckpointManager
from .retention import RetentionPolicy

__all__ = ["CheckpointManager", "LocalConversion", "RetentionPolicy", "convert_local_checkpoint"]
