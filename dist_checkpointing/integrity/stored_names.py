"""Writing only what the store keeps as written, and checking that it did.

An object store may rewrite a key (SeaweedFS stores ``a\\b`` as ``a/b``) or refuse it
halfway through a save (too long, a control character): a save that went on would report
success for a checkpoint that cannot be read back at its URL. So the names a writer is
about to use, the location's own key included, are checked first
(:func:`refuse_unkept_names`, before anything is written or deleted), and a save's commit
lists what was stored (:func:`verify_stored`: one listing of the prefix, where a listing
gives sizes) before it writes ``metadata.json``.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

from ..core import CheckpointingException
from ..storage import Storage


def refuse_unkept_names(storage: Storage, names: Iterable[str], what: str) -> None:
    """Raise :class:`CheckpointingException` naming the key if the store would not keep
    the location (``storage``'s root) or one of the files ``names`` in it as written.
    ``what`` names the operation in the message."""
    for name in ("", *names):
        problem = storage.name_problem(name)
        if problem is not None:
            raise CheckpointingException(
                f"{what}: {storage.describe(name)!r} is not a name the store keeps as written: {problem}; "
                "choose another location (or name)")


def verify_stored(storage: Storage, expected: Dict[str, Optional[int]], what: str) -> None:
    """Raise :class:`CheckpointingException` if a file of ``expected`` (name -> size,
    ``None``: any size) is not listed under ``storage``'s root with that size. One
    listing; nothing is checked where a listing does not give sizes (a file system keeps
    names as written, and a failed write raises)."""
    listed = storage.listed_sizes()
    if listed is None:
        return
    problems = []
    for name, size in sorted(expected.items()):
        found = listed.get(name)
        if found is None:
            problems.append(f"{storage.describe(name)} is not there")
        elif size is not None and found != size:
            problems.append(f"{storage.describe(name)} holds {found} bytes, not the {size} written")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointingException(f"{what}: the store did not keep what was written ({shown})")
