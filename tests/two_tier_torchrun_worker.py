"""A rank of the two-tier torchrun test (``tests/test_two_tier_torchrun.py``), launched with
torchrun's variables, one set of ranks per simulated node; the node's local directory is
``$TWO_TIER_NODE_DIR`` (set per node), nodes come from torchrun's ``LOCAL_WORLD_SIZE``.

``train ROOT STEPS OUT``: save steps 1..STEPS (local every step, persistent every 3);
``restore ROOT - OUT``: load and check bit-exactly. Each rank writes ``OUT/rank_{rank}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dist_checkpointing import CheckpointManager, ShardedObject, ShardedTensor


def state(rank: int, world: int, step: int, fill: bool = True) -> dict:
    gen = torch.Generator().manual_seed(100 * step + rank)
    local = torch.randn(1000, generator=gen) if fill else torch.zeros(1000)
    return {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world)),
            "rng": ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)), "step": step}


def main() -> None:
    mode, root, steps, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node_dir = os.environ["TWO_TIER_NODE_DIR"]
    report = {"rank": rank, "node_dir": node_dir, "group_rank": int(os.environ["GROUP_RANK"])}
    with CheckpointManager(root, save_interval_steps=3, local_dir=node_dir, local_interval=1,
                           replication_factor=2) as mgr:
        if mode == "train":
            for step in range(1, int(steps) + 1):
                mgr.save(step, state(rank, world, step))
            mgr.wait_until_finished()
            report["local_complete"] = mgr.local.complete
        else:
            newest = max((int(p.name.split("_")[1]) for p in Path(node_dir).glob("local_*")), default=None)
            report["own_copy_on_node"] = newest is not None and (
                Path(node_dir) / f"local_{newest:07d}" / f"rank_{rank:05d}.done").exists()
            loaded = mgr.load(state(rank, world, 0, fill=False))
            kind, step = mgr.restored_from
            expected = state(rank, world, step)
            report["restored_from"] = [kind, step]
            report["bit_exact"] = (torch.equal(loaded["w"], expected["w"].data) and loaded["step"] == step
                                   and loaded["rng"] == {"rank": rank, "step": step})
    Path(out, f"rank_{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
