"""Async save of a plain PyTorch DCP checkpoint (Megatron-LM's ``--ckpt-format torch_dcp
--async-save``): this library's ``FileSystemWriterAsync`` + ``state_dict_saver`` vs PyTorch
DCP's own ``async_save``, with DCP's synchronous ``save`` as the floor.

One process, a GPT-like CPU state (``--size-gib``, the tensors of ``bench_save_load.py``),
a new directory per save. For each method: the **blocking** time (until the trainer may
change its tensors: ours, the plan and the host snapshot; DCP's, ``async_save`` returning)
and the **total** time (until the checkpoint is complete, ``.metadata`` written). Methods
run interleaved, ``--rounds`` rounds, medians; the page cache is dropped of each checkpoint
(``fsync``, then deleted) before the next save; the order of the methods rotates by one
each round.

* ``ours``: ``save_state_dict_async_plan``, the writer's function in an ``AsyncCallsQueue``
  (one background thread, as Megatron-LM runs it), ``save_state_dict_async_finalize``; the
  default snapshot (a forked copy-on-write writer);
* ``ours_copy``: the same with ``FileSystemWriterAsync(async_snapshot="copy")`` (host copies,
  written by this process);
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` (its default stager), then
  ``.result()``;
* ``dcp_sync``: ``torch.distributed.checkpoint.save`` (blocking = total).

Run: ``python benchmarks/bench_dcp_async.py [--size-gib 1.0] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch
import torch.distributed.checkpoint as dcp

from _common import add_scratch_and_output_flags, build_params, fsync_path, write_report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dist_checkpointing.runtime.async_request import AsyncRequest  # noqa: E402
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from dist_checkpointing.strategies.dcp.async_save import (  # noqa: E402
    save_state_dict_async_finalize, save_state_dict_async_plan)
from dist_checkpointing.strategies.dcp.async_writer import FileSystemWriterAsync  # noqa: E402


def ours(state: Dict[str, torch.Tensor], path: Path, queue: AsyncCallsQueue,
         snapshot: str = "auto") -> Tuple[float, float]:
    start = time.perf_counter()
    writer = FileSystemWriterAsync(path, thread_count=2, async_snapshot=snapshot)
    planned = save_state_dict_async_plan(state, writer)
    fn, _, args = writer.get_save_function_and_args()
    queue.schedule_async_request(AsyncRequest(fn, args, [lambda: save_state_dict_async_finalize(*planned)]))
    blocking = time.perf_counter() - start
    queue.maybe_finalize_async_calls(blocking=True)
    return blocking, time.perf_counter() - start


def dcp_async(state: Dict[str, torch.Tensor], path: Path, _queue: object) -> Tuple[float, float]:
    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(path))
    blocking = time.perf_counter() - start
    future.result()
    return blocking, time.perf_counter() - start


def dcp_sync(state: Dict[str, torch.Tensor], path: Path, _queue: object) -> Tuple[float, float]:
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=str(path))
    total = time.perf_counter() - start
    return total, total


METHODS: Dict[str, Callable[..., Tuple[float, float]]] = {
    "ours": ours, "ours_copy": lambda state, path, queue: ours(state, path, queue, "copy"),
    "dcp_async": dcp_async, "dcp_sync": dcp_sync}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    add_scratch_and_output_flags(ap, ROOT / "benchmarks" / "scratch_dcp_async",
                                 ROOT / "benchmarks" / "results" / "dcp_async.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    started = datetime.datetime.now()
    state = {p.key: p.tensor for p in build_params(args.size_gib, 0, 1)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    scratch = Path(args.dir)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    queue = AsyncCallsQueue(persistent=True)
    times: Dict[str, list] = {m: [] for m in METHODS}
    print(f"{nbytes / 2**30:.2f} GiB in {len(state)} tensors; load average before {os.getloadavg()[0]:.2f}")
    names = list(METHODS)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated by one each round
            path = scratch / f"{name}_{r}"
            times[name].append(METHODS[name](state, path, queue))
            fsync_path(path)
            shutil.rmtree(path)
    queue.close()
    print(f"load average after {os.getloadavg()[0]:.2f}")
    results = {}
    for name, samples in times.items():
        blocking = statistics.median(b for b, _ in samples)
        total = statistics.median(t for _, t in samples)
        results[name] = {"blocking_s": blocking, "total_s": total, "total_gb_s": nbytes / total / 1e9}
    for name, res in results.items():
        print(f"{name:10s} blocking {res['blocking_s']:.3f} s  total {res['total_s']:.3f} s "
              f"({res['total_gb_s']:.2f} GB/s)  total vs dcp_async {res['total_s'] / results['dcp_async']['total_s']:.2f}x "
              f" blocking vs dcp_async {res['blocking_s'] / results['dcp_async']['blocking_s']:.2f}x")
    shutil.rmtree(scratch, ignore_errors=True)
    print("wrote", write_report(args.output, started, vars(args), "results", results))


if __name__ == "__main__":
    main()
