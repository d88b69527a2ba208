"""Living with checkpoints: inspect, validate, export and import them, in one process with
no process group (the command line, ``python -m dist_checkpointing``, is a thin layer over
these functions).

Every function that reads tensor data holds at most one whole tensor at a time, in one
buffer sized for the largest tensor, so a checkpoint far larger than memory can be
validated and exported.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import shutil
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from .bytes_view import nbytes
from .core import CheckpointingException, checkpoint_location, load_config, malformed, open_storage
from .storage.posix import fsync_dir
from .dict_utils import dict_list_map_outplace, nested_values
from .manifest import MANIFEST_FNAME, manifest_problems
from .mapping import ShardedObject, ShardedTensor
from .path_overlap import output_location, refuse_overlap
from .safetensors_stream import INDEX_FNAME, SafetensorsFileWriter, dtype_name, shard_names, write_index
from .serialization import get_default_load_sharded_strategy, load_common_state_dict, load_tensors_metadata, save
from .strategies.base import StrategyAction, get_default_strategy
from .strategies.common import TorchCommonLoadStrategy
from .strategies.torch_dist.load import TorchDistLoadShardedStrategy
from .strategies.torch_dist.metadata import read_metadata
from .whole_tensors import TensorReader, range_problem

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
# progress(done_bytes, total_bytes, what)
Progress = Callable[[int, int, str], None]


# ----------------------------------------------------------------------------- inspect


@dataclass
class TensorInfo:
    """One global tensor of a checkpoint."""

    key: str
    shape: Tuple[int, ...]  # the original global shape (also for flattened keys)
    dtype: str
    chunks: int
    nbytes: int  # bytes of the global tensor's values
    flattened: bool  # stored N-D reformulated (distributed-optimizer slices)


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` finds."""

    path: str
    sharded_backend: str
    sharded_backend_version: int
    common_backend: Optional[str]
    common_keys: List[str]
    common_error: Optional[str]
    tensors: List[TensorInfo] = field(default_factory=list)
    objects: Dict[str, int] = field(default_factory=dict)  # unique key -> stored bytes
    files: Dict[str, int] = field(default_factory=dict)  # file name -> size on disk

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def disk_bytes(self) -> int:
        return sum(self.files.values())

    def as_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "path": self.path, "sharded_backend": self.sharded_backend,
            "sharded_backend_version": self.sharded_backend_version, "common_backend": self.common_backend,
            "common_keys": self.common_keys, "common_error": self.common_error,
            "tensors": [vars(t) | {"shape": list(t.shape)} for t in self.tensors],
            "objects": self.objects, "files": self.files,
            "tensor_bytes": self.tensor_bytes, "disk_bytes": self.disk_bytes,
        }


def inspect_checkpoint(checkpoint_dir: PathLike) -> CheckpointInfo:
    """Describe a checkpoint: backend, common-state keys, every tensor (key, global shape,
    dtype, number of stored chunks, bytes, flattened or not), every ShardedObject, and the
    files with their sizes. Reads metadata only; raises only CheckpointingException."""
    checkpoint_dir = checkpoint_location(checkpoint_dir)
    with malformed(f"Cannot inspect checkpoint {checkpoint_dir}"):
        return _inspect(checkpoint_dir)


def _inspect(checkpoint_dir: Union[Path, str]) -> CheckpointInfo:
    config = load_config(checkpoint_dir)
    common_keys: List[str] = []
    common_error = None
    try:
        common_keys = sorted(map(str, load_common_state_dict(checkpoint_dir)))
    except CheckpointingException as e:
        common_error = str(e)
    info = CheckpointInfo(str(checkpoint_dir), config.sharded_backend, config.sharded_backend_version,
                          config.common_backend, common_keys, common_error)
    storage = open_storage(checkpoint_dir)
    info.files = {name: stat.size for name in storage.list() if (stat := storage.info(name)) is not None}
    stored = get_default_load_sharded_strategy(checkpoint_dir).stored_items(checkpoint_dir)
    info.tensors = [TensorInfo(t.key, t.shape, str(t.dtype), t.chunks, t.nbytes, t.flattened) for t in stored.tensors]
    info.objects = stored.objects
    return info


def format_info(info: CheckpointInfo) -> str:
    """A human-readable report of :func:`inspect_checkpoint`'s result."""
    lines = [
        f"checkpoint   {info.path}",
        f"backend      {info.sharded_backend} v{info.sharded_backend_version}"
        + (f" (common state: {info.common_backend})" if info.common_backend else " (common state inside)"),
        f"common state {', '.join(info.common_keys) or '-'}" + (f" (unreadable: {info.common_error})" if info.common_error else ""),
        f"tensors      {len(info.tensors)}, {human_size(info.tensor_bytes)}",
    ]
    if info.tensors:
        width = max(len(t.key) for t in info.tensors)
        lines.append(f"  {'key'.ljust(width)}  {'shape':<22} {'dtype':<16} {'chunks':>6} {'bytes':>10}  flattened")
        for t in info.tensors:
            shape = "(" + ", ".join(map(str, t.shape)) + ")"
            lines.append(f"  {t.key.ljust(width)}  {shape:<22} {t.dtype.replace('torch.', ''):<16} {t.chunks:>6} "
                         f"{human_size(t.nbytes):>10}  {'yes' if t.flattened else 'no'}")
    lines.append(f"objects      {len(info.objects)}")
    for key, nbytes in sorted(info.objects.items()):
        lines.append(f"  {key}  {human_size(nbytes)}")
    lines.append(f"files        {len(info.files)}, {human_size(info.disk_bytes)} on disk")
    return "\n".join(lines)


def human_size(nbytes: int) -> str:
    """A byte count as the tools print it (``512 B``, ``40.0 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""  # not reached: the last unit takes any size


# ----------------------------------------------------------------------------- validate


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
    problems = []
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or any(o < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape)):
            problems.append(f"tensor {key!r}: chunk at {offsets} of size {sizes} lies outside the shape {shape}")
    volume = sum(math.prod(sizes) for _, sizes in chunks)
    if volume != math.prod(shape):
        problems.append(f"tensor {key!r}: its chunks hold {volume} elements, the tensor has {math.prod(shape)}")
    if len(chunks) <= 4096:  # pairwise overlap check (exact cover = right volume and no overlap)
        ordered = sorted(chunks)
        for i, (o1, s1) in enumerate(ordered):
            for o2, s2 in ordered[i + 1:]:
                if o2[0] >= o1[0] + s1[0]:
                    break
                if all(a < b + t and b < a + s for a, s, b, t in zip(o1, s1, o2, s2)):
                    problems.append(f"tensor {key!r}: chunks at {o1} and {o2} overlap")
    return problems


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


def validate_checkpoint(checkpoint_dir: PathLike, progress: Optional[Progress] = None) -> ValidationReport:
    """Check a checkpoint completely: it is committed (``metadata.json``), its files match
    Megatron-Core's integrity manifest ``integrity.json`` if it has one, the common state
    and ``.metadata`` match their checksums, every tensor's chunks cover it exactly, every
    data file holds the byte ranges named for it, and every stored item can be read and
    matches its checksum (tensors are read whole, one at a time; objects are checked
    without being unpickled unsafely). Never raises for a damaged or hostile checkpoint:
    every failure, whatever its type, is a problem in the report."""
    report = ValidationReport(str(checkpoint_dir))
    with _reported(report, f"Validating {checkpoint_dir}"):
        _validate(checkpoint_location(checkpoint_dir), report, progress)
    return report


def _validate(checkpoint_dir: Union[Path, str], report: ValidationReport, progress: Optional[Progress]) -> None:
    config = load_config(checkpoint_dir)
    with _reported(report, open_storage(checkpoint_dir).describe(MANIFEST_FNAME)):
        report.problems += manifest_problems(checkpoint_dir)
    # What load would refuse (an unknown backend or version) is a problem here too.
    if not isinstance(get_default_load_sharded_strategy(checkpoint_dir), TorchDistLoadShardedStrategy):
        report.problems.append(f"backend {config.sharded_backend!r} cannot be validated by this tool (only torch_dist)")
        return
    if config.common_backend is not None:
        get_default_strategy(StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version)
        _check_readable(report, "common state",
                        lambda: TorchCommonLoadStrategy(allow_pickle=False).load_common(checkpoint_dir))
    metadata = read_metadata(checkpoint_dir)
    where = open_storage(checkpoint_dir).describe(".metadata")
    if getattr(metadata, "checksums", None) is None:
        report.notes.append("no item checksums are recorded (e.g. written by Megatron-Core): damage inside "
                            "tensor data cannot be detected, only unreadable or truncated items")
    # Every size the metadata claims is checked against the files before anything is allocated.
    file_sizes: Dict[str, int] = {}
    tensor_keys, object_keys = [], []
    with malformed(f"{where} is malformed"):
        for index, storage in metadata.storage_data.items():
            with _reported(report, f"{where}: the storage entry of {getattr(index, 'fqn', index)!r} is malformed"):
                problem = range_problem(checkpoint_dir, index, storage, file_sizes)
                if problem is not None:
                    report.problems.append(problem)
        for key, md in sorted(metadata.state_dict_metadata.items()):
            with _reported(report, f"{where}: the entry of {key!r} is malformed"):
                if hasattr(md, "chunks"):
                    report.problems += _coverage_problems(key, tuple(md.size),
                                                          [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
                    tensor_keys.append(key)
                else:
                    object_keys.append(key)
    if report.problems:
        return

    reader = TensorReader(checkpoint_dir, tensor_keys)
    sizes = {k: nbytes(tuple(reader.meta[k].global_shape), reader.meta[k].dtype) for k in tensor_keys}
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
    strategy = TorchDistLoadShardedStrategy(allow_pickle=False)
    for key in object_keys:
        _check_readable(report, f"object {key!r}", lambda k=key: strategy.load_local(
            {"o": ShardedObject.empty_from_unique_key(k)}, checkpoint_dir))
        report.checked_objects += 1


# ----------------------------------------------------------------------------- export


def _select_keys(checkpoint_dir: Path, key_prefix: Optional[str]) -> List[str]:
    with malformed(f"{checkpoint_dir / '.metadata'}: the tensor entries are malformed"):
        keys = sorted(load_tensors_metadata(checkpoint_dir))
    if key_prefix:
        keys = [k for k in keys if k.startswith(key_prefix)]
        if not keys:
            raise CheckpointingException(f"No tensor key of {checkpoint_dir} starts with {key_prefix!r}")
    if not keys:
        raise CheckpointingException(f"{checkpoint_dir} holds no tensors to export")
    return keys


class OutputExistsError(CheckpointingException):
    """The output of an export or import exists and replacing it was not asked for
    (``force=True``; on the command line ``--force``)."""

    def __init__(self, out: Path):
        super().__init__(f"{out} already exists (pass force=True to replace it)")
        self.out = out


def _umask() -> int:
    """The process's file mode creation mask."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _refuse_existing(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise OutputExistsError(out)


def export_checkpoint(
    checkpoint_dir: PathLike,
    out: PathLike,
    format: str = "safetensors",
    key_prefix: Optional[str] = None,
    force: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    progress: Optional[Progress] = None,
) -> List[Path]:
    """Write the checkpoint's tensors, each whole in its original shape (flattened keys
    restored), to ``out``; returns the files written.

    * ``format="safetensors"``: ``out`` is a directory holding ``model.safetensors``, or
      ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes`` each plus
      ``model.safetensors.index.json`` (the Hugging Face convention). Streamed: one tensor
      in memory at a time.
    * ``format="torch"``: ``out`` is one ``torch.save`` file of ``{key: tensor}`` (this
      needs every exported tensor in memory at once).

    Only keys starting with ``key_prefix`` are exported (an error if none does). An
    existing ``out`` is replaced only with ``force``; the new output is written next to
    it and moved into place at the end, so a failed export leaves ``out`` as it was.
    An ``out`` that is the checkpoint, holds it or lies inside it is refused before
    anything is read. Raises only CheckpointingException.
    """
    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    if format not in ("safetensors", "torch"):
        raise CheckpointingException(f"Unknown export format {format!r}: choose 'safetensors' or 'torch'")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise CheckpointingException(f"max_shard_bytes must be a positive number of bytes, not {max_shard_bytes!r}")
    refuse_overlap(checkpoint_dir, out, "export")
    with malformed(f"Cannot export {checkpoint_dir} to {out}"):
        load_config(checkpoint_dir)
        keys = _select_keys(checkpoint_dir, key_prefix)
        _refuse_existing(out, force)
        return _export(checkpoint_dir, out, format, keys, max_shard_bytes, progress)


def _export(checkpoint_dir: Path, out: Path, format: str, keys: List[str], max_shard_bytes: int,
            progress: Optional[Progress]) -> List[Path]:
    reader = TensorReader(checkpoint_dir, keys)
    sizes = {k: nbytes(tuple(reader.meta[k].global_shape), reader.meta[k].dtype) for k in keys}
    total = sum(sizes.values())
    start = time.perf_counter()
    with staging_dir(out) as (tmp, location), contextlib.closing(reader):
        done = 0
        if format == "torch":
            state = {}
            for key in keys:
                state[key] = reader.read(key).clone()
                done += sizes[key]
                if progress is not None:
                    progress(done, total, key)
            with open(tmp / "export.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            _move_into_place(tmp / "export.pt", location)
            written = [out]
        else:
            for key in keys:
                dtype_name(key, reader.meta[key].dtype)  # refuse unsupported dtypes before writing
            shards: List[List[str]] = [[]]
            shard_bytes = 0
            for key in keys:
                if shards[-1] and shard_bytes + sizes[key] > max_shard_bytes:
                    shards.append([])
                    shard_bytes = 0
                shards[-1].append(key)
                shard_bytes += sizes[key]
            names = shard_names(len(shards))
            for name, shard in zip(names, shards):
                writer = SafetensorsFileWriter(
                    tmp / name, [(k, tuple(reader.meta[k].global_shape), reader.meta[k].dtype) for k in shard],
                    {"format": "pt"})
                try:
                    for key in shard:
                        writer.write(key, reader.read(key))
                        done += sizes[key]
                        if progress is not None:
                            progress(done, total, key)
                except BaseException:
                    writer.abort()
                    raise
                writer.close()
            if len(shards) > 1:
                write_index(tmp, {k: name for name, shard in zip(names, shards) for k in shard}, total)
            written = [out / p.name for p in sorted(tmp.iterdir())]
            _move_into_place(tmp, location)
    seconds = time.perf_counter() - start
    logger.info("Exported %d tensors (%.1f MiB) of %s to %s in %.2f s (%.2f GB/s)", len(keys), total / 2**20,
                checkpoint_dir, out, seconds, total / max(seconds, 1e-9) / 1e9)
    return written


@contextmanager
def staging_dir(out: Path) -> Iterator[Tuple[Path, Path]]:
    """``(tmp, location)``: a new directory to write an output in, next to ``location``
    (where ``out`` goes: :func:`~dist_checkpointing.path_overlap.output_location`, never
    inside a source), with the usual mode (``0777`` less the umask, not ``mkdtemp``'s
    ``0700``). The block moves what it wrote into place (:func:`_move_into_place`);
    whatever is left of ``tmp`` afterwards is removed, also when the block fails."""
    location = output_location(out)
    location.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{location.name}.", dir=location.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp, location
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_into_place(src: Path, out: Path) -> None:
    """Replace ``out`` (a symlink itself, not its target) by the finished ``src`` (a file
    or directory) and make it durable."""
    if src.is_dir():
        for child in src.iterdir():  # the index and the files (already fsynced) and the entries
            if child.suffix == ".json":
                with open(child, "rb+") as f:
                    os.fsync(f.fileno())
        fsync_dir(src)
    _remove(out)
    os.replace(src, out)
    fsync_dir(out.parent)


def _remove(path: Path) -> None:
    """Delete ``path`` if there: a directory tree, a file, or a symlink itself (never its target)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


# ----------------------------------------------------------------------------- import


def _read_source(source: Path) -> Any:
    """The state dict in a ``torch.save`` file, a ``.safetensors`` file, or a directory of
    safetensors files (with or without an index)."""
    if source.is_dir() or source.suffix == ".safetensors" or source.name == INDEX_FNAME:
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise CheckpointingException("Importing safetensors files needs the safetensors package "
                                         "(pip install safetensors)") from e
        files = sorted(source.glob("*.safetensors")) if source.is_dir() else (
            sorted(source.parent.glob("*.safetensors")) if source.name == INDEX_FNAME else [source])
        if not files:
            raise CheckpointingException(f"{source} holds no .safetensors files")
        state: Dict[str, torch.Tensor] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key)
        return state
    archive = zipfile.is_zipfile(source)  # torch.save's format; mmap needs it (older files are plain pickles)
    try:
        return torch.load(source, map_location="cpu", mmap=archive, weights_only=True)
    except Exception as e:  # noqa: BLE001 - not a torch.save file, or unsafe content
        logger.debug("torch.load(%s) failed", source, exc_info=True)
        if not archive:
            reason = "neither a torch.save archive nor a plain pickle of tensors"
        elif isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e):
            reason = "it holds objects outside the safe allow-list"
        else:
            reason = "a damaged torch.save archive"
        raise CheckpointingException(
            f"Cannot import {source}: it is not a torch.save file of a state dict ({reason}), "
            "a .safetensors file or a directory of them") from e


def _keyed_leaves(state: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    if isinstance(state, dict):
        for k, v in state.items():
            yield from _keyed_leaves(v, f"{prefix}{k}.")
    elif isinstance(state, list):
        for i, v in enumerate(state):
            yield from _keyed_leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], state


def import_checkpoint(source: PathLike, out: PathLike, force: bool = False) -> int:
    """Turn a plain state dict (a ``torch.save`` file, or safetensors files) into a
    checkpoint that :func:`~dist_checkpointing.load` reads under any layout: every tensor
    becomes one whole global tensor keyed by its dotted path (``"layers.0.weight"``);
    other values become common state. Returns the number of tensors. An ``out`` that is
    the source (for an index file: its directory), holds it or lies inside it is refused
    before anything is read. Raises only CheckpointingException."""
    source, out = Path(source), Path(out)
    if not source.exists():
        raise CheckpointingException(f"{source} does not exist")
    refuse_overlap(source.parent if source.name == INDEX_FNAME else source, out, "import")
    with malformed(f"Cannot import {source} to {out}"):
        return _import(source, out, force)


def _import(source: Path, out: Path, force: bool) -> int:
    occupied = out.is_file() or (out.is_dir() and any(out.iterdir()))
    if occupied:
        _refuse_existing(out, force)
    state = _read_source(source)
    if not isinstance(state, dict):
        raise CheckpointingException(f"{source} holds a {type(state).__name__}, not a state dict")
    if occupied:
        _remove(out)
    # Both walks visit the leaves in the same order: each tensor gets its own dotted key.
    keys = iter([k for k, v in _keyed_leaves(state) if isinstance(v, torch.Tensor)])
    sharded = dict_list_map_outplace(
        lambda v: ShardedTensor.from_rank_offsets(next(keys), v) if isinstance(v, torch.Tensor) else v, state)
    save(sharded, out)
    return sum(1 for v in nested_values(sharded) if isinstance(v, ShardedTensor))
