"""The mapping layer: ShardedTensor / ShardedObject / factories / non-persistent objects."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_checkpointing import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _st(**overrides):
    """A valid 2-D ShardedTensor: chunk (2, 3) at (2, 3) of a (4, 6) global tensor."""
    kwargs = dict(
        key="w",
        data=torch.zeros(2, 3),
        dtype=torch.float32,
        local_shape=(2, 3),
        global_shape=(4, 6),
        global_offset=(2, 3),
        axis_fragmentations=(2, 2),
    )
    kwargs.update(overrides)
    return ShardedTensor(**kwargs)


# ----------------------------------------------------------------------------- construction


def test_valid_construction_normalizes_to_int_tuples():
    sh = _st(local_shape=[2, 3], global_shape=torch.Size([4, 6]), global_offset=[2, 3], axis_fragmentations=[2, 2])
    assert sh.local_shape == (2, 3) and isinstance(sh.local_shape, tuple)
    assert sh.global_shape == (4, 6) and isinstance(sh.global_shape, tuple)
    assert sh.global_offset == (2, 3) and isinstance(sh.global_offset, tuple)
    assert sh.axis_fragmentations == (2, 2)
    assert sh.replica_id == 0 and sh.prepend_axis_num == 0
    assert sh.allow_shape_mismatch is False and sh.flattened_range is None
    assert str(sh) == "ShardedTensor(key='w')"


def test_axis_fragmentations_none_allowed_for_uneven_grids():
    sh = _st(data=torch.zeros(3, 6), local_shape=(3, 6), global_shape=(5, 6), global_offset=(2, 0),
             axis_fragmentations=None)
    assert sh.axis_fragmentations is None
    sh.validate_metadata_integrity()


def test_data_none_is_allowed_metadata_only():
    sh = _st(data=None)
    assert sh.data is None
    sh.validate_metadata_integrity()


def test_scalar_global_tensor():
    sh = ShardedTensor("s", torch.tensor(3.0), torch.float32, (), (), (), None)
    assert sh.global_slice() == ()
    assert sh.local_chunk_offset_in_global() == ()


def test_chunk_touching_global_end_is_valid():
    _st(global_offset=(2, 3))
    _st(data=torch.zeros(4, 6), local_shape=(4, 6), global_offset=(0, 0))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(key=""), "key"),
        (dict(key=None), "key"),
        (dict(key=3), "key"),
        (dict(flattened_range=slice(0, 3)), "flattened_range"),
        (dict(dtype="float32"), "dtype"),
        (dict(dtype=None), "dtype"),
        (dict(prepend_axis_num=-1), "prepend_axis_num"),
        (dict(data=[[0.0] * 3] * 2), "torch.Tensor"),
        (dict(data=torch.zeros(2, 3, dtype=torch.float16)), "dtype"),
        (dict(data=torch.zeros(2, 3, dtype=torch.int64)), "dtype"),
        (dict(data=torch.zeros(3, 2)), "shape"),
        (dict(data=torch.zeros(2, 3, 1)), "shape"),
        (dict(data=torch.zeros(6)), "shape"),
        # wrong lengths
        (dict(global_offset=(2,)), "different lengths"),
        (dict(global_offset=(2, 3, 0)), "different lengths"),
        (dict(global_shape=(4, 6, 1), global_offset=(2, 3, 0), axis_fragmentations=(2, 2, 1)), "local_shape"),
        (dict(data=None, local_shape=(2,), global_shape=(4, 6)), "local_shape"),
        (dict(axis_fragmentations=(2,)), "axis_fragmentations"),
        (dict(axis_fragmentations=(2, 2, 1)), "axis_fragmentations"),
        # offsets outside the global shape
        (dict(global_offset=(3, 3)), "outside"),
        (dict(global_offset=(2, 4)), "outside"),
        (dict(global_offset=(-1, 0)), "outside"),
        (dict(global_offset=(0, -3)), "outside"),
        (dict(global_offset=(4, 0)), "outside"),
        (dict(global_shape=(1, 6)), "outside"),
        (dict(data=None, local_shape=(-1, 3)), "outside"),
        # non-integer shapes/offsets
        (dict(local_shape=("a", 3)), "tuple of ints"),
        (dict(global_shape=None), "tuple of ints"),
        (dict(global_offset=3), "tuple of ints"),
        (dict(axis_fragmentations=("x", 1)), "tuple of ints"),
    ],
)
def test_construction_errors(overrides, match):
    with pytest.raises(CheckpointingException, match=match):
        _st(**overrides)


def test_prepended_axis_offset_must_be_inside_global_shape():
    # prepended axes have size 1 in the global region
    ShardedTensor("p", torch.zeros(3), torch.float32, (3,), (4, 3), (3, 0), None, prepend_axis_num=1)
    with pytest.raises(CheckpointingException, match="outside"):
        ShardedTensor("p", torch.zeros(3), torch.float32, (3,), (4, 3), (4, 0), None, prepend_axis_num=1)
    with pytest.raises(CheckpointingException, match="local_shape"):
        ShardedTensor("p", torch.zeros(3), torch.float32, (3,), (4, 3), (0, 0), None, prepend_axis_num=2)


def test_validate_metadata_integrity_after_mutation():
    sh = _st()
    sh.global_offset = (3, 3)
    with pytest.raises(CheckpointingException, match="outside"):
        sh.validate_metadata_integrity()
    sh = _st()
    sh.data = torch.zeros(2, 3, dtype=torch.bfloat16)
    with pytest.raises(CheckpointingException, match="dtype"):
        sh.validate_metadata_integrity()


def test_flattened_range_needs_flat_data_and_the_flat_constructor():
    with pytest.raises(CheckpointingException, match="flattened_range"):
        _st(flattened_range=slice(0, 2))
    with pytest.raises(CheckpointingException, match="flattened_range|from_rank_offsets_flat"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, 0, 1), flattened_range=slice(0, 2))
    # flattened_range=None explicitly is fine
    ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, 0, 1), flattened_range=None)


# ----------------------------------------------------------------------------- from_rank_offsets


def test_from_rank_offsets_basic():
    data = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    sh = ShardedTensor.from_rank_offsets("w", data, (0, 1, 4), (1, 2, 3), replica_id=(0, 1))
    assert sh.data is data
    assert sh.dtype == torch.int64
    assert sh.local_shape == (2, 3)
    assert sh.global_shape == (8, 9)
    assert sh.global_offset == (2, 6)
    assert sh.axis_fragmentations == (4, 3)
    assert sh.replica_id == (0, 1)
    assert sh.global_slice() == (slice(2, 4), slice(6, 9))
    assert sh.local_chunk_offset_in_global() == (1, 2)


def test_from_rank_offsets_no_offsets_is_whole_tensor():
    data = torch.ones(3, 2)
    sh = ShardedTensor.from_rank_offsets("w", data)
    assert sh.global_shape == (3, 2)
    assert sh.global_offset == (0, 0)
    assert sh.axis_fragmentations == (1, 1)
    assert sh.local_chunk_offset_in_global() == (0, 0)


def test_from_rank_offsets_prepend():
    data = torch.ones(3, 2)
    sh = ShardedTensor.from_rank_offsets("w", data, (0, 5, 12), (2, 1, 2), prepend_axis_num=1)
    assert sh.global_shape == (12, 3, 4)
    assert sh.global_offset == (5, 0, 2)
    assert sh.axis_fragmentations == (12, 1, 2)
    assert sh.prepend_axis_num == 1
    assert sh.local_shape == (3, 2)
    assert sh.global_slice() == (5, slice(0, 3), slice(2, 4))
    assert sh.local_chunk_offset_in_global() == (5, 0, 1)
    # a prepended axis without a rank offset has size 1
    sh = ShardedTensor.from_rank_offsets("w", data, prepend_axis_num=2)
    assert sh.global_shape == (1, 1, 3, 2)
    assert sh.global_offset == (0, 0, 0, 0)
    assert sh.global_slice() == (0, 0, slice(0, 3), slice(0, 2))


def test_from_rank_offsets_passes_extra_kwargs():
    sh = ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, 0, 2), allow_shape_mismatch=True)
    assert sh.allow_shape_mismatch is True


@pytest.mark.parametrize(
    "rank_offsets, prepend, match",
    [
        ([(2, 0, 1)], 0, "out of range"),
        ([(-1, 0, 1)], 0, "out of range"),
        ([(3, 0, 1)], 1, "out of range"),
        ([(0, 2, 2)], 0, "invalid rank offset"),
        ([(0, 3, 2)], 0, "invalid rank offset"),
        ([(0, -1, 2)], 0, "invalid rank offset"),
        ([(0, 0, 0)], 0, "invalid rank offset"),
        ([(1, 0, -2)], 0, "invalid rank offset"),
        ([(0, 1, 2)], 1, None),  # valid control case
        ([(0, 4, 4)], 1, "invalid rank offset"),
        ([(0, 0, 2), (0, 1, 2)], 0, "duplicate"),
        ([(1, 0, 2), (0, 0, 1), (1, 0, 2)], 0, "duplicate"),
        ([(0, 1)], 0, "triple"),
        ([(0, 1, 2, 3)], 0, "triple"),
        ([(0,)], 0, "triple"),
        ([()], 0, "triple"),
        ([5], 0, "triple"),
        ([None], 0, "triple"),
        ([("a", 0, 1)], 0, "triple"),
        ([(0, "x", 1)], 0, "triple"),
    ],
)
def test_from_rank_offsets_invalid(rank_offsets, prepend, match):
    data = torch.zeros(2, 3)
    if match is None:
        ShardedTensor.from_rank_offsets("w", data, *rank_offsets, prepend_axis_num=prepend)
        return
    with pytest.raises(CheckpointingException, match=match):
        ShardedTensor.from_rank_offsets("w", data, *rank_offsets, prepend_axis_num=prepend)


def test_from_rank_offsets_data_must_be_tensor():
    with pytest.raises(CheckpointingException, match="torch.Tensor"):
        ShardedTensor.from_rank_offsets("w", [1.0, 2.0], (0, 0, 1))


@st.composite
def _rank_offset_cases(draw):
    prepend = draw(st.integers(0, 2))
    local_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
    ndim = prepend + len(local_shape)
    axes = draw(st.lists(st.integers(0, max(ndim - 1, 0)), unique=True, max_size=ndim)) if ndim else []
    offsets = []
    for axis in axes:
        fragments = draw(st.integers(1, 4))
        offsets.append((axis, draw(st.integers(0, fragments - 1)), fragments))
    replica_id = draw(st.one_of(st.integers(0, 3), st.tuples(st.integers(0, 2), st.integers(0, 2))))
    return prepend, local_shape, offsets, replica_id


@FAST
@given(_rank_offset_cases())
def test_from_rank_offsets_random_grids(case):
    prepend, local_shape, rank_offsets, replica_id = case
    ndim = prepend + len(local_shape)
    fragm = {axis: (off, n) for axis, off, n in rank_offsets}
    sizes = (1,) * prepend + local_shape

    expected_shape = tuple(fragm.get(a, (0, 1))[1] * sizes[a] for a in range(ndim))
    expected_offset = tuple(fragm.get(a, (0, 1))[0] * sizes[a] for a in range(ndim))
    global_tensor = torch.arange(math.prod(expected_shape), dtype=torch.int64).reshape(expected_shape)
    # the chunk, cut from the global tensor independently of the library
    chunk = global_tensor
    for a in reversed(range(ndim)):
        chunk = chunk.narrow(a, expected_offset[a], sizes[a])
    chunk = chunk.reshape(local_shape).clone()

    sh = ShardedTensor.from_rank_offsets("t", chunk, *rank_offsets, replica_id=replica_id, prepend_axis_num=prepend)
    assert sh.global_shape == expected_shape
    assert sh.global_offset == expected_offset
    assert sh.local_shape == local_shape
    assert sh.axis_fragmentations == tuple(fragm.get(a, (0, 1))[1] for a in range(ndim))
    assert sh.replica_id == replica_id
    assert sh.prepend_axis_num == prepend
    assert sh.data is chunk and sh.dtype == torch.int64

    sl = sh.global_slice()
    assert all(isinstance(s, int) for s in sl[:prepend])
    assert all(isinstance(s, slice) for s in sl[prepend:])
    assert torch.equal(global_tensor[sl], chunk)
    assert sh.local_chunk_offset_in_global() == tuple(fragm.get(a, (0, 1))[0] for a in range(ndim))
    offsets, region_sizes = sh.global_region()
    assert offsets == expected_offset and region_sizes == sizes
    sh.validate_metadata_integrity()


def test_local_chunk_offset_in_global_uneven_grid_raises():
    sh = ShardedTensor("u", torch.zeros(3, 2), torch.float32, (3, 2), (5, 2), (2, 0), None)
    assert sh.global_slice() == (slice(2, 5), slice(0, 2))
    with pytest.raises(CheckpointingException, match="uneven"):
        sh.local_chunk_offset_in_global()


# ----------------------------------------------------------------------------- without_data / init_data


def test_without_data():
    sh = _st(replica_id=(1, 0), prepend_axis_num=0, allow_shape_mismatch=True)
    meta = sh.without_data()
    assert meta is not sh
    assert meta.data is None
    assert sh.data is not None  # original untouched
    for attr in ("key", "dtype", "local_shape", "global_shape", "global_offset", "axis_fragmentations",
                 "replica_id", "prepend_axis_num", "allow_shape_mismatch", "flattened_range"):
        assert getattr(meta, attr) == getattr(sh, attr), attr


def test_init_data_allocates_only_when_missing():
    meta = _st(data=None, dtype=torch.bfloat16)
    meta.init_data("cpu")
    assert meta.data is not None
    assert meta.data.shape == (2, 3) and meta.data.dtype == torch.bfloat16
    assert meta.data.device.type == "cpu"
    existing = meta.data
    meta.init_data("cpu", init_fn=torch.ones)
    assert meta.data is existing  # not reallocated

    meta = _st(data=None, dtype=torch.int16)
    meta.init_data(torch.device("cpu"), init_fn=torch.zeros)
    assert torch.equal(meta.data, torch.zeros(2, 3, dtype=torch.int16))
    meta.validate_metadata_integrity()

    calls = []

    def init_fn(shape, dtype, device):
        calls.append((tuple(shape), dtype, str(device)))
        return torch.full(shape, 7, dtype=dtype, device=device)

    meta = ShardedTensor("p", None, torch.int64, (3,), (2, 3), (1, 0), None, prepend_axis_num=1)
    meta.init_data("cpu", init_fn=init_fn)
    assert calls == [((3,), torch.int64, "cpu")]
    assert torch.equal(meta.data, torch.full((3,), 7))


# ----------------------------------------------------------------------------- narrow


def test_narrow_rows_of_a_fused_weight():
    # rank 1 of 2 along axis 0: local (4, 3) at offset (4, 0) of global (8, 3)
    data = torch.arange(12.0).reshape(4, 3)
    sh = ShardedTensor.from_rank_offsets("qkv", data, (0, 1, 2), replica_id=(0, 2))
    parts = sh.narrow(0, 1, 2)
    assert isinstance(parts, list) and len(parts) == 1
    part = parts[0]
    assert part is not sh
    assert part.key == "qkv" and part.replica_id == (0, 2)
    assert torch.equal(part.data, data[1:3])
    assert part.data.data_ptr() == data[1:3].data_ptr()  # a view, no copy
    assert part.local_shape == (2, 3)
    assert part.global_shape == (4, 3)
    assert part.global_offset == (2, 0)
    assert part.dtype == sh.dtype
    part.validate_metadata_integrity()
    # the original is untouched
    assert sh.local_shape == (4, 3) and sh.global_shape == (8, 3) and sh.global_offset == (4, 0)


def test_narrow_with_prepended_axes():
    data = torch.arange(24.0).reshape(4, 6)
    sh = ShardedTensor.from_rank_offsets("w", data, (0, 3, 5), (2, 1, 3), prepend_axis_num=1)
    assert sh.global_shape == (5, 4, 18) and sh.global_offset == (3, 0, 6)
    (part,) = sh.narrow(1, 2, 3)
    assert torch.equal(part.data, data[:, 2:5])
    assert part.local_shape == (4, 3)
    assert part.global_shape == (5, 4, 9)
    assert part.global_offset == (3, 0, 3)
    assert part.prepend_axis_num == 1


def test_narrow_errors():
    with pytest.raises(CheckpointingException, match="without data"):
        _st(data=None).narrow(0, 0, 1)
    # local 3 rows, narrowed to 2: global 6 * 2 / 3 = 4 ok, offset 3 * 2 / 3 = 2 ok
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(3, 2), (0, 1, 2))
    (part,) = sh.narrow(0, 0, 2)
    assert part.global_shape == (4, 2) and part.global_offset == (2, 0)
    # uneven grid: offset 1 of size-3 chunk cannot be scaled to length 2
    sh = ShardedTensor("w", torch.zeros(3, 2), torch.float32, (3, 2), (5, 2), (1, 0), None)
    with pytest.raises(CheckpointingException, match="cannot narrow"):
        sh.narrow(0, 0, 2)
    empty = ShardedTensor("e", torch.zeros(0, 2), torch.float32, (0, 2), (0, 2), (0, 0), None)
    with pytest.raises(CheckpointingException, match="cannot narrow"):
        empty.narrow(0, 0, 0)


# ----------------------------------------------------------------------------- ShardedObject


def test_sharded_object_basics():
    obj = ShardedObject("rng", {"seed": 1}, [2, 4], [1, 3], replica_id=(0, 1))
    assert obj.global_shape == (2, 4) and obj.global_offset == (1, 3)
    assert obj.unique_key == "rng/shard_1.3_2.4"
    assert str(obj) == "ShardedObject(key='rng')"
    meta = obj.without_data()
    assert meta.data is None and obj.data == {"seed": 1}
    assert meta.unique_key == obj.unique_key and meta.replica_id == (0, 1)
    assert ShardedObject("x", 1, (), ()).unique_key == "x/shard__"
    assert ShardedObject("a/b", 1, (1,), (0,)).unique_key == "a/b/shard_0_1"


@pytest.mark.parametrize(
    "args, match",
    [
        (("", 1, (1,), (0,)), "key"),
        ((None, 1, (1,), (0,)), "key"),
        (("k", 1, (2, 2), (0,)), "different lengths"),
        (("k", 1, (2,), (2,)), "outside"),
        (("k", 1, (2,), (-1,)), "outside"),
        (("k", 1, (0,), (0,)), "outside"),
        (("k", 1, (3, 1), (0, 1)), "outside"),
    ],
)
def test_sharded_object_invalid(args, match):
    with pytest.raises(CheckpointingException, match=match):
        ShardedObject(*args)


@pytest.mark.parametrize("bad", ["no_shard_marker", "k/shard_1_", "k/shard_a_1", "k/shard_0_1_2", "/shard_0_1",
                                 "k/shard_1_1"])
def test_empty_from_unique_key_rejects_bad_keys(bad):
    with pytest.raises(CheckpointingException):
        ShardedObject.empty_from_unique_key(bad)


_KEY_ALPHABET = st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r")


@st.composite
def _sharded_objects(draw):
    key = draw(st.text(_KEY_ALPHABET, min_size=1, max_size=12))
    shape = draw(st.lists(st.integers(1, 12), max_size=4))
    offset = [draw(st.integers(0, s - 1)) for s in shape]
    replica_id = draw(st.one_of(st.integers(0, 5), st.tuples(st.integers(0, 3), st.integers(0, 3))))
    return ShardedObject(key, object(), shape, offset, replica_id)


@FAST
@given(_sharded_objects())
def test_sharded_object_unique_key_round_trip(obj):
    uk = obj.unique_key
    assert uk == f"{obj.key}/shard_{'.'.join(map(str, obj.global_offset))}_{'.'.join(map(str, obj.global_shape))}"
    empty = ShardedObject.empty_from_unique_key(uk, replica_id=obj.replica_id)
    assert empty.key == obj.key
    assert empty.global_shape == obj.global_shape
    assert empty.global_offset == obj.global_offset
    assert empty.replica_id == obj.replica_id
    assert empty.data is None
    assert empty.unique_key == uk
    assert ShardedObject.empty_from_unique_key(uk).replica_id == 0


def test_unique_key_round_trip_tricky_keys():
    for key in ["a/shard_1_2", "x_y", "shard_0_1", "a.b/c", "k/", "1.2_3"]:
        obj = ShardedObject(key, None, (3, 2), (2, 1))
        back = ShardedObject.empty_from_unique_key(obj.unique_key)
        assert (back.key, back.global_shape, back.global_offset) == (key, (3, 2), (2, 1))


# ----------------------------------------------------------------------------- factories


def _split_build(key, data, replica_id, flattened_range):
    assert flattened_range is None
    half = data.shape[0] // 2
    return {
        "first": ShardedTensor.from_rank_offsets(f"{key}.first", data[:half], replica_id=replica_id),
        "second": ShardedTensor.from_rank_offsets(f"{key}.second", data[half:], replica_id=replica_id),
    }


def _cat_merge(sub):
    return torch.cat([sub["first"], sub["second"]])


def _factory(key="fused", data=None, replica_id=0):
    data = torch.arange(12.0).reshape(4, 3) if data is None else data
    return ShardedTensorFactory(key, data, _split_build, _cat_merge, replica_id=replica_id)


def test_factory_build():
    f = _factory(replica_id=(0, 1))
    built = f.build()
    assert set(built) == {"first", "second"}
    assert built["first"].key == "fused.first" and built["second"].key == "fused.second"
    assert torch.equal(built["first"].data, f.data[:2])
    assert torch.equal(built["second"].data, f.data[2:])
    assert built["first"].replica_id == (0, 1)
    f.validate_metadata_integrity()  # a no-op
    with pytest.raises(CheckpointingException):
        f.without_data()


def test_factory_build_fn_receives_arguments():
    seen = []

    def build_fn(key, data, replica_id, flattened_range):
        seen.append((key, data, replica_id, flattened_range))
        return ShardedTensor.from_rank_offsets(key, data)

    data = torch.ones(2)
    ShardedTensorFactory("k", data, build_fn, lambda x: x, replica_id=3).build()
    assert len(seen) == 1
    assert seen[0][0] == "k" and seen[0][1] is data and seen[0][2] == 3 and seen[0][3] is None


def test_apply_factories_and_merges():
    f1, f2 = _factory("a"), _factory("b", data=torch.arange(6.0).reshape(2, 3))
    plain = ShardedTensor.from_rank_offsets("plain", torch.ones(2))
    sd = {"layer": {"fused": f1, "plain": plain}, "list": [1, f2], "step": 5}
    request = {"layer": {"fused": f1, "plain": plain}, "list": [1, f2], "step": 5}
    apply_factories(sd)
    assert isinstance(sd["layer"]["fused"], dict)
    assert sd["layer"]["fused"]["first"].key == "a.first"
    assert sd["layer"]["plain"] is plain
    assert isinstance(sd["list"][1], dict) and sd["list"][1]["second"].key == "b.second"
    assert sd["step"] == 5

    # simulate a load: every ShardedTensor replaced by its tensor
    loaded = {
        "layer": {"fused": {"first": f1.data[:2].clone(), "second": f1.data[2:].clone()}, "plain": torch.ones(2)},
        "list": [1, {"first": f2.data[:1].clone(), "second": f2.data[1:].clone()}],
        "step": 5,
    }
    out = apply_factory_merges(loaded, request)
    assert out is loaded
    assert torch.equal(out["layer"]["fused"], f1.data)
    assert torch.equal(out["list"][1], f2.data)
    assert torch.equal(out["layer"]["plain"], torch.ones(2))
    assert out["step"] == 5


def test_apply_factory_merges_errors_and_missing_keys():
    f = _factory()
    with pytest.raises(CheckpointingException, match="Missing"):
        apply_factory_merges({}, {"f": f})
    # keys missing in the loaded dict that are not factories are skipped
    assert apply_factory_merges({"a": 1}, {"a": 1, "b": 2}) == {"a": 1}
    with pytest.raises(CheckpointingException, match="lengths"):
        apply_factory_merges([1, 2], [1, f, 3])
    # factory at the top level
    loaded = {"first": torch.zeros(1, 3), "second": torch.ones(2, 3)}
    assert torch.equal(apply_factory_merges(loaded, f), torch.cat([torch.zeros(1, 3), torch.ones(2, 3)]))


def test_factory_save_load_round_trip_single_process(tmp_path):
    from dist_checkpointing import load, save

    data = torch.arange(12.0).reshape(4, 3)
    save({"fused": _factory(data=data), "keep": LocalNonpersistentObject("not saved"), "step": 3},
         str(tmp_path / "ckpt"))
    target = torch.zeros(4, 3)
    out = load({"fused": _factory(data=target), "keep": LocalNonpersistentObject("local value")},
               str(tmp_path / "ckpt"))
    assert torch.equal(out["fused"], data)
    assert out["keep"] == "local value"
    assert out["step"] == 3
    from dist_checkpointing import load_tensors_metadata

    meta = load_tensors_metadata(str(tmp_path / "ckpt"))
    assert set(meta) == {"fused.first", "fused.second"}
    assert meta["fused.first"].global_shape == (2, 3)


# ----------------------------------------------------------------------------- LocalNonpersistentObject / replicas


def test_local_nonpersistent_object():
    payload = {"a": [1, 2]}
    obj = LocalNonpersistentObject(payload)
    assert obj.unwrap() is payload
    assert obj.obj is payload
    assert LocalNonpersistentObject().unwrap() is None


@pytest.mark.parametrize(
    "replica_id, main",
    [
        (0, True),
        (1, False),
        (7, False),
        (-1, False),
        ((), True),
        ((0,), True),
        ((0, 0, 0), True),
        ((0, 1), False),
        ((1, 0), False),
        ((0, 0, 2), False),
        ([0, 0], True),
    ],
)
def test_is_main_replica(replica_id, main):
    assert is_main_replica(replica_id) is main


@FAST
@given(st.lists(st.integers(0, 3), max_size=5))
def test_is_main_replica_tuples_random(ids):
    assert is_main_replica(tuple(ids)) == all(i == 0 for i in ids)


def test_unique_key_round_trip_key_with_newline():
    # Any non-empty str is a valid key, so empty_from_unique_key must invert unique_key
    # for it too (the regex's '.' does not match a newline).
    for key in ["a\nb", "ab\n", "\nx"]:
        obj = ShardedObject(key, None, (2,), (1,))
        back = ShardedObject.empty_from_unique_key(obj.unique_key)
        assert (back.key, back.global_shape, back.global_offset) == (key, (2,), (1,))
