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

**The truth is the directories**: a step is complete iff ``iter_{step:07d}/metadata.json``
exists, which ``save`` writes last. When a manager opens a root, rank 0 lists it once,
stats each ``iter_*`` directory's ``metadata.json`` and broadcasts the complete steps; the
tracker (for Megatron-LM) and the index (a cache of the metrics, also stored in each
checkpoint's ``content_metadata``) are never trusted for completeness. The root is read and
written only through the storage protocol, so it may be a directory, an ``s3://`` prefix or
another fsspec URL; nothing is ever removed as a tree.

**The order of a save of step S**, and what a kill right after each step leaves:

1. decide -- S valid and newer than every checkpoint, the same on every rank (one 17-byte
   ``all_reduce``), rank 0's metrics valid, a leftover ``iter_S`` deleted: nothing new;
2. ``save`` claims ``iter_S`` and writes the data: ``iter_S`` without ``metadata.json``, which
   the next manager deletes (a leftover), resuming from the previous complete step;
3. async only: finalized once every rank's writer is done; a failure anywhere raises on
   every rank: the same;
4. commit, ``metadata.json`` (rank 0, atomic): S complete, tracker and index still at the
   previous step; the next manager rewrites the tracker and completes the index from S;
5. retention computed alike on every rank (no collective): --;
6. rank 0's worker writes the index, then the tracker (atomic): it names S or the previous
   step, both complete;
7. the worker deletes what retention dropped, each directory's ``metadata.json`` first:
   a directory without ``metadata.json``, never loaded, deleted as a leftover.

So the newest directory with ``metadata.json`` is always a whole checkpoint, the tracker
always names a complete one (steps 6 and 7 run in one thread, in queue order, and
retention never deletes the newest), and no failed save deletes anything (retention runs
only after a commit). ``tests/test_manager_crash.py`` kills real processes at steps 2, 3, 6
and 7. Loading vs deletion: rank 0 marks the step being loaded in its worker, which skips
that directory's deletion until every rank has read (one ``all_reduce``). Deletion vs saves:
``save`` holds the worker's deletions until the checkpoint is committed or failed; one
running waits at its next 64 MiB piece (freeing a large file's blocks meets a save's
``fsync`` s in the journal: a 256 MiB save took 2.1-2.4x as long during a 1 GiB unlink).
Cost per ``save`` call: one 17-byte ``all_reduce``, plus one ``broadcast_object`` of rank 0's
metrics when it saves, at any world size; ``load`` adds a broadcast and an ``all_reduce``.

The storage calls the manager uses: ``write_atomic``, ``create_exclusive``, ``read_bytes``,
``list``, ``info``, ``kind``, ``delete``, and (added for it) ``entries`` / ``entry_kind``
(what each entry itself is, links not followed), ``delete_many`` (each named entry, a link
itself never its target, with a ``pause`` between pieces; POSIX truncates a large file from
its end in 64 MiB pieces through an ``O_NOFOLLOW`` descriptor before the unlink; S3 deletes
100 keys a request) and ``remove_dir`` (an empty directory).
"""

from .local.convert import LocalConversion, convert_local_checkpoint
from .manager import CheckpointManager
from .retention import RetentionPolicy

__all__ = ["CheckpointManager", "LocalConversion", "RetentionPolicy", "convert_local_checkpoint"]
