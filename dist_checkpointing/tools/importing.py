"""``import``: a plain state dict (a ``torch.save`` file, or safetensors files) as a
checkpoint of whole global tensors that loads under any layout.

Owns: ``import_checkpoint``: a plain state dict (a ``torch.save`` file or safetensors files)
as a checkpoint of whole tensors.
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

import torch

from ..core import CheckpointingException, malformed, open_storage
from ..dict_utils import dict_list_map_outplace, nested_values
from ..mapping import ShardedTensor
from ..pickling.safe_load import safe_torch_load
from ..integrity.overlap import refuse_overlap
from ..strategies.safetensors.format import INDEX_FNAME
from ..serialization import SAVED_FILE_NAMES, save
from ..storage import StorageOptions, url_scheme
from ..strategies.torch_dist.format import data_file_name
from ..integrity.stored_names import refuse_unkept_names
from .output import PathLike, clear_url_output, refuse_existing, remove_path, url_output

logger = logging.getLogger(__package__)  # (the package's name, as before the split)


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
    try:  # the policy of every stored pickle: the allow-list, the user's safe globals, the stand-ins
        return safe_torch_load(source, str(source), mmap=archive)
    except CheckpointingException as e:
        logger.debug("torch.load(%s) failed", source, exc_info=True)
        if not archive:
            reason = "neither a torch.save archive nor a plain pickle of tensors"
        elif str(e).startswith("Refusing to unpickle"):
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


def import_checkpoint(source: PathLike, out: PathLike, force: bool = False,
                      storage_options: StorageOptions = None) -> int:
    """Turn a plain state dict (a ``torch.save`` file, or safetensors files) into a
    checkpoint that :func:`~dist_checkpointing.load` reads under any layout: every tensor
    becomes one whole global tensor keyed by its dotted path (``"layers.0.weight"``);
    other values become common state. Returns the number of tensors. ``out`` is a local
    directory or a URL (``storage_options`` configure its client). An ``out`` that
    is the source (for an index file: its directory), holds it or lies inside it is
    refused before anything is read (a URL too: compared after normalising it, a
    ``file://`` URL as its path), and so is an ``out`` whose key the store would not keep
    as written. Raises only CheckpointingException."""
    source = Path(source)
    if not source.exists():
        raise CheckpointingException(f"{source} does not exist")
    refuse_overlap(source.parent if source.name == INDEX_FNAME else source, out, "import")
    if url_scheme(out) or storage_options:
        with malformed(f"Cannot import {source} to {out}"):
            return _import_to_url(source, str(out), force, storage_options)
    out = Path(out)
    with malformed(f"Cannot import {source} to {out}"):
        return _import(source, out, force)


def _save_state(source: Path, state: Any, out: Any, storage_options: StorageOptions) -> int:
    """Save the state dict ``state`` read from ``source`` as a checkpoint of whole tensors."""
    if not isinstance(state, dict):
        raise CheckpointingException(f"{source} holds a {type(state).__name__}, not a state dict")
    # Both walks visit the leaves in the same order: each tensor gets its own dotted key.
    keys = iter([k for k, v in _keyed_leaves(state) if isinstance(v, torch.Tensor)])
    sharded = dict_list_map_outplace(
        lambda v: ShardedTensor.from_rank_offsets(next(keys), v) if isinstance(v, torch.Tensor) else v, state)
    save(sharded, out, storage_options=storage_options)
    return sum(1 for v in nested_values(sharded) if isinstance(v, ShardedTensor))


def _import(source: Path, out: Path, force: bool) -> int:
    occupied = out.is_file() or (out.is_dir() and any(out.iterdir()))
    if occupied:
        refuse_existing(out, force)
    state = _read_source(source)
    if occupied and isinstance(state, dict):
        remove_path(out)
    return _save_state(source, state, out, None)


def _import_to_url(source: Path, out: str, force: bool, storage_options: StorageOptions) -> int:
    """:func:`import_checkpoint` into a URL: with ``force`` the files under it are deleted
    first (``metadata.json`` first; one level: a checkpoint is flat, a sub-directory there
    is refused)."""
    refuse_unkept_names(open_storage(out, storage_options), [*SAVED_FILE_NAMES, data_file_name(0, 0)],
                        f"Cannot import {source} to {out}")
    storage, names = url_output(out, storage_options, force)
    state = _read_source(source)
    if isinstance(state, dict):
        clear_url_output(storage, names)
    return _save_state(source, state, storage, None)
