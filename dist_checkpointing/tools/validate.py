"""``validate``: check a checkpoint completely (commit, integrity manifest, checksums,
chunk coverage, byte ranges, every stored item readable), reporting every problem
instead of raising. Tensors are read whole, one at a time.

Owns: ``validate_checkpoint`` (``ValidationReport``): for any backend whose load strategy
locates its items in its catalog (``stored_items``), checks coverage and byte ranges from
the catalog, the other files loads read (``stored_file_problems``: the per-key index) and
reads every item (with ``tools/whole_tensors.py``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple, Union

from ..core import (CheckpointingConfig, CheckpointingException, checkpoint_location, load_config, malformed,
                    open_storage)
from ..integrity.manifest import MANIFEST_FNAME, manifest_problems
from ..integrity.save_claim import CLAIM_FNAME, describe_claim
from ..mapping import ShardedObject
from ..readers import get_default_load_sharded_strategy
from ..storage import Storage, StorageOptions
from ..strategies.torch_dist.coverage import coverage_faults
from ..strategies.base import LoadShardedStrategy, StoredItems, StoredRange, StrategyAction, get_default_strategy
from ..strategies.common import TorchCommonLoadStrategy
from .whole_tensors import TensorReader
from .output import PathLike, Progress


@dataclass
class ValidationReport:
    """What :func:`validate_checkpoint` found; ``ok`` when there is no problem."""

    path: str
    checked_tensors: int = 0
    checked_objects: int = 0
    checked_bytes: int = 0
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _coverage_problems(key: str, shape: Tuple[int, ...], chunks: List[Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> List[str]:
    """Chunks outside the tensor, and every box of it stored in no chunk or in several
    (:func:`~..strategies.torch_dist.coverage.coverage_faults`: what a load of it refuses)."""
    problems = []
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
            problems.append(f"tensor {key!r}: chunk at {offsets} of size {sizes} lies outside the shape {shape}")
    faults = coverage_faults(((0,) * len(shape), shape), [c for c in chunks if len(c[0]) == len(shape)])
    return problems + [f"tensor {key!r} of shape {shape}: {fault.describe()}" for fault in faults]


def _leftovers(checkpoint_dir: Union[Path, Storage]) -> List[str]:
    """Notes on what a save leaves that loads ignore: its claim (a save stopped between its
    commit and removing the claim) and the temporary files of atomic writes."""
    storage = open_storage(checkpoint_dir)
    names = storage.list()
    notes = [f"{storage.describe(name)} is left from a save that stopped while writing it (loads ignore it)"
             for name in sorted(names) if name.startswith(".") and name.endswith(".tmp")]
    if CLAIM_FNAME in names:
        notes.append(f"{storage.describe(CLAIM_FNAME)} is left ({describe_claim(storage)}): the save committed but did "
                     "not remove its claim; loads ignore it, a save into this directory is refused")
    return notes


def _stored_problem(items: StoredItems, what: str, location: Optional[StoredRange]) -> Optional[str]:
    """Why the stored bytes of the item described as ``what`` are not in place (``None``: they are)."""
    if location is None:
        return f"{what}: no stored bytes are recorded for it"
    return items.range_problem(what, location)


@contextmanager
def _reported(report: ValidationReport, what: str) -> Iterator[None]:
    """Record any error in the block as a problem of ``report`` (named ``what`` unless it
    is a CheckpointingException, which names its key or file itself)."""
    try:
        with malformed(what):
            yield
    except CheckpointingException as e:
        report.problems.append(str(e))


def _check_readable(report: ValidationReport, what: str, load: Callable[[], Any]) -> None:
    """Run ``load``: a refusal to unpickle is a note (the checksum is verified before
    unpickling, so it is not damage), any other failure a problem."""
    try:
        with malformed(what):
            load()
    except CheckpointingException as e:
        (report.notes if "allow_pickle" in str(e) else report.problems).append(f"{what}: {e}")


def validate_checkpoint(checkpoint_dir: PathLike, progress: Optional[Progress] = None,
                        storage_options: StorageOptions = None) -> ValidationReport:
    """Check a checkpoint (a directory or a URL, ``storage_options`` for its client)
    completely: it is committed (``metadata.json``), its files match Megatron-Core's
    integrity manifest ``integrity.json`` if it has one, the common state and the sharded
    metadata match their checksums, every tensor's chunks cover it exactly, every data file
    holds the byte ranges named for it (all read from the load strategy's catalog of stored
    items, :meth:`~..strategies.base.LoadShardedStrategy.stored_items`), and every stored
    item can be read and matches its checksum (tensors are read whole, one at a time; objects are checked
    without being unpickled unsafely). Never raises for a damaged or hostile checkpoint:
    every failure, whatever its type, is a problem in the report."""
    report = ValidationReport(str(checkpoint_dir))
    with _reported(report, f"Validating {checkpoint_dir}"):
        _validate(checkpoint_location(checkpoint_dir, storage_options), report, progress)
    return report


def _validate(checkpoint_dir: Union[Path, Storage], report: ValidationReport, progress: Optional[Progress]) -> None:
    config = load_config(checkpoint_dir)
    with _reported(report, open_storage(checkpoint_dir).describe(MANIFEST_FNAME)):
        report.problems += manifest_problems(checkpoint_dir)
    # What load would refuse (an unknown backend or version) is a problem here too.
    strategy = get_default_load_sharded_strategy(checkpoint_dir)
    items = strategy.stored_items(checkpoint_dir)
    # damage of other files loads read (an index) does not stop the items' checks: reported after them
    file_problems, notes = strategy.stored_file_problems(checkpoint_dir)
    report.notes += notes + _leftovers(checkpoint_dir)
    try:
        _check_items(checkpoint_dir, config, strategy, items, report, progress)
    finally:
        report.problems += file_problems


def _check_items(checkpoint_dir: Union[Path, Storage], config: CheckpointingConfig, strategy: LoadShardedStrategy,
                 items: StoredItems, report: ValidationReport, progress: Optional[Progress]) -> None:
    """Check the catalog's sizes and coverage, then read every item."""
    if not items.located:
        report.problems.append(f"backend {config.sharded_backend!r} cannot be validated by this tool "
                               f"({type(strategy).__name__} does not say where it stores its items)")
        return
    if config.common_backend is not None:
        get_default_strategy(StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version)
        _check_readable(report, "common state",
                        lambda: TorchCommonLoadStrategy(allow_pickle=False).load_common(checkpoint_dir))
    if not items.checksums_recorded:
        report.notes.append("no item checksums are recorded (e.g. written by Megatron-Core): damage inside "
                            "tensor data cannot be detected, only unreadable or truncated items")
    # Every size the catalog claims is checked against the files before anything is allocated.
    problems = [_stored_problem(items, f"item {key!r}", items.object_locations.get(key)) for key in sorted(items.objects)]
    for t in items.tensors:
        problems += _coverage_problems(t.key, t.stored_shape or t.shape, [(c.offsets, c.sizes) for c in t.chunks])
        problems += [_stored_problem(items, f"item {t.key!r} (chunk at {c.offsets})", c.location) for c in t.chunks]
    report.problems += [p for p in problems if p is not None]
    if report.problems:
        return

    tensor_keys = [t.key for t in items.tensors]
    reader = TensorReader(checkpoint_dir, tensor_keys, items)
    sizes = {t.key: t.nbytes for t in items.tensors}
    total = sum(sizes.values())
    try:
        for key in tensor_keys:
            with _reported(report, f"tensor {key!r}"):
                reader.read(key)
            report.checked_tensors += 1
            report.checked_bytes += sizes[key]
            if progress is not None:
                progress(report.checked_bytes, total, key)
    finally:
        reader.close()
    for key in sorted(items.objects):
        _check_readable(report, f"object {key!r}", lambda k=key: reader.strategy.load_local(
            {"o": ShardedObject.empty_from_unique_key(k)}, checkpoint_dir))
        report.checked_objects += 1
