"""The load strategy of safetensors checkpoints (Hugging Face's layout, or this library's
safetensors saves): the torch_dist planner on the files' headers (:mod:`.source`), the
reads of :mod:`.reader`. Requests are resharded, cast, checked for coverage and shape, and
fail on every rank exactly as torch_dist loads do; the fully parallel wrapper works on it
unchanged (each replicated request read once per group, then exchanged)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple, Union

from ...core import CheckpointingException, open_storage
from ...dict_utils import nested_values
from ...mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from ...runtime.collectives import run_agreed
from ...storage import Storage
from ..async_strategies import check_async_strategy
from ..base import LoadShardedStrategy, StoredChunk, StoredItems, StoredRange, StoredTensor
from ..fully_parallel import with_base_strategy
from ..torch_dist.load import TorchDistLoadShardedStrategy, execute_reads, loaded_values, requested_regions
from ..torch_dist.load_plan import LoadPlan
from .reader import SafetensorsReader
from .source import BACKEND, SafetensorsSource


class SafetensorsLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Loads a directory (or prefix) of safetensors files with resharding.

    Each rank reads the headers of the files that hold the keys it requests (every file
    without an index) and then only the byte ranges of its requested regions.

    Args:
        thread_count: reader threads per rank.
        strict_dtypes: refuse a request whose dtype differs from the stored one (by
            default the stored values are cast, as for torch_dist).
    """

    supported_backends = (BACKEND,)
    supported_versions = (1,)

    def __init__(self, *, thread_count: int = 4, strict_dtypes: bool = False):
        super().__init__(thread_count=thread_count, verify_checksums=False, strict_dtypes=strict_dtypes)

    def offline_reader(self) -> "SafetensorsLoadShardedStrategy":
        return SafetensorsLoadShardedStrategy(thread_count=1, strict_dtypes=self.strict_dtypes)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
             async_strategy: Optional[str] = "mcore") -> StateDict:
        """Collective load (errors on any rank are raised on every rank)."""
        storage = open_storage(checkpoint_dir)

        def checked_plan() -> Tuple[SafetensorsSource, LoadPlan]:
            check_async_strategy(async_strategy)
            return self._source_plan(sharded_state_dict, storage)

        source, plan = run_agreed(checked_plan, "Planning the load")
        run_agreed(lambda: self._read(plan, source), "Reading the checkpoint")
        return loaded_values(sharded_state_dict, plan)

    def key_mismatch(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
                     need_missing: bool) -> Optional[Tuple[Set[str], Set[str]]]:
        return None  # (the keys come from load_sharded_metadata)

    def load_local(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> StateDict:
        """Load in this process alone (no collectives): for offline tools."""
        source, plan = self._source_plan(sharded_state_dict, open_storage(checkpoint_dir))
        self._read(plan, source)
        return loaded_values(sharded_state_dict, plan)

    def _source_plan(self, sharded_state_dict: ShardedStateDict, storage: Storage) -> Tuple[SafetensorsSource, LoadPlan]:
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedObject):
                raise CheckpointingException(
                    f"ShardedObject {sh.unique_key!r} not found in checkpoint {storage.describe()}: "
                    "a safetensors checkpoint holds tensors only")
        source = SafetensorsSource(storage)
        metadata = source.metadata(requested_regions(sharded_state_dict, False))
        return source, self._plan(sharded_state_dict, storage, metadata)

    def _read(self, plan: LoadPlan, source: SafetensorsSource) -> None:
        execute_reads(plan, SafetensorsReader(source.storage, set(source.files)), self.thread_count)
        self._scratch.end()

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Whole-tensor ShardedTensors of every stored tensor."""
        result = {}
        for key, (_, entry) in SafetensorsSource(open_storage(checkpoint_dir)).located().items():
            shape = entry.shape
            result[key] = ShardedTensor(key, None, entry.dtype, shape, shape, (0,) * len(shape), (1,) * len(shape))
        return result

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        return self.load_tensors_metadata(checkpoint_dir)

    def stored_items(self, checkpoint_dir: Union[str, Path]) -> StoredItems:
        """Every tensor, located: one chunk each, at its byte range (no checksums)."""
        storage = open_storage(checkpoint_dir)
        source = SafetensorsSource(storage)
        tensors: List[StoredTensor] = []
        for key, (name, entry) in sorted(source.located().items()):
            where = StoredRange(name, entry.begin, entry.end - entry.begin)
            tensors.append(StoredTensor(key, entry.shape, entry.dtype, [StoredChunk((0,) * len(entry.shape), entry.shape, where)],
                                        entry.end - entry.begin, False))
        return StoredItems(tensors, {}, located=True, files=_file_sizes(storage, source.files))

    def stored_file_problems(self, checkpoint_dir: Union[str, Path]) -> Tuple[List[str], List[str]]:
        return [], []

    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        """A safetensors directory without ``metadata.json`` has no common state."""
        return {}

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
        raise CheckpointingException(f"Removing tensors from the safetensors checkpoint {checkpoint_dir} is not "
                                     "supported (its files are Hugging Face's; write a new one)")


def _file_sizes(storage: Storage, names: List[str]) -> Dict[str, Optional[int]]:
    """Each file's size (``None``: missing): from one listing where the store gives sizes."""
    listed = storage.listed_sizes()
    if listed is not None:
        return {name: listed.get(name) for name in names}
    infos = {name: storage.info(name) for name in names}
    return {name: None if info is None else info.size for name, info in infos.items()}


def safetensors_strategy_like(strategy: LoadShardedStrategy) -> LoadShardedStrategy:
    """``strategy`` made to read a safetensors checkpoint: a ``torch_dist`` load strategy
    (also inside a fully parallel wrapper) becomes a :class:`SafetensorsLoadShardedStrategy`
    with its options (Megatron-LM's trainer passes a ``TorchDistLoadShardedStrategy``
    whatever the checkpoint); any other strategy is returned as it is."""
    def convert(base: LoadShardedStrategy) -> LoadShardedStrategy:
        if isinstance(base, TorchDistLoadShardedStrategy) and not isinstance(base, SafetensorsLoadShardedStrategy):
            return SafetensorsLoadShardedStrategy(thread_count=base.thread_count, strict_dtypes=base.strict_dtypes)
        return base

    return with_base_strategy(strategy, convert)


__all__ = ["SafetensorsLoadShardedStrategy", "safetensors_strategy_like"]
