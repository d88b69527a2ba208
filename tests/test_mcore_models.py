"""Megatron-Core's own model and optimizer code on this package, through the switch: every
test runs with Megatron-Core 0.15.3 and again with 0.19.2.

Every rank puts ``MCORE_SITE`` or ``MCORE19_SITE`` (the test-time peers, tests/peers.py) on
``sys.path`` and calls
``dist_checkpointing.megatron.install()`` before importing Megatron, so Megatron-Core's
``GPTModel`` (local, non-TE layer spec), its ``FP32Optimizer`` wrapper and Megatron-LM's way of
calling ``save`` / ``load`` / ``MCoreTensorAwareStateDict`` run unchanged on this package, on
CPU with gloo. A small model: hidden 64, 2 layers, 4 heads, vocab 128.

The oracle is independent of the load path: the test assembles every global tensor from
the pieces the saving ranks hand in (their ``ShardedTensor`` data, replicas checked equal,
the cover checked complete), then checks every piece of every parameter and optimizer
state that the loading ranks' model and optimizer hold, bit-exact (``torch.equal``). The
loading model is initialised with another seed, so a load that did nothing fails.

The ranks run in this module's own pools (1, 2 and 4 ranks), not the session's shared
ones: a rank that imported Megatron-Core keeps it, and other test modules check that their
ranks have no Megatron module imported.

CPU workarounds (in the test only; Megatron's source is not changed):

- ``model_parallel_cuda_manual_seed`` is not called (it needs CUDA); the models are built
  with ``use_cpu_initialization=True`` after ``torch.manual_seed``, which is all the CPU
  initialisation uses. No forward pass is run.
- ``FP32Optimizer.__init__`` puts its loss scale on ``device='cuda'``: the test uses a
  subclass whose ``__init__`` does what the original does with the scale on the CPU; its
  ``state_dict``, ``sharded_state_dict`` and ``load_state_dict`` are Megatron-Core's.
- ``DistributedOptimizer`` needs DDP grad buffers (CUDA streams, ``torch.cuda`` device
  placement): its test runs only where CUDA is available and skips otherwise.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
from typing import Dict, List, Tuple

import pytest
import torch

from .dist_pool import OwnPools
from .peers import require

_TIMEOUT = 240.0
HIDDEN, LAYERS, HEADS, VOCAB, SEQ = 64, 2, 4, 128, 32

Piece = Tuple[str, Tuple[int, ...], tuple, torch.Tensor, object]  # key, global shape, index, data, replica id


@pytest.fixture(scope="module", params=["MCORE_SITE", "MCORE19_SITE"], ids=["mcore015", "mcore019"])
def mcore_pools(request):
    """Each Megatron-Core version in pools of its own (a rank keeps the Megatron it imported)."""
    site = require(request.param)
    pools = OwnPools()
    yield site, pools.get
    pools.close()


# ----------------------------------------------------------------------------- rank side


def _megatron(site: str, tp: int, pp: int):
    """The switch, then Megatron's parallel state for ``tp`` x ``pp`` (data parallel: the rest)."""
    if site not in sys.path:
        sys.path.append(site)
    import numpy as np

    np.product = np.prod  # removed from NumPy 2, still used by Megatron-Core
    import dist_checkpointing.megatron as dm

    dm.install()
    from megatron.core import parallel_state as ps

    import megatron.core.dist_checkpointing as m
    import dist_checkpointing

    assert m is dist_checkpointing
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return ps


def _gpt(ps, seed: int, tp: int, pp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def _init_adam_state(optimizer, config=None) -> None:
    """Zero Adam moments for parameters without state (what Megatron's ``init_state_fn`` does)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if len(optimizer.state[p]) == 0:
                optimizer.state[p]["exp_avg"] = torch.zeros_like(p.data)
                optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def _fp32_optimizer(model, step: bool):
    """Megatron-Core's ``FP32Optimizer`` over Adam with Megatron's parameter groups (loss
    scale on the CPU); one step taken
    with gradients that are a function of the parameter values (equal on replicas)."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    class CpuFP32Optimizer(FP32Optimizer):
        def __init__(self, optimizer, config, init_state_fn):  # noqa: D401 - FP32Optimizer's, scale on CPU
            MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
            self._scale = torch.tensor([1.0], dtype=torch.float)
            self.is_stub_optimizer = optimizer is None

    config = OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=torch.float32, clip_grad=0.0)
    # Megatron's parameter groups (weight-decay and no-weight-decay, with their multipliers)
    if "lr_mult" in inspect.signature(_get_param_groups).parameters:  # Megatron-Core 0.15
        groups = _get_param_groups([model], None, None, lr_mult=1.0, lr=1e-2, min_lr=0.0, decoupled_lr=None,
                                   decoupled_min_lr=None)
    else:  # 0.19: from the optimizer config
        groups = _get_param_groups([model], config, None)
    adam = torch.optim.Adam(groups, lr=1e-2)
    opt = CpuFP32Optimizer(adam, config, _init_adam_state)
    if step:
        for p in model.parameters():
            p.grad = torch.sin(3 * p.detach()) + 0.5
        opt.step()
        opt.zero_grad()
    return opt


def _pieces(sharded_state_dict) -> List[Piece]:
    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.dict_utils import nested_values

    return [(sh.key, tuple(sh.global_shape), sh.global_slice(), sh.data.detach().clone(), sh.replica_id)
            for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]


def _strategies(ps, fully_parallel: bool):
    if not fully_parallel:
        return None, None
    from dist_checkpointing.serialization import get_default_load_sharded_strategy, get_default_save_sharded_strategy
    from dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper,
    )

    group = ps.get_data_parallel_group(with_context_parallel=True)
    return (FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group),
            lambda ckpt: FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(ckpt), group))


def _save_rank(rank, world, site, tp, pp, ckpt, fully_parallel):
    """Build, step and save model + optimizer as Megatron-LM does; hand in every piece."""
    ps = _megatron(site, tp, pp)
    import megatron.core.dist_checkpointing as mdc

    model = _gpt(ps, 1234, tp, pp)
    opt = _fp32_optimizer(model, step=True)
    model_sd = model.sharded_state_dict()
    state = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd), "iteration": 7}
    save_strategy, _ = _strategies(ps, fully_parallel)
    mdc.save(state, ckpt, save_strategy)
    return _pieces(state)


def _load_rank(rank, world, site, tp, pp, ckpt, fully_parallel):
    """A fresh model (another seed) and optimizer at another layout, loaded as Megatron-LM
    loads; hand in what the model and the optimizer then hold, and what they held before."""
    ps = _megatron(site, tp, pp)
    import megatron.core.dist_checkpointing as mdc

    model = _gpt(ps, 99, tp, pp)
    opt = _fp32_optimizer(model, step=False)
    before = _pieces(model.sharded_state_dict())
    model_sd = model.sharded_state_dict()
    request = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)}
    _, load_strategy = _strategies(ps, fully_parallel)
    loaded = mdc.load(request, ckpt, load_strategy(ckpt) if load_strategy else None)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    steps = {int(s["step"]) for s in opt.optimizer.state.values()}
    after_sd = model.sharded_state_dict()
    return before, _pieces({"model": after_sd, "optimizer": opt.sharded_state_dict(after_sd)}), \
        loaded["iteration"], steps


# ----------------------------------------------------------------------------- test side


def _assemble(per_rank: List[List[Piece]]) -> Dict[str, torch.Tensor]:
    """The global tensors the pieces cover: replicas equal, every element covered."""
    globals_: Dict[str, torch.Tensor] = {}
    for pieces in per_rank:
        for key, shape, index, data, _ in pieces:
            glob = globals_.setdefault(key, torch.full(shape, math.nan, dtype=data.dtype))
            target = glob[index]
            seen = ~torch.isnan(target)
            assert torch.equal(target[seen], data[seen]), f"replicas of {key} differ"
            target.copy_(data)
    for key, glob in globals_.items():
        assert not torch.isnan(glob).any(), f"{key} is not covered"
    return globals_


def _check(globals_: Dict[str, torch.Tensor], per_rank: List[List[Piece]]) -> int:
    checked = 0
    for pieces in per_rank:
        for key, shape, index, data, _ in pieces:
            assert key in globals_, f"{key} was not saved"
            assert tuple(globals_[key].shape) == shape, key
            assert torch.equal(globals_[key][index], data), f"{key}{index} differs"
            checked += 1
    return checked


# (save layout, load layout): (tp, pp) each; the world is the pool's
LAYOUTS = [
    pytest.param((2, 1, 2), (1, 1, 1), False, id="tp2_w2-to-tp1_w1"),
    pytest.param((1, 1, 1), (2, 2, 4), False, id="tp1_w1-to-tp2pp2_w4"),
    pytest.param((2, 2, 4), (1, 2, 2), False, id="tp2pp2_w4-to-pp2_w2"),
    pytest.param((1, 2, 2), (4, 1, 4), False, id="pp2_w2-to-tp4_w4"),
    pytest.param((1, 1, 4), (2, 1, 4), True, id="dp4_w4-to-tp2dp2_w4-fully_parallel"),
]


@pytest.mark.parametrize("save_layout,load_layout,fully_parallel", LAYOUTS)
def test_gpt_and_optimizer_reshard_bit_exact(mcore_pools, tmp_path, save_layout, load_layout, fully_parallel):
    site, get = mcore_pools
    ckpt = str(tmp_path / "ckpt")
    (stp, spp, sworld), (ltp, lpp, lworld) = save_layout, load_layout
    saved = get(sworld).run(_save_rank, site, stp, spp, ckpt, fully_parallel, timeout=_TIMEOUT)
    globals_ = _assemble(saved)
    model_keys = {k for k in globals_ if not k.startswith("optimizer.")}
    assert "decoder.layers.self_attention.linear_qkv.weight" in model_keys and "output_layer.weight" in model_keys
    assert {f"optimizer.state.{m}.{k}" for k in model_keys for m in ("exp_avg", "exp_avg_sq")} <= set(globals_)

    results = get(lworld).run(_load_rank, site, ltp, lpp, ckpt, fully_parallel, timeout=_TIMEOUT)
    befores = [r[0] for r in results]
    assert any(not torch.equal(globals_[k][i], d) for pieces in befores for k, _, i, d, _ in pieces), \
        "the fresh model already held the saved values: the test could not fail"
    loaded = [r[1] for r in results]
    assert _check(globals_, loaded) >= len(model_keys)
    assert {k for pieces in loaded for k, *_ in pieces} == set(globals_)  # every key, both layouts together
    assert all(r[2] == 7 and r[3] == {1} for r in results)


# ----------------------------------------------------------------------------- MCoreTensorAwareStateDict


def _tasd_rank(rank, world, site, tp, pp, algo):
    """Megatron-LM's local checkpointing path: the state as a tensor-aware state dict, its
    tensors popped and put back (as the local checkpoint manager does), then loaded into a
    fresh model and optimizer of the same layout."""
    from dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    ps = _megatron(site, tp, pp)
    model = _gpt(ps, 1234, tp, pp)
    opt = _fp32_optimizer(model, step=True)
    model_sd = model.sharded_state_dict()
    state = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd), "iteration": 3}
    expected = _pieces(state)
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo=algo)
    tensors = [t.clone() for t in tasd.pop_tensors()]
    tasd.insert_tensors(tensors)

    fresh = _gpt(ps, 99, tp, pp)
    fresh_opt = _fp32_optimizer(fresh, step=False)
    fresh_sd = fresh.sharded_state_dict()
    request = {"model": fresh_sd, "optimizer": fresh_opt.sharded_state_dict(fresh_sd, is_loading=True)}
    loaded = tasd.to_state_dict(request, algo=algo)
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optimizer"])
    after_sd = fresh.sharded_state_dict()
    got = _pieces({"model": after_sd, "optimizer": fresh_opt.sharded_state_dict(after_sd)})
    assert [(k, i) for k, _, i, _, _ in got] == [(k, i) for k, _, i, _, _ in expected]
    bad = [k for (k, _, _, a, _), (_, _, _, b, _) in zip(got, expected) if not torch.equal(a, b)]
    assert not bad and loaded["iteration"] == 3, bad
    return len(tensors), len(expected)


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 1, 2), (2, 2, 4), (1, 1, 4)],
                         ids=["tp1_w1", "tp2_w2", "tp2pp2_w4", "dp4_w4"])
@pytest.mark.parametrize("algo", ["atomic", "fully_parallel"])
def test_tensor_aware_state_dict_round_trip_with_gpt(mcore_pools, layout, algo):
    site, get = mcore_pools
    tp, pp, world = layout
    counts = get(world).run(_tasd_rank, site, tp, pp, algo, timeout=_TIMEOUT)
    kept, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if algo == "atomic" or world == 1:
        assert kept == total  # every rank keeps all its tensors
    else:  # fully_parallel: a tensor replicated over ranks (data parallel, or TP-replicated norms) is kept once
        assert kept < total


# ----------------------------------------------------------------------------- needs CUDA


def _distopt_rank(rank, world, site, ckpt, save):
    """Megatron-Core's DDP + DistributedOptimizer on CUDA: save after a step, or load into a
    fresh one; hand in every ShardedTensor (flattened ones as their slices) on the CPU."""
    ps = _megatron(site, 1, 1)
    import megatron.core.dist_checkpointing as mdc
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from dist_checkpointing import ShardedTensor
    from dist_checkpointing.dict_utils import nested_values

    torch.cuda.set_device(0)
    model = _gpt(ps, 1234 if save else 99, 1, 1).cuda()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [ddp])
    if save:
        for p in ddp.parameters():
            p.main_grad.copy_(torch.sin(3 * p.detach()) + 0.5)
        opt.step()
    metadata = {"distrib_optim_sharding_type": "fully_sharded_model_space"}
    model_sd = ddp.sharded_state_dict()
    state = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=not save, metadata=metadata)}
    if save:
        mdc.save(state, ckpt)
    else:
        loaded = mdc.load(state, ckpt)
        ddp.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        model_sd = ddp.sharded_state_dict()
        state = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=metadata)}
    return {(sh.key, tuple(sh.global_offset), repr(sh.flattened_range)): sh.data.detach().cpu().clone()
            for sh in nested_values(state) if isinstance(sh, ShardedTensor)}


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Megatron-Core's DistributedOptimizer needs DDP grad buffers on a CUDA device "
                           "(torch.cuda streams and device placement); CPU-only here")
def test_distributed_optimizer_round_trip_on_cuda(mcore_pools, tmp_path):
    site, get = mcore_pools
    ckpt = str(tmp_path / "ckpt")
    [saved] = get(1).run(_distopt_rank, site, ckpt, True, timeout=_TIMEOUT)
    [loaded] = get(1).run(_distopt_rank, site, ckpt, False, timeout=_TIMEOUT)
    assert set(loaded) == set(saved) and any(k[0].startswith("optimizer.") for k in saved)
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == []
