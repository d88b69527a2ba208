"""The ``torch_dist`` save strategy: writes this rank's items (sync; async from a staging
arena written by the persistent writer process, or from a forked copy-on-write writer),
then agrees on the outcome and has rank 0 write ``.metadata``
(:meth:`TorchDistSaveShardedStrategy._publish`).

The save costs one 2-byte ``all_reduce`` of the outcome and one gather of item locations
to rank 0 alone; there is no planning round trip before writing.

**Sync save** (:meth:`TorchDistSaveShardedStrategy.save`): (1) the rank's main-replica items
(:mod:`.save_plan`: tensor chunks with a leading size-1 axis per prepended axis,
ShardedObjects as ``torch.save([data])`` bytes); (2) their files (``separation_hint`` groups,
at most ``thread_count`` files a group, balanced by bytes), written on up to ``thread_count``
threads (:func:`.writing.write_files`, zip CRC off per thread, each record checksummed
while written, every file ``fsync``ed; errors kept, not raised yet); (3) :meth:`_publish`:
one 2-byte ``all_reduce`` (MAX) -- this rank failed, this rank's layout changed since this
strategy's previous save (a SHA-256 of its sorted item locations) -- then, after a failure
only, an ``all_gather_object`` of the messages; (4) a gather to rank 0 alone of every rank's
item locations as columns (:mod:`.location_table`: ~60 bytes plus the key per item; with
``cached_metadata=True`` and no layout changed, only ``(file, offset, checksum)``, 32 bytes,
and rank 0 reuses its previous table); (5) rank 0 joins and checks the columns (agreement
across ranks, no duplicate main replicas, no key both a tensor and an object), streams
``.metadata`` (:mod:`.metadata_writer`), its sidecar and the per-key index; (6) a
``broadcast_object`` of rank 0's outcome.

**Async save** (:meth:`TorchDistSaveShardedStrategy.async_save`): ``async_snapshot="auto"``
is ``"stream"`` when a tensor of this rank is on an accelerator, else ``"fork"``; a fork on a
storage that is not ``fork_safe`` becomes ``"copy"``
(:func:`...runtime.snapshot.snapshot_mode`). *Fork*: items planned and objects serialized
as in a sync save; tensors a fork does not isolate (not on the CPU, pinned, or in a shared
or file-backed mapping: :mod:`...runtime.memory_maps`) copied into reused host buffers;
errors agreed; then a :class:`~...runtime.forked_call.ForkedCall` writes the files with the
sync writer and reports the locations and checksums through a pipe. *Copy / stream* (the
arena modes): every tensor laid out in one :class:`~...runtime.arenas.StagingArena` of the
process-wide ``ARENAS`` pool, reserved in the agreed preparation (:func:`.writing.arena_plan`)
and filled after the call's last collective (``async_save_agreed``: ``serialization.save``
adds no agreement after it); ``"copy"`` waits for the copies, ``"stream"`` leaves the event
in the request (``wait_for_staging()``). The request's ``async_fn`` then hands the arena to
the persistent writer (:mod:`...runtime.persistent_worker`), which runs
:func:`.records.write_from_arena` -- the same ``write_records`` reading the bytes in place --
and returns each record's offset, length and checksum; a storage without ``process_spec``
(``memory://``) is written from the queue's thread. In every mode the finalize step is the
second half of a sync save (steps 3-6); the arena is held until the write is done.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ...runtime.collectives import (
    all_gather_object,
    all_reduce_max_uint8,
    broadcast_object,
    error_message,
    gather_object,
    get_rank,
    raise_if_any,
    run_agreed,
)
from ...core import CheckpointingException, gc_paused, open_storage
from ...mapping import ShardedStateDict
from ...runtime.async_request import AsyncRequest
from ..async_strategies import check_async_strategy
from ...runtime.forked_call import ForkedCall
from ..base import AsyncSaveShardedStrategy
from ...storage import Storage
from ...storage.buffers import (
    BUFFERS_PER_FILE,
    adopt_write_buffers,
    reserve_write_buffers,
    return_write_buffers,
)
from ...runtime.persistent_worker import shared_worker
from .records import write_from_arena
from ...runtime.progress import SharedCount, current_sink, poll_count, reporting_bytes
from ...runtime.arenas import ArenaPool, Staged, StagingArena, stage
from ...runtime.snapshot import SNAPSHOT_MODES, ForkHostCopies, fork_host_copies, snapshot_mode
from .format import data_file_name
from .location_table import (
    ChecksumColumns, ItemLocation, LocationTable, encode_checksums, encode_locations, in_file_order,
)
from .metadata import assemble_table, table_metadata, write_table
from .save_plan import SaveItem, assign_files, collect_save_items, hint_prefix
from .writing import arena_files, arena_plan, arena_records, locations, write_files


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves ShardedTensors and ShardedObjects in the torch_dist (DCP) format.

    Args:
        backend, version: recorded in ``metadata.json``.
        keep_only_main_replica: accepted for Megatron-Core compatibility; only main
            replicas are ever written.
        thread_count: writer threads (and files) per rank.
        cached_metadata: when every rank writes the same items as in the previous save
            with this strategy, skip gathering item locations and reuse the previous
            global metadata.
        separation_hint: keys starting with this prefix go to separate files
            ``{hint}__{rank}_{n}.distcp``.
        checksums: record an xxh3-64 checksum of every stored item (verified on load).
        async_snapshot: how :meth:`async_save` takes its snapshot (the user guide's "Async
            save" compares them):

            * ``"auto"`` (default): ``"stream"`` when any tensor is on an accelerator, else
              ``"fork"`` (``"copy"`` for a storage that is not ``fork_safe``).
            * ``"stream"``: tensors are copied into a shared host arena reused across saves
              (pinned where CUDA is), accelerator tensors on a side stream: the call returns
              before the copies complete. Later work on the caller's current stream waits for
              them on the device, so the checkpoint is the state at the call; work on other
              streams must call the request's ``wait_for_staging()`` first.
            * ``"copy"``: the same, but the call returns once the copies are done.
            * ``"fork"``: a forked child process sees the CPU tensors copy-on-write and
              writes them; the call returns after the fork (a fraction of one memcpy), but
              every page the caller writes while the child runs is copied by the kernel on
              its first write; tensors a fork does not isolate are copied into host buffers
              first (:func:`...runtime.memory_maps.needs_host_copy`: other devices, pinned memory, shared and
              file-backed mappings; every CPU tensor where ``/proc/self/maps`` cannot be
              read).

            ``"stream"`` and ``"copy"`` write from this process's persistent writer (one
            process spawned on the first such save, :mod:`..persistent_worker`), or from
            the async queue's thread for a storage another process cannot open
            (``memory://``).
        cpu_shm_mode: Megatron-Core 0.19's argument (copy accelerator tensors into host
            shared memory before the async writer sees them), accepted for its callers:
            that is what ``"auto"`` does here for any accelerator tensor.
    """

    def __init__(self, backend: str = "torch_dist", version: int = 1, keep_only_main_replica: bool = True,
                 thread_count: int = 2, cached_metadata: bool = False, separation_hint: Optional[str] = None,
                 cpu_shm_mode: bool = False, checksums: bool = True, async_snapshot: str = "auto"):
        super().__init__(backend, version)
        if async_snapshot not in SNAPSHOT_MODES:
            raise CheckpointingException(f"async_snapshot must be one of {', '.join(map(repr, SNAPSHOT_MODES))}, "
                                         f"not {async_snapshot!r}")
        self.async_snapshot = async_snapshot
        self.cpu_shm_mode = cpu_shm_mode
        self.checksums = checksums
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = max(1, int(thread_count))
        #: Megatron-Core's name of ``cached_metadata`` (Megatron-LM sets it after construction)
        self.use_cached_ckpt_structure = cached_metadata
        self.separation_hint = separation_hint
        # (layout digest, rank 0's LocationTable, or a Metadata plugged in) of the last save with cached metadata
        self._cache: Optional[Tuple[Optional[str], Union[None, Metadata, LocationTable]]] = None
        self._host_copies = ForkHostCopies()

    _runtime_attrs = ("_host_copies",)

    def _new_runtime(self) -> Dict[str, Any]:
        return {"_host_copies": ForkHostCopies()}

    @property
    def _arenas(self) -> ArenaPool:
        """The staging arenas of this process's async saves (shared by every strategy)."""
        return ARENAS

    @property
    def cached_metadata(self) -> bool:
        """Whether an unchanged layout reuses the previous save's global metadata."""
        return self.use_cached_ckpt_structure

    @cached_metadata.setter
    def cached_metadata(self, value: bool) -> None:
        self.use_cached_ckpt_structure = value

    @property
    def cached_global_metadata(self) -> Optional[Metadata]:
        """The global metadata kept from the last save (rank 0; ``None`` elsewhere or when
        not caching). Megatron-LM plugs in the metadata its load strategy read: accepted,
        but not reused (the next save gathers its own; a layout this strategy has not
        seen saved is never assumed)."""
        cached = self._cache[1] if self._cache is not None else None
        return table_metadata(cached) if isinstance(cached, LocationTable) else cached

    @cached_global_metadata.setter
    def cached_global_metadata(self, metadata: Optional[Metadata]) -> None:
        self._cache = None if metadata is None else (None, metadata)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        storage = open_storage(checkpoint_dir)
        locations: List[ItemLocation] = []
        error: Optional[str] = None
        try:
            locations = self._write_files(self._plan_files(sharded_state_dict), storage)
        except Exception as e:  # noqa: BLE001 - agreed on below
            error = error_message(e)
        self._publish(locations, error, storage)

    #: ``async_save`` raises on every rank by itself: its preparation is agreed, and a failure
    #: of the copies queued after that (the last collective of the call) is reported by the
    #: request's write, at finalization. ``save`` adds no agreement around it, so nothing
    #: after the queued copies waits for them (on NCCL, every collective reads its flags back
    #: with a host sync, which would wait for the copies).
    async_save_agreed = True

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
                   async_strategy: Optional[str] = "nvrx") -> AsyncRequest:
        """Snapshot this rank's items and write them in the background (``async_strategy``:
        Megatron-Core >= 0.16's, checked; both names run on this library's machinery,
        :mod:`..async_strategies`).

        Returns an :class:`AsyncRequest` whose ``async_fn`` writes the data (or waits for
        the writer) and whose finalize step gathers the item locations and writes
        ``.metadata`` (collective). Once this returns the caller may change its tensors
        (see ``async_snapshot`` for how, and for what ``"stream"`` asks of work on other
        streams). Host buffers and arenas are kept for the next save (released by
        :meth:`release`, which ``AsyncCallsQueue.close`` calls). Collective: ``run_agreed``
        agrees on the preparation (plan, snapshot mode, staging arena reserved and pinned);
        the copies are queued after it, and no collective follows them.
        """
        storage = open_storage(checkpoint_dir)
        written: Dict[str, Any] = {"sink": current_sink()}  # bytes reported from the waiting thread
        held: List[Callable[[], None]] = []  # this rank's arena hold, ended if another rank fails

        def finalize() -> None:
            self._publish(written["locations"], None, storage)

        def prepare() -> Tuple[str, Any]:
            check_async_strategy(async_strategy)
            files = self._plan_files(sharded_state_dict)
            mode = self._snapshot_mode(files, storage)
            if mode == "fork":
                return mode, self._stage(files)
            return mode, _reserve_arena(files, storage, held)

        try:
            mode, prepared = run_agreed(prepare, "Preparing the async save")
        except BaseException:
            for done in held:
                done()
            raise
        if mode != "fork":
            write, staged = self._stage_arena(prepared, storage, written, wait=mode == "copy")
            request = AsyncRequest(write, (), [finalize], resources=[self])
            request.staged = staged
            return request
        files = prepared
        # The writer's file write buffers: the pool's (already touched), reserved for it.
        buffers = reserve_write_buffers(min(self.thread_count, max(1, len(files))) * BUFFERS_PER_FILE)
        count = written["count"] = SharedCount() if written["sink"] is not None else None

        def write_in_child() -> List[ItemLocation]:
            adopt_write_buffers(buffers)
            with reporting_bytes(count and count.sink):
                return self._write_files(files, storage)

        try:
            writer = ForkedCall(write_in_child, f"Writing {storage.describe()} on rank {get_rank()}")
        except BaseException:
            return_write_buffers(buffers)
            raise
        written["buffers"] = buffers
        return AsyncRequest(_wait_for_writer, (writer, written), [finalize], resources=[self])

    def _snapshot_mode(self, files: Dict[str, List[SaveItem]], storage: Storage) -> str:
        """The snapshot this save takes (:func:`...runtime.snapshot.snapshot_mode`)."""
        tensors = [it.payload for items in files.values() for it in items if isinstance(it.payload, torch.Tensor)]
        return snapshot_mode(self.async_snapshot, tensors, storage.fork_safe)

    def _stage_arena(self, reserved: "_Reserved", storage: Storage, written: Dict[str, Any],
                     wait: bool) -> Tuple[Callable[[], None], Staged]:
        """Copy every tensor of the reserved plan into its arena (:mod:`...runtime.arenas`; after the
        call's last collective); returns the request's ``async_fn`` (wait for the copies,
        then write from the persistent writer, or from this thread where the storage needs
        it) and the copies' handle. A failure of the copies ends the arena's hold (once the
        copies already queued are done) and is raised by that ``async_fn``."""
        tensors, offsets, plan, arena, done, spec = reserved
        try:
            staged = stage(arena, tensors, offsets)
            if wait:
                staged.wait()
        except Exception as e:  # noqa: BLE001 - reported by the write, agreed at finalization
            done()
            error = CheckpointingException(f"Staging the async save on rank {get_rank()} failed: {error_message(e)}")

            def failed() -> None:
                raise error

            return failed, Staged([], [])
        except BaseException:
            done()
            raise
        del tensors, reserved  # the plan keeps no reference to the sources
        what = f"Writing {storage.describe()} on rank {get_rank()}"
        sink = written["sink"]

        def write() -> None:
            try:
                staged.wait()
                if spec is None:
                    with reporting_bytes(sink):
                        written["locations"] = write_files(arena_files(plan, arena.flat), storage, self.checksums,
                                                           self.thread_count)
                    return
                sent, templates = arena_records(plan, arena.flat)
                worker = shared_worker()
                worker.share_arena(arena.id, arena.fd, arena.size)
                job = worker.submit(write_from_arena, (spec, arena.id, sent, templates, self.checksums,
                                                       self.thread_count, sink is not None), what=what,
                                    on_progress=sink)
                written["locations"] = locations(plan, job.result())
            finally:
                done()

        return write, staged

    def release(self) -> None:
        """Free the host buffers and arenas kept for staging the tensors of async saves."""
        self._host_copies.release()
        self._arenas.release()

    def _stage(self, files: Dict[str, List[SaveItem]]) -> Dict[str, List[SaveItem]]:
        """The same files with the tensors a fork does not snapshot replaced by host copies
        (:func:`...runtime.snapshot.fork_host_copies`)."""
        tensors = [((fname, i), it.payload) for fname, items in files.items() for i, it in enumerate(items)
                   if isinstance(it.payload, torch.Tensor)]
        copies = fork_host_copies(tensors, True, self._host_copies)
        return {fname: [replace(it, payload=copies[(fname, i)]) if (fname, i) in copies else it
                        for i, it in enumerate(items)] for fname, items in files.items()}

    def data_file_names(self, rank: int) -> List[str]:
        prefixes = {"", hint_prefix(self.separation_hint) if self.separation_hint else ""}
        return [data_file_name(rank, self.thread_count - 1, prefix) for prefix in sorted(prefixes)]

    def _plan_files(self, sharded_state_dict: ShardedStateDict) -> Dict[str, List[SaveItem]]:
        items = collect_save_items(sharded_state_dict)
        #: tensor bytes this rank writes in the current save (logged by ``save``)
        self.last_written_bytes = sum(it.nbytes for it in items if it.tensor_meta is not None)
        return assign_files(items, get_rank(), self.thread_count, self.separation_hint)

    def _publish(self, locations: List[ItemLocation], error: Optional[str], storage: Storage) -> None:
        """Agree on every rank's write outcome; rank 0 writes ``.metadata`` (collective).

        One 2-byte ``all_reduce`` (did any rank fail? did any rank's layout change since the
        last save with ``cached_metadata``?), then the item locations as columns
        (:func:`.location_table.encode_locations`) — or, for an unchanged layout, only their
        checksums — gathered to rank 0 alone, then rank 0's outcome broadcast. Error messages
        travel only after a failure."""
        rank = get_rank()
        locations = in_file_order(locations)
        sent = None
        if error is None:
            try:
                sent = encode_locations(locations)
            except Exception as e:  # noqa: BLE001 - agreed on below
                error = error_message(e)
        digest = hashlib.sha256(pickle.dumps([loc[:5] for loc in locations])).hexdigest()
        unchanged = self._cache is not None and self._cache[0] == digest and (rank != 0 or self._cache[1] is not None)
        failed, changed = all_reduce_max_uint8([int(error is not None), int(not unchanged)])
        if failed:
            raise_if_any(all_gather_object(error), "Writing the checkpoint data")

        reuse = self.cached_metadata and not changed
        # Same layout as last time: only the checksums (file, offset, checksum: 32 bytes per item) travel.
        with gc_paused():
            self._assemble(encode_checksums(locations) if reuse else sent, reuse, digest, storage)

    def _assemble(self, sent: tuple, reuse: bool, digest: str, storage: Storage) -> None:
        """Gather the locations (or checksums) to rank 0, which streams ``.metadata`` and its
        index from their columns; agree on its outcome."""
        rank = get_rank()
        metadata_error: Optional[str] = None
        per_rank = gather_object(sent)
        if rank == 0:
            try:
                if reuse:  # the same files as last time (last_written_files too), in the same order
                    table = self._cache[1]
                    checks = ChecksumColumns.gather(per_rank)
                    table.check_same_items(checks)  # now table.checksums
                else:
                    self.last_written_files = None
                    table = assemble_table(per_rank, storage)
                    checks = table.checksums
                    self.last_written_files = table.data_file_sizes()
                del per_rank
                write_table(table, checks, storage)
                if self.cached_metadata:
                    self._cache = (digest, table)
            except Exception as e:  # noqa: BLE001 - broadcast below
                metadata_error = error_message(e)
        elif self.cached_metadata:
            self._cache = (digest, None)  # only rank 0 needs the metadata itself
        metadata_error = broadcast_object(metadata_error)
        if metadata_error is not None:
            raise CheckpointingException(f"Writing the checkpoint metadata failed on rank 0: {metadata_error}")

    def _write_files(self, files: Dict[str, List[SaveItem]], storage: Storage) -> List[ItemLocation]:
        return write_files(files, storage, self.checksums, self.thread_count)


def _wait_for_writer(writer: ForkedCall, written: Dict[str, Any]) -> None:
    """The ``async_fn`` of an async save: wait for the forked writer, keep its locations,
    give its write buffers back to the pool."""
    try:
        if written.get("count") is not None:
            poll_count(written["sink"], written["count"], writer.wait)
        written["locations"] = writer.result()
    finally:
        return_write_buffers(written.pop("buffers", []))


def _forget_arena(arena: StagingArena) -> None:
    """Tell this process's persistent writer (if it has ``arena``) to unmap it."""
    shared_worker().forget_arena(arena.id)


#: the staging arenas of this process's async saves, shared by every strategy (a strategy
#: built per save reuses them: pinned memory stays bounded)
ARENAS = ArenaPool(_forget_arena)

# (tensors, offsets, arena plan, arena, end of its hold, the storage's spec for the writer)
_Reserved = Tuple[List[torch.Tensor], List[int], Dict[str, Any], StagingArena, Callable[[], None], Any]


def _reserve_arena(files: Dict[str, List[SaveItem]], storage: Storage, held: List[Callable[[], None]]) -> _Reserved:
    """Take (and pin, for CUDA tensors) an arena of the process's pool for ``files``; its
    hold's end goes into ``held`` at once (for a caller whose agreement fails)."""
    tensors, offsets, size, plan = arena_plan(files)
    arena, done = ARENAS.take(size)
    held.append(done)
    arena.pin_for(tensors)
    return tensors, offsets, plan, arena, done, storage.process_spec()
