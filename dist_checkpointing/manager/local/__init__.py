"""The local tier of two-tier checkpointing (:class:`.tier.LocalTier`): frequent per-rank
copies in node-local directories, replicated to partner ranks. One concept a module:
:mod:`.tier` (saving, replicating, finalizing), :mod:`.snapshot` (a rank's state as one flat
buffer), :mod:`.format` (the header), :mod:`.files` (copies and markers on disk),
:mod:`.marker` (which job a copy belongs to), :mod:`.restore` (restoring, from this rank's
copy or a partner's), :mod:`.convert` (a step as a torch_dist checkpoint). Imported on use.

**Partners**: nodes come from ``node_of_rank`` or torchrun's ``LOCAL_WORLD_SIZE``; rank r's
replicas go to the ranks with r's index within its node on the next
``replication_factor - 1`` nodes, cyclically -- a pure function, so no collective decides
it. **Owners**: at construction rank 0 reads (or creates) the root's run id and broadcasts
the job; every marker carries it, and another job's copies are refused on every rank
(``local_takeover``: the directory's cleaner deletes them).

**Save of a local step S** (after the manager's step agreement): the snapshot, agreed with
``run_agreed`` -- a ``ForkedCall`` for CPU state with ``local_snapshot="fork"`` (tensors a
fork does not isolate copied first), else a copy on the training thread, into one flat
anonymous shared buffer reused across saves, hashed 1 MiB at a time. Then one background
thread: the own copy and marker, and the exchange with the partners (``PGTransport`` on a
gloo group of the tier's own, so its messages never interleave with the trainer's
collectives); each received replica's checksum is recomputed before it is written with its
marker. Finalize (next ``save`` / ``load`` / ``wait_until_finished`` / ``close``): one
``run_agreed``; a failure anywhere deletes S's files everywhere (markers first), success
lets each directory's cleaner delete every other copy of this job. A marker is written
after its payload, so a kill leaves payloads without markers, which restore ignores: S is
restored only if every rank's copy has a marker somewhere, else an older step or the
persistent tier. ``load(..., persist_local=True)`` saves a restored step into the
persistent tier through the manager's normal ``save``. Cost per local save: a fork or one
copy, two 1-byte ``all_reduce`` s, point-to-point traffic to ``replication_factor - 1``
partners -- independent of the world size.
"""
