"""``export``: a checkpoint's tensors, each whole in its original shape, to safetensors
files (streamed, one tensor in memory at a time) or one ``torch.save`` file, in a local
directory or at a URL.

Owns: ``export_checkpoint``: tensors whole to safetensors (streamed) or one ``torch.save``
file.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from ..tensors.bytes_view import nbytes
from ..core import CheckpointingException, check_key, checkpoint_location, load_config, malformed, open_storage
from ..integrity.overlap import refuse_overlap
from ..mapping import KeyMap, key_mapper
from ..strategies.safetensors.file_writer import SafetensorsFileWriter, read_back_header
from ..strategies.safetensors.format import INDEX_FNAME, dtype_name, file_groups, key_refusal, shard_names, write_index
from ..readers import load_tensors_metadata
from ..storage import PosixStorage, Storage, StorageOptions, url_scheme
from ..integrity.stored_names import refuse_unkept_names
from .whole_tensors import TensorReader
from .output import (OutputExistsError, PathLike, Progress, clear_url_output, delete_quietly, move_into_place,
                     refuse_existing, temp_output_dir, url_output)

_TORCH_FNAME = "export.pt"  # the torch format's file while it is written locally

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
    key_map: Optional[KeyMap] = None,
) -> List[Union[Path, str]]:
    """Write the checkpoint's tensors, each whole in its original shape (flattened keys
    restored), to ``out`` (a local path or a URL); returns the files written (paths, or
    URLs for a URL ``out``). The checkpoint may be a directory or a URL;
    ``storage_options`` configure the client of each URL.

    * ``format="safetensors"``: ``out`` is a directory (or prefix) holding
      ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files of at most
      ``max_shard_bytes`` each plus ``model.safetensors.index.json`` (the Hugging Face
      convention). Streamed: one tensor in memory at a time.
    * ``format="torch"``: ``out`` is one ``torch.save`` file (or object) of ``{key: tensor}``
      (this needs every exported tensor in memory at once).

    Only keys starting with ``key_prefix`` are exported (an error if none does). An
    existing ``out`` (a URL prefix that holds any object) is replaced only with ``force``.
    A local output is written next to ``out`` and moved into place at the end, so a failed
    export leaves ``out`` as it was. A URL output is written in place (an object store
    cannot rename): with ``force`` the old output is deleted first, and a failed export
    deletes what it wrote; a file appears only whole, and a sharded export's index is
    written last, so nothing half-written looks complete. An ``out`` that is the
    checkpoint, holds it or lies inside it is refused before anything is read. Raises only
    CheckpointingException.

    ``key_map`` names each exported key in the output (a dict, keys it does not name kept,
    or a callable ``key -> name``): e.g. Megatron-style keys to a Hugging Face model's, the
    reverse of the ``key_map`` a load from that model takes. Two keys given one name are refused.
    """
    to_url = bool(url_scheme(out))
    local_source_to_url = to_url and not isinstance(checkpoint_dir, Storage) and not url_scheme(checkpoint_dir)
    checkpoint_dir = checkpoint_location(checkpoint_dir, None if local_source_to_url else storage_options)
    if format not in ("safetensors", "torch"):
        raise CheckpointingException(f"Unknown export format {format!r}: choose 'safetensors' or 'torch'")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise CheckpointingException(f"max_shard_bytes must be a positive number of bytes, not {max_shard_bytes!r}")
    if key_prefix:
        check_key(key_prefix, "The export's key prefix")
    refuse_overlap(checkpoint_dir, out, "export")
    with malformed(f"Cannot export {checkpoint_dir} to {out}"):
        load_config(checkpoint_dir)
        keys = _output_names(_select_keys(checkpoint_dir, key_prefix), key_map)
        if not to_url:
            refuse_existing(Path(out), force)
            return _export_local(checkpoint_dir, Path(out), format, keys, max_shard_bytes, progress)
        return _export_url(checkpoint_dir, str(out), format, keys, max_shard_bytes, progress, force, storage_options)


def _output_names(keys: List[str], key_map: Optional[KeyMap]) -> Dict[str, str]:
    """``{stored key: its name in the output}`` (:func:`export_checkpoint`'s ``key_map``)."""
    names: Dict[str, str] = {}
    named: Dict[str, str] = {}
    mapped = (lambda k: k) if key_map is None else key_mapper(key_map)
    for key in keys:
        name = mapped(key)
        if name in named:
            raise CheckpointingException(f"key_map gives {named[name]!r} and {key!r} the one name {name!r}")
        names[key], named[name] = name, key
    return names


def _export_local(checkpoint_dir: Union[Path, Storage], out: Path, format: str, keys: Dict[str, str],
                  max_shard_bytes: int, progress: Optional[Progress]) -> List[Union[Path, str]]:
    """Export into a new directory next to ``out``, then move it (or its one file) into place."""
    with temp_output_dir(out) as (tmp, location):
        # (plain writes: the tensors come from the reader's one reused buffer, a copy would add memory)
        names = _export(checkpoint_dir, PosixStorage(tmp, buffered=False), _TORCH_FNAME, format, keys,
                        max_shard_bytes, progress, str(out))
        if format == "torch":
            move_into_place(tmp / _TORCH_FNAME, location)
            return [out]
        move_into_place(tmp, location)
        return [out / name for name in names]


def _split_object_url(out: str) -> Tuple[str, str]:
    """``(prefix URL, object name)`` of the URL of one object."""
    parent, _, name = out.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/"):
        raise CheckpointingException(f"Cannot export to {out}: the torch format needs the URL of an object "
                                     "(scheme://bucket/name)")
    return parent, name


def _export_url(checkpoint_dir: Union[Path, Storage], out: str, format: str, keys: Dict[str, str], max_shard_bytes: int,
                progress: Optional[Progress], force: bool, storage_options: StorageOptions) -> List[Union[Path, str]]:
    """Export into the prefix ``out`` (the object ``out`` for the torch format) in place."""
    if format == "torch":
        parent, name = _split_object_url(out)
        storage = open_storage(parent, storage_options)
        refuse_unkept_names(storage, [name], f"Cannot export to {out}")
        try:
            kind = storage.kind(name)
        except OSError as e:
            raise CheckpointingException(f"Cannot export to {out}: {e}") from e
        if kind == "dir":
            raise CheckpointingException(f"Cannot export to {out}: it is a prefix that holds objects, not an object")
        if kind == "file":
            if not force:
                raise OutputExistsError(out)
            storage.delete(name)
        _export(checkpoint_dir, storage, name, format, keys, max_shard_bytes, progress, out)
        return [out]
    refuse_unkept_names(open_storage(out, storage_options), [*shard_names(1), *shard_names(2)[:1], INDEX_FNAME],
                        f"Cannot export to {out}")
    storage, old = url_output(out, storage_options, force)
    clear_url_output(storage, old)
    return [storage.describe(name)
            for name in _export(checkpoint_dir, storage, "", format, keys, max_shard_bytes, progress, out)]


def _export(checkpoint_dir: Union[Path, Storage], out: Storage, torch_name: str, format: str, names: Dict[str, str],
            max_shard_bytes: int, progress: Optional[Progress], destination: str) -> List[str]:
    """Write the export into ``out`` (the torch format as the file ``torch_name``); returns
    the names written. ``names``: each stored key's name in the output. On failure, what was
    written is deleted. ``destination`` is where the export ends up (``out`` may be a
    temporary output directory), for the log."""
    keys = list(names)
    reader = TensorReader(checkpoint_dir, keys)
    sizes = {k: nbytes(tuple(reader.meta[k].global_shape), reader.meta[k].dtype) for k in keys}
    total = sum(sizes.values())
    start = time.perf_counter()
    written: List[str] = []
    with contextlib.closing(reader):
        done = 0

        def report(key: str) -> None:
            nonlocal done
            done += sizes[key]
            if progress is not None:
                progress(done, total, key)

        try:
            if format == "torch":
                state = {}
                for key in keys:
                    state[names[key]] = reader.read(key).clone()
                    report(key)
                stream = out.create_stream(torch_name)
                try:
                    torch.save(state, stream)
                    stream.close()
                except BaseException:
                    stream.abort()
                    raise
                written.append(torch_name)
            else:
                for key in keys:  # refuse what the format cannot hold before writing
                    dtype_name(key, reader.meta[key].dtype)
                    refusal = key_refusal(names[key])
                    if refusal is not None:
                        raise CheckpointingException(f"Cannot export {checkpoint_dir} as safetensors: {refusal}")
                shards = file_groups(keys, sizes, max_shard_bytes)
                files = shard_names(len(shards))
                for name, shard in zip(files, shards):
                    writer = SafetensorsFileWriter(
                        out, name, [(names[k], tuple(reader.meta[k].global_shape), reader.meta[k].dtype) for k in shard],
                        {"format": "pt"})
                    try:
                        for key in shard:
                            writer.write(names[key], reader.read(key))
                            report(key)
                    except BaseException:
                        writer.abort()
                        raise
                    writer.close()
                    written.append(name)
                    read_back_header(out, name)
                if len(shards) > 1:  # last: the index marks the sharded export complete
                    write_index(out, {names[k]: name for name, shard in zip(files, shards) for k in shard}, total)
                    written.append(INDEX_FNAME)
        except BaseException:
            delete_quietly(out, written)
            raise
    seconds = time.perf_counter() - start
    logger.info("Exported %d tensors (%.1f MiB) of %s to %s in %.2f s (%.2f GB/s)", len(keys), total / 2**20,
                checkpoint_dir, destination, seconds, total / max(seconds, 1e-9) / 1e9)
    return sorted(written)
