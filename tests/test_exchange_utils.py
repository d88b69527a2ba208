"""``exchange_utils``: the deterministic greedy shard assignment, the group distribution
computed from per-rank summaries, and the three byte-level exchange algorithms.

The assignment is checked against a naive re-implementation of its documented order
(cross-group loads last, fewest holders, largest first, shard id; least-loaded holder,
lowest rank on a tie) with hypothesis, plus hand-computed examples. The distribution and
the exchanges run on real gloo groups of a pool (the whole world and the DP sub-groups
{0, 2}, {1, 3} of world 4): each rank builds its ShardedTensors, computes the distribution,
"loads" the shards assigned to it with deterministic values (random bytes, so every bit
pattern of every dtype travels) and receives the others; every received shard is compared
byte for byte with the value it must have and must land in the request's own tensor.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing import exchange_utils as eu
from dist_checkpointing.exchange import tensors as exchange_tensors  # where the buffer sizes live
from dist_checkpointing.exchange_utils import ShardDistribution, ShardInfo, shard_id

from .conftest import get_pool

_TIMEOUT = 60.0

DTYPES = {
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "i16": torch.int16,
    "i64": torch.int64,
    "f8": torch.float8_e4m3fn,
    "b": torch.bool,
}
# Replicated shards only: more dtypes gloo cannot carry as such, and some it can.
EXTRA_DTYPES = {
    "u16": torch.uint16,
    "u32": torch.uint32,
    "u64": torch.uint64,
    "f8e5": torch.float8_e5m2,
    "f16": torch.float16,
    "c64": torch.complex64,
    "u8": torch.uint8,
}

# Exchange constants per mode; "tiny" forces many buckets and rounds and shards that
# span rounds (96 is not a multiple of 8, so int64 elements are split between rounds).
MODES: Dict[str, Dict[str, int]] = {
    "tiny": {"SMALL_SHARD_BYTES": 64, "BUCKET_BYTES": 200, "ROUND_BYTES": 96},
    "default": {},
}


# ----------------------------------------------------------------------------- assignment


def _reference_assignment(shard_to_ranks, shard_to_size, num_ranks, cross=()):
    """The documented greedy order, written the naive way (no heaps, no list sharing)."""
    cross = set(cross)
    loads = [0] * num_ranks
    out = {}
    order = sorted(shard_to_ranks, key=lambda s: (s in cross, len(set(shard_to_ranks[s])), -shard_to_size[s], s))
    for sid in order:
        rank = min(set(shard_to_ranks[sid]), key=lambda r: (loads[r], r))
        loads[rank] += shard_to_size[sid]
        out[sid] = rank
    return out


_SIZES = st.one_of(st.sampled_from([0, 1, 4, 64, 100]), st.integers(0, 1000))


@st.composite
def _problems(draw, full_replication: bool = False):
    """``(shard_to_ranks, shard_to_size, num_ranks, cross)``; holder lists are sometimes
    shared objects, sometimes fresh (permuted, with duplicates)."""
    num_ranks = draw(st.integers(1, 6))
    ids = draw(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 30)), max_size=40, unique=True))
    everyone = list(range(num_ranks))
    fresh_holders = (st.permutations(everyone).map(list) if full_replication else
                     st.lists(st.integers(0, num_ranks - 1), min_size=1, max_size=num_ranks + 2))
    shared = [draw(fresh_holders) for _ in range(3)]
    shard_to_ranks = {}
    for sid in ids:
        choice = draw(st.integers(0, 4))
        shard_to_ranks[sid] = shared[choice] if choice < 3 else (everyone if full_replication and choice == 3
                                                                  else draw(fresh_holders))
    sizes = {sid: draw(_SIZES) for sid in ids}
    cross = draw(st.sets(st.sampled_from(ids))) if ids else set()
    return shard_to_ranks, sizes, num_ranks, cross


@settings(max_examples=100, deadline=None)
@given(_problems(), st.randoms(use_true_random=False))
def test_assignment_follows_documented_order_and_is_deterministic(problem, rnd):
    shard_to_ranks, sizes, num_ranks, cross = problem
    got = eu.distribute_shards_to_ranks(shard_to_ranks, sizes, num_ranks, cross)
    assert got == _reference_assignment(shard_to_ranks, sizes, num_ranks, cross)
    for sid, rank in got.items():
        assert rank in shard_to_ranks[sid], (sid, rank)
    assert set(got) == set(shard_to_ranks)
    # Same input in another insertion order, with fresh holder lists (no sharing), and the
    # cross loads as another iterable: the same answer.
    items = list(shard_to_ranks.items())
    rnd.shuffle(items)
    permuted = {sid: list(reversed(ranks)) for sid, ranks in items}
    sizes_items = list(sizes.items())
    rnd.shuffle(sizes_items)
    again = eu.distribute_shards_to_ranks(permuted, dict(sizes_items), num_ranks, sorted(cross))
    assert again == got
    assert eu.distribute_shards_to_ranks(shard_to_ranks, sizes, num_ranks, cross) == got


@settings(max_examples=100, deadline=None)
@given(_problems(full_replication=True))
def test_assignment_balances_fully_replicated_shards(problem):
    shard_to_ranks, sizes, num_ranks, cross = problem
    got = eu.distribute_shards_to_ranks(shard_to_ranks, sizes, num_ranks, cross)
    loads = [0] * num_ranks
    for sid, rank in got.items():
        loads[rank] += sizes[sid]
    largest = max(sizes.values(), default=0)
    assert max(loads) - min(loads) <= largest, (loads, largest)


def test_assignment_hand_computed_examples():
    # Fewest holders first (b), then largest first (c, d before f), cross-group loads last
    # (e, although it is the largest of the three-holder shards).
    holders = {"a": [0, 1, 2], "b": [1], "c": [0, 1], "d": [1, 0], "e": [2, 1, 0], "f": [2, 0]}
    sizes = {"a": 10, "b": 1, "c": 5, "d": 5, "e": 20, "f": 3}
    # b->1 [0,1,0]; c->0 [5,1,0]; d->1 [5,6,0]; f->2 [5,6,3]; a->2 [5,6,13]; e->0 [25,6,13]
    assert eu.distribute_shards_to_ranks(holders, sizes, 3, ["e"]) == {
        "a": 2, "b": 1, "c": 0, "d": 1, "e": 0, "f": 2}
    # Without the cross-group mark e goes first among the three-holder shards.
    assert eu.distribute_shards_to_ranks(holders, sizes, 3) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 2, "f": 2}

    # Largest first, shard id on equal sizes, lowest rank on equal loads:
    # q->0 [9,0]; x->1 [9,4]; y->1 [9,8]; z->1 [9,10]; p->0 [10,10]; w (0 bytes) tie -> 0.
    both = [0, 1]
    holders = {"p": both, "q": [1, 0], "w": both, "x": both, "y": [0, 1, 1], "z": both}
    sizes = {"p": 1, "q": 9, "w": 0, "x": 4, "y": 4, "z": 2}
    assert eu.distribute_shards_to_ranks(holders, sizes, 2) == {"q": 0, "x": 1, "y": 1, "z": 1, "p": 0, "w": 0}
    assert eu.distribute_shards_to_ranks({}, {}, 3) == {}

    # Holder sets {0, 1} and {1, 2} interleave, so rank 1's load grows through the other
    # set: a->0 [10,0,0]; b->1 [10,10,0]; c->2 [10,10,10]; d->1 [10,19,10]; e: rank 0 (10)
    # is less loaded than rank 1 (19) -> 0.
    x, y = [0, 1], [1, 2]
    holders = {"a": x, "b": y, "c": y, "d": y, "e": x}
    sizes = {"a": 10, "b": 10, "c": 10, "d": 9, "e": 9}
    assert eu.distribute_shards_to_ranks(holders, sizes, 3) == {"a": 0, "b": 1, "c": 2, "d": 1, "e": 0}


@pytest.mark.parametrize("ranks, num_ranks", [([], 2), ([0, 2], 2), ([-1, 0], 2), ([5], 4)],
                         ids=["empty", "too-high", "negative", "single-out"])
def test_assignment_rejects_bad_holders(ranks, num_ranks):
    with pytest.raises(CheckpointingException, match="bad.shard"):
        eu.distribute_shards_to_ranks({"ok": [0], "bad.shard": ranks}, {"ok": 1, "bad.shard": 1}, num_ranks)


# ----------------------------------------------------------------------------- distribution from summaries


def _info(shape, dtype=torch.float32):
    n = 1
    for s in shape:
        n *= s
    return ShardInfo(tuple(shape), dtype, n * dtype.itemsize)


def test_distribution_from_summaries_groups_and_order():
    main_in_group = ("m", (0,), ())
    main_elsewhere = ("c", (0,), ())
    only_one = ("o", (4,), (2, 6))
    per_rank = [
        [(main_in_group, _info((25,)), True), (main_elsewhere, _info((250,)), False)],
        [(main_in_group, _info((25,)), False), (main_elsewhere, _info((250,)), False),
         (only_one, _info((4,), torch.int16), True)],
    ]
    d = eu.distribution_from_summaries(per_rank)
    d_all = eu.distribution_from_summaries(per_rank, ignore_groups=True)
    # The shard without a main replica here goes last although it is the largest.
    assert d.main_rank_for_shard == {main_in_group: 0, main_elsewhere: 1, only_one: 1}
    assert d_all.main_rank_for_shard == d.main_rank_for_shard
    assert d.shards_in_this_group == {main_in_group, only_one}
    assert d_all.shards_in_this_group == {main_in_group, main_elsewhere, only_one}
    assert d.all_ranks_for_shard == {main_in_group: [0, 1], main_elsewhere: [0, 1], only_one: [1]}
    assert d.shard_to_metadata[only_one] == ShardInfo((4,), torch.int16, 8)
    assert d.shard_to_metadata[main_elsewhere].nbytes == 1000


def test_distribution_from_real_sharded_tensors():
    """local_tensor_summary of real ShardedTensors: flattened ranges are separate shards,
    a repeated shard counts once and is main if any copy is."""
    per_rank = []
    for rank in range(2):
        t = torch.zeros(2, 3)
        sd = {
            "a": ShardedTensor.from_rank_offsets("w", t, (0, rank, 2), replica_id=0),
            "rep": [ShardedTensor.from_rank_offsets("b", torch.zeros(3), replica_id=(0, 1)),
                    ShardedTensor.from_rank_offsets("b", torch.zeros(3), replica_id=(0, rank))],
            "flat": ShardedTensor.from_rank_offsets_flat("f", torch.zeros(2), (4,), (0, 0, 1),
                                                          flattened_range=slice(2 * rank, 2 * rank + 2),
                                                          replica_id=rank),
        }
        per_rank.append(eu.local_tensor_summary(sd))
    d = eu.distribution_from_summaries(per_rank)
    assert set(d.all_ranks_for_shard) == {("w", (0, 0), ()), ("w", (2, 0), ()), ("b", (0,), ()),
                                          ("f", (0,), (0, 2)), ("f", (0,), (2, 4))}
    assert d.all_ranks_for_shard[("b", (0,), ())] == [0, 1]
    assert d.shard_to_metadata[("f", (0,), (2, 4))] == ShardInfo((2,), torch.float32, 8)
    # b is main on rank 0 (its second copy), f's second range has no main replica (replica 1).
    assert d.shards_in_this_group == {("w", (0, 0), ()), ("w", (2, 0), ()), ("b", (0,), ()), ("f", (0,), (0, 2))}


@pytest.mark.parametrize("second", [_info((8,)), _info((4,), torch.bfloat16)], ids=["shape", "dtype"])
def test_distribution_from_summaries_rejects_differing_shards(second):
    sid = ("layer.weight", (0,), ())
    per_rank = [[(sid, _info((4,)), True)], [], [(sid, second, False)]]
    with pytest.raises(CheckpointingException, match="layer.weight") as e:
        eu.distribution_from_summaries(per_rank)
    assert "group rank 0" in str(e.value) and "group rank 2" in str(e.value)


def test_repeated_shard_id_with_another_shape_on_one_rank_is_not_collapsed():
    """A load request may read overlapping chunks of one tensor: here k[0:4] (TP grid of 2)
    and k[0:8] on the same rank. Both have shard id ('k', (0,), ()). The summary must not
    silently keep only one of the two shapes: it must tell both apart or raise.

    Collapsing them hangs a fully parallel load: the plan has one 32-byte shard, the reading
    rank reads the first request (16 bytes), and a rank receiving it raises in
    ``_destination`` (shape (4,) vs (8,)) while the others wait in the exchange forever.
    The plain (non fully parallel) load of the same request returns the right values."""
    req = {"a": ShardedTensor.from_rank_offsets("k", torch.zeros(4), (0, 0, 2), replica_id=1),
           "b": ShardedTensor.from_rank_offsets("k", torch.zeros(8), replica_id=0)}
    try:
        summary = eu.local_tensor_summary(req)
    except CheckpointingException as e:
        assert "'k'" in str(e)
        return
    shapes = sorted(info.local_shape for _, info, _ in summary)
    assert shapes == [(4,), (8,)], f"two different shards collapsed into one summary entry: {summary}"
    assert len({sid for sid, _, _ in summary}) == 2


def test_group_of_one_gives_no_distribution():
    assert not dist.is_initialized()  # this test process is world 1 without a process group
    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(3))}
    assert eu.determine_main_replica_uniform_distribution(sd, None) is None
    assert eu.determine_main_replica_uniform_distribution(sd, None, ignore_groups=True) is None


def test_unknown_exchange_algo():
    empty = ShardDistribution({}, set(), {}, {})
    with pytest.raises(CheckpointingException, match="scatter"):
        eu.exchange_by_distribution({}, {}, empty, None, "scatter")
    with pytest.raises(CheckpointingException, match="broadcast"):
        eu.check_exchange_algo("Broadcast")
    for algo in eu.EXCHANGE_ALGORITHMS:
        eu.check_exchange_algo(algo)


# ----------------------------------------------------------------------------- rank helpers

_GROUPS: Dict[Any, Any] = {}


def _group(rank: int, world: int, kind: str) -> Optional[Any]:
    """None for the whole world; for 'dp' the DP group of this rank ({0, 2} or {1, 3} at
    world 4); for 'single' a group of this rank alone. Groups are created once per process,
    by every rank, in the same order."""
    if kind == "world":
        return None
    if world not in _GROUPS:
        groups = {}
        if world == 4:
            groups["dp", 0] = dist.new_group([0, 2])
            groups["dp", 1] = dist.new_group([1, 3])
        for r in range(world):
            groups["single", r] = dist.new_group([r])
        _GROUPS[world] = groups
    groups = _GROUPS[world]
    return groups["dp", rank % 2] if kind == "dp" else groups["single", rank]


def _group_members(rank: int, world: int, kind: str) -> List[int]:
    if kind == "world":
        return list(range(world))
    if kind == "dp":
        return [r for r in range(world) if r % 2 == rank % 2]
    return [rank]


def _values(sid, dtype: torch.dtype, shape) -> torch.Tensor:
    """Deterministic random contents of a shard (every bit pattern; 0/1 for bool)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(sid).encode()))
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(tuple(shape))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _layout(rank: int, world: int, mode: str) -> List[ShardedTensor]:
    """This rank's ShardedTensors (with their expected values as data).

    rep.*: every rank (main on rank 0); scalar: 0-dim, every rank; tp.*, big.bf16, flat: split in two along an axis by
    rank parity, replicated over rank // 2; own: this rank alone; pair01: ranks 0 and 1;
    empty.*: zero elements; edge: exactly SMALL_SHARD_BYTES in the tiny mode; big.f32:
    more than ROUND_BYTES (tiny) or SMALL_SHARD_BYTES (default)."""
    t, d = rank % 2, rank // 2
    out = []

    def add(key, dtype, shape, *offsets, replica, flat=None):
        if flat is None:
            sh = ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype), *offsets, replica_id=replica)
        else:
            sh = ShardedTensor.from_rank_offsets_flat(key, torch.empty(flat.stop - flat.start, dtype=dtype), shape,
                                                      *offsets, flattened_range=flat, replica_id=replica)
        out.append(dataclasses.replace(sh, data=_values(shard_id(sh), dtype, tuple(sh.data.shape))))

    for name, dtype in DTYPES.items():
        add(f"rep.{name}", dtype, (5, 3), replica=rank)
        add(f"tp.{name}", dtype, (2, 6), (0, t, 2), replica=d)
    for name, dtype in EXTRA_DTYPES.items():
        add(f"rep.{name}", dtype, (3, 2), replica=rank)
    add("scalar.f64", torch.float64, (), replica=rank)
    add("own", torch.int64, (3,), (0, rank, world), replica=0)
    if rank < 2:
        add("pair01", torch.float32, (7,), replica=rank)
    add("empty.f32", torch.float32, (0, 4), replica=rank)
    add("empty.b", torch.bool, (3, 0), (0, t, 2), replica=d)
    add("edge", torch.int64, (8,), replica=rank)
    big = (20, 16) if mode == "tiny" else (1030, 256)
    add("big.f32", torch.float32, big, replica=rank)
    add("big.bf16", torch.bfloat16, (big[0], 8), (1, t, 2), replica=d)
    add("flat.f32", torch.float32, (6, 4), (0, t, 2), replica=d, flat=slice(3, 17))
    return out


def _strided_zeros(shape, dtype) -> torch.Tensor:
    """A zero tensor of ``shape`` that is not contiguous (transposed or strided view;
    a 0-dim tensor is always contiguous)."""
    if len(shape) == 0:
        return torch.zeros((), dtype=dtype)
    if len(shape) == 2:
        return torch.zeros(tuple(reversed(shape)), dtype=dtype).t()
    return torch.zeros((2 * shape[0],), dtype=dtype)[::2]


def _noncontiguous_copy(values: torch.Tensor) -> torch.Tensor:
    out = _strided_zeros(tuple(values.shape), values.dtype)
    out.copy_(values)
    return out


_FILL = 0x5A


class _Guarded:
    """A contiguous destination that is a view into a larger buffer with guard bytes."""

    def __init__(self, shape, dtype):
        numel = 1
        for s in shape:
            numel *= s
        size = dtype.itemsize
        self.raw = torch.full(((numel + 6) * size,), 1 if dtype == torch.bool else _FILL, dtype=torch.uint8)
        self.view = self.raw.view(dtype)[3:3 + numel].view(tuple(shape))
        self.guard = self.raw.clone()
        self.lo, self.hi = 3 * size, (3 + numel) * size

    def guards_intact(self) -> bool:
        return (torch.equal(self.raw[:self.lo], self.guard[:self.lo])
                and torch.equal(self.raw[self.hi:], self.guard[self.hi:]))


_DEST_KINDS = ("zeros", "none", "strided", "guarded", "param")
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _exchange_rank(rank: int, world: int, kind: str, algo: str, mode: str, via_dispatch: bool):
    group = _group(rank, world, kind)
    saved = {name: getattr(exchange_tensors, name) for name in MODES[mode]}
    try:
        for name, value in MODES[mode].items():
            setattr(exchange_tensors, name, value)
        shards = _layout(rank, world, mode)
        expected = {shard_id(sh): sh.data for sh in shards}
        distribution = eu.determine_main_replica_uniform_distribution(
            {f"s{i}": sh for i, sh in enumerate(shards)}, group, ignore_groups=True)
        me = dist.get_rank(group)
        loaded: Dict[Any, torch.Tensor] = {}
        unloaded: Dict[Any, ShardedTensor] = {}
        dests: Dict[Any, Tuple[str, Any]] = {}
        for i, sh in enumerate(sorted(shards, key=shard_id)):
            sid = shard_id(sh)
            if distribution.main_rank_for_shard[sid] == me:
                # Loaded shards: fresh copies, every other one not contiguous.
                src = sh.data.clone() if i % 2 or sh.data.ndim == 0 else _noncontiguous_copy(sh.data)
                loaded[sid] = src
                continue
            dkind = _DEST_KINDS[len(unloaded) % len(_DEST_KINDS)]
            shape, dtype = tuple(sh.data.shape), sh.dtype
            if dkind == "param" and dtype not in _PARAM_DTYPES:
                dkind = "zeros"
            if dkind == "param":  # filled in place, outside autograd
                dest = holder = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
            elif dkind == "zeros":
                dest = torch.zeros(shape, dtype=dtype)
                holder = dest
            elif dkind == "none":
                dest = holder = None
            elif dkind == "strided":
                dest = holder = _strided_zeros(shape, dtype)
                assert not dest.is_contiguous() or dest.numel() <= 1
            else:
                holder = _Guarded(shape, dtype)
                dest = holder.view
            dests[sid] = (dkind, holder)
            unloaded[sid] = dataclasses.replace(sh, data=dest)
        ptrs = {sid: sh.data.data_ptr() for sid, sh in unloaded.items() if sh.data is not None}
        sources = {sid: t for sid, t in loaded.items()}

        if via_dispatch:
            result = eu.exchange_by_distribution(loaded, unloaded, distribution, group, algo)
        else:
            result = getattr(eu, f"exchange_loaded_tensors_{algo}")(loaded, unloaded, distribution, group)

        errors = []
        if set(result) != set(expected):
            errors.append(f"result keys differ: missing {set(expected) - set(result)}, "
                          f"extra {set(result) - set(expected)}")
        for sid, want in expected.items():
            got = result.get(sid)
            if got is None:
                continue
            if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
                errors.append(f"{sid}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
                continue
            if not torch.equal(_bytes(got), _bytes(want)):
                errors.append(f"{sid}: wrong bytes ({dests.get(sid, ('loaded',))[0]})")
            if sid in loaded:
                if got is not sources[sid]:
                    errors.append(f"{sid}: a loaded tensor was replaced")
                continue
            dkind, holder = dests[sid]
            if dkind == "none":
                continue
            dest = unloaded[sid].data
            if got is not dest or got.data_ptr() != ptrs[sid]:
                errors.append(f"{sid}: result is not the request's own tensor ({dkind})")
            if dkind == "guarded" and not holder.guards_intact():
                errors.append(f"{sid}: bytes around the destination view were overwritten")
        # The sources were only read.
        for sid, src in loaded.items():
            if not torch.equal(_bytes(src), _bytes(expected[sid])):
                errors.append(f"{sid}: the loaded (source) tensor changed")
        if errors:
            raise AssertionError(f"rank {rank} ({kind}, {algo}, {mode}):\n" + "\n".join(errors))

        # What was exercised (group-wide, from the distribution, independent of the code).
        streams: Dict[int, int] = {}
        small: Dict[int, int] = {}
        largest = 0
        for sid, src in distribution.main_rank_for_shard.items():
            nbytes = distribution.shard_to_metadata[sid].nbytes
            if nbytes and len(set(distribution.all_ranks_for_shard[sid])) > 1:
                streams[src] = streams.get(src, 0) + nbytes
                small[src] = small.get(src, 0) + (nbytes <= exchange_tensors.SMALL_SHARD_BYTES)
                largest = max(largest, nbytes)
        return {
            "unloaded": len(unloaded),
            "kinds": sorted({k for k, _ in dests.values()}),
            "longest_stream": max(streams.values(), default=0),
            "max_small_per_src": max(small.values(), default=0),
            "largest_exchanged": largest,
            "constants": {name: getattr(exchange_tensors, name) for name in ("SMALL_SHARD_BYTES", "BUCKET_BYTES", "ROUND_BYTES")},
        }
    finally:
        for name, value in saved.items():
            setattr(exchange_tensors, name, value)


_EXCHANGE_CASES = [(2, "world"), (4, "world"), (4, "dp")]


@pytest.mark.parametrize("mode", ["tiny", "default"])
@pytest.mark.parametrize("world, kind", _EXCHANGE_CASES, ids=[f"w{w}-{k}" for w, k in _EXCHANGE_CASES])
@pytest.mark.parametrize("algo", eu.EXCHANGE_ALGORITHMS)
def test_exchange_bit_exact_into_request_tensors(algo, world, kind, mode):
    stats = get_pool(world).run(_exchange_rank, kind, algo, mode, False, timeout=_TIMEOUT)
    assert all(s["unloaded"] >= 1 for s in stats)
    assert sum(s["unloaded"] for s in stats) >= 8
    assert set().union(*(s["kinds"] for s in stats)) == set(_DEST_KINDS)
    for s in stats:
        assert s["constants"] == {**{"SMALL_SHARD_BYTES": 1 << 20, "BUCKET_BYTES": 16 << 20,
                                     "ROUND_BYTES": 16 << 20}, **MODES[mode]}
        if mode == "tiny":
            round_bytes = MODES["tiny"]["ROUND_BYTES"]
            assert s["longest_stream"] > 4 * round_bytes  # several rounds
            assert s["largest_exchanged"] > round_bytes  # a shard spans rounds
            assert s["max_small_per_src"] >= 3  # small shards share buckets
        else:
            assert s["largest_exchanged"] > exchange_tensors.SMALL_SHARD_BYTES
    # The constants were restored on every rank after the run.
    assert get_pool(world).run(_constants_rank) == [(1 << 20, 16 << 20, 16 << 20)] * world


def _constants_rank(rank, world):
    return exchange_tensors.SMALL_SHARD_BYTES, exchange_tensors.BUCKET_BYTES, exchange_tensors.ROUND_BYTES


@pytest.mark.parametrize("algo", eu.EXCHANGE_ALGORITHMS)
def test_exchange_by_distribution_dispatch(pool4, algo):
    stats = pool4.run(_exchange_rank, "dp", algo, "tiny", True, timeout=_TIMEOUT)
    assert all(s["unloaded"] >= 1 for s in stats)
    assert set().union(*(s["kinds"] for s in stats)) == set(_DEST_KINDS)


# ----------------------------------------------------------------------------- distribution on real groups


def _distribution_rank(rank: int, world: int, kind: str):
    group = _group(rank, world, kind)
    sd = {"shards": _layout(rank, world, "tiny")}
    return (eu.determine_main_replica_uniform_distribution(sd, group),
            eu.determine_main_replica_uniform_distribution(sd, group, ignore_groups=True))


@pytest.mark.parametrize("kind", ["world", "dp"])
def test_distribution_on_groups(pool4, kind):
    world = 4
    results = pool4.run(_distribution_rank, kind, timeout=_TIMEOUT)
    layouts = {r: _layout(r, world, "tiny") for r in range(world)}
    for rank, (d, d_all) in enumerate(results):
        members = _group_members(rank, world, kind)
        for other in members:  # every rank of the group computed the same distribution
            assert results[other] == (d, d_all)
        # Expected, from the layout: holders by group rank, main replicas in the group.
        holders: Dict[Any, List[int]] = {}
        with_main = set()
        infos = {}
        for group_rank, global_rank in enumerate(members):
            for sh in layouts[global_rank]:
                sid = shard_id(sh)
                holders.setdefault(sid, []).append(group_rank)
                infos[sid] = _info(tuple(sh.data.shape), sh.dtype)  # flat shards: 1-D slice length
                if sh.replica_id == 0:
                    with_main.add(sid)
        assert d.all_ranks_for_shard == holders
        assert d.shard_to_metadata == infos
        assert d.shards_in_this_group == with_main
        assert d_all.shards_in_this_group == set(holders)
        # Only the group {1, 3} lacks main replicas (those on rank 0).
        assert (with_main != set(holders)) == (kind == "dp" and rank % 2 == 1)
        assert d_all.main_rank_for_shard == d.main_rank_for_shard
        sizes = {sid: info.nbytes for sid, info in infos.items()}
        assert d.main_rank_for_shard == _reference_assignment(holders, sizes, len(members), set(holders) - with_main)
        assert set(d.main_rank_for_shard.values()) <= set(range(len(members)))
        assert all(d.main_rank_for_shard[sid] in ranks for sid, ranks in holders.items())
    if kind == "dp":  # group {1, 3}: rep.* has its main replica on rank 0, outside the group
        assert ("rep.f32", (0, 0), ()) not in results[1][0].shards_in_this_group
        assert ("rep.f32", (0, 0), ()) in results[1][1].shards_in_this_group
        assert ("rep.f32", (0, 0), ()) in results[0][0].shards_in_this_group


def _single_group_rank(rank: int, world: int):
    sd = {"shards": _layout(rank, world, "tiny")}
    return eu.determine_main_replica_uniform_distribution(sd, _group(rank, world, "single"), ignore_groups=True)


def test_distribution_for_group_of_one_rank(pool2):
    assert pool2.run(_single_group_rank, timeout=_TIMEOUT) == [None, None]


def _mismatch_rank(rank: int, world: int, what: str):
    if rank == world - 1:
        data = torch.zeros(8) if what == "shape" else torch.zeros(4, dtype=torch.int16)
    else:
        data = torch.zeros(4)
    sd = {"ok": ShardedTensor.from_rank_offsets("ok", torch.zeros(2), (0, rank, world)),
          "bad": ShardedTensor.from_rank_offsets("decoder.bad_weight", data, replica_id=rank)}
    return eu.determine_main_replica_uniform_distribution(sd, None)


@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_distribution_differing_shard_raises_on_every_rank(pool2, what):
    errors = pool2.run_expect_error(_mismatch_rank, what, timeout=_TIMEOUT)
    for e in errors:
        assert isinstance(e, CheckpointingException), repr(e)
        assert "decoder.bad_weight" in str(e)


# ----------------------------------------------------------------------------- objects


def _objects_rank(rank: int, world: int, kind: str):
    loaded = {f"obj/{rank}": {"rank": rank, "payload": list(range(rank))}}
    return eu.exchange_loaded_objects_gather_object(loaded, _group(rank, world, kind))


@pytest.mark.parametrize("kind", ["world", "dp"])
def test_exchange_objects_within_group(pool4, kind):
    results = pool4.run(_objects_rank, kind, timeout=_TIMEOUT)
    for rank, got in enumerate(results):
        assert got == {f"obj/{r}": {"rank": r, "payload": list(range(r))} for r in _group_members(rank, 4, kind)}
