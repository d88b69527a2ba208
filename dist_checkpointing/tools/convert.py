"""Rewriting a checkpoint into Megatron-Core 0.19's layout (``dist-ckpt convert``): a
``torch_dist`` checkpoint, or one of Megatron-Core's earlier ``zarr`` checkpoints.

Megatron-Core 0.19 reads the common state from the ShardedObject ``common_state`` (it
reads ``common.pt`` only through a deprecated path) and has no code path for tensors
stored flattened in 0.15's N-D reformulated layout (distributed-optimizer state).
:func:`convert_checkpoint` writes a new checkpoint in which

* every tensor is one whole global tensor in its original shape (one chunk, written
  with its checksum), read one at a time: memory stays near the largest tensor;
* every ShardedObject is copied byte for byte (a zarr checkpoint's ``torch.save(obj)``
  files wrapped, without unpickling, into the ``torch.save([obj])`` records of ``torch_dist``);
* ``common.pt`` becomes the ``common_state`` object, without unpickling it (its pickle is
  wrapped into the one-element list Megatron-Core stores objects as), and
  ``metadata.json`` records no common backend.

The result loads in this library and in Megatron-Core 0.19 under any layout.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import StorageMeta

from ..tensors.bytes_view import nbytes
from ..core import (CONFIG_FNAME, CheckpointingConfig, CheckpointingException, Location, checkpoint_location,
                   load_config, malformed, open_storage, save_config)
from ..integrity.checksums import read_file_verified, sidecar_name
from ..integrity.overlap import refuse_overlap
from ..integrity.stored_names import refuse_unkept_names
from ..integrity.save_claim import CLAIM_FNAME, check_claim, claim_save_dir, current_save_id, release_claim
from ..strategies.base import StoredItems
from ..strategies.common import COMMON_STATE_FNAME
from ..strategies.torch_dist.writing import write_file
from ..storage import PosixStorage, Storage, StorageOptions, url_scheme
from ..readers import get_default_load_sharded_strategy
from ..strategies.torch_dist.format import COMMON_STATE_OBJECT_KEY, METADATA_FNAME, data_file_name
from ..strategies.torch_dist.metadata import build_metadata, data_file_sizes, write_metadata
from .output import Progress, clear_url_output, move_into_place, refuse_existing, temp_output_dir, url_output
from .whole_tensors import TensorReader

logger = logging.getLogger(__name__)

LAYOUTS = ("mcore-0.19",)
SOURCES = ("torch_dist", "zarr")  # the sharded backends read (zarr: Megatron-Core's earlier format)
DATA_FNAME = data_file_name(0, 0)
_WRITTEN = (DATA_FNAME, METADATA_FNAME, sidecar_name(METADATA_FNAME), CONFIG_FNAME, CLAIM_FNAME)


@dataclass
class ConvertResult:
    """What :func:`convert_checkpoint` wrote."""

    tensors: int  # tensors written whole
    flattened: int  # of those, tensors the source stored flattened (N-D reformulated)
    objects: int  # ShardedObjects copied, the common state included
    nbytes: int  # tensor bytes


def convert_checkpoint(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], layout: str = "mcore-0.19",
                       force: bool = False, progress: Optional[Progress] = None,
                       storage_options: StorageOptions = None) -> ConvertResult:
    """Write ``src`` to ``dst`` (each a directory or a URL; ``storage_options`` configure
    the client of each URL) in ``layout`` (only ``"mcore-0.19"``: see the module doc).

    An existing ``dst`` (a URL prefix that holds any object) is replaced only with
    ``force``. A local ``dst`` is written next to it and moved into place at the end, so a
    failed conversion leaves ``dst`` as it was. A URL ``dst`` is written in place as a save
    writes it (an object store cannot rename): with ``force`` the old objects are deleted
    first (``metadata.json`` first), the prefix is claimed, and ``metadata.json``, the
    commit, is written last: what a failed conversion leaves never loads as complete. A
    ``dst`` that is ``src``, holds it or lies inside it is refused before anything is
    read. ``progress(done_bytes, total_bytes, key)`` is called after each tensor. Raises
    only CheckpointingException.
    """
    to_url = bool(url_scheme(dst))
    local_source_to_url = to_url and not url_scheme(src)
    src = checkpoint_location(src, None if local_source_to_url else storage_options)
    if layout not in LAYOUTS:
        raise CheckpointingException(f"Unknown checkpoint layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    refuse_overlap(src, dst, "convert")
    with malformed(f"Cannot convert {src} to {dst}"):
        config = load_config(src)
        if config.sharded_backend not in SOURCES:
            raise CheckpointingException(f"{src} is a {config.sharded_backend!r} checkpoint: only "
                                         f"{' and '.join(SOURCES)} checkpoints convert")
        new_config = CheckpointingConfig("torch_dist", 1, None, None)
        if to_url:
            return _convert_to_url(src, str(dst), config, new_config, progress, force, storage_options)
        dst = Path(dst)
        refuse_existing(dst, force)
        with temp_output_dir(dst) as (tmp, location):
            result, _ = _convert(src, PosixStorage(tmp), str(dst), config, progress)
            save_config(new_config, tmp)
            move_into_place(tmp, location)
        return result


def _convert_to_url(src: Location, dst: str, config: CheckpointingConfig, new_config: CheckpointingConfig,
                    progress: Optional[Progress], force: bool, storage_options: StorageOptions) -> ConvertResult:
    """Convert into the prefix ``dst`` with a save's commit rules (claim, ``metadata.json`` last)."""
    refuse_unkept_names(open_storage(dst, storage_options), _WRITTEN, f"Cannot convert {src} to {dst}")
    out, old = url_output(dst, storage_options, force)
    clear_url_output(out, old)
    save_id = claim_save_dir(out)
    result, written = _convert(src, out, dst, config, progress)
    check_claim(out, save_id)
    save_config(new_config, out)
    release_claim(out, save_id)
    return result


def _convert(src: Location, out: Storage, dst: str, config: CheckpointingConfig,
             progress: Optional[Progress]) -> Tuple[ConvertResult, Dict[str, Optional[int]]]:
    """Write the converted data file and ``.metadata`` into ``out`` (``metadata.json``, the
    commit, is the caller's); returns what was written and the files with their sizes
    (``None``: not counted here)."""
    start = time.perf_counter()
    items = get_default_load_sharded_strategy(src).stored_items(src)
    keys = sorted(t.key for t in items.tensors)
    # torch_dist stores an object as torch.save([obj]) (the form written here), zarr as torch.save(obj)
    objects = _object_payloads(src, config, items, sorted(items.objects), in_lists=config.sharded_backend != "zarr")
    reader = TensorReader(src, keys, items)
    sizes = {k: nbytes(tuple(reader.meta[k].global_shape), reader.meta[k].dtype) for k in keys}
    with contextlib.closing(reader):

        def payloads() -> Iterator[Union[torch.Tensor, bytes]]:
            done = 0
            for key in keys:  # one tensor in memory at a time: the reader's buffer, reused
                yield reader.read(key)
                done += sizes[key]
                if progress is not None:
                    progress(done, sum(sizes.values()), key)
            yield from (payload for _, payload in objects)

        spans = write_file(out, DATA_FNAME, payloads())  # type: ignore[arg-type] - iterated once
        metas: List[Optional[tuple]] = [_whole_tensor_meta(reader, k) for k in keys] + [None] * len(objects)
        names = keys + [key for key, _ in objects]
        locations = [(key, meta, DATA_FNAME, off, length, cs)
                     for key, meta, (off, length, cs) in zip(names, metas, spans)]
        new_metadata = build_metadata([locations], out)
        new_metadata.storage_meta = StorageMeta(checkpoint_id=dst, save_id=current_save_id(out) or uuid.uuid4().hex)
        write_metadata(new_metadata, out)
    result = ConvertResult(tensors=len(keys), flattened=sum(t.flattened for t in items.tensors),
                           objects=len(objects), nbytes=sum(sizes.values()))
    logger.info("Converted %s to %s (%s) in %.2f s: %d tensors (%d were flattened, %.1f MiB), %d objects",
                src, dst, LAYOUTS[0], time.perf_counter() - start, result.tensors, result.flattened,
                result.nbytes / 2**20, result.objects)
    return result, {**data_file_sizes(new_metadata), METADATA_FNAME: None, sidecar_name(METADATA_FNAME): None}


def _whole_tensor_meta(reader: TensorReader, key: str) -> tuple:
    """The location metadata of ``key`` stored as one chunk: the whole tensor, not reformulated."""
    shape = tuple(reader.meta[key].global_shape)
    return shape, reader.meta[key].dtype, (0,) * len(shape), shape, None


def _object_payloads(src: Location, config: CheckpointingConfig, items: StoredItems, keys: List[str],
                     in_lists: bool = True) -> List[Tuple[str, bytes]]:
    """Every ShardedObject's stored bytes (each ``torch.save(obj)`` file wrapped into
    ``torch.save([obj])`` unless ``in_lists``), and the common state as the ``common_state`` object."""
    out = []
    for key in keys:
        at = items.object_locations.get(key)
        if at is None:
            raise CheckpointingException(f"{open_storage(src).describe('.metadata')} has no storage entry for object {key!r}")
        problem = items.range_problem(f"item {key!r}", at)
        if problem is not None:
            raise CheckpointingException(f"{src}: {problem}")
        if not in_lists:
            out.append((key, _as_object_payload(src, at.file)))
            continue
        file = open_storage(src).open_reader(at.file)
        try:
            out.append((key, file.read(at.offset, at.length)))
        finally:
            file.close()
    if config.common_backend is not None:
        if COMMON_STATE_OBJECT_KEY in keys:
            raise CheckpointingException(f"{src} has both {COMMON_STATE_FNAME} and a {COMMON_STATE_OBJECT_KEY!r} object")
        out.append((COMMON_STATE_OBJECT_KEY, _as_object_payload(src, COMMON_STATE_FNAME)))
    return out


def _as_object_payload(src: Location, name: str) -> bytes:
    """``torch.save([state])`` from the bytes of ``torch.save(state)``, without unpickling:
    the pickle is wrapped into a one-element list (EMPTY_LIST before it, APPEND after it;
    memo indices are unchanged) and the other records of the archive are copied."""
    data = read_file_verified(src, name)
    common_file = open_storage(src).describe(name)
    with malformed(f"{common_file} is not a torch.save file"):
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        records = reader.get_all_records()
        pickled = reader.get_record("data.pkl")
        if len(pickled) < 3 or pickled[0] != 0x80 or pickled[-1:] != b".":
            raise CheckpointingException(f"{common_file}: data.pkl is not a pickle (protocol 2 or later)")
        out = io.BytesIO()
        writer = torch._C.PyTorchFileWriter(out)
        for name in records:
            record = reader.get_record(name)
            if name == "data.pkl":
                record = pickled[:2] + b"]" + pickled[2:-1] + b"a."
            writer.write_record(name, record, len(record))
        writer.write_end_of_file()
        return out.getvalue()

