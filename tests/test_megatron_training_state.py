"""A Megatron-LM training checkpoint loads with the default (safe) settings.

The state is built as Megatron-LM's trainer builds it: ``args`` (an ``argparse.Namespace``
with torch dtypes, lists, ``None`` and Megatron enums), ``iteration``, ``checkpoint_version``,
the RNG states as a ShardedObject over PP x TP, the rerun state machine's state (enums and
named tuples), optimizer param groups, state and config, and Transformer Engine's
``_extra_state`` as an ``io.BytesIO``. The classes are look-alikes installed under
Megatron's and TE's real module names in the saving process only; the loading processes
cannot import them, so they get the library's stand-ins. It is saved at TP=2 and loaded at
TP=4 and TP=1. A hostile object in each of those positions is refused without running.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import io
import logging
import os
import random
import shlex
import sys
import types
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.pickling import safe_globals
from dist_checkpointing.pickling.safe_load import safe_torch_load

from .conftest import get_pool

_TIMEOUT = 60.0
_LAYERS = 2
_MODULES = ("megatron", "megatron.core", "megatron.core.enums", "megatron.core.transformer",
            "megatron.core.transformer.enums", "megatron.core.rerun_state_machine", "megatron.core.optimizer",
            "megatron.core.optimizer.optimizer_config", "transformer_engine", "transformer_engine.common",
            "transformer_engine.common.recipe")


# ----------------------------------------------------------------------------- look-alike classes


def _install_lookalikes(**extra) -> types.SimpleNamespace:
    """Megatron-Core / TE look-alike classes, as modules of their real names in sys.modules.

    ``extra`` changes the look-alikes for the mismatch tests (an enum member, a named
    tuple's fields, a config field that the library's stand-ins do not know)."""
    assert not any(m in sys.modules for m in _MODULES), "a real or leftover megatron module is imported"
    mods = {name: types.ModuleType(name) for name in _MODULES}
    sys.modules.update(mods)

    def put(module: str, *classes: type) -> None:
        for cls in classes:
            cls.__module__, cls.__qualname__ = module, cls.__name__
            setattr(mods[module], cls.__name__, cls)

    model_type_members = {"encoder_or_decoder": 1, "encoder_and_decoder": 2, **extra.get("ModelType", {})}
    ModelType = enum.Enum("ModelType", model_type_members)
    AttnBackend = enum.Enum("AttnBackend", {"flash": 1, "fused": 2, "unfused": 3, "local": 4, "auto": 5})
    AttnMaskType = enum.Enum("AttnMaskType", {"padding": 1, "causal": 2, "no_mask": 3})
    CudaGraphScope = enum.Enum("CudaGraphScope", {"full_iteration": 1, "attn": 2, "mlp": 3})
    put("megatron.core.enums", ModelType)
    put("megatron.core.transformer.enums", AttnBackend, AttnMaskType, CudaGraphScope)

    class RerunMode(str, enum.Enum):
        DISABLED = "disabled"
        VALIDATE_RESULTS = "validate_results"

    class RerunState(enum.Enum):
        NOT_RUNNING_YET = 0
        WILL_RERUN_FROM_CHECKPOINT = 3

    class RerunDiagnostic(str, enum.Enum):
        TRANSIENT_ERROR = "transient_error"

    Caller = NamedTuple("Caller", [(f, object) for f in extra.get("Caller", ("message", "rank"))])

    class Call(NamedTuple):
        caller: object
        sequence: int

    put("megatron.core.rerun_state_machine", RerunMode, RerunState, RerunDiagnostic, Caller, Call)

    OptimizerConfig = dataclasses.make_dataclass("OptimizerConfig", [
        ("lr", Optional[float], None), ("weight_decay", float, 0.01), ("bf16", bool, False),
        ("params_dtype", torch.dtype, torch.float32), ("adam_beta2", float, 0.999),
        ("use_distributed_optimizer", bool, False), ("clip_grad", float, 1.0),
        *[(f, object, None) for f in extra.get("OptimizerConfig", ())]])
    put("megatron.core.optimizer.optimizer_config", OptimizerConfig)

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    put("transformer_engine.common.recipe", _FormatHelper)
    Format = enum.Enum("Format", {"E4M3": _FormatHelper(448, 448), "HYBRID": _FormatHelper(448, 57344)})

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: object = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"

    put("transformer_engine.common.recipe", Format, DelayedScaling)
    return types.SimpleNamespace(**{k: v for k, v in locals().items() if isinstance(v, type)})


def _remove_lookalikes() -> None:
    for name in _MODULES:
        sys.modules.pop(name, None)


@pytest.fixture
def lookalikes():
    """``_install_lookalikes`` in this process, removed after the test."""
    yield _install_lookalikes
    _remove_lookalikes()


# ----------------------------------------------------------------------------- the training state


class Evil:
    """Unpickling this runs ``touch <marker>`` (a stand-in for arbitrary code)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


class EvilConfig:
    """A config class whose ``__setstate__`` would run ``touch <marker>``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __setstate__(self, state):
        os.system(f"touch {shlex.quote(state['marker'])}")


def _weight(layer: int) -> torch.Tensor:
    return torch.arange(32.0).reshape(8, 4) * (layer + 1)


def _rng_state(tp_rank: int) -> dict:
    """What Megatron's ``get_rng_state`` holds for one rank, after seeding with its TP rank."""
    random.seed(1000 + tp_rank)
    np.random.seed(1000 + tp_rank)
    torch.manual_seed(1000 + tp_rank)
    tracker = torch.Generator().manual_seed(2000 + tp_rank)
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
            "rng_tracker_states": {"model-parallel-rng": tracker.get_state()}, "generator": tracker}


def _extra_state(layer: int, classes: types.SimpleNamespace) -> io.BytesIO:
    """TE's ``_extra_state`` (before TE 1.6): a ``torch.save`` of the FP8 meta in a BytesIO."""
    buf = io.BytesIO()
    torch.save({"recipe": classes.DelayedScaling(margin=layer), "scale_fwd": torch.full((3,), 0.5 + layer),
                "amax_history_fwd": torch.zeros(4, 3)}, buf)
    buf.seek(0)
    return buf


def _sharded(tp_rank: int, tp: int, classes: Optional[types.SimpleNamespace], evil_at: Optional[str] = None,
             marker: str = "") -> dict:
    """The sharded part of the state at (PP=1, TP=tp); ``classes`` None: a load request."""
    rows = 8 // tp
    fill = classes is not None
    model, state = {}, {}
    for layer in range(_LAYERS):
        key = f"decoder.layers.{layer}.self_attention.linear_qkv.weight"
        w = _weight(layer)[tp_rank * rows:(tp_rank + 1) * rows] if fill else torch.empty(rows, 4)
        model[key] = ShardedTensor.from_rank_offsets(key, w, (0, tp_rank, tp))
        avg = w * 0.1 if fill else torch.empty(rows, 4)
        state[layer] = {"exp_avg": ShardedTensor.from_rank_offsets(f"optimizer.state.exp_avg.{key}", avg,
                                                                   (0, tp_rank, tp)),
                        "step": torch.tensor(7.0)}
        extra = (Evil(marker) if evil_at == "extra_state" else _extra_state(layer, classes)) if fill else None
        model[f"decoder.layers.{layer}.self_attention.linear_qkv._extra_state"] = ShardedObject(
            "decoder.layers.self_attention.linear_qkv._extra_state", extra, (_LAYERS,), (layer,),
            replica_id=(0, tp_rank, 0))
    rng = ([_rng_state(tp_rank)] if evil_at != "rng" else [{"np_rng_state": Evil(marker)}]) if fill else None
    return {
        "model": model,
        "optimizer": {"optimizer": {"state": state}},
        "rng_state": ShardedObject("rng_state", rng, (1, tp), (0, tp_rank), replica_id=0),
        "rerun_state_machine": {"sharded": ShardedObject(
            "rerun_state_machine_state", _rerun_sharded(tp_rank, classes) if fill else None, (tp,), (tp_rank,))},
    }


def _rerun_sharded(rank: int, c: types.SimpleNamespace) -> dict:
    return {"rerun_requested": False, "checkpoint_requested": True,
            "error_injector_checkpoint": {"injected_error_type": c.RerunDiagnostic.TRANSIENT_ERROR},
            "failed_validation_call": c.Call(c.Caller("loss is NaN", rank), 2), "initial_result": 1.5,
            "suspicious_node": None, "data_iterator_checkpoints": None, "large_value_counts": {"loss": 1}}


def _common(c: types.SimpleNamespace, evil_at: Optional[str], marker: str) -> dict:
    args = argparse.Namespace(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1, num_layers=_LAYERS, params_dtype=torch.bfloat16,
        model_type=c.ModelType.encoder_or_decoder, attention_backend=c.AttnBackend.flash,
        cuda_graph_scope=[c.CudaGraphScope.attn, c.CudaGraphScope.mlp], lr=3e-4, lr_warmup_fraction=None,
        data_path=["1.0", "/data/corpus_text_document"], save=Path("/ckpt/run1"), fp8="hybrid")
    if evil_at == "args":
        args.tokenizer = Evil(marker)
    config = EvilConfig(marker) if evil_at == "optimizer_config" else c.OptimizerConfig(
        lr=3e-4, weight_decay=0.1, bf16=True, params_dtype=torch.bfloat16, adam_beta2=0.95)
    return {
        "args": args, "iteration": 1000, "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 1.5e18,
        "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": 128000, "decay_style": "cosine"},
        "rerun_state_machine": {"mode": c.RerunMode.VALIDATE_RESULTS,
                                "state": c.RerunState.WILL_RERUN_FROM_CHECKPOINT, "current_iteration": 999},
        "optimizer": {"optimizer": {"param_groups": [
            {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
             "params": [0, 1], "wd_mult": 1.0, "is_decoupled_lr": False}]},
            "grad_scaler": None, "config": config},
    }


def _save(rank: int, world: int, ckpt: str, evil_at: Optional[str] = None, marker: str = "") -> bool:
    classes = _install_lookalikes()
    try:
        state = _sharded(rank, world, classes, evil_at, marker)
        for key, value in _common(classes, evil_at, marker).items():  # merged as Megatron's trainer does
            state.setdefault(key, {})
            if isinstance(value, dict) and isinstance(state[key], dict):
                _merge(state[key], value)
            else:
                state[key] = value
        dc.save(state, ckpt)
        if evil_at:
            return True
        # while the classes are importable, loading gives the real classes back, not stand-ins
        common = dc.load_common_state_dict(ckpt)
        assert common["args"].attention_backend is classes.AttnBackend.flash
        assert type(common["optimizer"]["config"]) is classes.OptimizerConfig
        return True
    finally:
        _remove_lookalikes()


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


# ----------------------------------------------------------------------------- checks on load


def _check_stand_in(value, full_name: str, name: str, member_value) -> None:
    assert f"{type(value).__module__}.{type(value).__qualname__}" == full_name
    assert (value.name, value.value) == (name, member_value)


def _load(rank: int, world: int, ckpt: str) -> bool:
    """Load at TP=world with default settings, the look-alikes not importable, check everything."""
    assert not any(m in sys.modules for m in _MODULES)  # the library imports no Megatron / TE either
    request = _sharded(rank, world, None)
    # the RNG states (PP x TP of the save) are read by the ranks of the same TP rank at save
    request["rng_state"] = ShardedObject("rng_state", None, (1, 2), (0, rank % 2), replica_id=rank // 2)
    request["rerun_state_machine"]["sharded"] = ShardedObject(
        "rerun_state_machine_state", None, (2,), (rank % 2,), replica_id=rank // 2)
    out = dc.load(request, ckpt)
    assert not any(m in sys.modules for m in _MODULES)
    rows = 8 // world
    for layer in range(_LAYERS):
        key = f"decoder.layers.{layer}.self_attention.linear_qkv.weight"
        expected = _weight(layer)[rank * rows:(rank + 1) * rows]
        assert torch.equal(out["model"][key], expected)
        assert torch.equal(out["optimizer"]["optimizer"]["state"][layer]["exp_avg"], expected * 0.1)
        extra = out["model"][f"decoder.layers.{layer}.self_attention.linear_qkv._extra_state"]
        assert isinstance(extra, io.BytesIO)
        meta = safe_torch_load(extra.getvalue(), "extra state")  # as a tool decoding TE's FP8 meta would
        assert torch.equal(meta["scale_fwd"], torch.full((3,), 0.5 + layer))
        recipe = meta["recipe"]
        assert type(recipe).__module__ == "transformer_engine.common.recipe" and recipe.margin == layer
        _check_stand_in(recipe.fp8_format, "transformer_engine.common.recipe.Format", "HYBRID", (448, 57344))
        assert recipe.fp8_format.value.max_bwd == 57344 and recipe.unknown_fields() == []
    _check_args(out["args"])
    assert (out["iteration"], out["checkpoint_version"]) == (1000, 3.0)
    assert out["num_floating_point_operations_so_far"] == 1.5e18
    _check_rng(out["rng_state"], rank % 2)
    _check_rerun(out["rerun_state_machine"], rank % 2)
    _check_optimizer(out["optimizer"])
    return True


def _check_args(args) -> None:
    assert type(args) is argparse.Namespace
    assert args.params_dtype is torch.bfloat16 and args.lr_warmup_fraction is None
    assert args.data_path == ["1.0", "/data/corpus_text_document"] and args.save == Path("/ckpt/run1")
    _check_stand_in(args.model_type, "megatron.core.enums.ModelType", "encoder_or_decoder", 1)
    _check_stand_in(args.attention_backend, "megatron.core.transformer.enums.AttnBackend", "flash", 1)
    assert [(s.name, s.value) for s in args.cuda_graph_scope] == [("attn", 2), ("mlp", 3)]
    assert (args.tensor_model_parallel_size, args.num_layers, args.fp8) == (2, _LAYERS, "hybrid")


def _check_rng(rng, tp_rank: int) -> None:
    expected = _rng_state(tp_rank)
    [got] = rng
    assert got["random_rng_state"] == expected["random_rng_state"]
    np_got, np_exp = got["np_rng_state"], expected["np_rng_state"]
    assert np_got[0] == np_exp[0] and np.array_equal(np_got[1], np_exp[1]) and np_got[2:] == np_exp[2:]
    assert torch.equal(got["torch_rng_state"], expected["torch_rng_state"]) and got["cuda_rng_state"] is None
    assert torch.equal(got["rng_tracker_states"]["model-parallel-rng"],
                       expected["rng_tracker_states"]["model-parallel-rng"])
    assert torch.equal(got["generator"].get_state(), expected["generator"].get_state())


def _check_rerun(rerun: dict, rank: int) -> None:
    _check_stand_in(rerun["mode"], "megatron.core.rerun_state_machine.RerunMode",
                    "VALIDATE_RESULTS", "validate_results")
    assert rerun["mode"] == "validate_results"  # a (str, Enum) stand-in is a str
    _check_stand_in(rerun["state"], "megatron.core.rerun_state_machine.RerunState",
                    "WILL_RERUN_FROM_CHECKPOINT", 3)
    sharded = rerun["sharded"]
    call = sharded["failed_validation_call"]
    assert type(call).__qualname__ == "Call" and call._fields == ("caller", "sequence")
    assert call.sequence == 2 and call.caller._fields == ("message", "rank")
    assert tuple(call.caller) == ("loss is NaN", rank)
    _check_stand_in(sharded["error_injector_checkpoint"]["injected_error_type"],
                    "megatron.core.rerun_state_machine.RerunDiagnostic", "TRANSIENT_ERROR", "transient_error")
    assert sharded["checkpoint_requested"] is True and sharded["large_value_counts"] == {"loss": 1}


def _check_optimizer(optimizer: dict) -> None:
    [group] = optimizer["optimizer"]["param_groups"]
    assert group["betas"] == (0.9, 0.95) and group["params"] == [0, 1] and group["weight_decay"] == 0.1
    assert optimizer["optimizer"]["state"][0]["step"].item() == 7.0 and optimizer["grad_scaler"] is None
    config = optimizer["config"]
    assert f"{type(config).__module__}.{type(config).__qualname__}" == (
        "megatron.core.optimizer.optimizer_config.OptimizerConfig")
    assert vars(config) == {"lr": 3e-4, "weight_decay": 0.1, "bf16": True, "params_dtype": torch.bfloat16,
                            "adam_beta2": 0.95, "use_distributed_optimizer": False, "clip_grad": 1.0}
    assert config.unknown_fields() == []


def test_megatron_training_state_loads_by_default_at_another_tp(tmp_path):
    ckpt = str(tmp_path / "iter_0001000")
    assert get_pool(2).run(_save, ckpt, timeout=_TIMEOUT) == [True, True]
    assert get_pool(4).run(_load, ckpt, timeout=_TIMEOUT) == [True] * 4
    assert get_pool(1).run(_load, ckpt, timeout=_TIMEOUT) == [True]


# ----------------------------------------------------------------------------- hostile objects


def _load_default(rank: int, world: int, ckpt: str) -> bool:
    dc.load(_sharded(rank, world, None), ckpt)
    return True


@pytest.mark.parametrize("position,culprit", [
    ("args", "common.pt"), ("optimizer_config", "common.pt"), ("rng", "rng_state/shard_"),
    ("extra_state", "_extra_state/shard_")])
def test_hostile_object_in_each_position_is_refused_without_running(position, culprit, tmp_path):
    pool, ckpt, marker = get_pool(2), str(tmp_path / "ckpt"), tmp_path / "marker"
    assert pool.run(_save, ckpt, position, str(marker), timeout=_TIMEOUT) == [True, True]
    excs = pool.run_expect_error(_load_default, ckpt, timeout=_TIMEOUT)
    blocked = "test_megatron_training_state.EvilConfig" if position == "optimizer_config" else "posix.system"
    assert len(excs) == 2
    for e in excs:
        assert isinstance(e, CheckpointingException), f"{type(e).__name__}: {e}"
        assert culprit in str(e) and blocked in str(e) and "allow_pickle" in str(e), str(e)
    assert not marker.exists()


# ----------------------------------------------------------------------------- stand-ins, registration


@dataclasses.dataclass
class Tokenizer:
    """A user's class: refused by default, loadable once registered."""

    vocab: int


def _pickled(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_real_class_when_imported_stand_in_otherwise(lookalikes):
    c = lookalikes()
    data = _pickled({"m": c.ModelType.encoder_and_decoder, "cfg": c.OptimizerConfig(lr=1.0)})
    loaded = safe_torch_load(data, "x")
    assert loaded["m"] is c.ModelType.encoder_and_decoder and type(loaded["cfg"]) is c.OptimizerConfig
    _remove_lookalikes()
    loaded = safe_torch_load(data, "x")
    _check_stand_in(loaded["m"], "megatron.core.enums.ModelType", "encoder_and_decoder", 2)
    assert loaded["cfg"].lr == 1.0 and loaded["cfg"] == safe_torch_load(data, "x")["cfg"]


@pytest.mark.parametrize("extra,build,message", [
    ({"ModelType": {"retro_future": 9}}, lambda c: c.ModelType.retro_future,
     "megatron.core.enums.ModelType has no member with value 9"),
    ({"Caller": ("filename", "lineno", "rank")}, lambda c: c.Caller("train.py", 3, 0),
     "megatron.core.rerun_state_machine.Caller holds 3 values; its stand-in has the 2 fields message, rank"),
], ids=["enum_value", "named_tuple_fields"])
def test_stand_in_mismatch_is_refused(lookalikes, extra, build, message):
    data = _pickled({"x": build(lookalikes(**extra))})
    _remove_lookalikes()
    with pytest.raises(CheckpointingException) as e:
        safe_torch_load(data, "common state /ckpt/common.pt")
    assert message in str(e.value) and "common.pt" in str(e.value) and "allow_pickle" in str(e.value)


@pytest.mark.parametrize("state", [["lr", 1.0], {"lr": 1.0, "unknown_fields": []}, {"__class__": 1}],
                         ids=["list", "method_name", "dunder"])
def test_config_state_that_is_not_fields_is_refused(lookalikes, state):
    c = lookalikes()
    c.OptimizerConfig.__getstate__ = lambda self: state
    data = _pickled(c.OptimizerConfig(lr=1.0))
    _remove_lookalikes()
    with pytest.raises(CheckpointingException, match="OptimizerConfig: the stored state is not a dict of field"):
        safe_torch_load(data, "x")


def test_config_with_unknown_fields_loads_flagged(lookalikes, caplog):
    c = lookalikes(OptimizerConfig=("new_knob",))
    data = _pickled(c.OptimizerConfig(lr=2.0, new_knob=5))
    _remove_lookalikes()
    with caplog.at_level(logging.WARNING):
        cfg = safe_torch_load(data, "x")
    assert (cfg.lr, cfg.new_knob, cfg.unknown_fields()) == (2.0, 5, ["new_knob"])
    assert "OptimizerConfig" in caplog.text and "new_knob" in caplog.text


def test_register_safe_globals_and_torch_add_safe_globals(monkeypatch):
    data = _pickled({"tok": Tokenizer(5)})
    with pytest.raises(CheckpointingException, match=r"test_megatron_training_state\.Tokenizer.*allow_pickle"):
        safe_torch_load(data, "x")
    with torch.serialization.safe_globals([Tokenizer]):  # torch's own allow-list is honoured
        assert safe_torch_load(data, "x")["tok"] == Tokenizer(5)
    monkeypatch.setattr(safe_globals, "_REGISTERED", [])
    dc.register_safe_globals(Tokenizer)
    assert safe_torch_load(data, "x")["tok"] == Tokenizer(5)
    with pytest.raises(CheckpointingException, match="register_safe_globals takes"):
        dc.register_safe_globals("Tokenizer")
