"""What checking a ``.metadata`` field by field costs, next to reading it.

Builds the DCP metadata of a large checkpoint (``--keys`` tensors of ``--chunks`` chunks
each, with item checksums), pickles it, and times, interleaved over ``--rounds`` rounds:
unpickling it (what every reader pays) and ``check_dcp_metadata`` on the result.

    python benchmarks/bench_metadata_checks.py            # --keys 300 --chunks 512 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)

from dist_checkpointing.strategies.torch_dist.metadata_checks import check_dcp_metadata  # noqa: E402


def build(keys: int, chunks: int) -> Metadata:
    """Metadata of ``keys`` tensors of shape (chunks, 64), one row per chunk, one file per chunk index."""
    sdm, storage, sums = {}, {}, {}
    for k in range(keys):
        key = f"layers.{k}.weight"
        sdm[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([chunks, 64]),
                                         [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 64]))
                                          for i in range(chunks)])
        for i in range(chunks):
            storage[MetadataIndex(key, torch.Size([i, 0]))] = _StorageInfo(f"__{i}_0.distcp", k * 1024, 1024)
            sums[(f"__{i}_0.distcp", k * 1024)] = (k * chunks + i) * 2654435761 % (1 << 64)
    metadata = Metadata(sdm, storage_data=storage)
    metadata.checksums = {"algorithm": "xxh3_64", "scope": "record", "items": sums}
    return metadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    blob = pickle.dumps(build(args.keys, args.chunks))
    load_s, check_s = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        metadata = pickle.loads(blob)
        load_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        check_dcp_metadata(metadata, "bench")
        check_s.append(time.perf_counter() - start)
    load, check = statistics.median(load_s), statistics.median(check_s)
    print(f"{args.keys * args.chunks} chunks, .metadata of {len(blob) / 2**20:.1f} MiB, {args.rounds} rounds, medians: "
          f"unpickle {load:.3f} s, check {check:.3f} s (check / unpickle = {check / load:.2f}); "
          f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
