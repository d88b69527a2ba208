"""How the ranks of a :class:`~.manager.CheckpointManager` agree: a decision rank 0 takes
for every rank (:func:`decided_on_rank0`), and the step every rank passes (:func:`step_flags`
reduced with max, then :func:`same_on_every_rank`; :func:`check_step` first).

Owns: how the manager's ranks agree: ``decided_on_rank0`` (rank 0 decides, one broadcast,
its error on every rank), ``step_flags`` / ``same_on_every_rank`` (the same step everywhere,
in one ``all_reduce``), ``check_step``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, TypeVar

from ..core import CheckpointingException
from ..runtime.collectives import broadcast_object, error_message, get_rank

T = TypeVar("T")


def decided_on_rank0(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on rank 0 and return its result on every rank, or raise its error on every
    rank (one broadcast)."""
    outcome: Tuple[Optional[str], Any] = (None, None)
    if get_rank() == 0:
        try:
            outcome = (None, fn())
        except Exception as e:  # noqa: BLE001 - broadcast to every rank
            outcome = (error_message(e), None)
    error, result = broadcast_object(outcome)
    if error is not None:
        raise CheckpointingException(error if error.startswith("CheckpointManager") else f"{what}: {error}")
    return result


def check_step(step: Any) -> int:
    """``step`` if it is a valid step (a non-negative integer below 2**63), else raise."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise CheckpointingException(f"CheckpointManager: a step is a non-negative integer below 2**63, not {step!r}")
    return step


def step_flags(step: int) -> List[int]:
    """The bytes of ``step`` and their complements: after an element-wise max over the
    ranks, each pair sums to 255 only if every rank passed the same step."""
    raw = step.to_bytes(8, "little")
    return list(raw) + [255 - b for b in raw]


def same_on_every_rank(agreed: List[int]) -> bool:
    """From :func:`step_flags` reduced with max: whether every rank passed the same step."""
    return all(a + b == 255 for a, b in zip(agreed[:8], agreed[8:16]))
