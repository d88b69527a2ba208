"""Helpers for nested structures of dicts and lists (the shape of every state dict).

Owns: nested dict/list helpers: extract, merge, diff (Megatron-Core's semantics: tensors by
value, mismatch entries ``(path, type, type, …)``), map in/out of place; ``find_anywhere``
(a value in any container, with its path).
"""

from __future__ import annotations

import types
from collections import defaultdict, deque
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, TypeVar, Union

import numpy as np
import torch

T = TypeVar("T")
U = TypeVar("U")
Nested = Union[dict, list, Any]


def extract_matching_values(
    x: Union[dict, list], predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Union[dict, list], Union[dict, list]]:
    """Split ``x`` into (leaves matching ``predicate``, the rest), keeping the nesting.

    As Megatron-Core's: an empty dict or list under a dict key stays in the rest (so the
    common state keeps it); one in a list is a leaf like any other; containers left empty
    by the split are dropped. With ``return_lists_as_dicts`` lists become dicts keyed by
    index, so positions survive the split.
    """

    def _set(container, k, v):
        if isinstance(container, dict):
            container[k] = v
        else:
            container.append(v)

    def _split(node):
        if isinstance(node, dict):
            items = node.items()
            match, rest = {}, {}
        elif isinstance(node, list):
            items = enumerate(node)
            if return_lists_as_dicts:
                match, rest = {}, {}
            else:
                match, rest = [], []
        else:
            raise TypeError(f"Expected dict or list, got {type(node)}")
        for k, v in items:
            if isinstance(v, (dict, list)) and (v or isinstance(node, dict)):
                m, r = _split(v)
                if m:
                    _set(match, k, m)
                if r or not v:  # an empty container under a dict key is kept
                    _set(rest, k, r)
            elif predicate(v):
                _set(match, k, v)
            else:
                _set(rest, k, v)
        return match, rest

    return _split(x)


def diff(x1: Any, x2: Any, prefix: Tuple = ()) -> Tuple[list, list, list]:
    """Compare two nested structures (dicts, lists, tuples, NumPy arrays), as Megatron-Core's
    ``diff`` does.

    Returns ``(only_left, only_right, mismatch)``: the paths (tuples, under ``prefix``)
    only in ``x1`` / only in ``x2`` (sequence indices from the last), and one entry per
    differing value: ``(path, type of x1's value, type of x2's value, ...)``. Tensors are
    equal when their shapes match and every element compares equal, whatever their dtypes
    and devices; then the entry adds the number of differing elements, the shape and the
    differing positions (shapes that differ: both shapes). ``ShardedTensor``-like values
    (with a ``replica_id``) of one type are compared by their ``data``, under
    ``path + (type,)``. Containers of different types differ.
    """
    mismatch: list = []
    only_left: list = []
    only_right: list = []
    sequences = (list, tuple, np.ndarray)
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        pairs = [(k, x1[k], x2[k]) for k in x1.keys() & x2.keys()]
    elif isinstance(x1, sequences) and type(x1) is type(x2):
        only_left = [prefix + (i,) for i in range(len(x1) - 1, len(x2) - 1, -1)]
        only_right = [prefix + (i,) for i in range(len(x2) - 1, len(x1) - 1, -1)]
        pairs = [(i, v1, v2) for i, (v1, v2) in enumerate(zip(x1, x2))]
    elif hasattr(x1, "replica_id") and hasattr(x2, "replica_id") and type(x1) is type(x2):
        return diff(x1.data, x2.data, prefix + (type(x1),))
    else:
        entry = _leaf_mismatch(x1, x2)
        return [], [], [] if entry is None else [(prefix, type(x1), type(x2), *entry)]
    for k, v1, v2 in pairs:
        _left, _right, _mismatch = diff(v1, v2, prefix + (k,))
        only_left += _left
        only_right += _right
        mismatch += _mismatch
    return only_left, only_right, mismatch


def _leaf_mismatch(x1: Any, x2: Any) -> Optional[tuple]:
    """``None`` when two leaves are equal, else the details :func:`diff` adds to its entry."""
    if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        if x1.shape != x2.shape:
            return x1.shape, x2.shape
        try:
            differs = x1.cpu() != x2.cpu()
        except (RuntimeError, TypeError) as e:  # e.g. no comparison between these dtypes
            return (str(e),)
        return None if not differs.any() else (int(differs.sum()), differs.shape, differs.nonzero().tolist())
    if isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor) or \
            isinstance(x1, (dict, list, tuple, np.ndarray)) or isinstance(x2, (dict, list, tuple, np.ndarray)):
        return ()  # a tensor and something else, or containers of different types
    try:
        return None if not bool(x1 != x2) else ()
    except (RuntimeError, ValueError, TypeError):
        return ()


def nested_values(x: Nested) -> Iterator[Any]:
    """Yield the leaves of a nested dict/list structure."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: Nested) -> Iterator[Tuple[Any, Any]]:
    """Yield ``(key, leaf)`` pairs; the key is the innermost dict key or list index."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield k, v


def dict_map(f: Callable[[Any], Any], x: dict) -> None:
    """Apply ``f`` in place to every leaf under dicts (lists are leaves)."""
    for k, v in x.items():
        if isinstance(v, dict):
            dict_map(f, v)
        else:
            x[k] = f(v)


def dict_map_with_key(f: Callable[[Any, Any], Any], x: dict) -> None:
    """Like :func:`dict_map` with ``f(key, value)``."""
    for k, v in x.items():
        if isinstance(v, dict):
            dict_map_with_key(f, v)
        else:
            x[k] = f(k, v)


def dict_list_map_inplace(f: Callable[[Any], Any], x: Nested) -> Nested:
    """Apply ``f`` in place to every leaf of nested dicts and lists; returns ``x``
    (or ``f(x)`` when ``x`` is itself a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = (dict_list_map_inplace(f, v) for v in x)
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Nested) -> Nested:
    """Return a new nested structure with ``f`` applied to every leaf (``x`` untouched)."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def copy_structure(x: Nested) -> Nested:
    """Copy the dicts and lists of ``x``, sharing the leaves (cheap; no tensor copies)."""
    return dict_list_map_outplace(lambda v: v, x)


def merge(x1: Nested, x2: Nested, key: Tuple = ()) -> Nested:
    """Merge ``x2`` into ``x1`` in place (dicts by key, lists by position); returns ``x1``.

    Raises ``ValueError`` for lists of different lengths or a leaf that would be
    overwritten by a container (or the reverse).
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                x1[k] = v2
            else:
                x1[k] = merge(x1[k], v2, key=key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"Cannot merge two lists with different lengths ({len(x1)} and {len(x2)}) "
                f"at key {key}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key=key + (i,))
    else:
        raise ValueError(
            f"Duplicate non-dict and non-list values encountered at key {key}: "
            f"`{type(x1).__name__}` and `{type(x2).__name__}`"
        )
    return x1


def map_reduce(
    xs: Iterable[T],
    key_fn: Callable[[T], Any] = lambda x: x,
    value_fn: Callable[[T], U] = lambda x: x,
    reduce_fn: Callable[[List[U]], Any] = lambda x: x,
) -> Dict[Any, Any]:
    """Group ``xs`` by ``key_fn``, map each by ``value_fn``, reduce each group with ``reduce_fn``."""
    groups: Dict[Any, List[U]] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def find_anywhere(x: Any, predicate: Callable[[Any], bool], root: str = "state_dict") -> Optional[Tuple[str, Any, type]]:
    """The first value matching ``predicate`` anywhere inside ``x`` — in dicts and lists,
    but also tuples (named too), sets, deques, other mappings and the attributes of plain
    objects — as ``(path, value, container)``, where ``container`` is the type of the first
    container on the path that is neither a dict nor a list (``dict`` if there is none).
    ``None`` if nothing matches. Each object is visited once (cycles are fine)."""
    seen = set()
    stack: List[Tuple[str, Any, type]] = [(root, x, dict)]
    while stack:
        path, value, container = stack.pop()
        if predicate(value):
            return path, value, container
        if id(value) in seen:
            continue
        if isinstance(value, Mapping):
            children = [(f"{path}[{k!r}]", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple, deque)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, (set, frozenset)):
            children = [(f"{path}{{...}}", v) for v in value]
        elif hasattr(value, "__dict__") and not isinstance(value, _OPAQUE):
            children = [(f"{path}.{name}", v) for name, v in vars(value).items()]
        else:
            continue
        seen.add(id(value))
        inner = container if container is not dict or type(value) in (dict, list) else type(value)
        stack.extend((p, v, inner) for p, v in reversed(children))
    return None
