"""Zarr checkpoints in the layout Megatron-Core's ``zarr`` backend writes (uncompressed zarr
v2 arrays, C order, edge chunks padded), for tests and ``benchmarks/bench_zarr.py``."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Sequence

import torch

from dist_checkpointing.strategies.zarr import DTYPES


def write_array(root: Path, key: str, tensor: torch.Tensor, chunk_shape: Sequence[int], separator: str = ".",
                **overrides) -> None:
    """``tensor`` as a zarr v2 array ``root/key`` (uncompressed, C order, edge chunks padded
    with zeros), as Megatron-Core writes one; ``overrides`` replace ``.zarray`` fields."""
    names = {v: k for k, v in DTYPES.items()}
    chunks = tuple(chunk_shape)
    array_dir = root / key
    array_dir.mkdir(parents=True)
    meta = {"zarr_format": 2, "shape": list(tensor.shape), "chunks": list(chunks), "dtype": names[tensor.dtype],
            "compressor": None, "fill_value": None, "filters": None, "order": "C"}
    if separator != ".":
        meta["dimension_separator"] = separator
    meta.update(overrides)
    (array_dir / ".zarray").write_text(json.dumps(meta))
    grid = [range(math.ceil(s / c)) for s, c in zip(tensor.shape, chunks)] if tensor.dim() else [range(1)]
    for index in itertools.product(*grid):
        padded = torch.zeros(tuple(chunks), dtype=tensor.dtype)
        src = tensor[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunks))]
        padded[tuple(slice(0, s) for s in src.shape)] = src
        name = separator.join(map(str, index)) if tensor.dim() else "0"
        (array_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (array_dir / name).write_bytes(padded.reshape(-1).view(torch.uint8).numpy().tobytes())


def write_checkpoint(root: Path) -> None:
    """``metadata.json`` of a zarr checkpoint and a small ``common.pt`` in ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"iteration": 1}, root / "common.pt")
