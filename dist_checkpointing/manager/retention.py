"""Retention: which complete checkpoints to keep. A pure function of the steps and their
metrics, so every rank computes the same answer from the same inputs.

Owns: ``RetentionPolicy``: which complete checkpoints to keep, a pure function of the steps
and their metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..core import CheckpointingException
from .layout import Metrics


def check_positive(name: str, value: Optional[int]) -> None:
    """``value`` must be a positive integer or ``None`` (the setting ``name`` of the manager)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise CheckpointingException(f"CheckpointManager: {name} must be a positive integer or None, not {value!r}")


def metric_value(metrics: Metrics, name: str) -> Optional[float]:
    """``metrics[name]`` as a finite float, or ``None`` when it is missing or not a finite number."""
    value: Any = (metrics or {}).get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep a checkpoint if any policy keeps it: the ``keep_last`` newest, every step that is
    a multiple of ``keep_every_n_steps``, the ``keep_best`` best by ``metrics[best_metric]``
    (``best_mode`` ``'min'`` or ``'max'``). The newest checkpoint is always kept; with no
    policy at all every checkpoint is kept."""

    keep_last: Optional[int] = None
    keep_every_n_steps: Optional[int] = None
    keep_best: Optional[int] = None
    best_metric: Optional[str] = None
    best_mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every_n_steps", "keep_best"):
            check_positive(name, getattr(self, name))
        if self.best_mode not in ("min", "max"):
            raise CheckpointingException(f"CheckpointManager: best_mode must be 'min' or 'max', not {self.best_mode!r}")
        if self.keep_best is not None and not isinstance(self.best_metric, str):
            raise CheckpointingException("CheckpointManager: keep_best needs best_metric (the name of a metric)")

    @property
    def deletes(self) -> bool:
        """Whether any policy is set (without one, nothing is ever deleted)."""
        return any(v is not None for v in (self.keep_last, self.keep_every_n_steps, self.keep_best))

    def ranked(self, steps: Dict[int, Metrics]) -> List[int]:
        """The steps that have the best metric, best first (ties: the newer first)."""
        if self.best_metric is None:
            return []
        sign = 1.0 if self.best_mode == "min" else -1.0
        scored = []
        for step, metrics in steps.items():
            value = metric_value(metrics, self.best_metric)
            if value is not None:
                scored.append((sign * value, -step))
        return [-neg_step for _, neg_step in sorted(scored)]

    def to_delete(self, steps: Dict[int, Metrics]) -> List[int]:
        """The steps no policy keeps (ascending); never the newest."""
        if not self.deletes or not steps:
            return []
        ordered = sorted(steps)
        keep = {ordered[-1]}
        if self.keep_last is not None:
            keep.update(ordered[-self.keep_last:])
        if self.keep_every_n_steps is not None:
            keep.update(s for s in ordered if s % self.keep_every_n_steps == 0)
        if self.keep_best is not None:
            keep.update(self.ranked(steps)[:self.keep_best])
        return [s for s in ordered if s not in keep]
