"""``inspect``: what a checkpoint holds (backend, common-state keys, tensors, objects,
files), read from metadata only, for any registered backend (through its load
strategy's ``stored_items``).

Owns: ``inspect_checkpoint``, ``format_info``, ``human_size``: describes any registered
backend through its load strategy's ``stored_items``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from ..core import CheckpointingException, checkpoint_location, load_config, malformed, open_storage
from ..readers import get_default_load_sharded_strategy, load_common_state_dict
from ..storage import Storage, StorageOptions
from .output import PathLike


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


def inspect_checkpoint(checkpoint_dir: PathLike, storage_options: StorageOptions = None) -> CheckpointInfo:
    """Describe a checkpoint (a directory or a URL, ``storage_options`` for its client):
    backend, common-state keys, every tensor (key, global shape, dtype, number of stored
    chunks, bytes, flattened or not), every ShardedObject, and the files with their sizes.
    Reads metadata only; raises only CheckpointingException."""
    with malformed(f"Cannot inspect checkpoint {checkpoint_dir}"):
        return _inspect(checkpoint_location(checkpoint_dir, storage_options))


def _inspect(checkpoint_dir: Union[Path, Storage]) -> CheckpointInfo:
    storage = open_storage(checkpoint_dir)
    config = load_config(checkpoint_dir)
    common_keys: List[str] = []
    common_error = None
    try:
        common_keys = sorted(map(str, load_common_state_dict(checkpoint_dir)))
    except CheckpointingException as e:
        common_error = str(e)
    info = CheckpointInfo(storage.describe(), config.sharded_backend, config.sharded_backend_version,
                          config.common_backend, common_keys, common_error)
    info.files = {name: stat.size for name in storage.list() if (stat := storage.info(name)) is not None}
    stored = get_default_load_sharded_strategy(checkpoint_dir).stored_items(checkpoint_dir)
    info.files.update({name: size for name, size in stored.files.items() if size is not None})  # in subdirectories too
    info.tensors = [TensorInfo(t.key, t.shape, str(t.dtype), len(t.chunks), t.nbytes, t.flattened)
                    for t in stored.tensors]
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
