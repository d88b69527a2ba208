"""The ``torch_dist`` save strategy: writes this rank's items (sync, async from host
copies, or async from a forked copy-on-write writer), then agrees on the outcome and has
rank 0 write ``.metadata`` (:meth:`TorchDistSaveShardedStrategy._publish`).

The save costs one 2-byte ``all_reduce`` of the outcome and one gather of item locations
to rank 0 alone; there is no planning round trip before writing.
"""

from __future__ import annotations

import hashlib
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from itertools import repeat
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ...exchange.collectives import (
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
from ..async_request import AsyncRequest
from ..forked_call import ForkedCall
from ..base import AsyncSaveShardedStrategy
from ...storage import Storage
from ...storage.buffers import (
    BUFFERS_PER_FILE,
    adopt_staging_buffers,
    reserve_staging_buffers,
    return_staging_buffers,
)
from ..filesystem_async import HostStaging, payload_nbytes, write_file
from ..progress import byte_meter
from ..memory_maps import not_isolated_by_fork
from .format import data_file_name
from .metadata import Location, build_metadata, checksum_table, data_file_sizes, storage_meta, write_metadata
from .save_plan import SaveItem, assign_files, collect_save_items, hint_prefix


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
        async_snapshot: how :meth:`async_save` takes its snapshot. ``"fork"`` (default): a
            forked child process sees the tensors copy-on-write and writes them; the call
            returns after the fork (a fraction of one memcpy), but every page the caller
            writes while the child runs is copied by the kernel on its first write, and
            written pages stay write-protected until then (see the user guide); tensors a
            fork does not isolate are copied into host buffers first (:func:`_needs_staging`:
            other devices, pinned memory, shared and file-backed mappings such as
            ``np.memmap`` or ``torch.load(mmap=True)``; every CPU tensor where
            ``/proc/self/maps`` cannot be read). ``"copy"``: every tensor is copied into
            host buffers reused from the previous save of the same structure (one memcpy;
            device tensors into pinned memory), then written by the async queue's thread;
            no later cost to the caller. A storage that is not ``fork_safe`` (S3) is
            always saved the ``"copy"`` way.
    """

    def __init__(self, backend: str = "torch_dist", version: int = 1, keep_only_main_replica: bool = True,
                 thread_count: int = 2, cached_metadata: bool = False, separation_hint: Optional[str] = None,
                 checksums: bool = True, async_snapshot: str = "fork"):
        super().__init__(backend, version)
        if async_snapshot not in ("fork", "copy"):
            raise CheckpointingException(f"async_snapshot must be 'fork' or 'copy', not {async_snapshot!r}")
        self.async_snapshot = async_snapshot
        self.checksums = checksums
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = max(1, int(thread_count))
        #: Megatron-Core's name of ``cached_metadata`` (Megatron-LM sets it after construction)
        self.use_cached_ckpt_structure = cached_metadata
        self.separation_hint = separation_hint
        # (layout digest, rank 0's metadata) of the last save with cached metadata
        self._cache: Optional[Tuple[Optional[str], Optional[Metadata]]] = None
        self._staging = HostStaging()

    _runtime_attrs = ("_staging",)

    def _new_runtime(self) -> Dict[str, Any]:
        return {"_staging": HostStaging()}

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
        return self._cache[1] if self._cache is not None else None

    @cached_global_metadata.setter
    def cached_global_metadata(self, metadata: Optional[Metadata]) -> None:
        self._cache = None if metadata is None else (None, metadata)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> None:
        storage = open_storage(checkpoint_dir)
        locations: List[Location] = []
        error: Optional[str] = None
        try:
            locations = self._write_files(self._plan_files(sharded_state_dict), storage)
        except Exception as e:  # noqa: BLE001 - agreed on below
            error = error_message(e)
        self._publish(locations, error, storage)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> AsyncRequest:
        """Snapshot this rank's items and write them in the background.

        Returns an :class:`AsyncRequest` whose ``async_fn`` writes the data (or waits for
        the forked writer) and whose finalize step gathers the item locations and writes
        ``.metadata`` (collective). Once this returns the caller may change its tensors:
        with ``async_snapshot="fork"`` a forked writer sees them as they are now
        (copy-on-write; tensors a fork does not isolate — on other devices, in pinned
        memory, in shared or file-backed mappings — are first copied into host buffers),
        with ``"copy"`` every tensor has been copied into host buffers. The buffers are
        kept for the next save of the same structure (released by :meth:`release`, which
        ``AsyncCallsQueue.close`` calls). Collective: ``run_agreed`` agrees on the
        preparation.
        """
        storage = open_storage(checkpoint_dir)
        # A storage a forked child cannot use (S3: obstore's runtime) is written from a thread.
        copy_all = self.async_snapshot == "copy" or not storage.fork_safe
        files = run_agreed(lambda: self._stage(self._plan_files(sharded_state_dict), copy_all),
                           "Preparing the async save")
        written: Dict[str, Any] = {}

        def finalize() -> None:
            self._publish(written["locations"], None, storage)

        if copy_all:
            done = self._staging.hold([it.payload for items in files.values() for it in items
                                       if isinstance(it.payload, torch.Tensor)])

            def write() -> None:
                try:
                    written["locations"] = self._write_files(files, storage)
                finally:
                    done()

            return AsyncRequest(write, (), [finalize], resources=[self])
        # The writer's file staging buffers: the pool's (already touched), reserved for it.
        buffers = reserve_staging_buffers(min(self.thread_count, max(1, len(files))) * BUFFERS_PER_FILE)

        def write_in_child() -> List[Location]:
            adopt_staging_buffers(buffers)
            return self._write_files(files, storage)

        try:
            writer = ForkedCall(write_in_child, f"Writing {storage.describe()} on rank {get_rank()}")
        except BaseException:
            return_staging_buffers(buffers)
            raise
        written["buffers"] = buffers
        return AsyncRequest(_wait_for_writer, (writer, written), [finalize], resources=[self])

    def release(self) -> None:
        """Free the host buffers kept for staging the tensors of async saves."""
        self._staging.release()

    def _stage(self, files: Dict[str, List[SaveItem]], copy_all: bool = False) -> Dict[str, List[SaveItem]]:
        """The same files with tensors replaced by host copies: every tensor (``copy_all``),
        else those a fork does not snapshot (:func:`_needs_staging`)."""
        tensors = [((fname, i), it.payload) for fname, items in files.items() for i, it in enumerate(items)
                   if isinstance(it.payload, torch.Tensor)]
        needed = [True] * len(tensors) if copy_all else _needs_staging([t for _, t in tensors])
        chosen = [slot_tensor for slot_tensor, need in zip(tensors, needed) if need]
        copies = self._staging.stage(chosen, pin=copy_all)
        staged = {fname: list(items) for fname, items in files.items()}
        for ((fname, i), _), copy in zip(chosen, copies):
            staged[fname][i] = replace(staged[fname][i], payload=copy)
        return staged

    def data_file_names(self, rank: int) -> List[str]:
        prefixes = {"", hint_prefix(self.separation_hint) if self.separation_hint else ""}
        return [data_file_name(rank, self.thread_count - 1, prefix) for prefix in sorted(prefixes)]

    def _plan_files(self, sharded_state_dict: ShardedStateDict) -> Dict[str, List[SaveItem]]:
        items = collect_save_items(sharded_state_dict)
        #: tensor bytes this rank writes in the current save (logged by ``save``)
        self.last_written_bytes = sum(it.nbytes for it in items if it.tensor_meta is not None)
        return assign_files(items, get_rank(), self.thread_count, self.separation_hint)

    def _publish(self, locations: List[Location], error: Optional[str], storage: Storage) -> None:
        """Agree on every rank's write outcome; rank 0 writes ``.metadata`` (collective).

        One 2-byte ``all_reduce`` (did any rank fail? did any rank's layout change since the
        last save with ``cached_metadata``?), then the item locations — or, for an unchanged
        layout, only their checksums — gathered to rank 0 alone, then rank 0's outcome
        broadcast. Error messages travel only after a failure."""
        rank = get_rank()
        layout = sorted((loc[:5] for loc in locations), key=lambda loc: (loc[2], loc[3]))
        digest = hashlib.sha256(pickle.dumps(layout)).hexdigest()
        unchanged = self._cache is not None and self._cache[0] == digest and (rank != 0 or self._cache[1] is not None)
        failed, changed = all_reduce_max_uint8([int(error is not None), int(not unchanged)])
        if failed:
            raise_if_any(all_gather_object(error), "Writing the checkpoint data")

        reuse = self.cached_metadata and not changed
        # Same layout as last time: only the checksums (8 bytes per item) travel.
        with gc_paused():  # rank 0 unpickles and builds a million small objects at scale
            self._assemble(locations if not reuse else [(loc[2], loc[3], loc[5]) for loc in locations],
                           reuse, digest, storage)

    def _assemble(self, sent: List[Any], reuse: bool, digest: str, storage: Storage) -> None:
        """Gather the locations (or checksums) to rank 0, which writes ``.metadata``; agree on
        its outcome."""
        rank = get_rank()
        metadata_error: Optional[str] = None
        per_rank = gather_object(sent)
        if rank == 0:
            try:
                if reuse:  # the same files as last time (last_written_files too)
                    metadata = self._cache[1]
                    metadata.storage_meta = storage_meta(storage)
                    metadata.checksums = checksum_table(per_rank)
                    rows = None
                else:
                    self.last_written_files = None
                    rows = {}
                    metadata = build_metadata(per_rank, storage, rows)
                    self.last_written_files = data_file_sizes(metadata)
                write_metadata(metadata, storage, rows)
                del rows
                if self.cached_metadata:
                    self._cache = (digest, metadata)
            except Exception as e:  # noqa: BLE001 - broadcast below
                metadata_error = error_message(e)
        elif self.cached_metadata:
            self._cache = (digest, None)  # only rank 0 needs the metadata itself
        metadata_error = broadcast_object(metadata_error)
        if metadata_error is not None:
            raise CheckpointingException(f"Writing the checkpoint metadata failed on rank 0: {metadata_error}")

    def _write_files(self, files: Dict[str, List[SaveItem]], storage: Storage) -> List[Location]:
        """Each file through :func:`write_file` (one storage stream per file, files in
        parallel on ``thread_count`` threads); the location of every item written. The
        bytes written are reported to the caller's progress sink, if any (:mod:`..progress`)."""
        payloads = [[it.payload for it in items] for items in files.values()]
        meter = byte_meter("write", sum(payload_nbytes(p) for ps in payloads for p in ps))
        args = (repeat(storage), files, payloads, repeat(self.checksums), repeat(meter and meter.add))
        if len(files) <= 1:
            spans = list(map(write_file, *args))
        else:
            with ThreadPoolExecutor(min(self.thread_count, len(files))) as pool:
                spans = list(pool.map(write_file, *args))
        if meter is not None:
            meter.finish()
        return [(it.key, it.tensor_meta, fname, off, length, cs)
                for fname, file_spans in zip(files, spans) for it, (off, length, cs) in zip(files[fname], file_spans)]


def _needs_staging(tensors: List[torch.Tensor]) -> List[bool]:
    """For each tensor, whether a forked writer would not see it as it is now: memory on
    another device, pinned memory (not inherited reliably), or CPU memory a fork does not
    isolate (shared or file-backed mappings; every CPU tensor where the process's mappings
    cannot be read: :func:`.memory_maps.not_isolated_by_fork`)."""
    needed = [True] * len(tensors)
    cpu = [i for i, t in enumerate(tensors) if t.device.type == "cpu" and not _is_pinned(t)]
    for i, unisolated in zip(cpu, not_isolated_by_fork([tensors[i] for i in cpu])):
        needed[i] = unisolated
    return needed


def _is_pinned(t: torch.Tensor) -> bool:
    try:
        return t.is_pinned()
    except RuntimeError:  # no accelerator to ask
        return False


def _wait_for_writer(writer: ForkedCall, written: Dict[str, Any]) -> None:
    """The ``async_fn`` of an async save: wait for the forked writer, keep its locations,
    give its staging buffers back to the pool."""
    try:
        written["locations"] = writer.result()
    finally:
        return_staging_buffers(written.pop("buffers", []))
