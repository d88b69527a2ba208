"""Test-only crash points: where ``DIST_CKPT_MANAGER_CRASH`` names the point, the process
SIGKILLs itself there (the crash tests and the demo use it to kill a run mid-save,
mid-finalize, mid-tracker-update and mid-deletion). Unset, a crash point does nothing."""

from __future__ import annotations

import os
import signal

CRASH_ENV = "DIST_CKPT_MANAGER_CRASH"
#: ``save``: the async save is writing; ``finalize``: every rank wrote its data, before the
#: commit; ``tracker``: committed and indexed, before the tracker is replaced; ``delete``:
#: a checkpoint's metadata.json is deleted, the rest is not; ``local``: a local-tier save's
#: background work starts (nothing of the step written by this rank yet).
POINTS = ("save", "finalize", "tracker", "delete", "local")


def crash_point(point: str, step: int) -> None:
    """SIGKILL this process if ``DIST_CKPT_MANAGER_CRASH`` is ``point`` or ``point:step``."""
    wanted = os.environ.get(CRASH_ENV)
    if wanted and wanted in (point, f"{point}:{step}"):
        os.kill(os.getpid(), signal.SIGKILL)
