"""Bytes this job's own processes pickled — other ranks over the process group, a forked
child's report, metadata built in this process — are a trusted channel, not stored content:
:func:`loads_trusted` is the one ``pickle.loads`` of such bytes, so every place that reads
them is marked (imports no torch: the persistent writer uses it too).

Owns: ``loads_trusted``: the one ``pickle.loads`` of bytes this job's own processes pickled
(other ranks in ``runtime/collectives.py``, ``transport/wire.py``,
``integrity/common_state.py``; a forked child's report in ``runtime/forked_call.py``;
metadata built in this process).
"""

from __future__ import annotations

import pickle
from typing import Any


def loads_trusted(data: bytes) -> Any:
    """Unpickle bytes this job's own processes pickled (never bytes read from a checkpoint)."""
    return pickle.loads(data)
