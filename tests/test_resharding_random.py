"""Random resharding through real save/load on gloo process pools.

Hypothesis draws, in the test process, a few global tensors (shape, dtype), a save layout
and a load layout for each. A layout splits every axis into contiguous (possibly uneven)
pieces, takes the Cartesian product as chunks, and hands each chunk to one or several
ranks, exactly one of which holds the main replica (``replica_id`` 0 / all zeros). Axes
can be *prepended* (size-1 pieces absent from the local tensor). The ranks save layout A
into a fresh directory, then load layout B into zero-filled tensors and compare every
chunk with the expected slice of the global tensor.
"""

from __future__ import annotations

import itertools
import math
import os
import uuid
from typing import Any, Dict, List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import get_pool

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
KEY_NAMES = ["decoder.layers.linear_qkv.weight", "optimizer/state/exp_avg", "embedding.word_embeddings.weight"]
MAX_DIM_SIZE = {1: 9, 2: 5, 3: 4}
# raise (e.g. RESHARD_EXAMPLES=500) for a longer bug hunt
EXAMPLES_PER_WORLD = int(os.environ.get("RESHARD_EXAMPLES", "12"))

# A chunk held by a rank: (global_offset, sizes including prepended axes, replica_id)
Chunk = Tuple[Tuple[int, ...], Tuple[int, ...], Any]


# ----------------------------------------------------------------------------- rank side


def global_values(shape: Tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """A deterministic global tensor whose neighbouring elements differ (where the dtype allows)."""
    n = math.prod(shape)
    idx = torch.arange(n, dtype=torch.int64) + 17 * salt
    if dtype == torch.bool:
        vals = (idx * 7919) % 3 == 1
    elif dtype == torch.uint8:
        vals = idx % 251
    elif dtype == torch.int8:
        vals = idx % 251 - 125
    elif dtype in (torch.int16, torch.int32):
        vals = idx * 37 - 1000
    elif dtype == torch.int64:
        vals = idx * 1_000_000_007 - 3
    elif dtype in (torch.float16, torch.bfloat16):
        vals = (idx % 256).to(torch.float32) * 0.5 - 64.0
    else:
        vals = idx.to(torch.float64) * 0.25 + 0.125
    return vals.to(dtype).reshape(shape)


def _chunk_index(offset, sizes, prepend):
    return tuple(offset[:prepend]) + tuple(slice(o, o + s) for o, s in zip(offset[prepend:], sizes[prepend:]))


def _save_rank(rank: int, world_size: int, ckpt_dir: str, example: int, keys: List[Dict[str, Any]]) -> int:
    from dist_checkpointing import ShardedTensor, save

    sharded: Dict[str, list] = {}
    for spec in keys:
        shape, dtype, p = spec["shape"], spec["dtype"], spec["save_prepend"]
        glob = global_values(shape, dtype, spec["salt"])
        for offset, sizes, replica_id in spec["save"][rank]:
            data = glob[_chunk_index(offset, sizes, p)]
            if not spec["save_view"]:
                data = data.clone()
            sh = ShardedTensor(spec["name"], data, dtype, sizes[p:], shape, offset, None,
                               replica_id=replica_id, prepend_axis_num=p)
            sharded.setdefault(spec["name"], []).append(sh)
    state = {"common": {"example": example, "world": world_size}, "model": sharded}
    save(state, ckpt_dir)
    return sum(len(v) for v in sharded.values())


def _load_rank(rank: int, world_size: int, ckpt_dir: str, example: int, keys: List[Dict[str, Any]]) -> int:
    from dist_checkpointing import ShardedTensor, load

    request: Dict[str, list] = {}
    expected: Dict[str, list] = {}
    for spec in keys:
        shape, dtype, p = spec["shape"], spec["dtype"], spec["load_prepend"]
        glob = global_values(shape, dtype, spec["salt"])
        for offset, sizes, replica_id in spec["load"][rank]:
            data = torch.zeros(sizes[p:], dtype=dtype)
            sh = ShardedTensor(spec["name"], data, dtype, sizes[p:], shape, offset, None,
                               replica_id=replica_id, prepend_axis_num=p)
            request.setdefault(spec["name"], []).append(sh)
            expected.setdefault(spec["name"], []).append((glob[_chunk_index(offset, sizes, p)], data, offset, sizes))
    result = load({"model": request}, ckpt_dir)

    assert result["common"] == {"example": example, "world": world_size}, result["common"]
    loaded = result.get("model", {})
    assert set(loaded) == set(expected), (sorted(loaded), sorted(expected))
    checked = 0
    for name, chunks in expected.items():
        assert len(loaded[name]) == len(chunks)
        for got, (want, requested, offset, sizes) in zip(loaded[name], chunks):
            assert isinstance(got, torch.Tensor), type(got)
            assert got.dtype == want.dtype and got.shape == want.shape, (name, offset, got.dtype, got.shape, want.shape)
            assert torch.equal(got, want), (
                f"rank {rank}: {name} chunk at offset {offset} sizes {sizes} differs:\n"
                f"got {got}\nwant {want}"
            )
            # loading fills the request's own tensor in place
            assert got.data_ptr() == requested.data_ptr() and torch.equal(requested, want), (name, offset)
            checked += 1
    return checked


# ----------------------------------------------------------------------------- test side


def _replica_id(draw, kind, main: bool):
    if kind == "int":
        return 0 if main else draw(st.integers(1, 3))
    length = kind
    if main:
        return (0,) * length
    ids = draw(st.lists(st.integers(0, 2), min_size=length, max_size=length))
    if all(i == 0 for i in ids):
        ids[draw(st.integers(0, length - 1))] = 1
    return tuple(ids)


@st.composite
def layouts(draw, shape: Tuple[int, ...], prepend: int, world: int, allow_unrequested: bool):
    """Per-rank lists of chunks covering ``shape`` (every chunk held by >= 1 rank unless
    ``allow_unrequested``), with exactly one main replica per held chunk."""
    pieces_per_dim = []
    for axis, size in enumerate(shape):
        if axis < prepend:
            pieces = [(i, 1) for i in range(size)]
        else:
            cuts = sorted(draw(st.sets(st.integers(1, size - 1), max_size=size - 1))) if size > 1 else []
            bounds = [0] + cuts + [size]
            pieces = [(a, b - a) for a, b in zip(bounds, bounds[1:])]
        pieces_per_dim.append(pieces)
    kind = draw(st.sampled_from(["int", 2, 3]))
    per_rank: List[List[Chunk]] = [[] for _ in range(world)]
    for chunk in itertools.product(*pieces_per_dim):
        offset = tuple(p[0] for p in chunk)
        sizes = tuple(p[1] for p in chunk)
        if allow_unrequested and draw(st.integers(0, 9)) == 0:
            continue
        holders = draw(st.lists(st.integers(0, world - 1), unique=True, min_size=1, max_size=world))
        for j, r in enumerate(holders):  # the first holder drawn has the main replica
            per_rank[r].append((offset, sizes, _replica_id(draw, kind, main=(j == 0))))
    # the order of a rank's chunks in its state dict is arbitrary
    return [draw(st.permutations(chunks)) for chunks in per_rank]


@st.composite
def tensor_specs(draw, world: int, name: str, salt: int):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, MAX_DIM_SIZE[ndim]), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    # prepended axes: usually none; all axes prepended (scalar local data) is allowed too
    save_prepend = draw(st.sampled_from([0, 0, 0] + list(range(1, ndim + 1))))
    load_prepend = draw(st.sampled_from([0, 0, 0] + list(range(1, ndim + 1))))
    return {
        "name": name,
        "salt": salt,
        "shape": shape,
        "dtype": dtype,
        "save_prepend": save_prepend,
        "load_prepend": load_prepend,
        "save_view": draw(st.booleans()),
        "save": draw(layouts(shape, save_prepend, world, allow_unrequested=False)),
        "load": draw(layouts(shape, load_prepend, world, allow_unrequested=True)),
    }


@st.composite
def cases(draw, world: int):
    n_keys = draw(st.integers(1, 3))
    return [draw(tensor_specs(world, KEY_NAMES[i], salt=i)) for i in range(n_keys)]


def _describe(keys) -> str:
    lines = []
    for k in keys:
        lines.append(f"{k['name']}: shape={k['shape']} dtype={k['dtype']} prepend save/load="
                     f"{k['save_prepend']}/{k['load_prepend']} view={k['save_view']}")
        lines.append(f"  save={k['save']}")
        lines.append(f"  load={k['load']}")
    return "\n".join(lines)


def run_case(world: int, keys, base_dir) -> None:
    pool = get_pool(world)
    ckpt_dir = str(base_dir / f"ckpt_{uuid.uuid4().hex[:8]}")  # does not exist yet: save creates it
    example = int(uuid.uuid4().int % 10_000)
    saved = pool.run(_save_rank, ckpt_dir, example, keys)
    held = sum(len(k["save"][r]) for k in keys for r in range(world))
    assert sum(saved) == held
    checked = pool.run(_load_rank, ckpt_dir, example, keys)
    assert sum(checked) == sum(len(k["load"][r]) for k in keys for r in range(world))


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"world{w}")
@settings(
    max_examples=EXAMPLES_PER_WORLD,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(data=st.data())
def test_random_resharding(world, data, tmp_path_factory):
    keys = data.draw(cases(world), label="keys")
    note_desc = _describe(keys)
    try:
        run_case(world, keys, tmp_path_factory.mktemp("reshard"))
    except Exception as e:
        raise AssertionError(f"resharding failed for:\n{note_desc}") from e


# ----------------------------------------------------------------------------- fixed cases


def _spec(name, shape, dtype, save, load, save_prepend=0, load_prepend=0, salt=0, save_view=False):
    return {"name": name, "salt": salt, "shape": shape, "dtype": dtype, "save_prepend": save_prepend,
            "load_prepend": load_prepend, "save_view": save_view, "save": save, "load": load}


def _grid_1d(bounds, owners, world):
    """1-D chunks [bounds[i], bounds[i+1]) held by ``owners[i]`` (rank list; first = main)."""
    per_rank = [[] for _ in range(world)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for j, r in enumerate(owners[i]):
            per_rank[r].append(((a,), (b - a,), 0 if j == 0 else j))
    return per_rank


def test_uneven_pieces_to_other_uneven_pieces(tmp_path):
    # sizes [3, 1, 2] on ranks 0, 1, 1 (chunk 2 replicated on rank 0) -> sizes [2, 4]
    save = _grid_1d([0, 3, 4, 6], [[0], [1], [1, 0]], 2)
    load = _grid_1d([0, 2, 6], [[1, 0], [0]], 2)
    run_case(2, [_spec("u", (6,), torch.bfloat16, save, load)], tmp_path)


def test_stacked_layers_to_flat_and_back(tmp_path):
    # save: 4 layers of a (3, 4) weight, one layer per chunk with prepend_axis_num=1, split over
    # 4 ranks with rank offsets along the hidden axis too; load: the whole (4, 3, 4) at once on
    # every rank (rank 0 main) and, for a second key, the reverse direction.
    world = 4
    save_stacked = [[] for _ in range(world)]
    for layer in range(4):
        for half in range(2):
            r = (layer + half) % world
            save_stacked[r].append(((layer, 0, 2 * half), (1, 3, 2), 0))
    load_flat = [[((0, 0, 0), (4, 3, 4), 0 if r == 0 else r)] for r in range(world)]
    save_flat = [[((0, 0, 0), (2, 3, 4), 0)], [((2, 0, 0), (2, 3, 4), 0)], [], [((0, 0, 0), (2, 3, 4), 1)]]
    load_stacked = [[((r, 0, 0), (1, 3, 4), 0)] for r in range(world)]
    run_case(world, [
        _spec("stacked", (4, 3, 4), torch.float32, save_stacked, load_flat, save_prepend=1, load_prepend=0),
        _spec("flat", (4, 3, 4), torch.int64, save_flat, load_stacked, save_prepend=0, load_prepend=1, salt=1),
    ], tmp_path)


def test_all_axes_prepended_scalar_chunks(tmp_path):
    # every element its own 0-d local tensor (prepend_axis_num = ndim) -> 2-D chunks
    world = 2
    save = [[] for _ in range(world)]
    for i, j in itertools.product(range(2), range(3)):
        save[(i + j) % world].append(((i, j), (1, 1), 0))
    load = [[((0, 0), (2, 2), 0)], [((0, 2), (2, 1), 0), ((0, 0), (2, 2), 1)]]
    run_case(world, [_spec("s", (2, 3), torch.float16, save, load, save_prepend=2, load_prepend=0)], tmp_path)


def test_several_keys_views_and_tuple_replicas(tmp_path):
    world = 4
    # key a: (4, 6) split 2x2 regular, every chunk replicated on two ranks with tuple ids
    save_a = [[] for _ in range(world)]
    for n, (i, j) in enumerate(itertools.product(range(2), range(2))):
        save_a[n].append(((2 * i, 3 * j), (2, 3), (0, 0)))
        save_a[(n + 1) % world].append(((2 * i, 3 * j), (2, 3), (0, 1)))
    load_a = [[((0, 0), (1, 6), (0, 0))], [((1, 0), (3, 2), (0, 0))], [((1, 2), (3, 4), (0, 0))],
              [((0, 0), (4, 6), (1, 0))]]
    # key b: uint8 (7,) uneven, all on rank 3
    save_b = [[], [], [], [((0,), (5,), 0), ((5,), (2,), 0)]]
    load_b = [[((0,), (7,), 0)], [((0,), (7,), 1)], [], [((3,), (1,), 1)]]
    run_case(world, [
        _spec("a", (4, 6), torch.int16, save_a, load_a, save_view=True),
        _spec("b", (7,), torch.uint8, save_b, load_b, salt=1),
        _spec("c", (3,), torch.bool, [[((0,), (3,), 0)], [], [], []], [[], [], [((1,), (2,), 0)], []], salt=2),
    ], tmp_path)
