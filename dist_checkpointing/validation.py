"""Load strictness (:class:`StrictHandling`) and checks on what is saved and loaded."""

from __future__ import annotations

from enum import Enum
from typing import Union

from .core import CheckpointingException


class StrictHandling(Enum):
    """What ``load`` does with key mismatches between request and checkpoint.

    *Unexpected* keys are requested but absent from the checkpoint (per rank); *missing*
    keys are in the checkpoint but requested by no rank (global).
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        """Whether the mode needs the request compared with the checkpoint metadata."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        """Whether the mode needs every rank's request (to find missing keys)."""
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        """Whether ``load`` returns ``(state_dict, missing, unexpected)``."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """Accept a :class:`StrictHandling` or its string value."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError as e:
        raise CheckpointingException(
            f"Unknown strict mode {strict!r}; use one of {[m.value for m in StrictHandling]}"
        ) from e
