"""Run by test_convert in a subprocess whose PYTHONPATH has megatron-core 0.19: Megatron-Core's
own torch_dist loader reads checkpoints this library wrote or converted (world 1).

Usage: python megatron19_peer_load.py SPEC_FILE

SPEC_FILE (torch.save) is a list of checkpoints to load, each a dict: ``dir``; ``tp`` (every
tensor is requested as the last of ``tp`` chunks along the first axis ``tp`` divides: another
TP than the save's);
``tensors`` ``{key: whole expected tensor}``; ``objects`` ``{unique key: expected data}``;
``common`` (the expected common state). Prints ``OK <dir>`` for each checkpoint that loads exactly.
"""

import os
import sys
import types

import numpy as np
import torch
import torch.distributed as dist

# CPU shims Megatron-Core needs without CUDA (the same the shared fixtures were made with).
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
np.product = np.prod


def _import_dist_checkpointing():
    """``megatron.core.dist_checkpointing`` without running ``megatron/core/__init__.py``
    (which needs triton in 0.19): bare package modules, as the fixtures were written."""
    import importlib.util

    site = next(p for p in sys.path if os.path.isdir(os.path.join(p, "megatron", "core")))
    for name, path in (("megatron", os.path.join(site, "megatron")),
                       ("megatron.core", os.path.join(site, "megatron", "core"))):
        module = types.ModuleType(name)
        module.__path__ = [path]
        sys.modules[name] = module
    assert importlib.util.find_spec("megatron.core.dist_checkpointing") is not None
    for name in ("megatron.core.tensor_parallel", "megatron.core.utils", "megatron.core.parallel_state"):
        __import__(name)
    from megatron.core import dist_checkpointing as mdc

    return mdc


def _check(mdc, entry) -> None:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    tp, request, expected = entry["tp"], {}, {}
    for key, full in entry["tensors"].items():  # split along the first axis tp divides (else whole)
        axis = next((a for a, n in enumerate(full.shape) if n % tp == 0), None)
        want = full if axis is None else full.chunk(tp, axis)[-1]
        offsets = () if axis is None else ((axis, tp - 1, tp),)
        request[key] = ShardedTensor.from_rank_offsets(key, torch.zeros_like(want), *offsets)
        expected[key] = want
    for unique_key in entry["objects"]:
        request[unique_key] = ShardedObject.empty_from_unique_key(unique_key)
    out = mdc.load(request, entry["dir"], validate_access_integrity=False)
    for key, want in expected.items():
        assert torch.equal(out[key], want), (key, out[key], want)
    for unique_key, want in entry["objects"].items():
        assert out[unique_key] == want, (unique_key, out[unique_key], want)
    common = mdc.load_common_state_dict(entry["dir"])
    assert common == entry["common"], (common, entry["common"])
    assert all(out[k] == v for k, v in entry["common"].items())
    assert set(mdc.load_tensors_metadata(entry["dir"])) == set(entry["tensors"])
    print("OK", entry["dir"], flush=True)


def main(spec_file: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mdc = _import_dist_checkpointing()
    for entry in torch.load(spec_file, weights_only=False):  # the test's own file (common states hold Namespaces)
        try:
            _check(mdc, entry)
        except Exception as e:  # noqa: BLE001 - reported per checkpoint
            print("FAILED", entry["dir"], f"{type(e).__name__}: {e}"[:2000], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
