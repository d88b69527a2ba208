"""Loading a Megatron-Core ``zarr`` checkpoint: this library vs the zarr package vs raw reads.

A GPT-like state (``--size-gib``, ``--layers``; the tensors of ``bench_save_load.py`` at
TP2, assembled into global tensors) is written in the layout Megatron-Core's zarr backend
writes (uncompressed zarr v2 arrays, one chunk per TP rank; ``tests/zarr_layout.py``),
then read in one process, with a warm page cache, two ways: every tensor whole
(consolidating, e.g. for export), and every TP rank's chunk of every tensor (``_tp``: what
the ranks of a job resumed at TP2 read, here in one process):

* ``ours``: ``dist_checkpointing.load`` (default ``ZarrLoadShardedStrategy``);
* ``zarr``: ``zarr.open(dir, "r")[region]`` per array or chunk into a NumPy array, then a
  tensor (``pip install "zarr<3" ml_dtypes``: left out when not installed; ``ml_dtypes``
  gives NumPy its ``bfloat16``);
* ``raw``: by hand, the least work: a chunk that is one contiguous run of its destination
  read straight into it, any other read into a buffer and copied into its strided place.

Methods run interleaved, ``--rounds`` rounds, medians.

Run: ``python benchmarks/bench_zarr.py [--size-gib 1.0] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch

from _common import add_scratch_and_output_flags, build_params, write_report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dist_checkpointing as dc  # noqa: E402
from dist_checkpointing import ShardedTensor  # noqa: E402
from tests.zarr_layout import write_array, write_checkpoint  # noqa: E402


def global_state(size_gib: float, layers: int) -> Dict[str, Tuple[torch.Tensor, Tuple[int, ...]]]:
    """The global tensors of the TP2 state, each with its TP chunk shape."""
    ranks = [build_params(size_gib, rank, 2, layers=layers) for rank in range(2)]
    out = {}
    for p0, p1 in zip(*ranks):
        if p0.tp_axis is None:
            out[p0.key] = (p0.tensor, tuple(p0.tensor.shape))
        else:
            out[p0.key] = (torch.cat([p0.tensor, p1.tensor], dim=p0.tp_axis), tuple(p0.tensor.shape))
    return out


def _ours(ckpt: Path, shapes: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(s, dtype=d)) for k, (s, d) in shapes.items()}
    return dc.load(request, str(ckpt))


def _zarr(ckpt: Path, shapes: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    import zarr

    out = {}
    for key, (_, dtype) in shapes.items():
        values = zarr.open(str(ckpt / key), "r")[...]
        out[key] = torch.from_numpy(values.view("<u2")).view(torch.bfloat16) if dtype == torch.bfloat16 \
            else torch.from_numpy(values)
    return out


def _chunks(layout: Dict[str, tuple]) -> list:
    """``(key, grid index, region slices, chunk shape)`` of every chunk: each TP rank's share."""
    out = []
    for key, (shape, _, chunks) in layout.items():
        for index in itertools.product(*[range(-(-s // c)) for s, c in zip(shape, chunks)]):
            out.append((key, index, tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunks)), chunks))
    return out


def _ours_chunks(ckpt: Path, layout: Dict[str, tuple]) -> Dict[tuple, torch.Tensor]:
    """Every TP rank's request (its chunk of each tensor) in one load: as a resumed job reads."""
    request = {}
    for key, index, _, chunks in _chunks(layout):
        shape, dtype, _ = layout[key]
        offsets = [(axis, i, n // c) for axis, (i, n, c) in enumerate(zip(index, shape, chunks)) if n != c]
        request[(key, index)] = ShardedTensor.from_rank_offsets(key, torch.empty(chunks, dtype=dtype), *offsets)
    flat = dc.load({str(k): v for k, v in request.items()}, str(ckpt), validate_access_integrity=False)
    return {k: flat[str(k)] for k in request}


def _zarr_chunks(ckpt: Path, layout: Dict[str, tuple]) -> Dict[tuple, torch.Tensor]:
    import zarr

    out = {}
    for key, index, region, _ in _chunks(layout):
        values = zarr.open(str(ckpt / key), "r")[region]
        out[(key, index)] = torch.from_numpy(values.view("<u2")).view(torch.bfloat16) \
            if layout[key][1] == torch.bfloat16 else torch.from_numpy(values)
    return out


def _raw_chunks(ckpt: Path, layout: Dict[str, tuple]) -> Dict[tuple, torch.Tensor]:
    """Each chunk file read straight into a new tensor of its shape."""
    out = {}
    for key, index, _, chunks in _chunks(layout):
        t = out[(key, index)] = torch.empty(chunks, dtype=layout[key][1])
        with open(ckpt / key / ".".join(map(str, index)), "rb", buffering=0) as f:
            f.readinto(t.reshape(-1).view(torch.uint8).numpy())
    return out


def _raw(ckpt: Path, layout: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    """Each global tensor assembled by hand from its chunk files (see the module)."""
    out = {}
    for key, (shape, dtype, chunks) in layout.items():
        full = torch.empty(shape, dtype=dtype)
        grid = [range(-(-s // c)) for s, c in zip(shape, chunks)]
        for index in itertools.product(*grid):
            dest = full[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunks))]
            with open(ckpt / key / ".".join(map(str, index)), "rb", buffering=0) as f:
                if dest.is_contiguous():
                    f.readinto(dest.reshape(-1).view(torch.uint8).numpy())
                else:
                    buf = torch.empty(chunks, dtype=dtype)
                    f.readinto(buf.reshape(-1).view(torch.uint8).numpy())
                    dest.copy_(buf)
        out[key] = full
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    add_scratch_and_output_flags(ap, ROOT / "benchmarks" / "scratch_zarr", ROOT / "benchmarks" / "results" / "zarr.json")
    args = ap.parse_args()
    started = datetime.datetime.now()
    state = global_state(args.size_gib, args.layers)
    ckpt = Path(args.dir) / "ckpt"
    shutil.rmtree(args.dir, ignore_errors=True)
    write_checkpoint(ckpt)
    for key, (tensor, chunk) in state.items():
        write_array(ckpt, key, tensor, chunk)
    shapes = {k: (tuple(t.shape), t.dtype) for k, (t, _) in state.items()}
    layout = {k: (tuple(t.shape), t.dtype, chunk) for k, (t, chunk) in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t, _ in state.values())
    methods: Dict[str, Callable[[], object]] = {
        "ours": lambda: _ours(ckpt, shapes), "raw": lambda: _raw(ckpt, layout),
        "ours_tp": lambda: _ours_chunks(ckpt, layout), "raw_tp": lambda: _raw_chunks(ckpt, layout)}
    try:
        import ml_dtypes  # noqa: F401 - NumPy's bfloat16, for zarr
        import zarr  # noqa: F401

        methods["zarr"] = lambda: _zarr(ckpt, shapes)
        methods["zarr_tp"] = lambda: _zarr_chunks(ckpt, layout)
    except ImportError:
        print("zarr (or ml_dtypes) not installed: the zarr package is left out")
    for name, method in methods.items():  # correct, and the page cache warm
        loaded = method()
        if name.endswith("_tp"):
            assert all(torch.equal(loaded[(k, i)], state[k][0][region]) for k, i, region, _ in _chunks(layout)), name
        else:
            assert all(torch.equal(loaded[k], t) for k, (t, _) in state.items()), name
    times: Dict[str, list] = {name: [] for name in methods}
    order = list(methods)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            t = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"state {nbytes / 2**30:.3f} GiB in {len(state)} arrays ({sum(len(list((ckpt / k).iterdir())) - 1 for k in state)} chunk files), "
          f"{args.rounds} rounds, medians; load average {os.getloadavg()[0]:.1f}")
    print(f"{'method':<8} {'load s':>8} {'GB/s':>6}")
    for name, s in med.items():
        print(f"{name:<8} {s:8.3f} {nbytes / s / 1e9:6.2f}")
    ratios = {"ours / raw": med["ours"] / med["raw"], "ours_tp / raw_tp": med["ours_tp"] / med["raw_tp"]}
    if "zarr" in med:
        ratios["zarr / ours"] = med["zarr"] / med["ours"]
        ratios["zarr_tp / ours_tp"] = med["zarr_tp"] / med["ours_tp"]
    print("ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in ratios.items()))
    path = write_report(args.output, started, vars(args), "results",
                        {"bytes": nbytes, "seconds": times, "medians": med, "ratios": ratios})
    print(f"wrote {path}")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
