"""Helpers for nested dict/list structures."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_checkpointing.dict_utils import (
    copy_structure,
    diff,
    dict_list_map_inplace,
    dict_list_map_outplace,
    dict_map,
    dict_map_with_key,
    extract_matching_values,
    map_reduce,
    merge,
    nested_items_iter,
    nested_values,
)
from dist_checkpointing.mapping import ShardedTensor

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Leaf:
    """A distinct, identity-compared leaf (never a dict or list)."""

    _n = 0

    def __init__(self, tag: str = ""):
        Leaf._n += 1
        self.id = Leaf._n
        self.tag = tag

    def __repr__(self):
        return f"Leaf({self.id}{',' + self.tag if self.tag else ''})"


_keys = st.text("abcdefgh", min_size=1, max_size=3)
_leaves = st.builds(Leaf, st.sampled_from(["x", "y", ""]))
_nested = st.recursive(
    _leaves,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(_keys, children, max_size=4)),
    max_leaves=20,
)
_nested_dicts = st.dictionaries(_keys, _nested, max_size=5)


def _leaf_paths(x, prefix=()):
    """{path: leaf} with list indices in the path (empty containers have no paths)."""
    out = {}
    items = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
        if isinstance(v, (dict, list)):
            out.update(_leaf_paths(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _empty_paths(x, prefix=()):
    """The paths of the empty containers strictly inside ``x``."""
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    found = set()
    for k, v in items:
        if isinstance(v, (dict, list)):
            found |= {prefix + (k,)} if not v else _empty_paths(v, prefix + (k,))
    return found


def _has_empty_container(x, top=True):
    """True if a container strictly inside ``x`` is empty."""
    if isinstance(x, (dict, list)):
        vals = list(x.values()) if isinstance(x, dict) else x
        return (not vals and not top) or any(_has_empty_container(v, top=False) for v in vals)
    return False


# ----------------------------------------------------------------------------- extract_matching_values


def test_extract_matching_values_nested_dicts_and_lists():
    x = {
        "a": 1,
        "b": "s",
        "c": {"d": 2, "e": "t", "f": {"g": 3}},
        "l": [4, "u", [5, "v"], {"h": 6, "i": "w"}],
        "only_str": {"z": "z"},
    }
    match, rest = extract_matching_values(x, lambda v: isinstance(v, int))
    assert match == {"a": 1, "c": {"d": 2, "f": {"g": 3}}, "l": [4, [5], {"h": 6}]}
    assert rest == {"b": "s", "c": {"e": "t"}, "l": ["u", ["v"], {"i": "w"}], "only_str": {"z": "z"}}
    # the input is untouched
    assert x["c"] == {"d": 2, "e": "t", "f": {"g": 3}}


def test_extract_matching_values_lists_compact_positions():
    x = [1, "a", 2, "b", "c", 3]
    match, rest = extract_matching_values(x, lambda v: isinstance(v, int))
    assert match == [1, 2, 3]
    assert rest == ["a", "b", "c"]


def test_extract_matching_values_return_lists_as_dicts():
    x = {"l": [1, "a", [2, "b"], {"k": 3}], "m": "c"}
    match, rest = extract_matching_values(x, lambda v: isinstance(v, int), return_lists_as_dicts=True)
    assert match == {"l": {0: 1, 2: {0: 2}, 3: {"k": 3}}}
    assert rest == {"l": {1: "a", 2: {1: "b"}}, "m": "c"}
    top_match, top_rest = extract_matching_values([1, "a"], lambda v: isinstance(v, int), return_lists_as_dicts=True)
    assert top_match == {0: 1} and top_rest == {1: "a"}


def test_extract_matching_values_keeps_empty_containers_in_the_rest():
    """As Megatron-Core's: an empty container under a dict key stays in the rest (the
    common state keeps ``{}`` and ``[]``); in a list it is a leaf; containers the split
    leaves empty are dropped."""
    x = {"a": {}, "b": [], "c": {"d": []}, "e": 1}
    match, rest = extract_matching_values(x, lambda v: True)
    assert match == {"e": 1}
    assert rest == {"a": {}, "b": [], "c": {"d": []}}
    assert extract_matching_values({"f": {"g": 2}}, lambda v: True) == ({"f": {"g": 2}}, {})
    assert extract_matching_values({"l": [{}, [], 3]}, lambda v: v == 3) == ({"l": [3]}, {"l": [{}, []]})
    assert extract_matching_values({"l": [{}, [], 3]}, lambda v: True) == ({"l": [{}, [], 3]}, {})
    assert extract_matching_values({}, lambda v: True) == ({}, {})
    assert extract_matching_values([], lambda v: True) == ([], [])


def test_extract_matching_values_top_level_leaf_rejected():
    with pytest.raises(TypeError):
        extract_matching_values(5, lambda v: True)


def test_extract_matching_values_keeps_leaf_identity():
    t = torch.ones(2)
    match, rest = extract_matching_values({"t": t, "n": [None]}, lambda v: isinstance(v, torch.Tensor))
    assert match["t"] is t
    assert rest == {"n": [None]}


@FAST
@given(_nested_dicts, st.sampled_from(["x", "y", ""]))
def test_extract_matching_values_partitions_every_leaf_once(x, tag):
    pred = lambda v: getattr(v, "tag", None) == tag  # noqa: E731 - an empty container in a list is a leaf too
    all_leaves = list(nested_values(x))
    # as dicts: paths survive
    match, rest = extract_matching_values(x, pred, return_lists_as_dicts=True)
    original = _leaf_paths(x)
    m_paths, r_paths = _leaf_paths(match), _leaf_paths(rest)
    assert not set(m_paths) & set(r_paths)
    assert {**m_paths, **r_paths} == original
    assert all(pred(v) for v in m_paths.values())
    assert not any(pred(v) for v in r_paths.values())
    assert all(m_paths[p] is original[p] for p in m_paths)
    # empty containers (never matched here) stay in the rest, where they were
    assert not _has_empty_container(match) and _empty_paths(rest) == _empty_paths(x)
    # as lists: every leaf exactly once, in the original order within each side
    match, rest = extract_matching_values(x, pred)
    m_vals, r_vals = list(nested_values(match)), list(nested_values(rest))
    assert sorted(v.id for v in m_vals + r_vals) == sorted(v.id for v in all_leaves)
    assert [v.id for v in m_vals] == [v.id for v in all_leaves if pred(v)]
    assert [v.id for v in r_vals] == [v.id for v in all_leaves if not pred(v)]
    assert not _has_empty_container(match) and len(_empty_paths(rest)) == len(_empty_paths(x))


# ----------------------------------------------------------------------------- diff


def test_diff_equal_structures():
    x = {"a": torch.arange(4), "b": [1, "s", {"c": torch.ones(2, dtype=torch.bfloat16)}], "d": None}
    y = {"a": torch.arange(4), "b": [1, "s", {"c": torch.ones(2, dtype=torch.bfloat16)}], "d": None}
    assert diff(x, y) == ([], [], [])


def test_diff_keys_only_on_one_side():
    only_left, only_right, mismatch = diff({"a": 1, "b": {"c": 2, "d": 3}}, {"a": 1, "b": {"c": 2, "e": 3}, "f": 4})
    assert only_left == [("b", "d")]
    assert sorted(only_right) == [("b", "e"), ("f",)]
    assert mismatch == []


@pytest.mark.parametrize(
    "t1, t2",
    [
        (torch.zeros(4), torch.zeros(2, 2)),  # shape
        (torch.zeros(1), torch.zeros(())),
        (torch.arange(4.0), torch.tensor([0.0, 1.0, 2.0, 4.0])),  # value
        (torch.arange(4.0), torch.tensor([0, 1, 2, 4], dtype=torch.int16)),  # value, other dtype
        (torch.tensor([True, False]), torch.tensor([True, True])),
        (torch.tensor([float("nan")]), torch.tensor([float("nan")])),
        (torch.zeros(2), [0.0, 0.0]),  # tensor vs non-tensor
        (0, torch.zeros(())),
        (torch.zeros(2), None),
    ],
)
def test_diff_tensor_mismatches(t1, t2):
    for a, b in ((t1, t2), (t2, t1)):
        only_left, only_right, mismatch = diff({"k": {"t": a}}, {"k": {"t": b}})
        assert (only_left, only_right) == ([], [])
        assert [m[:3] for m in mismatch] == [(("k", "t"), type(a), type(b))]


def test_diff_tensor_mismatch_details():
    """As Megatron-Core's: the number of differing elements, the shape, their positions;
    both shapes when they differ."""
    (_, _, [entry]) = diff({"t": torch.tensor([[1, 2], [3, 4]])}, {"t": torch.tensor([[1, 0], [0, 4]])})
    assert entry == (("t",), torch.Tensor, torch.Tensor, 2, torch.Size([2, 2]), [[0, 1], [1, 0]])
    (_, _, [entry]) = diff({"t": torch.zeros(3)}, {"t": torch.zeros(1, 3)})
    assert entry == (("t",), torch.Tensor, torch.Tensor, torch.Size([3]), torch.Size([1, 3]))


@pytest.mark.parametrize("t1, t2", [
    (torch.arange(4, dtype=torch.float32), torch.arange(4, dtype=torch.float64)),
    (torch.arange(4, dtype=torch.int64), torch.arange(4, dtype=torch.int32)),
    (torch.arange(6), torch.arange(6.0, dtype=torch.bfloat16)),
    (torch.tensor([True, False]), torch.tensor([1, 0], dtype=torch.uint8)),
])
def test_diff_equal_values_of_other_dtypes_are_equal(t1, t2):
    """Megatron-Core compares values (``x1 == x2``), not dtypes: a state loaded into
    requests of another dtype equals what was saved."""
    assert diff({"t": t1}, {"t": t2}) == ([], [], [])
    assert diff([t2], [t1]) == ([], [], [])


def test_diff_equal_tensors_different_layout_and_empty():
    assert diff(torch.arange(6).reshape(2, 3).t(), torch.arange(6).reshape(2, 3).t().contiguous()) == ([], [], [])
    assert diff(torch.zeros(0, 3), torch.zeros(0, 3)) == ([], [], [])


def test_diff_sequences_of_different_length():
    """Indices only on one side, from the last, under the path (lists, tuples, arrays)."""
    assert diff([1, 2, 3, 4], [1, 5]) == ([(3,), (2,)], [], [((1,), int, int)])
    assert diff({"l": [1]}, {"l": [1, [2], {"a": 3}]}) == ([], [("l", 2), ("l", 1)], [])
    assert diff({"t": (1,)}, {"t": (1, 2)}, prefix=("c",)) == ([], [("c", "t", 1)], [])
    assert diff([1, 2], []) == ([(1,), (0,)], [], [])
    left, right, mismatch = diff({"a": np.array([1, 2, 3])}, {"a": np.array([1, 5])})
    assert (left, right) == ([("a", 2)], []) and [m[0] for m in mismatch] == [("a", 1)]


def test_diff_scalars_and_type_mismatches():
    assert diff(1, 1) == ([], [], [])
    assert diff(1, 1.0) == ([], [], [])
    assert diff("a", "b") == ([], [], [((), str, str)])
    assert diff({"a": {}}, {"a": []}) == ([], [], [(("a",), dict, list)])
    assert diff({"a": {"b": 1}}, {"a": 1}) == ([], [], [(("a",), dict, int)])
    assert diff([1], {0: 1}) == ([], [], [((), list, dict)])
    assert diff({"s": [1, 2]}, {"s": (1, 2)}) == ([], [], [(("s",), list, tuple)])


def test_diff_sharded_tensors_by_their_data():
    """``ShardedTensor``-like values are compared by their data, under ``path + (type,)``."""
    a = ShardedTensor.from_rank_offsets("w", torch.arange(4.0))
    b = ShardedTensor.from_rank_offsets("w", torch.arange(4, dtype=torch.int32))
    c = ShardedTensor.from_rank_offsets("w", torch.ones(4))
    assert diff({"w": a}, {"w": b}) == ([], [], [])
    assert [m[0] for m in diff({"w": a}, {"w": c})[2]] == [("w", ShardedTensor)]


@FAST
@given(_nested_dicts)
def test_diff_of_structure_with_its_copy_is_empty(x):
    assert diff(x, copy_structure(x)) == ([], [], [])


# ----------------------------------------------------------------------------- nested iteration


def test_nested_values_and_items_order():
    x = {"a": 1, "b": [2, {"c": 3, "d": []}, [4]], "e": {"f": {"g": 5}}, "h": {}}
    assert list(nested_values(x)) == [1, 2, 3, 4, 5]
    assert list(nested_items_iter(x)) == [("a", 1), (0, 2), ("c", 3), (0, 4), ("g", 5)]
    assert list(nested_values([1, [2]])) == [1, 2]
    assert list(nested_items_iter([7, [8]])) == [(0, 7), (0, 8)]
    t = torch.ones(3)
    assert next(nested_values({"t": t})) is t  # tensors are leaves, not iterated


@FAST
@given(_nested_dicts)
def test_nested_values_matches_leaf_paths(x):
    paths = _leaf_paths(x)
    assert [v.id for v in nested_values(x)] == [v.id for v in paths.values()]
    assert [(k, v.id) for k, v in nested_items_iter(x)] == [(p[-1], v.id) for p, v in paths.items()]


# ----------------------------------------------------------------------------- maps


def test_dict_list_map_inplace():
    inner_list = [1, 2, {"x": 3}]
    inner_dict = {"y": 4, "z": inner_list}
    x = {"a": 0, "b": inner_dict}
    out = dict_list_map_inplace(lambda v: v * 10, x)
    assert out is x
    assert x == {"a": 0, "b": {"y": 40, "z": [10, 20, {"x": 30}]}}
    assert x["b"] is inner_dict and x["b"]["z"] is inner_list  # containers kept
    assert dict_list_map_inplace(lambda v: v + 1, 5) == 6
    lst = [1, [2]]
    assert dict_list_map_inplace(str, lst) is lst and lst == ["1", ["2"]]


def test_dict_list_map_outplace():
    x = {"a": 1, "b": [2, {"c": 3}]}
    out = dict_list_map_outplace(lambda v: v * 2, x)
    assert out == {"a": 2, "b": [4, {"c": 6}]}
    assert x == {"a": 1, "b": [2, {"c": 3}]}
    assert out is not x and out["b"] is not x["b"] and out["b"][1] is not x["b"][1]
    assert dict_list_map_outplace(lambda v: -v, 3) == -3


@FAST
@given(_nested_dicts)
def test_map_inplace_and_outplace_agree(x):
    out = dict_list_map_outplace(lambda v: v.id, x)
    ids = [v.id for v in nested_values(x)]
    assert list(nested_values(out)) == ids
    dict_list_map_inplace(lambda v: v.id, x)
    assert x == out


def test_dict_map_treats_lists_as_leaves():
    x = {"a": 1, "b": {"c": [1, 2]}}
    dict_map(lambda v: ("leaf", v), x)
    assert x == {"a": ("leaf", 1), "b": {"c": ("leaf", [1, 2])}}
    y = {"a": 1, "b": {"c": 2}}
    dict_map_with_key(lambda k, v: f"{k}={v}", y)
    assert y == {"a": "a=1", "b": {"c": "c=2"}}


def test_copy_structure_shares_leaves_not_containers():
    t = torch.ones(2)
    obj = object()
    x = {"a": t, "b": [obj, {"c": t}], "d": {}}
    y = copy_structure(x)
    assert y is not x
    assert y["a"] is t and y["b"][0] is obj and y["b"][1]["c"] is t
    assert y["b"] is not x["b"] and y["b"][1] is not x["b"][1] and y["d"] is not x["d"]
    y["b"].append(1)
    y["b"][1]["new"] = 2
    y["d"]["z"] = 3
    assert x == {"a": t, "b": [obj, {"c": t}], "d": {}}


@FAST
@given(_nested_dicts)
def test_copy_structure_random(x):
    y = copy_structure(x)
    px, py = _leaf_paths(x), _leaf_paths(y)
    assert list(px) == list(py)
    assert all(px[p] is py[p] for p in px)

    def containers(z, acc):
        if isinstance(z, (dict, list)):
            acc.append(id(z))
            for v in z.values() if isinstance(z, dict) else z:
                containers(v, acc)
        return acc

    keep_alive = (x, y)  # noqa: F841 - ids are only unique while both live
    assert not set(containers(x, [])) & set(containers(y, []))


# ----------------------------------------------------------------------------- merge


def test_merge_dicts_and_lists():
    x1 = {"a": 1, "b": {"c": 2}, "l": [{"x": 1}, {}]}
    x2 = {"d": 3, "b": {"e": 4}, "l": [{"y": 2}, {"z": 3}]}
    out = merge(x1, x2)
    assert out is x1
    assert x1 == {"a": 1, "b": {"c": 2, "e": 4}, "d": 3, "l": [{"x": 1, "y": 2}, {"z": 3}]}
    assert merge({}, {"a": [1]}) == {"a": [1]}
    assert merge({"a": [1]}, {}) == {"a": [1]}


def test_merge_adopts_subtrees_of_x2():
    sub = {"k": 1}
    out = merge({}, {"s": sub})
    assert out["s"] is sub


@pytest.mark.parametrize(
    "x1, x2, match",
    [
        ([1, 2], [1], "different lengths"),
        ({"a": [1]}, {"a": [1, 2]}, r"different lengths.*\('a',\)"),
        ({"a": 1}, {"a": 1}, r"Duplicate.*\('a',\).*int.*int"),
        ({"a": {"b": 1}}, {"a": {"b": 2}}, r"\('a', 'b'\)"),
        ({"a": 1}, {"a": {"b": 1}}, "Duplicate"),
        ({"a": {"b": 1}}, {"a": 1}, "Duplicate"),
        ({"a": [1]}, {"a": {"0": 1}}, "Duplicate"),
        ({"a": [{"x": 1}]}, {"a": [{"x": 2}]}, r"\('a', 0, 'x'\)"),
        (1, 2, "Duplicate"),
        ({}, [], "Duplicate"),
    ],
)
def test_merge_errors(x1, x2, match):
    with pytest.raises(ValueError, match=match):
        merge(x1, x2)


@st.composite
def _disjoint_dict_pairs(draw):
    """Two nested dicts whose leaf paths are disjoint and whose shared keys are dicts on both sides."""
    x = draw(st.dictionaries(_keys, st.recursive(_leaves, lambda c: st.dictionaries(_keys, c, max_size=3),
                                                 max_leaves=12), max_size=5))
    paths = list(_leaf_paths(x).items())
    mask = draw(st.lists(st.booleans(), min_size=len(paths), max_size=len(paths)))
    x1, x2 = {}, {}
    for (path, leaf), left in zip(paths, mask):
        target = x1 if left else x2
        for k in path[:-1]:
            target = target.setdefault(k, {})
        target[path[-1]] = leaf
    return x, x1, x2


@FAST
@given(_disjoint_dict_pairs())
def test_merge_disjoint_dicts_is_union(case):
    x, x1, x2 = case
    expected = _leaf_paths(x)
    out = merge(x1, x2)
    assert out is x1
    got = _leaf_paths(out)
    assert set(got) == set(expected)
    assert all(got[p] is expected[p] for p in got)


@FAST
@given(_nested_dicts)
def test_extract_then_merge_restores_dict_structure(x):
    match, rest = extract_matching_values(x, lambda v: getattr(v, "tag", None) == "x", return_lists_as_dicts=True)
    merged = merge(match, rest)
    paths = _leaf_paths(merged)
    original = _leaf_paths(x)
    assert set(paths) == set(original)
    assert all(paths[p] is original[p] for p in paths)


# ----------------------------------------------------------------------------- map_reduce


def test_map_reduce():
    xs = [("a", 1), ("b", 2), ("a", 3), ("c", 4), ("b", 5)]
    assert map_reduce(xs, key_fn=lambda x: x[0], value_fn=lambda x: x[1], reduce_fn=sum) == {"a": 4, "b": 7, "c": 4}
    assert map_reduce(xs, key_fn=lambda x: x[0], value_fn=lambda x: x[1]) == {"a": [1, 3], "b": [2, 5], "c": [4]}
    assert map_reduce([1, 2, 1, 3, 1]) == {1: [1, 1, 1], 2: [2], 3: [3]}
    assert map_reduce([]) == {}
    # keys keep first-seen order
    assert list(map_reduce([3, 1, 3, 2], key_fn=lambda x: x)) == [3, 1, 2]


@FAST
@given(st.lists(st.integers(-20, 20), max_size=30))
def test_map_reduce_random(xs):
    out = map_reduce(xs, key_fn=lambda x: x % 3, value_fn=lambda x: x * 2, reduce_fn=sorted)
    for k in range(3):
        expected = sorted(x * 2 for x in xs if x % 3 == k)
        assert out.get(k, []) == expected
    assert set(out) == {x % 3 for x in xs}
