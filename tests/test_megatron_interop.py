"""Megatron-Core (a test-time peer only) reads what this library writes.

Megatron-Core 0.15 is installed by the test session into a separate directory
(``MCORE_SITE``, tests/peers.py), never into the library's environment; the check runs in a
subprocess with that directory on its PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor

from .conftest import get_pool

from .helpers import slack
from .peers import require


def _save(rank, world, ckpt):
    rows = 2 * world
    full_w = torch.arange(rows * 8.0).reshape(rows, 8)
    full_q = torch.arange(3 * 4 * 2, dtype=torch.bfloat16).reshape(3, 4, 2)
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", full_w[rank * 2:(rank + 1) * 2].clone(), (0, rank, world)),
        "q": [ShardedTensor.from_rank_offsets("q", full_q[i].clone(), (0, i, 3), replica_id=rank, prepend_axis_num=1)
              for i in range(3)],
        "o": ShardedObject("o", {"piece": rank}, (world,), (rank,)),
        "step": 9,
        # distributed-optimizer state: TP chunk of rows, every rank's slice is [0,5) and [5,16)
        "opt": [ShardedTensor.from_rank_offsets_flat("opt", full_w[rank * 2:(rank + 1) * 2].flatten()[a:b].clone(),
                                                     (2, 8), (0, rank, world), replica_id=0, flattened_range=slice(a, b))
                for a, b in ((0, 5), (5, 16))],
    }
    dc.save(sd, ckpt, content_metadata={"by": "dist_checkpointing"})


@pytest.fixture(scope="module")
def megatron_loads(tmp_path_factory) -> subprocess.CompletedProcess:
    """Checkpoints saved at world 1 and 2, then loaded by Megatron-Core in ONE peer process."""
    args = []
    for world in (1, 2):
        ckpt = tmp_path_factory.mktemp(f"world{world}") / "ckpt"
        get_pool(world).run(_save, str(ckpt))
        args += [str(ckpt), str(world)]
    env = {**os.environ, "PYTHONPATH": require("MCORE_SITE"), "MASTER_PORT": str(29000 + os.getpid() % 1000)}
    return subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_peer_load.py")), *args],
                          env=env, capture_output=True, text=True, timeout=slack(300))


@pytest.mark.parametrize("world", [1, 2])
def test_megatron_core_015_loads_our_checkpoint(world, megatron_loads):
    assert f"MEGATRON LOAD OK {world}\n" in megatron_loads.stdout, megatron_loads.stderr[-4000:]
