"""FP8 tensors in checkpoints (``dist_checkpointing/fp8.py`` and its users).

Two kinds of FP8 tensors, most scenarios run for both ("native" / "fake"):

* **native** torch ``float8_e4m3fn`` / ``float8_e5m2`` tensors are stored as they are: their
  bytes must come back bit for bit, NaN / inf / max / subnormal / -0 patterns included
  (values are random bytes viewed as float8, with those patterns planted);
* **fake**: :class:`tests.fp8_fake.FakeFloat8Tensor`, a stand-in for Transformer Engine's
  ``Float8Tensor`` (uint8 ``_data`` + per-tensor ``_scale_inv``, nominal dtype bf16). It is
  stored as its dequantized values in bf16 and loaded by quantizing the read values into
  the request's ``_data`` with the request's own scale, never through ``copy_`` (which, like
  TE's quantizer, would write ``amax_history`` / ``quantizer_calls``). With the scale it was
  saved with, the FP8 bytes come back exactly — checked with a non-power-of-two scale, as
  real TE scales are. With another scale the load is a *requantization* of the stored
  values (saturating to the format's range).

Every comparison is on bytes (``.view(torch.uint8)`` / ``_data``). Multi-rank cases run on
real gloo groups (``tests/dist_pool.py``); world-1 cases run in the test process.
"""

from __future__ import annotations

import math
import os
import sys
import zlib
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing.tensors.fp8 import is_float8tensor
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

from .conftest import get_pool
from .fp8_fake import FakeFloat8Tensor, quantize_bytes
from .helpers import RecordingLoad, slow_writes

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ALGOS = ("broadcast", "gather_rounds", "gather_object")
KINDS = ("native", "fake")
SCALE_INV = 0.0371  # not a power of two, like real TE scales: exact round trip still expected
POW2_SCALE_INV = 2.0 ** -4  # for requantization cases: every formula agrees bit for bit
_ERR_TIMEOUT = 60.0

# Bit patterns planted in native float8 values: NaNs, +-inf, +-max, subnormals, -0, min normal.
SPECIAL = {
    torch.float8_e4m3fn: [0x7F, 0xFF, 0x7E, 0xFE, 0x01, 0x81, 0x07, 0x80, 0x00, 0x08],
    torch.float8_e5m2: [0x7C, 0xFC, 0x7D, 0x7E, 0x7F, 0xFF, 0x7B, 0xFB, 0x01, 0x03, 0x80, 0x04],
}
MAX_BYTE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}


# ----------------------------------------------------------------------------- values


def _rand_bytes(key: str, shape, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}:{salt}".encode()))
    return torch.randint(0, 256, (math.prod(shape),), dtype=torch.uint8, generator=g).reshape(tuple(shape))


def _gen_bytes(kind: str, key: str, shape, fp8: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Deterministic FP8 bytes (uint8) of a global tensor. Native: any pattern, the special
    ones planted first. Fake: finite values only (NaN / inf have no exact bf16 round trip
    through a saturating quantizer), max and subnormals included."""
    b = _rand_bytes(key, shape, salt).reshape(-1)
    if kind == "native":
        sp = torch.tensor(SPECIAL[fp8], dtype=torch.uint8)
        b[: len(sp)] = sp
    elif fp8 == torch.float8_e4m3fn:
        b = torch.where((b & 0x7F) == 0x7F, b ^ 0x01, b)  # NaN -> +-max
        b[:4] = torch.tensor([0x7E, 0xFE, 0x01, 0x80], dtype=torch.uint8)
    else:
        b = torch.where((b & 0x7C) == 0x7C, b & 0xFB, b)  # inf / NaN -> large finite
        b[:4] = torch.tensor([0x7B, 0xFB, 0x01, 0x80], dtype=torch.uint8)
    return b.reshape(tuple(shape))


def _mk(kind: str, b: torch.Tensor, fp8: torch.dtype, scale_inv: float = SCALE_INV) -> torch.Tensor:
    """An FP8 tensor of ``kind`` holding exactly the bytes ``b`` (copied)."""
    if kind == "native":
        return b.clone().view(fp8)
    return FakeFloat8Tensor.from_bytes(b, scale_inv, fp8)


def _req(kind: str, shape, fp8: torch.dtype, scale_inv: float = SCALE_INV) -> torch.Tensor:
    """A load request of ``kind``: 0x5A bytes (not a value the checks expect by chance)."""
    return _mk(kind, torch.full(tuple(shape), 0x5A, dtype=torch.uint8), fp8, scale_inv)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, FakeFloat8Tensor):
        return t._data.reshape(-1)
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def _assert_bytes(got: torch.Tensor, exp: torch.Tensor, where: str) -> None:
    g, e = _bytes(got), exp.reshape(-1)
    assert g.shape == e.shape, f"{where}: {g.shape} vs {e.shape}"
    if not torch.equal(g, e):
        bad = (g != e).nonzero().reshape(-1)
        i = int(bad[0])
        raise AssertionError(f"{where}: {len(bad)} of {e.numel()} bytes differ, first at {i}: "
                             f"got {int(g[i]):#04x}, expected {int(e[i]):#04x}")


def _check(kind: str, got: Any, req: torch.Tensor, exp: torch.Tensor, where: str,
           scale_inv: float = SCALE_INV) -> None:
    """A loaded FP8 tensor: the request itself, holding the bytes ``exp``; a fake one was
    filled without its quantizer (no ``copy_``, no amax recorded) and kept its scale."""
    assert got is req, f"{where}: load returned a new tensor ({type(got).__name__}), not the request"
    _assert_bytes(got, exp, where)
    if kind == "fake":
        assert got.quantizer_calls == [], f"{where}: the load went through copy_ (TE's quantizer)"
        assert torch.equal(got.amax_history, torch.zeros(4)), f"{where}: amax history written: {got.amax_history}"
        assert torch.equal(got._scale_inv, torch.tensor(float(scale_inv))), f"{where}: scale changed"


def _st(key: str, data: torch.Tensor, *offs, **kw) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, data, *offs, **kw)


_GROUPS: Dict[Any, Any] = {}


def _dp_group(tp: int) -> Any:
    """This rank's DP group of a TP x DP layout (rank = dp * tp + tp_rank); every rank
    creates every group once per process, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if (world, tp) not in _GROUPS:
        _GROUPS[(world, tp)] = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    return _GROUPS[(world, tp)][rank % tp]


# ----------------------------------------------------------------------------- is_float8tensor


def test_is_float8tensor():
    fake = FakeFloat8Tensor.quantize(torch.randn(4, 3, dtype=torch.bfloat16), SCALE_INV)
    param = torch.nn.Parameter(fake, requires_grad=False)
    assert is_float8tensor(fake)
    assert is_float8tensor(param)
    assert is_float8tensor(FakeFloat8Tensor.quantize(torch.randn(2), 1.0, torch.float8_e5m2, te_style_dtype=True))
    for t in (torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.uint8),
              torch.zeros(3, dtype=torch.float8_e4m3fn), torch.zeros(3, dtype=torch.float8_e5m2),
              torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3), requires_grad=False),
              fake.dequantize(), fake._data):
        assert not is_float8tensor(t), (t.dtype, type(t))
    for obj in (None, 1, 1.5, "Float8Tensor", [fake], {"w": fake}, b"\x00", fake._data.numpy()):
        assert not is_float8tensor(obj), type(obj)
    # Other tensor subclasses are not FP8 tensors, even with TE's class name outside TE;
    # TE's classes are recognised by name and module, without importing TE.
    plain_sub = type("Sub", (torch.Tensor,), {})
    named = type("Float8Tensor", (torch.Tensor,), {"__module__": "mylib.float8_tensor"})
    te_like = type("Float8Tensor", (torch.Tensor,), {"__module__": "transformer_engine.pytorch.tensor.float8_tensor"})
    assert not is_float8tensor(torch.Tensor._make_subclass(plain_sub, torch.zeros(2)))
    assert not is_float8tensor(torch.Tensor._make_subclass(named, torch.zeros(2)))
    assert is_float8tensor(torch.Tensor._make_subclass(te_like, torch.zeros(2)))
    assert "transformer_engine" not in sys.modules


# ----------------------------------------------------------------------------- world 1 (in process)


def test_native_save_load_same_layout_special_bits_and_views(tmp_path):
    """Native float8: bytes (NaN, inf, max, subnormal, -0) survive; non-contiguous sources
    (a transposed view, a column slice) and destinations (same) work; neighbours of a
    destination view are untouched; stored dtype is the float8 dtype."""
    for fp8 in FP8:
        ckpt = tmp_path / str(fp8)
        glob = _gen_bytes("native", "n.a", (12, 10), fp8)
        wide = _gen_bytes("native", "n.wide", (12, 16), fp8)
        tsrc = glob.t().contiguous().view(fp8).t()  # (12, 10), column-major strides
        csrc = wide.clone().view(fp8)[:, 3:13]
        assert not tsrc.is_contiguous() and not csrc.is_contiguous()
        dc.save({"a": _st("a", glob.clone().view(fp8)), "t": _st("t", tsrc), "c": _st("c", csrc)}, ckpt)
        md = dc.load_tensors_metadata(ckpt)
        assert {k: md[k].dtype for k in "atc"} == {k: fp8 for k in "atc"}

        a = _req("native", (12, 10), fp8)
        tbase = torch.full((10, 12), 0x5A, dtype=torch.uint8).view(fp8)
        tdst = tbase.t()
        cbuf = torch.full((12, 16), 0x33, dtype=torch.uint8).view(fp8)
        cdst = cbuf[:, 2:12]
        part = _req("native", (4, 10), fp8)
        out = dc.load({"a": _st("a", a), "t": _st("t", tdst), "c": _st("c", cdst),
                       "part": {"x": _st("a", part, (0, 1, 3), replica_id=1)}}, ckpt)
        _check("native", out["a"], a, glob, f"{fp8} same layout")
        _check("native", out["t"], tdst, glob, f"{fp8} transposed source and destination")
        _check("native", out["c"], cdst, wide[:, 3:13], f"{fp8} column slices")
        _check("native", out["part"]["x"], part, glob[4:8], f"{fp8} partial request")
        untouched = cbuf.view(torch.uint8)
        assert (untouched[:, :2] == 0x33).all() and (untouched[:, 12:] == 0x33).all(), "columns outside the view"
        # a special-pattern byte really is special (guards the test's own setup)
        if fp8 == torch.float8_e4m3fn:
            assert torch.isnan(out["a"].float().reshape(-1)[0]) and out["a"].float().reshape(-1)[2] == 448
        else:
            assert torch.isinf(out["a"].float().reshape(-1)[0]) and out["a"].float().reshape(-1)[6] == 57344


@pytest.mark.parametrize("te_style", [False, True], ids=["torch-fp8-dtype", "te-enum-fp8-dtype"])
def test_fake_save_stores_dequantized_and_loads_back(tmp_path, te_style):
    for fp8 in FP8:
        ckpt = tmp_path / str(fp8)
        b = _gen_bytes("fake", "f.w", (12, 8), fp8)
        src = FakeFloat8Tensor.from_bytes(b, SCALE_INV, fp8, te_style_dtype=te_style)
        psrc = torch.nn.Parameter(FakeFloat8Tensor.from_bytes(b, SCALE_INV, fp8, te_style_dtype=te_style),
                                  requires_grad=False)
        values = src.dequantize()
        dc.save({"w": _st("w", src), "p": _st("p", psrc)}, ckpt)
        assert src.quantizer_calls == [] and torch.equal(src._data, b), "save changed the source"
        md = dc.load_tensors_metadata(ckpt)
        assert md["w"].dtype == torch.bfloat16 and md["p"].dtype == torch.bfloat16, md
        plain = dc.load_plain_tensors(ckpt)
        assert plain["w"].dtype == torch.bfloat16 and torch.equal(plain["w"], values), "stored values"
        assert torch.equal(plain["p"], values)

        req = FakeFloat8Tensor.empty_like_scaled((12, 8), SCALE_INV, fp8, fill_byte=0x5A)
        if te_style:
            req._fp8_dtype = src._fp8_dtype
        req_data = req._data
        preq = torch.nn.Parameter(FakeFloat8Tensor.empty_like_scaled((12, 8), SCALE_INV, fp8), requires_grad=False)
        bf = torch.zeros(12, 8, dtype=torch.bfloat16)
        part = FakeFloat8Tensor.empty_like_scaled((6, 8), SCALE_INV, fp8)
        out = dc.load({"w": _st("w", req), "p": _st("p", preq), "bf": _st("w", bf, replica_id=1),
                       "part": _st("w", part, (0, 1, 2), replica_id=1)}, ckpt)
        _check("fake", out["w"], req, b, f"{fp8} same scale")
        assert req._data is req_data, "the request's _data was replaced, not filled in place"
        _check("fake", out["p"], preq, b, f"{fp8} Parameter request")
        assert out["bf"] is bf and torch.equal(bf, values), f"{fp8} bf16 request != dequantize()"
        _check("fake", out["part"], part, b[6:12], f"{fp8} part of the saved tensor")

        # per-layer FP8 weights stacked along a prepended axis, loaded resharded
        lb = _gen_bytes("fake", "f.layers", (3, 4, 8), fp8)
        lckpt = tmp_path / f"layers_{fp8}"
        dc.save({"l": [_st("l", FakeFloat8Tensor.from_bytes(lb[i], SCALE_INV, fp8), (0, i, 3), prepend_axis_num=1)
                       for i in range(3)]}, lckpt)
        assert dc.load_tensors_metadata(lckpt)["l"].dtype == torch.bfloat16
        reqs = [FakeFloat8Tensor.empty_like_scaled((2, 8), SCALE_INV, fp8) for _ in range(3)]
        out = dc.load({"l": [_st("l", r, (0, i, 3), (1, 1, 2), prepend_axis_num=1) for i, r in enumerate(reqs)]}, lckpt)
        for i, r in enumerate(reqs):
            _check("fake", out["l"][i], r, lb[i, 2:4], f"{fp8} layer {i} (prepended axis), rows 2:4")


def test_fake_load_with_another_scale_requantizes_and_saturates(tmp_path):
    """Loading into an FP8 request whose scale differs from the saved one is a
    requantization of the stored (dequantized) values with the request's scale; values
    beyond the format's range saturate to +-max (never NaN / inf)."""
    for fp8 in FP8:
        ckpt = tmp_path / str(fp8)
        b = _gen_bytes("fake", "f.s", (16, 8), fp8)
        src = FakeFloat8Tensor.from_bytes(b, POW2_SCALE_INV, fp8)
        values = src.dequantize()
        dc.save({"w": _st("w", src)}, ckpt)
        coarse = FakeFloat8Tensor.empty_like_scaled((16, 8), POW2_SCALE_INV * 4, fp8)
        fine = FakeFloat8Tensor.empty_like_scaled((16, 8), POW2_SCALE_INV / 64, fp8)
        out = dc.load({"c": _st("w", coarse), "f": _st("w", fine, replica_id=1)}, ckpt)
        _check("fake", out["c"], coarse, quantize_bytes(values, POW2_SCALE_INV * 4, fp8), f"{fp8} coarser scale",
               POW2_SCALE_INV * 4)
        assert not torch.equal(coarse._data, b), "requantization with another scale changed nothing (bad setup)"
        _check("fake", out["f"], fine, quantize_bytes(values, POW2_SCALE_INV / 64, fp8), f"{fp8} finer scale",
               POW2_SCALE_INV / 64)
        lim = torch.finfo(fp8).max
        over = values.float().abs() / (POW2_SCALE_INV / 64) > lim
        assert over.sum() > 10, "no value saturates (bad setup)"
        got = fine._data.view(fp8).float()
        assert torch.isfinite(got).all(), f"{fp8}: saturation produced NaN/inf"
        assert torch.equal(got[over], torch.sign(values.float()[over]) * lim), f"{fp8}: not clamped to +-max"
        mx = MAX_BYTE[fp8]
        assert set(fine._data[over].tolist()) <= {mx, mx | 0x80}


# ----------------------------------------------------------------------------- resharding (world 2, 4)


def _reshard_rank(rank, world, base):
    """Save TP2 along axis 0 (replicated over DP), load TP=world along axis 0 and along
    axis 1 (native: into transposed views) and TP1 (the whole tensor on every rank)."""
    tp, tpr, dpr = 2, rank % 2, rank // 2
    n = 0
    for kind in KINDS:
        for fp8 in FP8:
            ckpt = os.path.join(base, f"{kind}_{str(fp8)[6:]}")
            glob = _gen_bytes(kind, f"r.{kind}", (16, 8), fp8)
            loc = glob[tpr * 8:(tpr + 1) * 8]
            dc.save({"w": _st("w", _mk(kind, loc, fp8), (0, tpr, tp), replica_id=dpr)}, ckpt)
            rows, cols = 16 // world, 8 // world
            r0 = _req(kind, (rows, 8), fp8)
            if kind == "native":
                c1 = torch.full((cols, 16), 0x5A, dtype=torch.uint8).view(fp8).t()
            else:
                c1 = _req(kind, (16, cols), fp8)
            full = _req(kind, (16, 8), fp8)
            out = dc.load({"r": _st("w", r0, (0, rank, world)), "c": _st("w", c1, (1, rank, world), replica_id=1),
                           "f": _st("w", full, replica_id=(2, rank))}, ckpt)
            where = f"rank {rank} {kind} {fp8}"
            _check(kind, out["r"], r0, glob[rank * rows:(rank + 1) * rows], f"{where} TP{world} axis 0")
            _check(kind, out["c"], c1, glob[:, rank * cols:(rank + 1) * cols], f"{where} TP{world} axis 1")
            _check(kind, out["f"], full, glob, f"{where} TP1")
            n += 3
    return n


@pytest.mark.parametrize("world", [2, 4])
def test_resharding(world, tmp_path):
    assert get_pool(world).run(_reshard_rank, str(tmp_path)) == [12] * world


# ----------------------------------------------------------------------------- flattened (world 2, 4)


def _flat_rank(rank, world, base):
    """Distributed-optimizer slices: TP (1 at world 2, 2 at world 4) along axis 0, each
    TP chunk flattened and cut over DP at uneven points. Loaded: other DP cuts (flat), the
    whole chunk non-flat, a non-flat TP=world split along axis 1, and (fake) a bf16 slice."""
    tp = 1 if world == 2 else 2
    tpr, dpr = rank % tp, rank // tp  # DP = 2 in both layouts
    shape = (8 * tp, 8)
    numel = 64  # of a TP chunk (8, 8)

    def cut(fracs):
        cuts = [round(f * numel) for f in fracs]
        return cuts[dpr], cuts[dpr + 1]

    save_fr, load_fr = ((0, 0.42, 1), (0, 0.69, 1)), ((0, 0.15, 1), (0, 0.77, 1))
    n = 0
    for kind in KINDS:
        for fp8 in FP8:
            ckpt = os.path.join(base, f"{kind}_{str(fp8)[6:]}")
            glob = _gen_bytes(kind, f"fl.{kind}", shape, fp8)
            chunk = glob[tpr * 8:(tpr + 1) * 8].reshape(-1)
            a, b = cut(save_fr[0] if tpr == 0 else save_fr[1])
            sh = ShardedTensor.from_rank_offsets_flat("o", _mk(kind, chunk[a:b], fp8), (8, 8), (0, tpr, tp),
                                                      flattened_range=slice(a, b))
            dc.save({"o": sh}, ckpt)
            assert dc.load_tensors_metadata(ckpt)["o"].dtype == (fp8 if kind == "native" else torch.bfloat16)
            la, lb = cut(load_fr[0] if tpr == 0 else load_fr[1])
            flat = _req(kind, (lb - la,), fp8)
            whole = _req(kind, (8, 8), fp8)
            cols = 8 // world
            flat_req = {"flat": ShardedTensor.from_rank_offsets_flat("o", flat, (8, 8), (0, tpr, tp),
                                                                     flattened_range=slice(la, lb))}
            bf = None
            if kind == "fake":
                bf = torch.zeros(lb - la, dtype=torch.bfloat16)
                flat_req["bf"] = ShardedTensor.from_rank_offsets_flat("o", bf, (8, 8), (0, tpr, tp),
                                                                      flattened_range=slice(la, lb), replica_id=3)
            # a request holds a key either flattened or not: two loads
            nonflat_req = {"whole": _st("o", whole, (0, tpr, tp), replica_id=dpr)}
            split = _req(kind, (shape[0], cols), fp8)
            nonflat_req["split"] = _st("o", split, (1, rank, world), replica_id=2)
            out = {**dc.load(flat_req, ckpt), **dc.load(nonflat_req, ckpt)}
            where = f"rank {rank} {kind} {fp8}"
            _check(kind, out["flat"], flat, chunk[la:lb], f"{where} flat, other DP cuts [{la}:{lb}]")
            _check(kind, out["whole"], whole, chunk, f"{where} whole chunk non-flat")
            _check(kind, out["split"], split, glob[:, rank * cols:(rank + 1) * cols], f"{where} axis-1 split")
            n += 3
            if bf is not None:
                exp = FakeFloat8Tensor.from_bytes(chunk[la:lb], SCALE_INV, fp8).dequantize()
                assert out["bf"] is bf and torch.equal(bf, exp), f"{where}: bf16 flat slice != dequantized values"
                n += 1
    return n


@pytest.mark.parametrize("world", [2, 4])
def test_flattened_slices(world, tmp_path):
    counts = get_pool(world).run(_flat_rank, str(tmp_path))
    assert counts == [2 * 2 * 3 + 2] * world, counts


# ----------------------------------------------------------------------------- fully parallel (world 2, 4)


def _fp_state(kind, rank, world, tp, fill, mixed=False):
    """FP8 tensors split over TP (axis 0 and axis 1) and replicated over DP, plus one
    replicated on every rank. ``fill=False``: the request (native: the axis-1 chunk into a
    transposed view; fake with ``mixed``: plain bf16 requests on odd ranks)."""
    tpr, dpr = rank % tp, rank // tp
    sd, expected, reqs = {}, {}, {}
    for fp8 in FP8:
        name = str(fp8)[6:]
        for key, shape, axis, replica in ((f"col.{name}", (8 * tp, 6), 0, dpr), (f"row.{name}", (6, 4 * tp), 1, dpr),
                                          (f"rep.{name}", (5, 7), None, rank)):
            glob = _gen_bytes(kind, f"fp.{kind}.{key}", shape, fp8)
            loc = glob if axis is None else glob.narrow(axis, tpr * (shape[axis] // tp), shape[axis] // tp)
            offs = () if axis is None else ((axis, tpr, tp),)
            expected[key] = loc
            if fill:
                data = _mk(kind, loc, fp8)
            elif kind == "native" and axis == 1:
                data = torch.full(tuple(reversed(loc.shape)), 0x5A, dtype=torch.uint8).view(fp8).t()
            elif mixed and kind == "fake" and rank % 2 == 1:
                data = torch.zeros(tuple(loc.shape), dtype=torch.bfloat16)
            else:
                data = _req(kind, loc.shape, fp8)
            reqs[key] = data
            sd[key] = _st(key, data, *offs, replica_id=replica)
    return sd, expected, reqs


def _fully_parallel_rank(rank, world, base, tp, kind_group, algos):
    group = None if kind_group == "world" else _dp_group(tp)
    assert "transformer_engine" not in sys.modules
    stats = []
    for kind in KINDS:
        ckpt = os.path.join(base, kind)
        sd, _, _ = _fp_state(kind, rank, world, tp, True)
        dc.save(sd, ckpt, sharded_strategy=FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), group))
        for algo in algos:
            req, expected, reqs = _fp_state(kind, rank, world, tp, False, mixed=True)
            rec = RecordingLoad()
            out = dc.load(req, ckpt, sharded_strategy=FullyParallelLoadStrategyWrapper(rec, group, exchange_algo=algo))
            for key, exp in expected.items():
                where = f"rank {rank} {kind} {algo} {key}"
                if kind == "fake" and not isinstance(reqs[key], FakeFloat8Tensor):
                    fp8 = torch.float8_e4m3fn if "e4m3" in key else torch.float8_e5m2
                    values = FakeFloat8Tensor.from_bytes(exp, SCALE_INV, fp8).dequantize()
                    assert out[key] is reqs[key] and torch.equal(out[key], values), f"{where}: bf16 request"
                else:
                    _check(kind, out[key], reqs[key], exp, where)
            stats.append((kind, algo, len(expected), len(rec.reads)))
    assert "transformer_engine" not in sys.modules, "recognising FP8 tensors imported Transformer Engine"
    return stats


@pytest.mark.parametrize("world,tp,kind_group", [(2, 1, "world"), (4, 1, "world"), (4, 2, "world"), (4, 2, "dp")],
                         ids=["w2-dp2", "w4-dp4", "w4-tp2dp2-world", "w4-tp2dp2-dp-subgroups"])
def test_fully_parallel_every_exchange_algo_on_gloo(world, tp, kind_group, tmp_path):
    """Native float8 and fake FP8 tensors through FullyParallel save + load with each
    exchange algorithm ('broadcast', 'gather_rounds', 'gather_object') on gloo; every
    shard is read by one rank of its group and exchanged to the others (checked: fewer
    reads than requested shards)."""
    results = get_pool(world).run(_fully_parallel_rank, str(tmp_path), tp, kind_group, ALGOS)
    for kind in KINDS:
        for algo in ALGOS:
            per_rank = [next(s for s in r if s[:2] == (kind, algo)) for r in results]
            requested = sum(s[2] for s in per_rank)
            read = sum(s[3] for s in per_rank)
            assert 0 < read < requested, (kind, algo, read, requested)


def _requant_via_wrapper_rank(rank, world, ckpt, algos):
    """Every rank requests every (replicated) tensor; rank 0 with the saved scale, rank 1
    with a 16x coarser one. Plain load: each gets the stored values quantized with its own
    scale. The fully parallel load must give the same result whoever read the shard."""
    fp8 = torch.float8_e4m3fn
    keys = [f"k{i}" for i in range(6)]
    globs = {k: _gen_bytes("fake", f"rq.{k}", (8, 8), fp8) for k in keys}
    dc.save({k: _st(k, FakeFloat8Tensor.from_bytes(globs[k], POW2_SCALE_INV, fp8), replica_id=rank) for k in keys},
            ckpt)
    my_scale = POW2_SCALE_INV * (1 if rank == 0 else 16)
    expected = {k: quantize_bytes(FakeFloat8Tensor.from_bytes(globs[k], POW2_SCALE_INV, fp8).dequantize(),
                                  my_scale, fp8) for k in keys}
    if rank == 0:
        assert all(torch.equal(expected[k], globs[k]) for k in keys)

    def request():
        reqs = {k: FakeFloat8Tensor.empty_like_scaled((8, 8), my_scale, fp8) for k in keys}
        return reqs, {k: _st(k, reqs[k], replica_id=rank) for k in keys}

    reqs, sd = request()
    dc.load(sd, ckpt)  # control: the plain strategy
    for k in keys:
        _check("fake", reqs[k], reqs[k], expected[k], f"rank {rank} plain load {k}", my_scale)
    failures, reads = [], {}
    for algo in algos:
        reqs, sd = request()
        rec = RecordingLoad()
        dc.load(sd, ckpt, sharded_strategy=FullyParallelLoadStrategyWrapper(rec, None, exchange_algo=algo))
        reads[algo] = len(rec.reads)
        for k in keys:
            if not torch.equal(reqs[k]._data, expected[k]):
                failures.append(f"rank {rank} {algo} {k}: {int((reqs[k]._data != expected[k]).sum())} bytes differ")
    return failures, reads


def test_fully_parallel_load_with_per_rank_scales_matches_plain_load(pool2, tmp_path):
    """The fully parallel wrapper must be transparent: a rank whose FP8 request has the
    saved scale gets the exact saved bytes even when the shard was read (and quantized) by
    a rank whose request has a coarser scale.

    Known library bug (fails when written): the reader loads the shard into *its own* FP8
    request (quantized with its scale, ``fully_parallel.py`` ``base_strategy.load`` of the
    reader's request), and ``exchange.tensors._source_bytes`` sends ``dequantize()`` of that,
    so receivers requantize already-quantized values (double quantization) instead of
    the stored values."""
    results = pool2.run(_requant_via_wrapper_rank, str(tmp_path / "c"), ALGOS)
    for algo in ALGOS:
        assert results[1][1][algo] > 0, f"{algo}: rank 1 (coarse scale) read nothing, the case is not exercised"
    failures = [f for fs, _ in results for f in fs]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- async save (world 2)


def _async_rank(rank, world, ckpt):
    """Async save of native and fake FP8 tensors; every source is overwritten right after
    ``save`` returns (while the writer is still sleeping); the checkpoint has the old bytes."""
    tpr = rank
    sd, old, srcs = {}, {}, {}
    for kind in KINDS:
        for fp8 in FP8:
            key = f"{kind}.{str(fp8)[6:]}"
            glob = _gen_bytes(kind, f"as.{key}", (8, 6), fp8)
            old[key] = glob
            srcs[key] = _mk(kind, glob[tpr * 4:(tpr + 1) * 4], fp8)
            sd[key] = _st(key, srcs[key], (0, tpr, world))
    queue = AsyncCallsQueue()
    try:
        with slow_writes(0.2):
            request = dc.save(sd, ckpt, async_sharded_save=True)
        assert isinstance(request, AsyncRequest)
        for key, t in srcs.items():  # allowed as soon as save returns
            if isinstance(t, FakeFloat8Tensor):
                t._data.fill_(0x11)
            else:
                t.view(torch.uint8).fill_(0x11)
        queue.schedule_async_request(request)
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    finally:
        queue.close()
    for key, glob in old.items():
        kind = key.split(".")[0]
        fp8 = torch.float8_e4m3fn if "e4m3" in key else torch.float8_e5m2
        req = _req(kind, (8, 6), fp8)
        out = dc.load({key: _st(key, req, replica_id=rank)}, ckpt)
        _check(kind, out[key], req, glob, f"rank {rank} {key}: values written after save returned?")
    return True


def test_async_save_snapshots_fp8_tensors(pool2, tmp_path):
    assert pool2.run(_async_rank, str(tmp_path / "c")) == [True, True]
    md = dc.load_tensors_metadata(tmp_path / "c")
    assert md["native.float8_e4m3fn"].dtype == torch.float8_e4m3fn
    assert md["fake.float8_e5m2"].dtype == torch.bfloat16


# ----------------------------------------------------------------------------- bad input (world 2)


def _dtype_mismatch_save(rank, world, ckpt):
    fp8 = torch.float8_e4m3fn
    dc.save({"f32": _st("f32", torch.arange(8, dtype=torch.float32).reshape(2, 4)[rank:rank + 1], (0, rank, 2)),
             "n8": _st("n8", torch.zeros(1, 4, dtype=fp8), (0, rank, 2)),
             "bf": _st("bf", torch.ones(1, 4, dtype=torch.bfloat16), (0, rank, 2))}, ckpt)


_MISMATCH = {  # case: (key, request factory, fragments the message must contain)
    "native-for-f32": ("f32", lambda: torch.zeros(2, 4, dtype=torch.float8_e4m3fn), ("float32", "float8_e4m3fn")),
    "e5m2-for-e4m3": ("n8", lambda: torch.zeros(2, 4, dtype=torch.float8_e5m2), ("float8_e4m3fn", "float8_e5m2")),
    "fake-bf16-for-f32": ("f32", lambda: FakeFloat8Tensor.empty_like_scaled((2, 4), 1.0), ("float32", "bfloat16")),
    "fake-bf16-for-native": ("n8", lambda: FakeFloat8Tensor.empty_like_scaled((2, 4), 1.0),
                             ("float8_e4m3fn", "bfloat16")),
    "fake-f32-for-bf16": ("bf", lambda: FakeFloat8Tensor.empty_like_scaled((2, 4), 1.0, dtype=torch.float32),
                          ("bfloat16", "float32")),
}


_MISMATCH_STORED = {"f32": lambda: torch.arange(8, dtype=torch.float32).reshape(2, 4),
                    "n8": lambda: torch.zeros(2, 4, dtype=torch.float8_e4m3fn),
                    "bf": lambda: torch.ones(2, 4, dtype=torch.bfloat16)}


def _dtype_mismatch_load(rank, world, ckpt, case, wrapped, strict):
    key, make, _ = _MISMATCH[case]
    strategy = TorchDistLoadShardedStrategy(strict_dtypes=strict)
    if wrapped:
        strategy = FullyParallelLoadStrategyWrapper(strategy, None, exchange_algo="broadcast")
    req = make()
    out = dc.load({key: _st(key, req, replica_id=rank)}, ckpt, sharded_strategy=strategy)[key]
    # by default the stored values are cast into the request (as Megatron-Core's reader does)
    values = _nominal(out).float() if is_float8tensor(out) else out.float()
    expected = _MISMATCH_STORED[key]().to(req.dtype if not is_float8tensor(req) else values.dtype).float()
    assert out is req and torch.allclose(values, expected, rtol=0.13, atol=0.02), (case, values, expected)


def _nominal(t):
    from dist_checkpointing.tensors.fp8 import dequantize

    return dequantize(t)


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "fully-parallel"])
def test_fp8_request_for_other_stored_dtype_is_cast_or_refused_when_strict(pool2, tmp_path, wrapped):
    ckpt = str(tmp_path / "c")
    pool2.run(_dtype_mismatch_save, ckpt)
    for case in _MISMATCH:
        pool2.run(_dtype_mismatch_load, ckpt, case, wrapped, False, timeout=_ERR_TIMEOUT)
    for case, (key, _, fragments) in _MISMATCH.items():
        excs = pool2.run_expect_error(_dtype_mismatch_load, ckpt, case, wrapped, True, timeout=_ERR_TIMEOUT)
        assert len(excs) == 2
        for rank, e in enumerate(excs):
            assert isinstance(e, CheckpointingException), f"{case} rank {rank}: {type(e).__name__}: {e}"
            for frag in (repr(key),) + fragments:
                assert frag in str(e), f"{case} rank {rank}: {frag!r} not in: {e}"
