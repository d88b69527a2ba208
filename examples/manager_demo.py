"""Checkpoint manager demo: train, get SIGKILLed mid-run, resume bit-exactly.

A small two-layer MLP is trained on 2 gloo ranks with tensor parallelism (the first
layer split by rows, the second by columns, the partial outputs summed by an
``all_reduce``) and SGD with momentum, whose buffers are sharded like the weights. The
batch of step ``s`` is drawn from a generator seeded with ``s``, so the run is a pure
function of the step.

1. **crash**: a run under a :class:`dist_checkpointing.CheckpointManager` (async saves
   every ``--interval`` steps, ``keep_last=2``), polling ``maybe_finalize()`` each step;
   at step ``--kill-at`` every rank SIGKILLs itself;
2. **resume**: a new run opens the manager on the same root, loads the newest complete
   checkpoint and trains on to the end, recording a hash of every rank's parameters and
   momenta at the step it resumed from and at the end;
3. **reference**: the same processes then train a fresh model from step 0 to the end
   without interruption; both hashes must equal the reference's at those steps, bit for bit.

Usage::

    python examples/manager_demo.py [--steps 300] [--interval 20] [--kill-at 170] [--dir DIR]

Prints ``manager demo OK`` and exits 0 only if everything matched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from dist_checkpointing import CheckpointManager, ShardedTensor

WORLD = 2
D_IN, HIDDEN, D_OUT, BATCH = 16, 64, 8, 32
LR, MOMENTUM = 0.05, 0.9
SEED = 1234


class ShardedMLP:
    """This rank's shards: ``w1`` rows and ``w2`` columns, and their momentum buffers."""

    def __init__(self, rank: int):
        gen = torch.Generator().manual_seed(SEED)
        full_w1 = torch.randn(HIDDEN, D_IN, generator=gen) / D_IN ** 0.5
        full_w2 = torch.randn(D_OUT, HIDDEN, generator=gen) / HIDDEN ** 0.5
        part = HIDDEN // WORLD
        self.rank = rank
        self.params = {"w1": full_w1[rank * part:(rank + 1) * part].clone(),
                       "w2": full_w2[:, rank * part:(rank + 1) * part].clone()}
        self.momenta = {k: torch.zeros_like(v) for k, v in self.params.items()}

    def sharded_state_dict(self, step: int) -> dict:
        """What the manager saves and loads: every tensor as this rank's ShardedTensor."""
        axes = {"w1": 0, "w2": 1}
        state: dict = {"step": step}
        for prefix, tensors in (("model", self.params), ("optimizer.momentum", self.momenta)):
            for name, t in tensors.items():
                state[f"{prefix}.{name}"] = ShardedTensor.from_rank_offsets(
                    f"{prefix}.{name}", t, (axes[name], self.rank, WORLD))
        return state

    def train_step(self, step: int) -> float:
        gen = torch.Generator().manual_seed(SEED + step)
        x = torch.randn(BATCH, D_IN, generator=gen)
        target = torch.randn(BATCH, D_OUT, generator=gen)
        w1 = self.params["w1"].requires_grad_(True)
        w2 = self.params["w2"].requires_grad_(True)
        partial = torch.relu(x @ w1.t()) @ w2.t()
        total = partial.detach().clone()
        dist.all_reduce(total)
        out = partial + (total - partial.detach())  # the sum over ranks; gradients flow to this rank's part
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        with torch.no_grad():
            for name, p in self.params.items():
                self.momenta[name].mul_(MOMENTUM).add_(p.grad)
                p.sub_(LR * self.momenta[name])
                p.grad = None
                p.requires_grad_(False)
        return loss.item()

    def digest(self) -> str:
        h = hashlib.sha256()
        for tensors in (self.params, self.momenta):
            for name in sorted(tensors):
                h.update(tensors[name].contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


def _all_ranks_here(out: str, rank: int) -> None:
    """Wait (through files, not a collective) until every rank has reached this point."""
    Path(out, f"at_kill_{rank}").touch()
    while not all(Path(out, f"at_kill_{r}").exists() for r in range(WORLD)):
        time.sleep(0.01)


def _rank_main(rank: int, port: int, phase: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = ShardedMLP(rank)
    report: Dict[str, object] = {}
    with CheckpointManager(args.root, save_interval_steps=args.interval, keep_last=2, async_save=True) as mgr:
        start = 0
        if phase == "resume":
            start = mgr.latest_step()
            loaded = mgr.load(model.sharded_state_dict(0))  # fills model's tensors in place
            assert loaded["step"] == start
            report.update(resumed_at=start, resumed_digest=model.digest(), found=mgr.all_steps())
        for step in range(start + 1, args.steps + 1):
            if phase == "crash" and step == args.kill_at:
                _all_ranks_here(out, rank)  # none is left inside a collective with a dead peer
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finalization: a real crash
            model.train_step(step)
            mgr.save(step, model.sharded_state_dict(step))
            mgr.maybe_finalize()
            if phase == "crash" and rank == 0:  # what the run knew to be complete when it died
                Path(out, "crash_latest.txt").write_text(str(mgr.latest_step()))
        mgr.wait_until_finished()
        report.update(final_digest=model.digest(), kept=mgr.all_steps())
    reference = ShardedMLP(rank)  # the uninterrupted run, from scratch
    digests = [reference.digest()]
    for step in range(1, args.steps + 1):
        reference.train_step(step)
        digests.append(reference.digest())
    report["reference"] = digests
    Path(out, f"{phase}_{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> multiprocessing.context.BaseContext:
    """Ranks forked from a server that imported torch and the library once (``forkserver``;
    ``spawn`` where there is none): each run starts its ranks in a fraction of a second."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "dist_checkpointing"])
    return ctx


def _run(phase: str, args: argparse.Namespace, out: str) -> List[Optional[int]]:
    """Run ``phase`` on WORLD ranks started afresh; their exit codes."""
    ctx = _context()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, phase, args, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)  # a hang fails the demo; a normal run takes seconds
        if p.exitcode is None:
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def _read(out: str, phase: str) -> List[dict]:
    return [json.loads(Path(out, f"{phase}_{r}.json").read_text()) for r in range(WORLD)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--kill-at", type=int, default=170)
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    args = parser.parse_args()
    if not 0 < args.interval < args.kill_at <= args.steps:
        parser.error("need 0 < --interval < --kill-at <= --steps")
    work = args.dir or tempfile.mkdtemp(prefix="manager_demo_")
    args.root = os.path.join(work, "checkpoints")
    t0 = time.perf_counter()
    try:
        codes = _run("crash", args, work)
        assert codes == [-signal.SIGKILL] * WORLD, f"the crash run was not SIGKILLed: exit codes {codes}"
        left = sorted(p.name for p in Path(args.root).iterdir())
        print(f"crash: every rank SIGKILLed itself at step {args.kill_at}; the root holds {left} "
              f"({time.perf_counter() - t0:.1f} s)")

        codes = _run("resume", args, work)
        assert codes == [0] * WORLD, f"resume run failed: exit codes {codes}"
        resumed = _read(work, "resume")
        reference = [r["reference"] for r in resumed]
        at = resumed[0]["resumed_at"]
        print(f"resume: complete checkpoints {resumed[0]['found']}; resumed from the newest, step {at} "
              f"(the last one the crash run had finalized)")
        for rank, r in enumerate(resumed):
            assert r["resumed_at"] == at
            assert r["resumed_digest"] == reference[rank][at], f"rank {rank}: state at step {at} differs"
            assert r["final_digest"] == reference[rank][args.steps], f"rank {rank}: final state differs"
            print(f"  rank {rank}: step {at} state {r['resumed_digest']} == uninterrupted run's; "
                  f"step {args.steps} state {r['final_digest']} == uninterrupted run's (bit-exact)")
        committed = int(Path(work, "crash_latest.txt").read_text())
        assert at == committed, f"resumed from {at}, but the crash run had committed step {committed}"
        print(f"kept after the run: {resumed[0]['kept']}")
        print(f"manager demo OK ({time.perf_counter() - t0:.1f} s)")
        return 0
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
