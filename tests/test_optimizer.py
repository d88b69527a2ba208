"""Optimizer state <-> sharded state: the helpers, and real resharding round trips.

The round trips train a 2-layer model (column-parallel ``fc1.weight`` (8 x 6) split on
axis 0, row-parallel ``fc2.weight`` (6 x 8) split on axis 1, a replicated ``fc2.bias``)
with ``torch.optim.Adam`` / ``SGD(momentum=0.9)``. Each rank's params are its shards of
deterministic full weights and its gradients the shards of deterministic full gradients;
both optimizers are elementwise, so the sharded run equals the unsharded one exactly.
In the flat (distributed-optimizer) layout each DP rank trains a contiguous slice of the
flattened TP chunk of every param.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, LocalNonpersistentObject, ShardedTensor, ShardedTensorFactory
from dist_checkpointing.optimizer import (
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
    sharded_optimizer_state_dict,
)

from .conftest import get_pool

# ----------------------------------------------------------------------------- helpers (unit)


def test_optim_param_to_id_map_first_occurrence_wins():
    a, b = torch.zeros(2), torch.zeros(3)
    assert get_optim_param_to_id_map([a, b, a]) == {id(a): 0, id(b): 1}
    assert get_optim_param_to_id_map([]) == {}


def _factory(key: str, data: torch.Tensor) -> ShardedTensorFactory:
    """Saves ``data`` as two global tensors ``{key}.a`` / ``{key}.b`` (first 2 elements, rest)."""

    def build(key, data, replica_id, flattened_range):
        return {"a": ShardedTensor.from_rank_offsets(key + ".a", data[:2], replica_id=replica_id),
                "b": ShardedTensor.from_rank_offsets(key + ".b", data[2:], replica_id=replica_id)}

    return ShardedTensorFactory(key, data, build, lambda loaded: torch.cat([loaded["a"], loaded["b"]]))


def test_param_id_to_sharded_param_map_nested_and_untracked(caplog):
    w, b, f, untracked = torch.zeros(4, 2), torch.zeros(2), torch.zeros(5), torch.zeros(3)
    sh_w = ShardedTensor.from_rank_offsets("w", w, (0, 1, 2))
    sh_b = ShardedTensor.from_rank_offsets("b", b, replica_id=1)
    fac = _factory("f", f)
    model_sd = {"layers": [{"w": sh_w}, {"f": fac}], "b": sh_b,
                "other": ShardedTensor.from_rank_offsets("u", untracked), "iteration": 3}
    with caplog.at_level(logging.DEBUG, logger="dist_checkpointing.optimizer"):
        mapping = get_param_id_to_sharded_param_map(model_sd, [b, w, f])
    assert mapping == {0: sh_b, 1: sh_w, 2: fac}
    assert mapping[1] is sh_w and mapping[2] is fac
    assert any("'u'" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_param_id_to_sharded_param_map_warns_when_nothing_matches(caplog):
    model_sd = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}
    with caplog.at_level(logging.WARNING, logger="dist_checkpointing.optimizer"):
        assert get_param_id_to_sharded_param_map(model_sd, [torch.zeros(2)]) == {}
    assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_make_sharded_optimizer_tensor_copies_the_sharding():
    model = ShardedTensor.from_rank_offsets("decoder.w", torch.zeros(2, 4, dtype=torch.bfloat16), (1, 1, 3),
                                            (2, 0, 2), replica_id=(0, 2), prepend_axis_num=1)
    exp_avg = torch.arange(8.0).reshape(2, 4)
    sh = make_sharded_optimizer_tensor(model, exp_avg, "optimizer.state.exp_avg")
    assert isinstance(sh, ShardedTensor)
    assert sh.key == "optimizer.state.exp_avg.decoder.w" and sh.data is exp_avg and sh.dtype == torch.float32
    for attr in ("local_shape", "global_shape", "global_offset", "axis_fragmentations", "replica_id",
                 "prepend_axis_num", "flattened_range"):
        assert getattr(sh, attr) == getattr(model, attr), attr
    assert model.key == "decoder.w" and model.dtype == torch.bfloat16  # the model param is untouched


def test_make_sharded_optimizer_tensor_flat():
    chunk = torch.zeros(3, 4)
    model = ShardedTensor.from_rank_offsets_flat("w", chunk.flatten()[5:11], (3, 4), (0, 1, 2),
                                                 flattened_range=slice(5, 11), replica_id=1)
    state = torch.arange(6.0, dtype=torch.float64)
    sh = make_sharded_optimizer_tensor(model, state, "optimizer.state.exp_avg_sq")
    assert sh.key == "optimizer.state.exp_avg_sq.w" and sh.data is state and sh.dtype == torch.float64
    assert sh.flattened_range == slice(5, 11) and sh.local_shape == (3, 4) and sh.global_shape == (6, 4)
    assert sh.global_offset == (3, 0) and sh.replica_id == 1
    with pytest.raises(CheckpointingException, match="optimizer.state.x.w"):
        make_sharded_optimizer_tensor(model, torch.zeros(5), "optimizer.state.x")
    with pytest.raises(CheckpointingException, match="optimizer.state.x.w"):
        make_sharded_optimizer_tensor(model, torch.zeros(2, 3), "optimizer.state.x")  # right numel, not 1-D


def test_make_sharded_optimizer_tensor_shape_mismatch_names_the_key():
    model = ShardedTensor.from_rank_offsets("enc.w", torch.zeros(2, 3))
    with pytest.raises(CheckpointingException, match=r"optimizer\.state\.m\.enc\.w"):
        make_sharded_optimizer_tensor(model, torch.zeros(3, 2), "optimizer.state.m")
    with pytest.raises(CheckpointingException, match="enc.w"):
        make_sharded_optimizer_tensor(model, torch.zeros(6), "optimizer.state.m")


def test_make_sharded_optimizer_tensor_factory():
    fac = _factory("f", torch.zeros(5))
    state = torch.arange(5.0)
    sh = make_sharded_optimizer_tensor(fac, state, "optimizer.state.exp_avg")
    assert isinstance(sh, ShardedTensorFactory) and sh is not fac
    assert sh.key == "optimizer.state.exp_avg.f" and sh.data is state
    assert sh.build_fn is fac.build_fn and sh.merge_fn is fac.merge_fn and fac.key == "f"
    built = sh.build()
    assert built["a"].key == "optimizer.state.exp_avg.f.a" and torch.equal(built["b"].data, state[2:])


def _adam_like_state() -> Tuple[dict, dict, Dict[int, ShardedTensor]]:
    w, b = torch.zeros(2, 3), torch.zeros(3)
    sharded = {0: ShardedTensor.from_rank_offsets("w", w, (0, 0, 2)),
               1: ShardedTensor.from_rank_offsets("b", b, replica_id=1)}
    inner0 = {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3), "exp_avg_sq": torch.ones(2, 3) * 2,
              "lr_scale": 0.5, "tag": "x"}
    inner1 = {"step": torch.tensor(3.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3) * 2,
              "other_shape": torch.ones(2)}
    state_dict = {"state": {0: inner0, 1: inner1},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]},
                                   {"lr": 0.2, "betas": (0.9, 0.99), "params": [1]}]}
    return state_dict, {0: dict(inner0), 1: dict(inner1)}, sharded


def test_optim_state_to_sharding_state():
    state_dict, originals, sharded = _adam_like_state()
    inner0, groups = state_dict["state"][0], state_dict["param_groups"]
    optim_state_to_sharding_state(state_dict, sharded)
    s0, s1 = state_dict["state"][0], state_dict["state"][1]
    assert isinstance(s0["exp_avg"], ShardedTensor) and s0["exp_avg"].key == "optimizer.state.exp_avg.w"
    assert s0["exp_avg"].data is originals[0]["exp_avg"] and s0["exp_avg"].global_shape == (4, 3)
    assert s1["exp_avg_sq"].key == "optimizer.state.exp_avg_sq.b" and s1["exp_avg_sq"].replica_id == 1
    # values not shaped like the param stay as they are (common state)
    assert s0["step"] is originals[0]["step"] and s0["lr_scale"] == 0.5 and s0["tag"] == "x"
    assert s1["step"] is originals[1]["step"] and s1["other_shape"] is originals[1]["other_shape"]
    # the per-param dicts given in are not modified (optimizer.state_dict() shares them)
    assert inner0 == originals[0] and s0 is not inner0
    # param_groups: deep-copied, params wrapped
    assert state_dict["param_groups"] is not groups and groups[0]["params"] == [0]
    for i, group in enumerate(state_dict["param_groups"]):
        assert isinstance(group["params"], LocalNonpersistentObject) and group["params"].unwrap() == [i]
        assert group["betas"] == (0.9, 0.99)


@pytest.mark.parametrize("exclude", [("step", "lr_scale"), "step"])
def test_optim_state_to_sharding_state_exclude_keys(exclude):
    state_dict, _, sharded = _adam_like_state()
    optim_state_to_sharding_state(state_dict, sharded, exclude_keys=exclude)
    expected0 = {"exp_avg", "exp_avg_sq", "tag"} | ({"lr_scale"} if exclude == "step" else set())
    assert set(state_dict["state"][0]) == expected0
    assert set(state_dict["state"][1]) == {"exp_avg", "exp_avg_sq", "other_shape"}


def test_optim_state_to_sharding_state_unmatched_param_id():
    state_dict, _, sharded = _adam_like_state()
    del sharded[1]
    with pytest.raises(CheckpointingException, match="param id 1"):
        optim_state_to_sharding_state(state_dict, sharded)


def test_optim_state_to_sharding_state_flat_and_factory():
    flat = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 3), (0, 1, 2), flattened_range=slice(2, 6))
    fac = _factory("f", torch.zeros(5))
    state_dict = {"state": {0: {"m": torch.ones(4), "v": torch.ones(2, 2), "step": torch.tensor(1.0)},
                            1: {"m": torch.ones(5), "v": torch.ones(4)}},
                  "param_groups": [{"params": [0, 1]}]}
    optim_state_to_sharding_state(state_dict, {0: flat, 1: fac})
    s0, s1 = state_dict["state"][0], state_dict["state"][1]
    assert s0["m"].flattened_range == slice(2, 6) and s0["m"].key == "optimizer.state.m.w"
    assert not isinstance(s0["v"], ShardedTensor) and not isinstance(s0["step"], ShardedTensor)
    assert isinstance(s1["m"], ShardedTensorFactory) and s1["m"].key == "optimizer.state.m.f"
    assert isinstance(s1["v"], torch.Tensor)


def test_sharded_optimizer_state_dict_factory_roundtrip_single_process(tmp_path):
    """A factory-sharded param: its Adam state is built, saved and merged back."""
    param = torch.nn.Parameter(torch.arange(5.0))
    opt = torch.optim.Adam([param], lr=0.1)
    param.grad = torch.linspace(-1, 1, 5)
    opt.step()
    expected = {k: v.clone() for k, v in opt.state[param].items()}
    dc.save({"optimizer": sharded_optimizer_state_dict(opt, {"p": _factory("p", param)})}, tmp_path / "ckpt")
    stored = set(dc.load_tensors_metadata(tmp_path / "ckpt"))
    assert {"optimizer.state.exp_avg.p.a", "optimizer.state.exp_avg_sq.p.b"} <= stored

    param2 = torch.nn.Parameter(torch.zeros(5))
    opt2 = torch.optim.Adam([param2], lr=0.5)
    opt2.state[param2] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5)}
    loaded = dc.load({"optimizer": sharded_optimizer_state_dict(opt2, {"p": _factory("p", param2)})}, tmp_path / "ckpt")
    opt2.load_state_dict(loaded["optimizer"])
    for k, v in expected.items():
        assert torch.equal(opt2.state[param2][k], v), k
    assert opt2.param_groups[0]["lr"] == 0.1


# ----------------------------------------------------------------------------- the model

# name -> (full shape, TP split axis or None for replicated)
_LAYOUT: Dict[str, Tuple[Tuple[int, ...], Optional[int]]] = {
    "fc1.weight": ((8, 6), 0),
    "fc2.weight": ((6, 8), 1),
    "fc2.bias": ((6,), None),
}
_SAVE_STEPS = 3


def _full(name: str, step: int) -> torch.Tensor:
    """Deterministic full tensors: the initial weight (step -1) and the gradient of each step."""
    shape, _ = _LAYOUT[name]
    seed = 1000 * (list(_LAYOUT).index(name) + 1) + step + 1
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _make_optimizer(kind: str, params: List[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.8, 0.95), eps=1e-6)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _dp_bounds(numel: int, dp: int, shift: int) -> List[int]:
    """Slice boundaries of ``dp`` contiguous, non-empty pieces of ``numel`` elements,
    the interior ones moved by ``shift`` from an even split."""
    bounds = [0] + [numel * i // dp + shift for i in range(1, dp)] + [numel]
    assert all(a < b for a, b in zip(bounds, bounds[1:])), bounds
    return bounds


class _Layout:
    """One rank's view of a TP x DP layout: which part of every full tensor it holds.

    Non-flat: the rank's TP chunk (replicated across DP). Flat: the DP rank's slice of the
    flattened TP chunk, boundaries from :func:`_dp_bounds` (``shift``).
    """

    def __init__(self, rank: int, tp: int, dp: int, flat: bool, shift: int = 0):
        self.tp, self.dp, self.flat = tp, dp, flat
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        self.rank, self.shift = rank, shift

    def _chunk(self, name: str, full: torch.Tensor) -> torch.Tensor:
        axis = _LAYOUT[name][1]
        return full if axis is None else full.chunk(self.tp, axis)[self.tp_rank]

    def _range(self, name: str) -> slice:
        chunk = self._chunk(name, torch.empty(_LAYOUT[name][0], device="meta"))
        bounds = _dp_bounds(chunk.numel(), self.dp, self.shift)
        return slice(bounds[self.dp_rank], bounds[self.dp_rank + 1])

    def part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` (a contiguous copy)."""
        chunk = self._chunk(name, full)
        if self.flat:
            return chunk.reshape(-1)[self._range(name)].clone()
        return chunk.clone()

    def sharded(self, name: str, data: torch.Tensor) -> ShardedTensor:
        """The ShardedTensor of this rank's part ``data`` of ``name``."""
        axis = _LAYOUT[name][1]
        offsets = () if axis is None else ((axis, self.tp_rank, self.tp),)
        # replicas: TP chunks across DP (unless each DP rank has its own slice), the bias across TP too
        replica_id = (0 if axis is not None else self.tp_rank) if self.flat else (
            self.dp_rank if axis is not None else self.rank)
        if self.flat:
            chunk_shape = self._chunk(name, torch.empty(_LAYOUT[name][0], device="meta")).shape
            return ShardedTensor.from_rank_offsets_flat(name, data, tuple(chunk_shape), *offsets,
                                                        flattened_range=self._range(name), replica_id=replica_id)
        return ShardedTensor.from_rank_offsets(name, data, *offsets, replica_id=replica_id)


def _reference(kind: str, steps: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]:
    """The unsharded run: full params and optimizer state after ``steps`` steps."""
    params = {name: torch.nn.Parameter(_full(name, -1)) for name in _LAYOUT}
    opt = _make_optimizer(kind, list(params.values()), lr=0.05)
    for step in range(steps):
        for name, p in params.items():
            p.grad = _full(name, step)
        opt.step()
    return ({n: p.detach().clone() for n, p in params.items()},
            {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()})


def _step(params: Dict[str, torch.Tensor], opt: torch.optim.Optimizer, layout: _Layout, step: int) -> None:
    for name, p in params.items():
        p.grad = layout.part(name, _full(name, step))
    opt.step()


def _check_against_reference(kind, layout, params, opt, steps) -> None:
    ref_params, ref_state = _reference(kind, steps)
    for name, p in params.items():
        assert torch.equal(p.detach(), layout.part(name, ref_params[name])), (name, steps)
        state = opt.state[p]
        assert set(state) == set(ref_state[name]), name
        for k, v in ref_state[name].items():
            expected = v if v.ndim == 0 else layout.part(name, v)  # 'step' is per param, not sharded
            assert state[k].dtype == expected.dtype and torch.equal(state[k], expected), (name, k, steps)


def _train_and_save(rank, world, ckpt, kind, tp, dp, flat, shift):
    layout = _Layout(rank, tp, dp, flat, shift)
    params = {name: torch.nn.Parameter(layout.part(name, _full(name, -1))) for name in _LAYOUT}
    opt = _make_optimizer(kind, list(params.values()), lr=0.05)
    for step in range(_SAVE_STEPS):
        _step(params, opt, layout, step)
    _check_against_reference(kind, layout, params, opt, _SAVE_STEPS)
    model_sd = {"model": {name: layout.sharded(name, p) for name, p in params.items()}}
    optim_sd = sharded_optimizer_state_dict(opt, model_sd)
    assert all(isinstance(v, ShardedTensor) for s in optim_sd["state"].values() for k, v in s.items() if k != "step")
    dc.save({**model_sd, "optimizer": optim_sd, "iteration": _SAVE_STEPS}, ckpt)
    return sorted(dc.load_tensors_metadata(ckpt)) if rank == 0 else None


def _zero_state(kind: str, p: torch.Tensor) -> Dict[str, torch.Tensor]:
    if kind == "adam":
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return {"momentum_buffer": torch.zeros_like(p)}


def _load_and_continue(rank, world, ckpt, kind, tp, dp, flat, shift):
    layout = _Layout(rank, tp, dp, flat, shift)
    params = {name: torch.nn.Parameter(torch.zeros_like(layout.part(name, _full(name, -1)))) for name in _LAYOUT}
    opt = _make_optimizer(kind, list(params.values()), lr=0.7)  # the checkpoint's lr wins
    for p in params.values():
        opt.state[p] = _zero_state(kind, p)
    # The optimizer is mapped through the parameters themselves; the model is loaded into
    # detached aliases (loading into a resharded nn.Parameter: see test_load_into_parameters).
    mapping_sd = {name: layout.sharded(name, p) for name, p in params.items()}
    model_sd = {name: layout.sharded(name, p.detach()) for name, p in params.items()}
    loaded = dc.load({"model": model_sd, "optimizer": sharded_optimizer_state_dict(opt, mapping_sd)}, ckpt)
    assert loaded["iteration"] == _SAVE_STEPS
    for name, p in params.items():  # the model was loaded in place (checked against the reference below)
        assert loaded["model"][name].data_ptr() == p.data_ptr()
    opt.load_state_dict(loaded["optimizer"])
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["params"] == list(params.values())
    _check_against_reference(kind, layout, params, opt, _SAVE_STEPS)
    _step(params, opt, layout, _SAVE_STEPS)
    _check_against_reference(kind, layout, params, opt, _SAVE_STEPS + 1)
    return True


def _roundtrip(tmp_path, kind: str, save: Tuple[int, int, bool, int], loads: List[Tuple[int, int, bool, int]]):
    ckpt = str(tmp_path / "ckpt")
    tp, dp, flat, shift = save
    keys = get_pool(tp * dp).run(_train_and_save, ckpt, kind, tp, dp, flat, shift)[0]
    state_keys = ("exp_avg", "exp_avg_sq") if kind == "adam" else ("momentum_buffer",)
    assert keys == sorted(list(_LAYOUT) + [f"optimizer.state.{k}.{n}" for k in state_keys for n in _LAYOUT])
    for tp, dp, flat, shift in loads:
        assert all(get_pool(tp * dp).run(_load_and_continue, ckpt, kind, tp, dp, flat, shift))


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_optimizer_roundtrip_tp2_to_tp4_and_tp1(tmp_path, kind):
    """Saved at TP=2; loaded at TP=4, at TP=1, and DP-sliced flat at TP=2 x DP=2."""
    _roundtrip(tmp_path, kind, save=(2, 1, False, 0),
               loads=[(4, 1, False, 0), (1, 1, False, 0), (2, 2, True, 1)])


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_optimizer_roundtrip_flat_dp_sliced(tmp_path, kind):
    """Saved DP-sliced flat at TP=2 x DP=2; loaded flat at TP=4/DP=1 and TP=1/DP=4 (other
    slice boundaries), and non-flat at TP=4 and TP=1."""
    _roundtrip(tmp_path, kind, save=(2, 2, True, -1),
               loads=[(4, 1, True, 0), (1, 4, True, 1), (4, 1, False, 0), (1, 1, False, 0)])


@pytest.mark.parametrize("flat", [False, True], ids=["chunk", "flat"])
def test_load_into_parameters(tmp_path, flat):
    """Model sharded state dicts hold the nn.Parameters themselves (they are what the optimizer
    is mapped through), so a resharded load must fill Parameters in place."""
    full = torch.arange(12.0).reshape(4, 3)
    dc.save({"p": ShardedTensor.from_rank_offsets("p", full)}, tmp_path / "ckpt")
    if flat:
        param = torch.nn.Parameter(torch.zeros(4))
        request = ShardedTensor.from_rank_offsets_flat("p", param, (2, 3), (0, 1, 2), flattened_range=slice(1, 5))
        expected = full[2:].reshape(-1)[1:5]
    else:
        param = torch.nn.Parameter(torch.zeros(2, 3))
        request = ShardedTensor.from_rank_offsets("p", param, (0, 1, 2))
        expected = full[2:]
    loaded = dc.load({"p": request}, tmp_path / "ckpt")
    assert loaded["p"] is param and torch.equal(param.detach(), expected) and param.requires_grad
