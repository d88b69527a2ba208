"""``export``: a checkpoint's tensors, each whole in its original shape, to safetensors
files (streamed, one tensor in memory at a time) or one ``torch.save`` file."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import List, Optional, Union

import torch

from ..bytes_view import nbytes
from ..core import CheckpointingException, checkpoint_location, load_config, malformed, open_storage
from ..path_overlap import refuse_overlap
from ..safetensors_stream import SafetensorsFileWriter, dtype_name, shard_names, write_index
from ..readers import load_tensors_metadata
from ..storage import Storage, StorageOptions, url_scheme
from ..whole_tensors import TensorReader
from .output import PathLike, Progress, move_into_place, refuse_existing, staging_dir

logger = logging.getLogger(__package__)  # (the package's name, as before the split)


def _select_keys(checkpoint_dir: Union[Path, Storage], key_prefix: Optional[str]) -> List[str]:
    with malformed(f"{open_storage(checkpoint_dir).describe('.metadata')}: the tensor entries are malformed"):
        keys = sorted(load_tensors_metadata(checkpoint_dir))
    if key_prefix:
        keys = [k for k in keys if k.startswith(key_prefix)]
        if not keys:
            raise CheckpointingException(f"No tensor key of {checkpoint_dir} starts with {key_prefix!r}")
    if not keys:
        raise CheckpointingException(f"{checkpoint_dir} holds no tensors to export")
    return keys

def export_checkpoint(
    checkpoint_dir: PathLike,
    out: PathLike,
    format: str = "safetensors",
    key_prefix: Optional[str] = None,
    force: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    progress: Optional[Progress] = None,
    storage_options: StorageOptions = None,
) -> List[Path]:
    """Write the checkpoint's tensors, each whole in its original shape (flattened keys
    restored), to the local ``out``; returns the files written. The checkpoint may be a
    directory or a URL (``storage_options`` configure its client).

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
    if url_scheme(out):
        raise CheckpointingException(f"Cannot export to {out}: the output must be a local path")
    checkpoint_dir, out = checkpoint_location(checkpoint_dir, storage_options), Path(out)
    if format not in ("safetensors", "torch"):
        raise CheckpointingException(f"Unknown export format {format!r}: choose 'safetensors' or 'torch'")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise CheckpointingException(f"max_shard_bytes must be a positive number of bytes, not {max_shard_bytes!r}")
    if isinstance(checkpoint_dir, Path):  # (a URL cannot overlap a local output)
        refuse_overlap(checkpoint_dir, out, "export")
    with malformed(f"Cannot export {checkpoint_dir} to {out}"):
        load_config(checkpoint_dir)
        keys = _select_keys(checkpoint_dir, key_prefix)
        refuse_existing(out, force)
        return _export(checkpoint_dir, out, format, keys, max_shard_bytes, progress)


def _export(checkpoint_dir: Union[Path, Storage], out: Path, format: str, keys: List[str], max_shard_bytes: int,
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
            move_into_place(tmp / "export.pt", location)
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
            move_into_place(tmp, location)
    seconds = time.perf_counter() - start
    logger.info("Exported %d tensors (%.1f MiB) of %s to %s in %.2f s (%.2f GB/s)", len(keys), total / 2**20,
                checkpoint_dir, out, seconds, total / max(seconds, 1e-9) / 1e9)
    return written
