"""A newer Megatron-LM through the switch: Megatron-Core 0.19.2's names and its trainer's
async path on this package.

* Megatron-LM's own ``megatron/training/async_utils.py`` (shipped in the 0.19.2 wheel) runs
  unchanged at world 2 on gloo: ``init_persistent_async_worker`` (the queue, the writer
  started with the trainer's priorities), ``schedule_async_save`` of what ``save`` returns
  with the trainer's arguments, ``maybe_finalize_async_save`` and
  ``reset_persistent_async_worker``, for both ``async_strategy`` names; the checkpoints are
  loaded back with the trainer's load strategy and compared with the state at each save;
  and its ``torch_dcp`` async path (``get_save_and_finalize_callbacks`` over this library's
  ``FileSystemWriterAsync``), a failed write raised on every rank.
* Megatron-LM's own ``save_checkpoint`` / ``load_checkpoint`` (``megatron/training/checkpointing.py``,
  arguments parsed by its own parser) save a GPTModel, its FP32Optimizer and scheduler at
  one layout, sync or async, and load them at another, bit-exact (CPU shims:
  tests/mcore19_env.py).
* Megatron-Core 0.19's ``gpt_checkpoint_interop`` (Megatron-Core's own module, imported by
  the switch from the installed Megatron-Core) retargets a hybrid model's request at a GPT
  checkpoint this library wrote, and the load fills it.
* ``benchmarks/mcore_api_diff.py`` finds nothing that Megatron-Core 0.19's or Megatron-LM's
  code imports missing or differing.

The ranks run in this module's own pool (they import Megatron-Core 0.19).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Tuple

import pytest
import torch

from . import launch
from .dist_pool import OwnPools
from .helpers import slack
from .peers import require

ROOT = Path(__file__).resolve().parents[1]
_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def mcore19():
    site = require("MCORE19_SITE")
    pools = OwnPools()
    yield site, pools.get
    pools.close()


# ----------------------------------------------------------------------------- the trainer's async path


def _state(mdc, rank: int, world: int, step: int):
    """A rank's sharded state at ``step``: a TP-like split, a replicated tensor, an object."""
    weight = torch.arange(16 * 6, dtype=torch.float32).reshape(16, 6) * (step + 1)
    bias = torch.full((5,), float(step), dtype=torch.bfloat16)
    mine = weight.chunk(world)[rank].clone()
    return {
        "weight": mdc.ShardedTensor.from_rank_offsets("decoder.weight", mine, (0, rank, world)),
        "bias": mdc.ShardedTensor.from_rank_offsets("decoder.bias", bias.clone(), replica_id=rank),
        "rng": mdc.ShardedObject("rng_state", {"step": step, "rank": rank}, (world,), (rank,), replica_id=0),
        "iteration": step,
    }


def _async_args(args, name: str) -> None:
    """The trainer's arguments its async helpers read (--async-save with a persistent worker)."""
    args.__dict__.update(async_save=True, async_strategy=name, use_persistent_ckpt_worker=True,
                         async_ckpt_use_cpu_shm=False, async_ckpt_cpu_priority=10, async_ckpt_io_priority=3)


def _trainer_rank(rank: int, world: int, site: str, root: str, name: str):
    from .mcore19_env import ARGS, megatron19

    au, mdc = megatron19(site)
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy)
    from dist_checkpointing.runtime.persistent_worker import shared_worker

    _async_args(ARGS, name)
    nice_before = os.nice(0)
    au.init_persistent_async_worker(rank, "forkserver")  # what megatron/training/initialize.py calls
    pid = shared_worker().pid
    qos = (os.getpriority(os.PRIO_PROCESS, pid),
           subprocess.run(["ionice", "-p", str(pid)], capture_output=True, text=True).stdout.strip())

    # as megatron/training/checkpointing.py builds and calls them
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(cpu_shm_mode=False), None, True)
    expected = {}
    for step in (1, 2):
        state = _state(mdc, rank, world, step)
        request = mdc.save(state, f"{root}/iter_{step}", strategy, async_sharded_save=True,
                           validate_access_integrity=step == 1, preprocess_common_before_consistancy_check=None,
                           content_metadata={"step": step}, async_strategy=name, verify_integrity=False)
        au.schedule_async_save(request)
        expected[step] = {k: v.data.clone() for k, v in state.items() if k in ("weight", "bias")}
        for k in ("weight", "bias"):
            state[k].data.add_(1000)  # the trainer's next step: the checkpoint keeps the values at the call
        au.maybe_finalize_async_save(blocking=False)
    au.maybe_finalize_async_save(blocking=True, terminate=True)
    assert au.is_empty_async_queue()

    for step in (1, 2):
        request = _state(mdc, rank, world, 0)
        for k in ("weight", "bias"):
            request[k].data.zero_()
        load_strategy = FullyParallelLoadStrategyWrapper(
            TorchDistLoadShardedStrategy(cache_metadata=True, stream_ckpt_dequant=True), None,
            exchange_algo="broadcast")
        loaded = mdc.load(request, f"{root}/iter_{step}", load_strategy, validate_access_integrity=True,
                          strict="assume_ok_unexpected", verify_integrity=False)
        for k in ("weight", "bias"):
            assert torch.equal(loaded[k], expected[step][k]), (step, k)
        assert loaded["rng"] == {"step": step, "rank": rank}
        assert mdc.load_content_metadata(f"{root}/iter_{step}") == {"step": step}
    au.reset_persistent_async_worker(name)  # an in-process restart: queue closed, metadata cache cleared
    return nice_before, qos


@pytest.mark.parametrize("name", ["mcore", "nvrx"])
def test_megatron_lm_async_utils_run_on_this_package(mcore19, tmp_path, name):
    site, get = mcore19
    results = get(2).run(_trainer_rank, site, str(tmp_path), name, timeout=_TIMEOUT)
    for nice_before, (writer_nice, writer_io) in results:
        assert writer_nice == max(10, nice_before), results  # the trainer's --async-ckpt-cpu-priority
        assert writer_io == "idle", results  # its --async-ckpt-io-priority 3


def _dcp_rank(rank: int, world: int, site: str, root: str, name: str, fail_rank: int):
    """Megatron-LM's ``--ckpt-format torch_dcp --async-save`` path, as checkpointing.py runs it."""
    import torch.distributed.checkpoint as dcp

    from .mcore19_env import ARGS, megatron19

    au, mdc = megatron19(site)
    _async_args(ARGS, name)
    au.init_persistent_async_worker(rank, "forkserver")
    _, modules = mdc.strategies.torch.get_async_strategy(name)
    state = {f"layer{rank}.weight": torch.randn(64, 33), "shared.bias": torch.arange(7, dtype=torch.bfloat16),
             "step": 3, "extra": {"tokens": [7, "x"]}}
    expected = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
    ckpt = f"{root}/iter_0000003"
    writer = modules["FileSystemWriterAsync"](ckpt, thread_count=2, use_msc=False)
    if rank == fail_rank:  # before the snapshot (a forked writer may start at once): this rank's first file fails
        os.makedirs(f"{ckpt}/__{rank}_0.distcp")
    plan = modules["save_state_dict_async_plan"](state, writer, None, 0, planner=dcp.DefaultSavePlanner(),
                                                 enable_cache=False)
    request = au.get_save_and_finalize_callbacks(writer, plan, name)
    au.schedule_async_save(request)
    for v in state.values():
        if torch.is_tensor(v):
            v.add_(1)  # the next training step: the checkpoint keeps the values at the save
    try:
        au.maybe_finalize_async_save(blocking=True)
    except mdc.CheckpointingException as e:
        assert not os.path.exists(f"{ckpt}/.metadata")
        return str(e)
    finally:
        au.reset_persistent_async_worker(name)
    out = {k: torch.zeros_like(v) for k, v in expected.items() if torch.is_tensor(v)}
    out.update(step=0, extra={"tokens": None})
    dcp.load(out, checkpoint_id=ckpt)  # plain PyTorch DCP reads it
    for k, v in expected.items():
        assert torch.equal(out[k], v) if torch.is_tensor(v) else out[k] == v, (k, out[k], v)
    return "ok"


@pytest.mark.parametrize("name", ["mcore", "nvrx"])
def test_megatron_lm_torch_dcp_async_save_runs_on_this_package(mcore19, tmp_path, name):
    site, get = mcore19
    assert get(2).run(_dcp_rank, site, str(tmp_path), name, -1, timeout=_TIMEOUT) == ["ok", "ok"]


def test_megatron_lm_torch_dcp_async_save_failure_raised_on_every_rank(mcore19, tmp_path):
    site, get = mcore19
    errors = get(2).run(_dcp_rank, site, str(tmp_path), "mcore", 1, timeout=_TIMEOUT)
    for error in errors:
        assert "rank 1" in error and "__1_0.distcp" in error, errors


# ----------------------------------------------------------------------------- the trainer's save/load_checkpoint


def _pretrain_rank(rank: int, world: int, site: str, root: str, tp: int, save: bool, async_save: bool,
                   extra: Tuple[str, ...] = ()):
    """Megatron-LM's own ``save_checkpoint`` / ``load_checkpoint`` of a GPTModel and its
    FP32Optimizer (Adam) and scheduler, with arguments parsed as ``pretrain_gpt.py`` parses them."""
    from . import test_mcore_models as tm
    from .mcore19_env import megatron19, trainer_args

    au, _ = megatron19(site)
    import megatron.training.checkpointing as ck
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    argv = ["--num-layers", str(tm.LAYERS), "--hidden-size", str(tm.HIDDEN), "--num-attention-heads", str(tm.HEADS),
            "--seq-length", str(tm.SEQ), "--max-position-embeddings", str(tm.SEQ), "--vocab-size", str(tm.VOCAB),
            "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "1", "--lr", "0.01", "--train-iters", "10",
            "--save-interval", "5", "--save", root, "--load", root, "--ckpt-format", "torch_dist",
            "--tensor-model-parallel-size", str(tp), "--use-cpu-initialization", "--transformer-impl", "local",
            "--no-gradient-accumulation-fusion", "--no-save-rng", "--no-load-rng"]
    if async_save:
        argv += ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]
    argv += list(extra)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    trainer_args(argv)
    ps = tm._megatron(site, tp, 1)
    if async_save:
        au.init_persistent_async_worker(rank, "forkserver")  # as megatron/training/initialize.py does
    model = tm._gpt(ps, 1234 if save else 99, tp, 1)
    opt = tm._fp32_optimizer(model, step=save)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=0.01, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10,
                                    lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=10,
                                    wd_incr_style="constant")
    if save:
        context: dict = {}  # kept across saves, as the trainer keeps it (its cached strategy and structure)
        for iteration in (5, 10):
            if iteration == 10:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)  # a later step
                if async_save:
                    au.maybe_finalize_async_save(blocking=True)
            ck.save_checkpoint(iteration, [model], opt, sched, 0, checkpointing_context=context)
        model_sd = model.sharded_state_dict()
        pieces = tm._pieces({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)})
        if async_save:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # the next training step, while the checkpoint is written
            au.maybe_finalize_async_save(blocking=True, terminate=True)
        return pieces
    before = tm._pieces(model.sharded_state_dict())
    iteration, _ = ck.load_checkpoint([model], opt, sched, checkpointing_context={})  # the latest: 10
    after_sd = model.sharded_state_dict()
    return before, tm._pieces({"model": after_sd, "optimizer": opt.sharded_state_dict(after_sd)}), iteration, \
        {int(st["step"]) for st in opt.optimizer.state.values()}


# (argparse keeps the last --async-strategy: this variant runs the trainer's "nvrx" branches)
_CONSTANT = ("--ckpt-assume-constant-structure", "--ckpt-fully-parallel-load", "--async-strategy", "nvrx")


@pytest.mark.parametrize("save_layout,load_layout,async_save,extra", [
    pytest.param((2, 2), (1, 1), False, (), id="tp2_w2-to-tp1_w1"),
    pytest.param((1, 2), (2, 2), True, (), id="dp2_w2-async-to-tp2_w2"),
    pytest.param((1, 2), (1, 2), True, _CONSTANT, id="dp2_w2-async-nvrx-constant-structure-fully-parallel-load"),
])
def test_megatron_lm_save_and_load_checkpoint(mcore19, tmp_path, save_layout, load_layout, async_save, extra):
    from . import test_mcore_models as tm

    site, get = mcore19
    (stp, sworld), (ltp, lworld) = save_layout, load_layout
    saved = get(sworld).run(_pretrain_rank, site, str(tmp_path), stp, True, async_save, extra, timeout=_TIMEOUT)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert (tmp_path / "iter_0000005" / ".metadata").is_file() and (tmp_path / "iter_0000010" / ".metadata").is_file()
    globals_ = tm._assemble(saved)
    results = get(lworld).run(_pretrain_rank, site, str(tmp_path), ltp, False, False, extra, timeout=_TIMEOUT)
    assert any(not torch.equal(globals_[k][i], d) for r in results for k, _, i, d, _ in r[0]), \
        "the fresh model already held the saved values: the test could not fail"
    loaded = [r[1] for r in results]
    assert tm._check(globals_, loaded) > 0 and {k for pieces in loaded for k, *_ in pieces} == set(globals_)
    assert all(r[2] == 10 and r[3] == {1} for r in results)


# ----------------------------------------------------------------------------- gpt_checkpoint_interop

PATTERN = "M*-M*-"  # Mamba, attention, MLP, Mamba, attention, MLP: 2 GPT layers


def _interop_rank(rank: int, world: int, site: str, root: str):
    from .mcore19_env import megatron19

    _, mdc = megatron19(site)
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
        gpt_compatible_layer_maps, retarget_sharded_state_dict_to_gpt_checkpoint)
    import megatron.core.dist_checkpointing.gpt_checkpoint_interop as interop

    assert interop.__file__.startswith(site) and interop.ShardedTensor is mdc.ShardedTensor
    layers = 2
    qkv = torch.randn(layers, 8, 6, generator=torch.Generator().manual_seed(1))
    fc1 = torch.randn(layers, 4, 10, generator=torch.Generator().manual_seed(2))
    norm = torch.randn(6, generator=torch.Generator().manual_seed(3))
    # a GPT checkpoint as GPTModel saves it: homogeneous layers, the layer a prepended axis, TP on the last axis
    gpt = {"norm": mdc.ShardedTensor.from_rank_offsets("decoder.final_layernorm.weight", norm.clone(),
                                                       replica_id=rank)}
    for i in range(layers):
        gpt[f"qkv{i}"] = mdc.ShardedTensor.from_rank_offsets(
            "decoder.layers.self_attention.linear_qkv.weight", qkv[i].chunk(world, 1)[rank].clone(),
            (0, i, layers), (2, rank, world), prepend_axis_num=1)
        gpt[f"fc1{i}"] = mdc.ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.linear_fc1.weight", fc1[i].chunk(world, 0)[rank].clone(),
            (0, i, layers), (1, rank, world), prepend_axis_num=1)
    mdc.save(gpt, f"{root}/gpt")

    # the hybrid run's request: its own layer numbering, Mamba layers that GPT does not have
    fresh = torch.full((3, 3), 7.0)
    hybrid = {"decoder.final_norm.weight": mdc.ShardedTensor.from_rank_offsets(
        "decoder.final_norm.weight", torch.zeros(6), replica_id=rank)}
    for h in range(len(PATTERN)):
        if PATTERN[h] == "*":
            hybrid[h] = mdc.ShardedTensor.from_rank_offsets(
                f"decoder.layers.{h}.self_attention.linear_qkv.weight", torch.zeros(8, 6 // world), (1, rank, world))
        elif PATTERN[h] == "-":
            hybrid[h] = mdc.ShardedTensor.from_rank_offsets(
                f"decoder.layers.{h}.mlp.linear_fc1.weight", torch.zeros(4 // world, 10), (0, rank, world))
        else:
            hybrid[h] = mdc.ShardedTensor.from_rank_offsets(
                f"decoder.layers.{h}.mixer.in_proj.weight", fresh.clone(), replica_id=rank)
    retarget_sharded_state_dict_to_gpt_checkpoint(hybrid, gpt_compatible_layer_maps(PATTERN))
    loaded = mdc.load(hybrid, f"{root}/gpt", strict="raise_unexpected")
    assert torch.equal(loaded["decoder.final_norm.weight"], norm)
    assert torch.equal(loaded[1], qkv[0].chunk(world, 1)[rank]) and torch.equal(loaded[4], qkv[1].chunk(world, 1)[rank])
    assert torch.equal(loaded[2], fc1[0].chunk(world, 0)[rank]) and torch.equal(loaded[5], fc1[1].chunk(world, 0)[rank])
    assert torch.equal(loaded[0], fresh) and torch.equal(loaded[3], fresh)  # Mamba layers keep their values
    return True


def test_gpt_checkpoint_interop_retargets_onto_this_package(mcore19, tmp_path):
    site, get = mcore19
    assert get(2).run(_interop_rank, site, str(tmp_path), timeout=_TIMEOUT) == [True, True]


# ----------------------------------------------------------------------------- the name comparison


def test_api_diff_against_megatron_core_019_finds_nothing_user_code_imports_missing(mcore19):
    site, _ = mcore19
    code = f"""
        import contextlib, io, json, sys; sys.path.insert(0, 'benchmarks')
        import mcore_api_diff
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            status = mcore_api_diff.main(['--user-only', '--check', '--mcore-site', {site!r}])
        print(json.dumps({{"out": buf.getvalue(), "status": status}}))
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = launch.run(["-c", textwrap.dedent(code)], env=env, cwd=ROOT, timeout=slack(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == 0 and result["out"].strip().endswith(
        "user-imported names missing or differing: 0"), result["out"]
    assert "gpt_checkpoint_interop" in result["out"] and "strategies.nvrx" in result["out"]
