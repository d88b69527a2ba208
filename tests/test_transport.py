"""Live peer-to-peer transfer of training state (``dist_checkpointing/transport/``).

Everything runs on real gloo groups (``tests/dist_pool.py``): rank 0 sends, the other ranks
receive, at world 2 and world 3 (one ``send_checkpoint`` to two receivers). Values are
compared on their bytes. What the transport does on the wire is observed, never faked:
:class:`_SpyPG` forwards every ``send`` / ``recv`` to the real process group and records
the buffer it was given (data pointer, byte count, tag), which shows how many data
messages travelled and whether a tensor was sent from / received into its own memory.

Tests whose failure mode is a timeout (a refused transfer, an unserializable state) run
on a fresh ``dist.new_group`` made for the test, so that a broken group never leaks into
the next test; peers that die or never answer run in fresh subprocesses (one world-4
launch covers the three scenarios, see :func:`peer_failures`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import textwrap
import time
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten_with_path, tree_structure

from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing import transport
from dist_checkpointing.transport import PGTransport, recover_from_peer

from .conftest import get_pool
from .fp8_fake import FakeFloat8Tensor, quantize_bytes
from .helpers import free_port, slack
from .launch import Launched

T = timedelta(seconds=60)  # transfers that must succeed
ERR_T = timedelta(seconds=2)  # transfers expected to fail: a refusal needs milliseconds, not a timeout
POOL_TIMEOUT = 90.0
SMALL_BUCKET = 4096  # tensors of 2048 bytes or more travel alone
SCALE_INV = 0.0371  # not a power of two, like real TE scales
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NT = collections.namedtuple("NT", "weight step")


# ----------------------------------------------------------------------------- helpers


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values (an FP8 tensor's ``_data``), row-major."""
    if isinstance(t, FakeFloat8Tensor):
        t = t._data
    return t.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _assert_bits(got: torch.Tensor, exp: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got)}"
    assert got.dtype == exp.dtype, f"{what}: dtype {got.dtype} != {exp.dtype}"
    assert tuple(got.shape) == tuple(exp.shape), f"{what}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
    assert torch.equal(_raw(got), _raw(exp)), f"{what}: values differ"


def _rand(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic values of any dtype: random bytes (NaN patterns included) viewed as
    ``dtype``; bools are 0/1."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool().reshape(shape)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


class _SpyPG:
    """Forwards ``send`` / ``recv`` to the real group and records ``(tag, data_ptr,
    nbytes)`` of every buffer handed to it."""

    def __init__(self, pg=None):
        self.pg = pg if pg is not None else dist.group.WORLD
        self.sent: List[tuple] = []
        self.received: List[tuple] = []

    @staticmethod
    def _rec(t: torch.Tensor, tag: int) -> tuple:
        return tag, t.data_ptr(), t.numel() * t.element_size()

    def send(self, tensors, dst, tag):
        self.sent.append(self._rec(tensors[0], tag) + (dst,))
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self.received.append(self._rec(tensors[0], tag) + (src,))
        return self.pg.recv(tensors, src, tag)

    def data_sent(self) -> List[tuple]:
        return [r for r in self.sent if r[0] >= transport._TAG_DATA]

    def data_received(self) -> List[tuple]:
        return [r for r in self.received if r[0] >= transport._TAG_DATA]


class _bucket:
    """Set ``transport.wire.BUCKET_BYTES`` inside a rank function (restored on exit)."""

    def __init__(self, size: int):
        self.size, self.old = size, None

    def __enter__(self):
        self.old, transport.wire.BUCKET_BYTES = transport.wire.BUCKET_BYTES, self.size

    def __exit__(self, *exc):
        transport.wire.BUCKET_BYTES = self.old


@contextlib.contextmanager
def _fresh_group():
    """A new gloo group over all ranks for one test, which may leave it broken; destroyed
    after use."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


# ----------------------------------------------------------------------------- 1. rich nested state


def _rich_state(seed: int) -> Dict[str, Any]:
    """Every kind of leaf; same structure, shapes and dtypes for every seed."""
    counter = iter(range(1000))

    def r(shape, dtype):
        return _rand(shape, dtype, seed * 1000 + next(counter))

    g = torch.Generator().manual_seed(seed)
    return {
        "f32": r((4, 5), torch.float32),
        "bf16": r((7,), torch.bfloat16),
        "f16": r((3, 3), torch.float16),
        "i16": r((5,), torch.int16),
        "i64": r((2, 3), torch.int64),
        "u8": r((9,), torch.uint8),
        "bool": r((11,), torch.bool),
        "e4m3": r((6,), torch.float8_e4m3fn),
        "e5m2": r((2, 4), torch.float8_e5m2),
        "c64": r((3,), torch.complex64),
        "scalar": r((), torch.float64),
        "scalar_bf16": r((), torch.bfloat16),
        "scalar_bool": r((), torch.bool),
        "empty": torch.empty(0),
        "empty3d": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "nested": {
            "list": [r((2, 2), torch.float32), 3, "s", None, (r((5,), torch.int64), {"deep": r((3,), torch.bfloat16)})],
            "tuple": (1, r((2,), torch.float16)),
        },
        "int": 7 + seed,
        "str": f"hello {seed}",
        "none": None,
        "pyd": {"lr": 0.1 * seed, "betas": (0.9, 0.999), "name": f"adam{seed}"},
        "sharded": ShardedTensor.from_rank_offsets("layer.w", r((4, 6), torch.float32), (0, 1, 2),
                                                   replica_id=(0, 1, 0)),
        "sharded_flat": ShardedTensor.from_rank_offsets_flat("layer.m", r((5,), torch.bfloat16), (4, 3), (0, 1, 2),
                                                             flattened_range=slice(3, 8), replica_id=1),
        "obj": ShardedObject("rng", {"state": [seed, 2, 3]}, (2,), (1,), replica_id=(0, seed)),
        "param": torch.nn.Parameter(torch.randn(3, 4, generator=g)),
    }


_ST_FIELDS = ("key", "dtype", "local_shape", "global_shape", "global_offset", "axis_fragmentations", "replica_id",
              "prepend_axis_num", "allow_shape_mismatch", "flattened_range")


def _check_rich(out: Any, exp: Any, mine: Any) -> None:
    assert tree_structure(out) == tree_structure(exp), "structure differs"
    got_leaves, _ = tree_flatten_with_path(out)
    exp_leaves, _ = tree_flatten_with_path(exp)
    mine_leaves = tree_flatten_with_path(mine)[0] if mine is not None else [(None, None)] * len(exp_leaves)
    for (path, got), (_, e), (_, m) in zip(got_leaves, exp_leaves, mine_leaves):
        what = str(path)
        if isinstance(e, ShardedTensor):
            assert isinstance(got, ShardedTensor), what
            for f in _ST_FIELDS:
                assert getattr(got, f) == getattr(e, f), f"{what}.{f}: {getattr(got, f)!r} != {getattr(e, f)!r}"
            _assert_bits(got.data, e.data, what)
            if m is not None:
                assert got.data is m.data, f"{what}: not received in place"
        elif isinstance(e, ShardedObject):
            assert type(got) is ShardedObject, what
            assert (got.key, got.data, got.global_shape, got.global_offset, got.replica_id) == \
                (e.key, e.data, e.global_shape, e.global_offset, e.replica_id), what
        elif isinstance(e, torch.Tensor):
            _assert_bits(got, e, what)
            assert got.requires_grad == e.requires_grad, f"{what}: requires_grad {got.requires_grad}"
            if m is not None:
                assert got is m, f"{what}: the returned tensor is not the receiver's own"
        else:
            assert type(got) is type(e) and got == e, f"{what}: {got!r} != {e!r}"


def _rich_transfer(rank: int, world_size: int, inplace_ranks: List[int]) -> str:
    if rank == 0:
        PGTransport(None, T, torch.device("cpu")).send_checkpoint(list(range(1, world_size)), _rich_state(1))
        return "sent"
    exp = _rich_state(1)
    if rank in inplace_ranks:
        mine = _rich_state(2)
        before = {k: v.data_ptr() for k, v in mine.items() if isinstance(v, torch.Tensor)}
        out = PGTransport(None, T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
        _check_rich(out, exp, mine)
        # the receiver's own objects now hold the sender's values, in their original memory
        _assert_bits(mine["f32"], exp["f32"], "mine f32")
        assert all(mine[k].data_ptr() == p for k, p in before.items())
        assert type(out["param"]) is torch.nn.Parameter and out["param"].requires_grad and out["param"].grad is None
        return "inplace"
    out = PGTransport(None, T, "cpu").recv_checkpoint(0)
    _check_rich(out, exp, None)
    assert out["param"].requires_grad and out["e4m3"].dtype == torch.float8_e4m3fn
    return "new"


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "new"])
def test_rich_state_world2(pool2, inplace):
    assert pool2.run(_rich_transfer, [1] if inplace else [], timeout=POOL_TIMEOUT) == \
        ["sent", "inplace" if inplace else "new"]


def test_rich_state_world3_one_send_two_receivers():
    assert get_pool(3).run(_rich_transfer, [1], timeout=POOL_TIMEOUT) == ["sent", "inplace", "new"]


# ----------------------------------------------------------------------------- 2. in-place layouts


def _layout_state(seed: int) -> Dict[str, torch.Tensor]:
    return {
        "contig": _rand((5, 4), torch.float32, seed + 1),
        "transposed": _rand((6, 4), torch.float32, seed + 2),
        "colslice": _rand((6, 3), torch.float32, seed + 3),
        "big": _rand((3000,), torch.float32, seed + 4),  # 12000 B: alone
        "big_colslice": _rand((100, 20), torch.float32, seed + 5),  # 8000 B, non-contiguous destination
        "big_transposed": _rand((40, 50), torch.float64, seed + 6),  # 16000 B, non-contiguous destination
        "bool_colslice": _rand((4, 3), torch.bool, seed + 7),
    }


def _inplace_layouts(rank: int, world_size: int) -> str:
    with _bucket(SMALL_BUCKET):
        exp = _layout_state(10)
        if rank == 0:
            spy = _SpyPG()
            PGTransport(spy, T, "cpu").send_checkpoint([1], exp)
            # a large contiguous tensor is sent straight from its own memory
            assert ((exp["big"].data_ptr(), 12000) in [(p, n) for _, p, n, _ in spy.data_sent()]), spy.data_sent()
            return "sent"
        tbase = torch.full((4, 6), -7.0)
        buf = torch.full((6, 10), -1.0)
        bigbuf = torch.full((100, 50), -3.0)
        big_t_base = torch.full((50, 40), -5.0, dtype=torch.float64)
        boolbuf = torch.ones(4, 8, dtype=torch.bool)
        mine = {
            "contig": torch.zeros(5, 4),
            "transposed": tbase.t(),
            "colslice": buf[:, 2:5],
            "big": torch.zeros(3000),
            "big_colslice": bigbuf[:, 10:30],
            "big_transposed": big_t_base.t(),
            "bool_colslice": boolbuf[:, 4:7],
        }
        assert not mine["transposed"].is_contiguous() and not mine["colslice"].is_contiguous()
        ptrs = {k: v.data_ptr() for k, v in mine.items()}
        spy = _SpyPG()
        out = PGTransport(spy, T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
        for k, v in mine.items():
            assert out[k] is v and out[k].data_ptr() == ptrs[k], k
            _assert_bits(out[k], exp[k], k)
        # a large contiguous destination receives the bytes directly
        assert (mine["big"].data_ptr(), 12000) in [(p, n) for _, p, n, _ in spy.data_received()], spy.data_received()
        # views: only their own elements changed
        _assert_bits(tbase, exp["transposed"].t(), "transposed base")
        _assert_bits(buf[:, 2:5], exp["colslice"], "colslice")
        assert (buf[:, :2] == -1).all() and (buf[:, 5:] == -1).all(), "bytes outside the column slice changed"
        _assert_bits(bigbuf[:, 10:30], exp["big_colslice"], "big_colslice")
        assert (bigbuf[:, :10] == -3).all() and (bigbuf[:, 30:] == -3).all(), "bytes outside the big slice changed"
        _assert_bits(big_t_base, exp["big_transposed"].t(), "big transposed base")
        assert boolbuf[:, :4].all() and boolbuf[:, 7:].all(), "bytes outside the bool slice changed"
        return "ok"


def test_inplace_contiguous_and_noncontiguous_destinations(pool2):
    assert pool2.run(_inplace_layouts, timeout=POOL_TIMEOUT) == ["sent", "ok"]


# ----------------------------------------------------------------------------- 3. views travel as their own elements


def _view_state() -> Dict[str, torch.Tensor]:
    base = torch.arange(1_000_000, dtype=torch.float32)
    return {
        "small_view": base[10:20],
        "big_view": base[5000:7000],  # 8000 B: alone
        "strided": base[:4000].view(40, 100)[:, ::3],  # non-contiguous, 40 x 34
        "transposed": torch.arange(12.0).view(3, 4).t(),
        "int_view": torch.arange(100, dtype=torch.int16)[7:11],
    }


def _views(rank: int, world_size: int) -> Any:
    with _bucket(SMALL_BUCKET):
        state = _view_state()
        if rank == 0:
            spy = _SpyPG()
            PGTransport(spy, T, "cpu").send_checkpoint([1], state)
            assert transport._TAG_GO not in [tag for tag, *_ in spy.sent], "one receiver: its acceptance is the go-ahead"
            sent = spy.data_sent()
            own = sum(t.numel() * t.element_size() for t in state.values())
            total = sum(n for _, _, n, _ in sent)
            # the big view is sent straight from its own bytes, and never its base
            assert (state["big_view"].data_ptr(), 8000) in [(p, n) for _, p, n, _ in sent], sent
            assert own <= total <= own + 64 * len(state), (own, total)
            return total
        out = PGTransport(None, T, "cpu").recv_checkpoint(0)
        for k, v in state.items():
            _assert_bits(out[k], v, k)
            assert out[k].untyped_storage().nbytes() == v.numel() * v.element_size(), \
                f"{k}: storage of {out[k].untyped_storage().nbytes()} bytes"
        return "ok"


def test_views_send_only_their_elements(pool2):
    total, ok = pool2.run(_views, timeout=POOL_TIMEOUT)
    assert ok == "ok" and total < 64 * 1024  # far from the 4 MB base


# ----------------------------------------------------------------------------- 4. bucketing


def test_plan_messages(monkeypatch):
    monkeypatch.setattr(transport.wire, "BUCKET_BYTES", SMALL_BUCKET)
    half = SMALL_BUCKET // 2
    tensors = [torch.zeros(3, dtype=torch.bool), torch.zeros(5, dtype=torch.float64), torch.zeros(1, dtype=torch.uint8),
               torch.zeros(half - 1, dtype=torch.uint8), torch.zeros(half // 8, dtype=torch.float64),
               torch.zeros(half + 1, dtype=torch.uint8), torch.zeros(0), torch.zeros((), dtype=torch.int16),
               torch.zeros(3 * SMALL_BUCKET, dtype=torch.uint8), torch.zeros(3, 5, dtype=torch.complex64)]
    tensors += [torch.zeros(n, dtype=torch.uint8) for n in range(1, 300, 7)]
    values: List[Any] = list(tensors)
    values.insert(4, "not a tensor")
    columns, _ = transport._Columns.describe(values)
    meta = transport._Meta(None, columns)
    meta.plan()
    plan, offsets = meta.messages, meta.offsets
    assert (plan, offsets) == transport._plan_messages(columns, SMALL_BUCKET, transport.wire.ALONE_BYTES)
    leaves = transport._LeafColumns(columns)
    seen: Dict[int, int] = {}
    for m, (size, members) in enumerate(plan):
        assert members, "an empty message"
        spans = []
        for i in members:
            tm = leaves[i].tensor
            assert tm is not None and tm.nbytes > 0 and i not in seen
            seen[i] = m
            offset = offsets[i]
            assert offset % tm.dtype.itemsize == 0, f"leaf {i}: offset {offset} not a multiple of its element"
            spans.append((offset, offset + tm.nbytes))
            if tm.nbytes >= half:
                assert members == [i] and offset == 0 and size == tm.nbytes, "a large tensor must travel alone"
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "overlapping pieces"
        # a bucket holds one run per dtype: each starts aligned, its tensors without gaps
        runs = transport._segments(meta, members)
        assert len(runs) == len({columns.dtypes[i] for i in members}), runs
        for dtype, start, end, run in runs:
            assert start % 64 == 0 and end - start == sum(columns.nbytes[i] for i in run), (dtype, start, end)
            assert {columns.dtypes[i] for i in run} == {dtype} and run == sorted(run), "a run keeps leaf order"
        assert size == spans[-1][1]
        if len(members) > 1:
            assert size <= SMALL_BUCKET
    tensor_leaves = {i for i, lf in enumerate(leaves) if lf.tensor is not None and lf.tensor.nbytes > 0}
    assert set(seen) == tensor_leaves, "every non-empty tensor travels exactly once; nothing else does"
    small_bytes = sum(leaves[i].tensor.nbytes + 64 for i in tensor_leaves if leaves[i].tensor.nbytes < half)
    buckets = [p for p in plan if not (len(p[1]) == 1 and leaves[p[1][0]].tensor.nbytes >= half)]
    assert len(buckets) <= math.ceil(small_bytes / SMALL_BUCKET) + 1, [p[0] for p in plan]


def _many_small(rank: int, world_size: int, bucket: int) -> int:
    n, numel = 2000, 256  # 2000 x 1 KiB
    with _bucket(bucket):
        exp = [torch.arange(numel, dtype=torch.float32) + i * numel for i in range(n)]
        spy = _SpyPG()
        if rank == 0:
            PGTransport(spy, T, "cpu").send_checkpoint(list(range(1, world_size)), {"t": exp})
            assert len(spy.data_sent()) % (world_size - 1) == 0
            # several receivers: each hears whether every one of them accepted before any data
            goes = [(n, dst) for n, (tag, _, _, dst) in enumerate(spy.sent) if tag == transport._TAG_GO]
            first_data = min(n for n, (tag, *_) in enumerate(spy.sent) if tag >= transport._TAG_DATA)
            assert sorted(d for _, d in goes) == list(range(1, world_size)) and max(n for n, _ in goes) < first_data
            return len(spy.data_sent()) // (world_size - 1)
        if rank == 1:
            mine = {"t": [torch.zeros(numel) for _ in range(n)]}
            out = PGTransport(spy, T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
            assert all(a is b for a, b in zip(out["t"], mine["t"]))
        else:
            out = PGTransport(spy, T, "cpu").recv_checkpoint(0)
        assert len(out["t"]) == n
        for i, (got, e) in enumerate(zip(out["t"], exp)):
            assert torch.equal(got, e), i
        return len(spy.data_received())


@pytest.mark.parametrize("bucket", [None, 64 << 10], ids=["default_bucket", "64KiB_bucket"])
def test_many_small_tensors_travel_in_few_messages(bucket):
    bucket = bucket or transport.wire.BUCKET_BYTES
    counts = get_pool(3).run(_many_small, bucket, timeout=POOL_TIMEOUT)
    least = math.ceil(2000 * 1024 / bucket)
    assert counts[0] == counts[1] == counts[2], counts
    assert least <= counts[0] <= least + 1, f"{counts[0]} data messages for 2000 tensors (expected about {least})"


_MIXED_SPECS = [((3,), torch.bool), ((5,), torch.float64), ((1,), torch.uint8), ((7,), torch.float64),
                ((2047,), torch.uint8), ((256,), torch.float64), ((2049,), torch.uint8), ((255,), torch.float64),
                ((1,), torch.bool), ((3, 5), torch.complex64), ((511,), torch.float32), ((512,), torch.float32),
                ((513,), torch.float32), ((0,), torch.float64), ((), torch.float64), ((13,), torch.int16),
                ((3,), torch.bool), ((1023,), torch.bfloat16), ((1025,), torch.float16), ((9,), torch.float64)]


def _mixed(rank: int, world_size: int) -> str:
    with _bucket(SMALL_BUCKET):
        exp = [_rand(shape, dtype, 500 + i) for i, (shape, dtype) in enumerate(_MIXED_SPECS)]
        if rank == 0:
            PGTransport(None, T, "cpu").send_checkpoint(list(range(1, world_size)), exp)
            return "sent"
        if rank == 1:  # every destination non-contiguous: pieces are viewed as their dtype in the bucket
            bases, mine = [], []
            for shape, dtype in _MIXED_SPECS:
                if len(shape) == 1 and shape[0] > 1:  # (1-element / empty strided views: test_one_element_and_empty_strided_tensors)
                    base = torch.zeros(2 * shape[0] + 1, dtype=dtype)
                    mine.append(base[1::2])
                elif len(shape) == 1:
                    base = torch.zeros(shape, dtype=dtype)
                    mine.append(base)
                elif len(shape) == 2:
                    base = torch.zeros(shape[::-1], dtype=dtype)
                    mine.append(base.t())
                else:
                    base = torch.zeros((), dtype=dtype)
                    mine.append(base)
                bases.append(base)
            out = PGTransport(None, T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
            for i, (got, m, e, base) in enumerate(zip(out, mine, exp, bases)):
                assert got is m, i
                _assert_bits(got, e, f"leaf {i}")
                if base.dim() == 1 and base.numel() > got.numel():
                    assert not base[0::2].to(torch.float64).abs().sum(), f"leaf {i}: elements outside the view changed"
            return "inplace"
        out = PGTransport(None, T, "cpu").recv_checkpoint(0)
        for i, (got, e) in enumerate(zip(out, exp)):
            _assert_bits(got, e, f"leaf {i}")
        return "new"


def test_mixed_sizes_around_threshold_and_alignment():
    assert get_pool(3).run(_mixed, timeout=POOL_TIMEOUT) == ["sent", "inplace", "new"]


def _strided_single(rank: int, world_size: int, side: str) -> Any:
    """Tensors with one element (or none) and a non-unit stride: ``w[:, 0]`` of a (1, 4)
    matrix, ``x[1:1:2]``. ``side``: which side holds the strided tensors."""
    with _fresh_group() as g:
        mk = lambda: {"col": torch.arange(4.0, dtype=torch.float64).view(1, 4)[:, 1],  # noqa: E731
                      "col_bf16": torch.arange(4.0).bfloat16().view(1, 4)[:, 2],
                      "empty": torch.zeros(3)[1:1:2], "after": torch.arange(3.0)}
        contiguous = {k: v.clone(memory_format=torch.contiguous_format) for k, v in mk().items()}
        try:
            if rank == 0:
                PGTransport(g, ERR_T, "cpu").send_checkpoint([1], mk() if side == "sender" else contiguous)
                return "sent"
            mine = {k: v.zero_() for k, v in (mk() if side == "receiver" else contiguous).items()}
            out = PGTransport(g, ERR_T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
            for k, v in contiguous.items():
                assert out[k] is mine[k]
                _assert_bits(out[k], v, k)
            return "ok"
        except Exception as e:  # noqa: BLE001 - reported to the test
            return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_one_element_and_empty_strided_tensors(pool2, side):
    results = pool2.run(_strided_single, side, timeout=POOL_TIMEOUT)
    assert results == ["sent", "ok"], results


# ----------------------------------------------------------------------------- 5. FP8 (Transformer Engine-like)


def _fp8_state() -> Dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    v = lambda *shape: (torch.randn(*shape, generator=g) * 3).bfloat16()  # noqa: E731
    return {
        "w": FakeFloat8Tensor.quantize(v(4, 8), SCALE_INV, torch.float8_e4m3fn),
        "w5": FakeFloat8Tensor.quantize(v(3, 5), 0.5, torch.float8_e5m2),
        "big": FakeFloat8Tensor.quantize(v(64, 64), SCALE_INV, torch.float8_e4m3fn),  # 4096 B: alone
        "plain": v(3),
    }


_FP8_FMT = {"w": torch.float8_e4m3fn, "w5": torch.float8_e5m2, "big": torch.float8_e4m3fn}


def _fp8(rank: int, world_size: int, mode: str) -> str:
    with _bucket(SMALL_BUCKET):
        exp = _fp8_state()
        if rank == 0:
            PGTransport(None, T, "cpu").send_checkpoint(list(range(1, world_size)), exp)
            return "sent"
        role = {("fp8", 1): "fp8", ("fp8", 2): "new", ("plain", 1): "plain", ("plain", 2): "fp8_te"}[(mode, rank)]
        if role == "new":
            out = PGTransport(None, T, "cpu").recv_checkpoint(0)
            for k in _FP8_FMT:
                assert type(out[k]) is torch.Tensor, f"{k}: {type(out[k])}"
                _assert_bits(out[k], exp[k].dequantize(), k)
            _assert_bits(out["plain"], exp["plain"], "plain")
            return role
        if role == "plain":
            buf = torch.full((8, 10), -1.0, dtype=torch.bfloat16)
            mine = {"w": buf[:4, :8], "w5": torch.zeros(3, 5, dtype=torch.bfloat16),
                    "big": torch.zeros(64, 64, dtype=torch.bfloat16), "plain": torch.zeros(3, dtype=torch.bfloat16)}
            out = PGTransport(None, T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
            for k in _FP8_FMT:
                assert out[k] is mine[k], k
                _assert_bits(mine[k], exp[k].dequantize(), k)
            assert (buf[4:] == -1).all() and (buf[:, 8:] == -1).all()
            _assert_bits(out["plain"], exp["plain"], "plain")
            return role
        te_style = role == "fp8_te"
        mine = {k: FakeFloat8Tensor.from_bytes(torch.full(tuple(exp[k].shape), 0x11, dtype=torch.uint8), 1.0, fmt,
                                               te_style_dtype=te_style)
                for k, fmt in _FP8_FMT.items()}
        mine["plain"] = torch.zeros(3, dtype=torch.bfloat16)
        data_ptrs = {k: mine[k]._data.data_ptr() for k in _FP8_FMT}
        out = PGTransport(None, T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
        for k in _FP8_FMT:
            assert out[k] is mine[k], k
            assert mine[k]._data.data_ptr() == data_ptrs[k], f"{k}: _data replaced"
            assert torch.equal(mine[k]._data, exp[k]._data), f"{k}: FP8 bytes differ"
            assert float(mine[k]._scale_inv) == float(exp[k]._scale_inv), f"{k}: scale_inv {float(mine[k]._scale_inv)}"
            assert mine[k].quantizer_calls == [] and not mine[k].amax_history.any(), f"{k}: went through the quantizer"
        _assert_bits(out["plain"], exp["plain"], "plain")
        return role


@pytest.mark.parametrize("mode", ["fp8", "plain"])
def test_fp8_tensors(mode):
    """mode fp8: rank 1 in place into FakeFloat8Tensors, rank 2 without a state; mode
    plain: rank 1 in place into plain bf16 tensors, rank 2 into TE-style FP8 tensors."""
    expected = {"fp8": ["sent", "fp8", "new"], "plain": ["sent", "plain", "fp8_te"]}[mode]
    assert get_pool(3).run(_fp8, mode, timeout=POOL_TIMEOUT) == expected


def _plain_into_fp8(rank: int, world_size: int) -> Any:
    with _fresh_group() as g:
        src = (torch.randn(4, 8, generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
        try:
            if rank == 0:
                PGTransport(g, ERR_T, "cpu").send_checkpoint([1], {"w": src})
                return "ok"
            mine = {"w": FakeFloat8Tensor.from_bytes(torch.zeros(4, 8, dtype=torch.uint8), 0.25, torch.float8_e4m3fn)}
            PGTransport(g, ERR_T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
            return ("ok", mine["w"]._data.clone(), mine["w"].quantizer_calls, mine["w"].amax_history.clone())
        except CheckpointingException as e:
            return ("refused", str(e))


def test_plain_sender_into_fp8_receiver_is_not_silently_dropped(pool2):
    """A bf16 sender tensor received in place into an FP8 tensor must either land (quantized
    with the receiver's scale, without the quantizer) or be refused on both sides; it must
    not be written into a temporary and lost."""
    sender, receiver = pool2.run(_plain_into_fp8, timeout=POOL_TIMEOUT)
    if receiver[0] == "refused":
        assert isinstance(sender, tuple) and sender[0] == "refused", sender
        return
    src = (torch.randn(4, 8, generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
    _, data, calls, amax = receiver
    assert torch.equal(data, quantize_bytes(src, 0.25, torch.float8_e4m3fn)), \
        "the received values were not written into the FP8 tensor (it still holds its old bytes)"
    assert calls == [] and not amax.any()


# ----------------------------------------------------------------------------- 6. bad input


_GOOD = lambda: {"a": torch.arange(6.0).view(2, 3), "b": {"c": torch.ones(4, dtype=torch.int64)}, "n": 3}  # noqa: E731


def _bad_state(case: str) -> Dict[str, Any]:
    s = _GOOD()
    if case == "structure":
        del s["b"]["c"]
        s["b"]["extra"] = torch.ones(4, dtype=torch.int64)
    elif case == "shape":
        s["a"] = torch.zeros(3, 2)
    elif case == "dtype":
        s["b"]["c"] = torch.zeros(4, dtype=torch.int32)
    return s


def _zeroed(s):
    return {k: (_zeroed(v) if isinstance(v, dict) else v.zero_() if isinstance(v, torch.Tensor) else v)
            for k, v in s.items()}


def _mismatch(rank: int, world_size: int, case: str, bad_ranks: List[int]) -> None:
    with _fresh_group() as g:
        start = time.monotonic()
        mine = _zeroed(_bad_state(case) if rank in bad_ranks else _GOOD())
        try:
            if rank == 0:
                PGTransport(g, ERR_T, "cpu").send_checkpoint(list(range(1, world_size)), _GOOD())
            else:
                PGTransport(g, ERR_T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
        except CheckpointingException as e:
            if rank:
                flat = [v for _, v in tree_flatten_with_path(mine)[0] if isinstance(v, torch.Tensor)]
                if any(v.any() for v in flat):
                    raise AssertionError(f"rank {rank}: tensor bytes were written before the refusal") from e
            e.elapsed = time.monotonic() - start
            raise


_MISMATCH_WORDS = {
    "structure": ["['b']['c']", "['b']['extra']"],
    "shape": ["['a']", "(2, 3)", "(3, 2)"],
    "dtype": ["['b']['c']", "torch.int64", "torch.int32"],
}


@pytest.mark.parametrize("case", ["structure", "shape", "dtype"])
def test_receiver_mismatch_raises_on_both_sides(pool2, case):
    errs = pool2.run_expect_error(_mismatch, case, [1], timeout=POOL_TIMEOUT)
    for rank, e in enumerate(errs):
        assert isinstance(e, CheckpointingException), f"rank {rank}: {type(e).__name__}: {e}"
    for word in _MISMATCH_WORDS[case]:
        assert word in str(errs[1]), f"receiver's message lacks {word!r}: {errs[1]}"
        assert word in str(errs[0]), f"sender's message lacks {word!r}: {errs[0]}"
    assert "rank 1" in str(errs[0]), errs[0]
    for rank, e in enumerate(errs):  # a refusal is answered at once, it does not wait out the timeout
        assert e.elapsed < ERR_T.total_seconds() * 0.8, f"rank {rank} took {e.elapsed:.1f} s: {e}"


def test_one_receiver_mismatch_aborts_all_three():
    errs = get_pool(3).run_expect_error(_mismatch, "shape", [1], timeout=POOL_TIMEOUT)
    for rank, e in enumerate(errs):
        assert isinstance(e, CheckpointingException), f"rank {rank}: {type(e).__name__}: {e}"
    assert "['a']" in str(errs[1]) and "(3, 2)" in str(errs[1]), errs[1]
    assert "abort" in str(errs[2]) and "rank 1" in str(errs[2]) and "['a']" in str(errs[2]), errs[2]
    assert "rank 1" in str(errs[0]) and "['a']" in str(errs[0]), errs[0]
    for rank, e in enumerate(errs):
        assert e.elapsed < ERR_T.total_seconds() * 0.8, f"rank {rank} took {e.elapsed:.1f} s: {e}"


def _refused_then_good(rank: int, world_size: int) -> str:
    with _fresh_group() as g:
        mine = {"a": torch.zeros(3, 2)}
        try:
            if rank == 0:
                PGTransport(g, ERR_T, "cpu").send_checkpoint([1], {"a": torch.ones(2, 3)})
            else:
                PGTransport(g, ERR_T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
            raise AssertionError("the mismatching transfer succeeded")
        except CheckpointingException:
            pass
        # the same group carries the next transfer (no stale message, no broken connection)
        if rank == 0:
            PGTransport(g, ERR_T, "cpu").send_checkpoint([1], {"a": torch.full((3, 2), 4.0)})
            return "sent"
        out = PGTransport(g, ERR_T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
        assert out["a"] is mine["a"] and (mine["a"] == 4).all()
        return "ok"


def test_group_usable_after_a_refused_transfer(pool2):
    assert pool2.run(_refused_then_good, timeout=POOL_TIMEOUT) == ["sent", "ok"]


def _first_message_too_small(rank: int, world_size: int, head_bytes: int) -> Any:
    """With the first message ``head_bytes`` long on both sides, the metadata and then a
    sender's error follow it as their own messages: a transfer still arrives, and the
    error (longer than the first message) still reaches the receiver."""
    old = transport.wire.HEAD_BYTES
    transport.wire.HEAD_BYTES = head_bytes
    try:
        with _fresh_group() as g:
            state = {"a": torch.arange(6.0), "name": "x" * 200, "step": 3}
            if rank == 0:
                PGTransport(g, ERR_T, "cpu").send_checkpoint([1], state)
                with contextlib.suppress(CheckpointingException):
                    PGTransport(g, ERR_T, "cpu").send_checkpoint([1], {"a": torch.ones(3), "bad": lambda: None})
                return None
            got = PGTransport(g, ERR_T, "cpu").recv_checkpoint(0)
            assert got["name"] == state["name"] and got["step"] == 3 and torch.equal(got["a"], state["a"])
            with pytest.raises(CheckpointingException, match="rank 0.*cannot be serialized") as e:
                PGTransport(g, ERR_T, "cpu").recv_checkpoint(0)
            return len(str(e.value))
    finally:
        transport.wire.HEAD_BYTES = old


def test_metadata_and_error_larger_than_the_first_message(pool2):
    head_bytes = 64
    _, error_length = pool2.run(_first_message_too_small, head_bytes, timeout=POOL_TIMEOUT)
    assert error_length > head_bytes


def _another_version(rank: int, world_size: int) -> Any:
    """Rank 0 speaks protocol version 2 (a 3 x int64 header): rank 1 refuses it, naming both versions."""
    with _fresh_group() as g:
        if rank == 0:
            header = torch.tensor([transport.wire._MAGIC, 2, 10], dtype=torch.int64)
            g.send([header], 1, transport.wire._TAG_HEADER).wait(ERR_T)
            return None
        with pytest.raises(CheckpointingException, match="rank 0 speaks another protocol") as e:
            PGTransport(g, ERR_T, "cpu").recv_checkpoint(0)
        return str(e.value)


def test_peer_speaking_another_version_is_refused(pool2):
    _, error = pool2.run(_another_version, timeout=POOL_TIMEOUT)
    assert "version 2" in error and f", {transport.PROTOCOL_VERSION})" in error, error


def _block_scaled_fp8() -> FakeFloat8Tensor:
    """An FP8 tensor with two scales (a block-scaled layout the transport cannot send)."""
    data = quantize_bytes(torch.ones(4, 8), SCALE_INV, torch.float8_e4m3fn)
    return FakeFloat8Tensor(data, torch.full((2,), SCALE_INV), torch.float8_e4m3fn, torch.bfloat16)


def _undescribable_then_good(rank: int, world_size: int, bad: str) -> Any:
    """Rank 0 sends a state with a leaf it cannot describe to ranks 1 (in place) and 2
    (allocating); every rank records its error and how long it took; then the same group
    carries a good transfer (no stale message left behind)."""
    with _fresh_group() as g:
        leaf = _block_scaled_fp8() if bad == "fp8" else (lambda: None)  # a lambda does not pickle
        mine = {"a": torch.zeros(3), "bad": {"w": torch.zeros(4, 8, dtype=torch.bfloat16)}}
        start = time.monotonic()
        try:
            if rank == 0:
                PGTransport(g, ERR_T, "cpu").send_checkpoint([1, 2], {"a": torch.ones(3), "bad": {"w": leaf}})
            else:
                PGTransport(g, ERR_T, "cpu", state_dict=(lambda: mine) if rank == 1 else None).recv_checkpoint(0)
            error = None
        except CheckpointingException as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = f"not a CheckpointingException: {type(e).__name__}: {e}"
        elapsed = time.monotonic() - start
        if rank == 0:
            PGTransport(g, ERR_T, "cpu").send_checkpoint([1, 2], {"a": torch.full((3,), 4.0)})
            return error, elapsed, None
        out = PGTransport(g, ERR_T, "cpu").recv_checkpoint(0)
        return error, elapsed, out["a"].tolist()


@pytest.mark.parametrize("bad", ["fp8", "unpicklable"])
def test_sender_that_cannot_describe_a_leaf_fails_every_rank_at_once(bad):
    results = get_pool(3).run(_undescribable_then_good, bad, timeout=POOL_TIMEOUT)
    for rank, (error, elapsed, _) in enumerate(results):
        assert error is not None, f"rank {rank}: no error"
        assert not error.startswith("not a"), f"rank {rank}: {error}"
        assert elapsed < ERR_T.total_seconds() * 0.8, f"rank {rank} took {elapsed:.1f} s (waited out its timeout)"
        if bad == "fp8":  # the leaf's key and the reason, on every rank
            assert "['bad']['w']" in error and "per-tensor" in error, f"rank {rank}: {error}"
        else:
            assert "cannot be serialized" in error, f"rank {rank}: {error}"
        if rank:
            assert "rank 0" in error, f"rank {rank}: {error}"
    assert [r[2] for r in results] == [None, [4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]


def _trivial(rank: int, world_size: int) -> Any:
    states = [{}, {"step": 5, "cfg": {"a": [1, "x", None], "t": (1, 2.5)}, "name": "run"}, [], (None,)]
    receivers_own = [{}, {"step": 0, "cfg": {"a": [0, "", None], "t": (0, 0.0)}, "name": ""}, [], (None,)]
    if rank == 0:
        for s in states:
            PGTransport(None, T, "cpu").send_checkpoint(list(range(1, world_size)), s)
        return states
    outs = []
    for own in receivers_own:
        if rank == 1:  # in place (nothing to fill: the values come from the sender)
            outs.append(PGTransport(None, T, "cpu", state_dict=lambda: own).recv_checkpoint(0))
        else:
            outs.append(PGTransport(None, T, "cpu").recv_checkpoint(0))
    return outs


def test_empty_and_value_only_states():
    sent, a, b = get_pool(3).run(_trivial, timeout=POOL_TIMEOUT)
    assert a == sent and b == sent
    assert [type(x) for x in a] == [type(x) for x in sent]


def _namedtuple_state(rank: int, world_size: int) -> Any:
    with _fresh_group() as g:
        state = {"opt": NT(torch.arange(4.0), 3), "lr": 0.5}
        try:
            if rank == 0:
                PGTransport(g, ERR_T, "cpu").send_checkpoint([1], state)
                return "sent"
            out = PGTransport(g, ERR_T, "cpu").recv_checkpoint(0)
            return type(out["opt"]).__name__, out["opt"].weight, out["opt"].step, out["lr"]
        except CheckpointingException as e:
            return "CheckpointingException", str(e)
        except Exception as e:  # noqa: BLE001 - reported to the test
            return type(e).__name__, str(e)


def test_namedtuple_in_state(pool2):
    """Design: any nested state. A namedtuple (a pytree node) must transfer, or at least
    fail with CheckpointingException on the sender rather than another exception."""
    sender, receiver = pool2.run(_namedtuple_state, timeout=POOL_TIMEOUT)
    assert sender == "sent", f"sender: {sender}"
    name, weight, step, lr = receiver
    assert name == "NT" and torch.equal(weight, torch.arange(4.0)) and step == 3 and lr == 0.5


# ----------------------------------------------------------------------------- peers that die or never answer

_CHILD = textwrap.dedent(r"""
    import json, os, sys, time
    from datetime import timedelta
    sys.path.insert(0, ROOT)
    import torch, torch.distributed as dist
    from dist_checkpointing import transport
    from dist_checkpointing.transport import PGTransport

    rank, port, done = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=60))

    def report(name, fn):
        start = time.monotonic()
        try:
            fn()
            res = {"type": None, "msg": ""}
        except BaseException as e:
            res = {"type": type(e).__name__, "msg": str(e)}
        res["elapsed"] = time.monotonic() - start
        print("RESULT " + json.dumps({name: res}), flush=True)

    transport.wire.BUCKET_BYTES = 64 << 10
    state = {f"t{i}": torch.full((64 << 10,), float(i)) for i in range(40)}  # 40 x 256 KiB, each alone
    if rank == 1:  # sender to rank 0 that exits after 5 data messages
        orig, sent = transport.PGTransport._send, [0]
        def _send(self, t, dst, tag):
            if tag >= transport._TAG_DATA:
                sent[0] += 1
                if sent[0] > 5:
                    os._exit(1)
            return orig(self, t, dst, tag)
        transport.PGTransport._send = _send
        PGTransport(None, timedelta(seconds=10), "cpu").send_checkpoint([0], state)
        os._exit(0)
    if rank == 3:  # sender to rank 2 that exits once the metadata is out
        orig_wait = transport.PGTransport._wait
        def _wait(self, works, what, peer):  # dies when it would wait for the receiver's answer
            if what == "receiving the metadata check":
                os._exit(1)
            return orig_wait(self, works, what, peer)
        transport.PGTransport._wait = _wait
        PGTransport(None, timedelta(seconds=10), "cpu").send_checkpoint([2], state)
        os._exit(0)
    mine = {k: torch.zeros_like(v) for k, v in state.items()}
    if rank == 0:
        report("partway", lambda: PGTransport(None, timedelta(seconds=10), "cpu",
                                               state_dict=lambda: mine).recv_checkpoint(1))
        # then send to rank 2, which never calls recv_checkpoint
        report("norecv", lambda: PGTransport(None, timedelta(seconds=3), "cpu").send_checkpoint([2], {"x": torch.ones(3)}))
        os._exit(0)
    def slow_state():  # the receiver's state takes a moment: the sender is gone when it answers
        time.sleep(1.5)
        return mine
    report("after_metadata", lambda: PGTransport(None, timedelta(seconds=10), "cpu",
                                                  state_dict=slow_state).recv_checkpoint(3))
    deadline = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)
""").replace("ROOT", repr(_ROOT))


class _PeerFailureLaunch:
    """The world-4 children of :func:`peer_failures`, started early (they mostly wait)."""

    def __init__(self, workdir):
        self.script, self.done = workdir / "child.py", workdir / "done"
        self.script.write_text(_CHILD)
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs = [Launched([str(self.script), str(r), str(port), str(self.done)], env=env) for r in range(4)]
        self.results: Dict[str, Dict[str, Any]] = {}

    def collect(self) -> Dict[str, Dict[str, Any]]:
        if self.results:
            return self.results
        outputs = [""] * 4
        try:
            try:
                outputs[0] = "".join(self.procs[0].communicate(timeout=slack(90)))
            finally:
                self.done.touch()
            for r in (1, 2, 3):
                outputs[r] = "".join(self.procs[r].communicate(timeout=slack(30)))
        finally:
            self.kill()
        for out in outputs:
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    self.results.update(json.loads(line[len("RESULT "):]))
        self.results["_log"] = {"outputs": outputs}
        return self.results

    def kill(self) -> None:
        self.done.touch()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module", autouse=True)
def _peer_failure_launch(request, tmp_path_factory):
    """Start the children at the module's first test when a selected test needs them."""
    needed = any("peer_failures" in getattr(item, "fixturenames", ()) for item in request.session.items)
    launch = _PeerFailureLaunch(tmp_path_factory.mktemp("peer_failures")) if needed else None
    yield launch
    if launch is not None:
        launch.kill()


@pytest.fixture(scope="module")
def peer_failures(_peer_failure_launch) -> Dict[str, Dict[str, Any]]:
    """One world-4 launch of new processes (launch.py): rank 1 sends to rank 0 and exits after 5 data
    messages; rank 3 sends to rank 2 and exits right after the metadata; then rank 0 sends to
    rank 2, which never receives. Returns each scenario's result (exception type, message,
    seconds) as seen by the surviving rank."""
    return _peer_failure_launch.collect()


def _result(results, name):
    assert name in results, f"no result for {name}; children's output:\n" + "\n---\n".join(results["_log"]["outputs"])
    return results[name]


def test_sender_exits_midway(peer_failures):
    res = _result(peer_failures, "partway")
    assert res["type"] == "CheckpointingException", res
    assert "rank 1" in res["msg"], res
    assert res["elapsed"] < 20, res


def test_sender_exits_after_metadata(peer_failures):
    res = _result(peer_failures, "after_metadata")
    assert res["type"] == "CheckpointingException", res
    assert "rank 3" in res["msg"], res
    assert res["elapsed"] < 20, res


def test_receiver_that_never_receives(peer_failures):
    res = _result(peer_failures, "norecv")
    assert res["type"] == "CheckpointingException", res
    assert "rank 2" in res["msg"], res
    assert 2.5 < res["elapsed"] < 10, res  # waited for its own 3 s timeout, not forever


# ----------------------------------------------------------------------------- 7. recover_from_peer


def _recover(rank: int, world_size: int) -> Dict[str, Any]:
    torch.manual_seed(100 + rank)  # every rank starts from different values
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 4)).pow(2).sum().backward()
    opt.step()
    before = model.weight.detach().clone()
    step = 5 if rank == 0 else 0
    state_fn = lambda: {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}  # noqa: E731
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    opt_objs = [dict(s) for s in opt.state.values()]
    out = recover_from_peer(state_fn, 0, [1, 2], timeout=T)
    if rank == 0:
        assert out is None
    else:
        assert out["step"] == 5
        for n, p in model.named_parameters():
            assert p.data_ptr() == ptrs[n] and out["model"][n].data_ptr() == ptrs[n], f"{n}: not in place"
        for objs, s in zip(opt_objs, opt.state.values()):
            assert all(s[k] is v for k, v in objs.items()), "optimizer state tensors replaced"
        for i, s in out["optim"]["state"].items():
            assert all(v is opt.state[opt.param_groups[0]["params"][i]][k] for k, v in s.items())
    return {"before": before, "model": {n: p.detach().clone() for n, p in model.named_parameters()},
            "optim": [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]}


def test_recover_from_peer_world3():
    states = get_pool(3).run(_recover, timeout=POOL_TIMEOUT)
    healthy = states[0]
    for rank in (1, 2):
        assert not torch.equal(states[rank]["before"], healthy["model"]["weight"]), "ranks must start different"
        for n, t in healthy["model"].items():
            _assert_bits(states[rank]["model"][n], t, f"rank {rank} {n}")
        assert len(states[rank]["optim"]) == len(healthy["optim"]) == 2
        for s_got, s_exp in zip(states[rank]["optim"], healthy["optim"]):
            assert set(s_got) == set(s_exp) == {"step", "exp_avg", "exp_avg_sq"}
            for k in s_exp:
                _assert_bits(s_got[k], s_exp[k], f"rank {rank} optim {k}")


def _recover_neither(rank: int, world_size: int) -> str:
    model = torch.nn.Linear(2, 2)
    try:
        recover_from_peer(lambda: {"model": model.state_dict()}, 0, [1], timeout=T)
        return "ok"
    except CheckpointingException as e:
        return f"raised: {e}"


def test_recover_from_peer_rank_neither_healthy_nor_recovering():
    results = get_pool(3).run(_recover_neither, timeout=POOL_TIMEOUT)
    assert results[:2] == ["ok", "ok"], results
    assert results[2].startswith("raised:") and "rank 2" in results[2], results[2]


def test_metadata_round_trip():
    # The metadata travels as columns; per-leaf objects are built on first use. Every
    # field of every leaf comes back, values included; the structure compares equal.
    from torch.utils._pytree import tree_flatten

    state = {"w": torch.zeros(3, 4, dtype=torch.bfloat16, requires_grad=True), "step": 7, "none": None,
             "m": [torch.ones(5, dtype=torch.int16), "text"]}
    values, treespec = tree_flatten(state)
    columns, tensors = transport._Columns.describe(values)
    assert [t is v if isinstance(v, torch.Tensor) else t is None for t, v in zip(tensors, values)] == [True] * len(values)
    columns.fp8[0] = (torch.float8_e4m3fn, 0.5)  # as if an FP8 tensor
    sent = transport._Meta(treespec, columns, receivers=2, bucket_bytes=1 << 10, alone_bytes=16)
    meta = transport._decode_meta(transport._encode_meta(sent))
    assert meta.treespec == treespec and meta.fp8_leaves == [0]
    assert (meta.receivers, meta.bucket_bytes, meta.alone_bytes) == (2, 1 << 10, 16)
    sent.plan()
    meta.plan()  # the receiver's plan is the sender's
    assert (meta.messages, meta.offsets) == (sent.messages, sent.offsets) and len(meta.messages) == 2
    assert meta.columns == columns
    assert len(meta.leaves) == len(values)
    w = meta.leaves[0]
    assert w.kind == "tensor" and w.tensor.shape == (3, 4) and w.tensor.dtype == torch.bfloat16
    assert w.tensor.nbytes == 24 and w.tensor.requires_grad and w.tensor.fp8 == (torch.float8_e4m3fn, 0.5)
    assert [lf.value for lf in meta.leaves if lf.kind == "value"] == [v for v in values if not isinstance(v, torch.Tensor)]
    assert meta.leaves[-1] is meta.leaves[-1]  # decoded once


def test_decoding_metadata_leaves_the_warning_filters_alone():
    """Decoding warns nothing and changes no warning filter: the filters are the process's,
    and silencing a warning for the decode (``catch_warnings``) would also silence another
    thread's warnings meanwhile, or drop a filter it adds."""
    import threading
    import warnings

    from torch.utils._pytree import tree_flatten

    values, treespec = tree_flatten({f"layer{i}": {"w": torch.zeros(1), "b": [1, None]} for i in range(200)})
    payload = transport._encode_meta(transport._Meta(treespec, transport._Columns.describe(values)[0], 1))
    with warnings.catch_warnings(record=True) as seen:  # the user's setup: every warning counted
        warnings.simplefilter("always")
        stop, emitted = threading.Event(), []

        def user_thread():
            while not stop.is_set():
                warnings.warn("the user's own", FutureWarning)
                emitted.append(1)

        thread = threading.Thread(target=user_thread)
        thread.start()
        try:
            for _ in range(50):
                assert transport._decode_meta(payload).treespec == treespec
        finally:
            stop.set()
            thread.join()
        assert [str(w.message) for w in seen] == ["the user's own"] * len(emitted)


# ----------------------------------------------------------------------------- 8. host bounce (accelerator tensors over gloo)


class _Bounced(PGTransport):
    """The transport with every tensor taken for an accelerator tensor on a host-memory
    wire: with ``HOST_STAGING`` on, every data message goes through host bounce buffers
    (:mod:`dist_checkpointing.transport.host_bounce`), the CPU standing in for the device (the
    code CUDA state over gloo runs; the copies are synchronous here, and not pinned)."""

    def _through_host(self, t: torch.Tensor) -> bool:
        return True


class _host_bounce:
    """Set ``HOST_STAGING`` and ``STAGING_BYTES`` inside a rank function (restored on exit)."""

    def __init__(self, on: bool, limit: int = 64 << 20):
        self.values, self.old = (on, limit), None

    def __enter__(self):
        self.old = transport.wire.HOST_STAGING, transport.wire.STAGING_BYTES
        transport.wire.HOST_STAGING, transport.wire.STAGING_BYTES = self.values

    def __exit__(self, *exc):
        transport.wire.HOST_STAGING, transport.wire.STAGING_BYTES = self.old


def _bounced_state(seed: int) -> Dict[str, Any]:
    """Every dtype and kind of leaf (the rich state), small and alone tensors around the
    bucket's threshold, and the layouts of the in-place test."""
    return {"rich": _rich_state(seed),
            "mixed": [_rand(shape, dtype, seed * 100 + i) for i, (shape, dtype) in enumerate(_MIXED_SPECS)],
            "layout": _layout_state(seed * 10)}


def _bounced_transfer(rank: int, world_size: int, limit: int) -> Any:
    with _host_bounce(True, limit), _bucket(SMALL_BUCKET):
        exp = _bounced_state(1)
        spy = _SpyPG()
        if rank == 0:
            _Bounced(spy, T, "cpu").send_checkpoint(list(range(1, world_size)), exp)
            sent = [(p, n) for _, p, n, _ in spy.data_sent()]
            # bounced: even a large contiguous tensor goes out of a host buffer, not its own memory
            assert (exp["layout"]["big"].data_ptr(), 12000) not in sent, sent
            return len(sent) // (world_size - 1)
        if rank == 2:  # new tensors: nothing to bounce on the receiver (they are host tensors)
            out = _Bounced(spy, T, "cpu").recv_checkpoint(0)
            _check_rich(out["rich"], exp["rich"], None)
            for k, v in {**dict(enumerate(exp["mixed"])), **exp["layout"]}.items():
                got = out["mixed"][k] if isinstance(k, int) else out["layout"][k]
                _assert_bits(got, v, str(k))
            return len(spy.data_received())
        mine = _bounced_state(2)
        # non-contiguous destinations (their bases keep other bytes)
        base = torch.full((100, 50), -3.0)
        mine["layout"]["big_colslice"] = base[:, 10:30]
        tbase = torch.full((50, 40), -5.0, dtype=torch.float64)
        mine["layout"]["big_transposed"] = tbase.t()
        mine["mixed"][5] = torch.zeros(513, dtype=torch.float64)[1::2]
        mine["mixed"][9] = torch.zeros(5, 3, dtype=torch.complex64).t()
        leaves = [v for v in tree_flatten_with_path(mine)[0]]
        ptrs = [(str(p), v.data_ptr()) for p, v in leaves if isinstance(v, torch.Tensor)]
        out = _Bounced(spy, T, "cpu", state_dict=lambda: mine).recv_checkpoint(0)
        _check_rich(out["rich"], exp["rich"], mine["rich"])
        for k, v in exp["layout"].items():
            assert out["layout"][k] is mine["layout"][k], k
            _assert_bits(mine["layout"][k], v, k)
        for i, v in enumerate(exp["mixed"]):
            assert out["mixed"][i] is mine["mixed"][i], i
            _assert_bits(mine["mixed"][i], v, f"mixed {i}")
        assert [(str(p), v.data_ptr()) for p, v in tree_flatten_with_path(mine)[0] if isinstance(v, torch.Tensor)] == ptrs
        assert (base[:, :10] == -3).all() and (base[:, 30:] == -3).all(), "bytes outside the column slice changed"
        _assert_bits(tbase, exp["layout"]["big_transposed"].t(), "transposed base")
        received = [(p, n) for _, p, n, _ in spy.data_received()]
        assert (mine["layout"]["big"].data_ptr(), 12000) not in received, "bounced: received into a host buffer"
        return len(received)


@pytest.mark.parametrize("limit", [1, 64 << 20], ids=["one_message_at_a_time", "default_limit"])
def test_host_bounce_every_dtype_and_layout_world3(limit):
    """The host-bounce path (CPU standing in for the device): every dtype, scalars, empty
    tensors, views and non-contiguous destinations, bit-exact; rank 1 in place, rank 2 into
    new tensors; with a limit of 1 byte the pipeline holds the fewest messages it can (one
    copied out ahead on the sender, two receives posted)."""
    sent, inplace, new = get_pool(3).run(_bounced_transfer, limit, timeout=POOL_TIMEOUT)
    assert sent == inplace == new > 10, (sent, inplace, new)


def _cpu_state_with_host_bounce_on(rank: int, world_size: int) -> str:
    with _host_bounce(True):
        return _inplace_layouts(rank, world_size)


def test_host_bounce_leaves_cpu_state_on_its_path(pool2):
    """With ``HOST_STAGING`` on, CPU state over gloo still travels straight from and into the
    tensors' own memory (the checks of the in-place test)."""
    assert pool2.run(_cpu_state_with_host_bounce_on, timeout=POOL_TIMEOUT) == ["sent", "ok"]
