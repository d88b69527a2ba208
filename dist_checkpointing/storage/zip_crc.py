"""The zip-CRC switch of ``torch.save``: off while our writers serialize into a stream.

Owns: ``zip_crc_disabled``: ``torch.save``'s zip-CRC switch off while our writers serialize
(per thread where torch keeps it per thread).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, List, Optional

from torch.serialization import get_crc32_options, set_crc32_options

_crc_lock = threading.Lock()
_crc_depth = 0
_crc_saved = True
_crc_switch_per_thread: Optional[bool] = None


def _crc_switch_is_per_thread() -> bool:
    """Whether torch keeps the zip-CRC switch per thread (a context variable, as recent
    torch does) rather than process-wide. Probed once, by the caller that has just turned
    the switch off: a fresh thread still sees it on only if the switch is per thread."""
    global _crc_switch_per_thread
    if _crc_switch_per_thread is None:
        seen: List[bool] = []
        probe = threading.Thread(target=lambda: seen.append(get_crc32_options()), name="dist-ckpt-crc-probe")
        probe.start()
        probe.join()
        _crc_switch_per_thread = seen[0]
    return _crc_switch_per_thread


@contextlib.contextmanager
def zip_crc_disabled() -> Iterator[None]:
    """Skip ``torch.save``'s zip CRC32 (a slow byte-by-byte pass) in ``torch.save`` calls
    made by this thread meanwhile.

    Neither ``torch.load`` nor DCP verifies it (stdlib ``zipfile.read`` would: read our blobs
    with ``torch.load``). Enter it on the thread that saves: recent torch keeps the switch
    per thread, and then only this thread's setting changes; where torch keeps it
    process-wide, it is off while any such block runs. Re-entrant and thread-safe; the
    previous setting is restored on exit.
    """
    global _crc_depth, _crc_saved
    with _crc_lock:
        previous = get_crc32_options()
        set_crc32_options(False)
        per_thread = _crc_switch_is_per_thread()
        if not per_thread:
            if _crc_depth == 0:
                _crc_saved = previous
            _crc_depth += 1
    try:
        yield
    finally:
        if per_thread:
            set_crc32_options(previous)
        else:
            with _crc_lock:
                _crc_depth -= 1
                if _crc_depth == 0:
                    set_crc32_options(_crc_saved)
