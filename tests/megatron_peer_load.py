"""Run by test_megatron_interop in a subprocess whose PYTHONPATH has megatron-core 0.15:
Megatron-Core's own torch_dist loader reads checkpoints this library wrote (world 1).

Usage: python megatron_peer_load.py CHECKPOINT_DIR WORLD_SAVED [CHECKPOINT_DIR WORLD_SAVED ...]
Prints ``MEGATRON LOAD OK <WORLD_SAVED>`` for each checkpoint that loads as expected, else
its traceback; exits 1 if any did not.
"""

import os
import sys
import traceback

import numpy as np
import torch
import torch.distributed as dist

# CPU shims Megatron-Core needs without CUDA (the same the shared fixtures were made with).
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
np.product = np.prod


def check(ckpt: str, world_saved: int) -> None:
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    rows = 2 * world_saved
    full_w = torch.arange(rows * 8.0).reshape(rows, 8)
    full_q = torch.arange(3 * 4 * 2, dtype=torch.bfloat16).reshape(3, 4, 2)
    request = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(rows // 2, 8), (0, 1, 2)),
        "q": [ShardedTensor.from_rank_offsets("q", torch.zeros(4, 2, dtype=torch.bfloat16), (0, i, 3),
                                              prepend_axis_num=1) for i in range(3)],
        "o": ShardedObject("o", None, (world_saved,), (world_saved - 1,)),
        # another grid (TP1: the whole tensor flattened) and other slice boundaries: a
        # single-process Megatron-Core cannot request one chunk of a multi-chunk flat grid
        "opt": ShardedTensor.from_rank_offsets_flat("opt", torch.zeros(9), (rows, 8),
                                                    flattened_range=slice(rows * 8 - 12, rows * 8 - 3)),
    }
    out = mdc.load(request, ckpt, validate_access_integrity=False)
    assert torch.equal(out["w"], full_w[rows // 2:]), out["w"]
    assert all(torch.equal(out["q"][i], full_q[i]) for i in range(3))
    assert out["o"] == {"piece": world_saved - 1}, out["o"]
    assert torch.equal(out["opt"], full_w.flatten()[rows * 8 - 12:rows * 8 - 3]), out["opt"]
    assert out["step"] == 9 and mdc.load_content_metadata(ckpt) == {"by": "dist_checkpointing"}
    assert set(mdc.load_tensors_metadata(ckpt)) == {"w", "q", "opt"}
    print(f"MEGATRON LOAD OK {world_saved}", flush=True)


def main(pairs) -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    failed = 0
    for ckpt, world_saved in pairs:
        try:
            check(ckpt, int(world_saved))
        except Exception:  # noqa: BLE001 - reported, the next checkpoint still checked
            traceback.print_exc()
            failed += 1
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main(zip(sys.argv[1::2], sys.argv[2::2])))
