"""The ``torch_dist`` load strategy: reads ours, Megatron-Core's and plain DCP checkpoints,
resharding on the fly. Planning (:mod:`.load_plan`) and reading (:mod:`.reader`) are
agreed on across ranks; :meth:`TorchDistLoadShardedStrategy.load_local` runs them in one
process for the offline tools.

Owns: ``TorchDistLoadShardedStrategy``: agreed planning and reading (``load``), the same in
one process (``load_local``), metadata readers, the ``common_state`` object;
``execute_reads`` (a plan's reads on the reader threads, with progress);
``get_reformulation_metadata`` (Megatron-Core's: how ``.metadata`` stores each flattened key
of a request).
"""

from __future__ import annotations

import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from ...pickling.dcp_types import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ...runtime.collectives import run_agreed
from ...core import CheckpointingException, check_key, open_storage
from ...dict_utils import dict_list_map_outplace, nested_values
from ...integrity.checksums import SCOPE_RECORD, item_checksum_scope
from ...mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from ...storage import Storage
from ..async_strategies import check_async_strategy
from ..base import LoadShardedStrategy, StoredItems
from .metadata_checks import check_stored_sizes
from ..resharding import TensorReformulationMetadata, is_nd_flattened_tensor
from .format import COMMON_STATE_OBJECT_KEY, original_global_shape
from .index_view import Requests, index_problems, indexed_view
from .load_plan import LoadPlan, ScratchArena, plan_load
from .maintenance import remove_sharded_tensors
from .metadata import read_metadata, stored_items
from ...runtime.progress import ByteMeter, byte_meter
from .reader import Reader, read_nbytes


def requested_regions(sharded_state_dict: ShardedStateDict, regions: bool = True) -> Requests:
    """The keys a request needs from the index: each tensor key with its requested global
    regions (``None``: all of it, or without ``regions``), each object's unique key."""
    out: Requests = {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, (ShardedTensor, ShardedObject)):
            check_key(sh.key, f"Loading {type(sh).__name__}")
        if isinstance(sh, ShardedTensor):
            boxes = out.setdefault(sh.key, [] if regions else None)
            if boxes is not None:
                boxes.append(sh.global_region())
        elif isinstance(sh, ShardedObject):
            out[sh.unique_key] = None
    return out


#: items below this size are read by one thread, in file order: their reads are mostly
#: Python work, and threads taking turns for the GIL item by item made a load of 4,800
#: tensors of 2 KiB 3.3x, and of 2,000 of 256 KiB 1.9x slower than one thread (2 cores)
SMALL_ITEM_BYTES = 1 << 20
#: the least bytes of larger items one reader thread takes at a time
BATCH_MIN_BYTES = 16 << 20


def _batches(tasks: List[Tuple[Callable[[Any], None], Any]], thread_count: int) -> List[List[Tuple[Callable[[Any], None], Any]]]:
    """``tasks`` (in file order) as runs for ``thread_count`` reader threads: the small
    items in one run; the others in runs of about a quarter of a thread's share, at least
    :data:`BATCH_MIN_BYTES`."""
    if thread_count <= 1:
        return [tasks]
    sized = [(read_nbytes(task[1]), task) for task in tasks]
    small = [task for n, task in sized if n < SMALL_ITEM_BYTES]
    large = [(n, task) for n, task in sized if n >= SMALL_ITEM_BYTES]
    target = max(BATCH_MIN_BYTES, sum(n for n, _ in large) // (4 * thread_count))
    runs: List[List[Tuple[Callable[[Any], None], Any]]] = [small] if small else []
    size = target
    for n, task in large:
        if size >= target:
            runs.append([])
            size = 0
        runs[-1].append(task)
        size += n
    return runs or [[]]


def _run(tasks: List[Tuple[Callable[[Any], None], Any]]) -> None:
    for fn, arg in tasks:
        fn(arg)


def loaded_values(sharded_state_dict: ShardedStateDict, plan: LoadPlan) -> StateDict:
    """The request's structure with each ShardedTensor replaced by its (filled) tensor and
    each ShardedObject by the object read for it, once ``plan`` has been executed."""
    _, object_reads, _ = plan

    def unwrap(sh: Any) -> Any:
        if isinstance(sh, ShardedTensor):
            return sh.data
        if isinstance(sh, ShardedObject):
            return object_reads[id(sh)].result[0]
        return sh

    return dict_list_map_outplace(unwrap, sharded_state_dict)


def execute_reads(plan: LoadPlan, reader: Reader, thread_count: int) -> None:
    """Run a load plan's reads with ``reader`` (closed after) on ``thread_count`` threads
    (:func:`_batches`), the bytes counted for the progress sink if any, then its copies."""
    tensor_reads, object_reads, post_copies = plan
    try:
        tasks = [(reader.read_tensor, r) for r in tensor_reads] + [(reader.read_object, r) for r in object_reads.values()]
        tasks.sort(key=lambda t: (t[1].storage.relative_path, t[1].storage.offset))
        reader.plan(arg for _, arg in tasks)
        meter = byte_meter("read", sum(read_nbytes(arg) for _, arg in tasks))
        if meter is not None:  # counted per item read
            tasks = [(_counted(fn, meter), arg) for fn, arg in tasks]
        batches = _batches(tasks, thread_count)
        if len(batches) <= 1:
            _run(tasks)
        else:
            with ThreadPoolExecutor(min(thread_count, len(batches))) as pool:
                for f in [pool.submit(_run, batch) for batch in batches]:
                    f.result()
        if meter is not None:
            meter.finish()
    finally:
        reader.close()
    for copy in post_copies:  # assembled flattened data into its destination
        copy()


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Loads the torch_dist format (ours, Megatron-Core's and plain DCP's) with resharding.

    Args:
        thread_count: reader threads per rank.
        allow_pickle: opt in to unpickling objects outside the safe allow-list (runs code
            from the checkpoint: only for checkpoints you trust).
        verify_checksums: verify every item read against its recorded checksum
            (checkpoints without checksums, e.g. Megatron-Core's, load unverified).
        strict_dtypes: refuse a request whose dtype differs from the stored one. By
            default (as Megatron-Core, through PyTorch's reader) the stored values are cast
            into the request's tensor, one stored chunk at a time.
        cache_metadata, stream_ckpt_dequant, checkpoint_name: Megatron-Core 0.19's
            arguments (first, in its order; ours are keyword-only), accepted so that its
            callers (Megatron-LM) run unchanged: ``.metadata`` is always cached across loads
            (per file version), FP8 destinations are always filled one tensor at a time, and
            the checkpoint is the one ``load`` is given.

    Resharding loads of flattened keys assemble through temporary buffers that the
    strategy keeps for its next load (at most 256 MiB; :meth:`release_scratch` frees them).
    """

    supported_backends = ("torch_dist",)
    supported_versions = (1,)

    def __init__(self, cache_metadata: bool = False, stream_ckpt_dequant: bool = True,
                 checkpoint_name: Optional[str] = None, *, thread_count: int = 4, allow_pickle: bool = False,
                 verify_checksums: bool = True, strict_dtypes: bool = False):
        self.thread_count = max(1, int(thread_count))
        self.allow_pickle = allow_pickle
        self.verify_checksums = verify_checksums
        self.strict_dtypes = strict_dtypes
        self.cache_metadata, self.stream_ckpt_dequant, self.checkpoint_name = cache_metadata, stream_ckpt_dequant, checkpoint_name
        #: the global metadata read by the last load (Megatron-Core's attribute; Megatron-LM
        #: hands it to its save strategy)
        self.cached_global_metadata: Optional[Metadata] = None
        self._scratch = ScratchArena()

    _runtime_attrs = ("_scratch",)

    def _new_runtime(self) -> Dict[str, Any]:
        return {"_scratch": ScratchArena()}

    def offline_reader(self) -> "TorchDistLoadShardedStrategy":
        """One reader thread (at most one temporary chunk buffer at a time), no unsafe
        unpickling, checksums verified as this strategy verifies them."""
        return TorchDistLoadShardedStrategy(thread_count=1, verify_checksums=self.verify_checksums,
                                            strict_dtypes=self.strict_dtypes)

    def release_scratch(self) -> None:
        """Free the temporary memory kept from the last resharding load of flattened keys."""
        self._scratch.release()

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
             async_strategy: Optional[str] = "mcore") -> StateDict:
        """Collective load: errors on any rank are raised on every rank. With a per-key
        index (:mod:`.key_index`) each rank learns only the metadata of the keys it
        requests (:func:`.index_view.indexed_view`); without one, every rank reads
        ``.metadata``. ``async_strategy``: Megatron-Core 0.19's (which metadata reader it
        uses), checked in the agreed planning step and otherwise unused."""
        storage = open_storage(checkpoint_dir)
        view = indexed_view(storage, lambda: requested_regions(sharded_state_dict))
        metadata = view.metadata if view is not None else None

        def checked_plan() -> LoadPlan:
            check_async_strategy(async_strategy)
            return self._plan(sharded_state_dict, storage, metadata)

        plan = run_agreed(checked_plan, "Planning the load")
        run_agreed(lambda: self._execute(plan, storage, metadata), "Reading the checkpoint")
        return loaded_values(sharded_state_dict, plan)

    def key_mismatch(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
                     need_missing: bool) -> Optional[Tuple[Set[str], Set[str]]]:
        """``(missing, unexpected)`` keys of a strict load, from the index (collective);
        ``None`` on every rank when the checkpoint has no usable index."""
        view = indexed_view(open_storage(checkpoint_dir), lambda: requested_regions(sharded_state_dict, False),
                            need_missing)
        if view is None:
            return None
        unexpected = {sh.key for sh in nested_values(sharded_state_dict)
                      if (sh.unique_key if isinstance(sh, ShardedObject) else sh.key) in view.absent}
        return view.missing, unexpected

    def load_local(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> StateDict:
        """Load in this process alone (no collectives): for offline tools. Tensors requested
        without data (e.g. from :meth:`load_tensors_metadata`) are allocated only once their
        keys' stored sizes are checked against the data files."""
        storage = open_storage(checkpoint_dir)
        view = indexed_view(storage, lambda: requested_regions(sharded_state_dict), collective=False)
        metadata = view.metadata if view is not None else read_metadata(storage)
        dataless = {sh.key for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor) and sh.data is None}
        if dataless:
            check_stored_sizes(metadata, storage,
                               [k for k in dataless if isinstance(metadata.state_dict_metadata.get(k), TensorStorageMetadata)])
        plan = self._plan(sharded_state_dict, storage, metadata)
        self._execute(plan, storage, metadata)
        return loaded_values(sharded_state_dict, plan)

    def _plan(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path, Storage],
              metadata: Optional[Metadata] = None) -> LoadPlan:
        """The reads of the request, planned on ``metadata`` (default: ``.metadata``)."""
        storage = open_storage(checkpoint_dir)
        metadata = self.cached_global_metadata = metadata if metadata is not None else read_metadata(storage)
        self._scratch.begin()
        return plan_load(sharded_state_dict, metadata, storage.describe(), self._scratch, self.strict_dtypes)

    def _execute(self, plan: LoadPlan, storage: Storage, metadata: Optional[Metadata] = None) -> None:
        metadata = metadata if metadata is not None else (read_metadata(storage) if self.verify_checksums else None)
        table = getattr(metadata, "checksums", None) if self.verify_checksums else None
        scope = item_checksum_scope(table, storage.describe()) if table is not None else None
        execute_reads(plan, Reader(storage, self.allow_pickle, table["items"] if table else None, scope == SCOPE_RECORD),
                      self.thread_count)
        self._scratch.end()

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Whole-tensor ShardedTensors in the original global shape. A key stored flattened
        (distributed-optimizer slices) is described as Megatron-Core describes it: flattened,
        with the whole range (``flattened_range=slice(0, numel)``), so it loads 1-D."""
        metadata = read_metadata(checkpoint_dir)
        result = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                orig = original_global_shape(metadata, key)
                shape = orig or tuple(md.size)
                result[key] = ShardedTensor(key, None, md.properties.dtype, shape, shape, (0,) * len(shape),
                                            (1,) * len(shape),
                                            flattened_range=None if orig is None else slice(0, math.prod(shape)))
        return result

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Tensors keyed by key; ShardedObjects keyed by unique key (data-less)."""
        result = self.load_tensors_metadata(checkpoint_dir)
        for key, md in read_metadata(checkpoint_dir).state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                try:
                    result[key] = ShardedObject.empty_from_unique_key(key)
                except CheckpointingException:
                    continue  # a bytes item that is not a ShardedObject
        return result

    def stored_items(self, checkpoint_dir: Union[str, Path]) -> StoredItems:
        """Every tensor and object of ``.metadata``, located (:func:`.metadata.stored_items`)."""
        return stored_items(checkpoint_dir)

    def stored_file_problems(self, checkpoint_dir: Union[str, Path]) -> Tuple[List[str], List[str]]:
        """Damage of the per-key index, checked as loads read it (:func:`.index_view.index_problems`)."""
        storage = open_storage(checkpoint_dir)
        return index_problems(storage, read_metadata(storage))

    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        """The common state of checkpoints that store it as the ``common_state`` object."""
        request = {"common": ShardedObject.empty_from_unique_key(COMMON_STATE_OBJECT_KEY)}
        return self.load_local(request, checkpoint_dir)["common"]

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
        """Remove tensors whose key starts with ``key_prefix``; data files that hold
        nothing else are deleted."""
        remove_sharded_tensors(checkpoint_dir, key_prefix)


def _counted(fn: Callable[[Any], None], meter: ByteMeter) -> Callable[[Any], None]:
    """``fn`` (one read task), then its bytes counted on ``meter``."""
    def run(arg: Any) -> None:
        fn(arg)
        meter.add(read_nbytes(arg))
    return run


def get_reformulation_metadata(sharded_state_dict: ShardedStateDict,
                               checkpoint_dir: Union[str, Path]) -> Dict[str, TensorReformulationMetadata]:
    """For every flattened key of ``sharded_state_dict``, how the checkpoint stores it
    (original and reformulated global shape, from ``.metadata``): the input of
    :func:`~dist_checkpointing.strategies.resharding.apply_nd_flattened_tensors_reformulation`.
    A 1-D key stored without its original shape (older checkpoints) is skipped with a warning."""
    metadata = read_metadata(checkpoint_dir)
    found: Dict[str, TensorReformulationMetadata] = {}
    for sh in nested_values(sharded_state_dict):
        if not is_nd_flattened_tensor(sh):
            continue
        orig = original_global_shape(metadata, sh.key)
        stored = metadata.state_dict_metadata.get(sh.key)
        if orig is None and len(sh.global_shape) == 1:
            warnings.warn(f"Legacy checkpoint format detected for 1-D flattened tensor {sh.key!r}: "
                          "no reformulation metadata, skipped")
            continue
        if orig is None or not isinstance(stored, TensorStorageMetadata):
            raise CheckpointingException(
                f"Flattened tensor {sh.key!r}: the checkpoint {checkpoint_dir} records "
                f"{'no original global shape' if orig is None else 'no stored tensor'} for it"
            )
        found[sh.key] = TensorReformulationMetadata(orig, tuple(stored.size))
    return found
