"""Plain Python values in ShardedObjects and common state load with the safe (default) loader.

``torch.save`` pickles with protocol 2, which stores some plain values by naming a builtin
or stdlib global: ``b""`` is ``builtins.bytes()``, a ``frozenset``, ``slice`` or ``range``
calls its class, ``...`` is the global ``builtins.Ellipsis``, ``type(None)`` is
``builtins.type(None)``, a ``datetime`` calls its class on packed bytes. torch's safe
unpickler lists none of them; ours does, through constructors that can only rebuild the
value (``bytes(n)`` and ``type(name, bases, ns)`` are refused).
"""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import io
import math
import uuid
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.pickling.safe_load import safe_torch_load

from .conftest import get_pool
from .helpers import assert_all_raise

# fixed offsets (a zoneinfo.ZoneInfo pickles through builtins.getattr: it needs the opt-in)
_FIXED_ZONES = st.builds(datetime.timezone, st.timedeltas(datetime.timedelta(hours=-23), datetime.timedelta(hours=23)))
_ATOMS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
    st.binary(max_size=8),  # b"" is the case torch's own list misses
    st.builds(bytearray, st.binary(max_size=4)), st.complex_numbers(allow_nan=False),
    st.builds(slice, st.none() | st.integers(), st.none() | st.integers(), st.none() | st.integers(1, 9)),
    st.builds(range, st.integers(-50, 50), st.integers(-50, 50), st.integers(1, 9)),
    st.sampled_from([Ellipsis, NotImplemented, type(None), type(Ellipsis), type(NotImplemented)]),
    st.datetimes(timezones=st.none() | _FIXED_ZONES), st.dates(), st.times(), st.timedeltas(), _FIXED_ZONES,
    st.decimals(allow_nan=False), st.fractions(), st.uuids(),
    st.frozensets(st.integers() | st.text(max_size=4), max_size=4),
)


PLAIN = st.recursive(
    _ATOMS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.tuples(children, children),
        st.dictionaries(st.text(max_size=4) | st.binary(max_size=4) | st.integers(), children, max_size=4),
        st.builds(collections.OrderedDict, st.dictionaries(st.text(max_size=3), children, max_size=3)),
        st.builds(collections.Counter, st.dictionaries(st.text(max_size=3), st.integers(), max_size=3)),
        st.sets(st.integers() | st.text(max_size=3) | st.frozensets(st.integers(), max_size=2), max_size=4),
        st.frozensets(st.integers() | st.binary(max_size=3) | st.builds(range, st.integers(0, 9)), max_size=3),
    ),
    max_leaves=12,
)


def _saved(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save([value], buf)
    return buf.getvalue()


@settings(max_examples=150, deadline=None)
@given(PLAIN)
def test_plain_values_round_trip_through_the_safe_loader(value):
    data = _saved(value)
    loaded = safe_torch_load(data, "item 'k'")[0]
    # the value torch's unrestricted unpickler builds (equal to ``value`` for all of these,
    # and of the same types all the way down)
    assert _typed(loaded) == _typed(torch.load(io.BytesIO(data), weights_only=False)[0])
    assert loaded == value


def _typed(value: Any) -> Any:
    """``value`` with every container's and leaf's type beside it (``1 == 1.0 == True``)."""
    if isinstance(value, (list, tuple)):
        return type(value), [_typed(v) for v in value]
    if isinstance(value, dict):
        return type(value), sorted(((repr(k), _typed(v)) for k, v in value.items()), key=repr)
    return type(value), repr(value)


class _Reduces:
    """Pickles as ``func(*args)``: what a hostile file can write with the allowed globals."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("hostile, says", [
    (_Reduces(bytes, 2 * 10**9), "builtins.bytes with a size"),  # would allocate 2 GB
    (_Reduces(type, "X", (), {}), "builtins.type"),               # would create a class
    (_Reduces(type, 7), "builtins.type"),
], ids=["bytes-of-size", "type-new-class", "type-of-int"])
def test_allowed_builtins_refuse_what_is_not_rebuilding_a_value(hostile, says):
    with pytest.raises(CheckpointingException, match=f"Refusing to unpickle item 'k'.*{says}"):
        safe_torch_load(_saved(hostile), "item 'k'")
    assert safe_torch_load(_saved(_Reduces(bytes, b"ab")), "item 'k'") == [b"ab"]


def test_containers_torch_cannot_fill_still_need_the_opt_in():
    """A deque or a defaultdict with items: torch's unpickler fills only lists and dicts,
    so they are refused by name, and load with ``allow_pickle``."""
    for value in (collections.deque([1, 2]), collections.defaultdict(list, {"a": [1]})):
        with pytest.raises(CheckpointingException, match="collections"):
            safe_torch_load(_saved(value), "item 'k'")
        assert safe_torch_load(_saved(value), "item 'k'", allow_pickle=True) == [value]


# ----------------------------------------------------------------------------- through save/load

_VALUES = {
    "empty_bytes": b"", "bytes_in_dict": {"tokenizer": b"", "vocab": b"ab"},
    "frozenset": frozenset({"a", 1}), "slice": slice(0, 64), "range": range(0, 8, 2), "ellipsis": ...,
    "none_type": type(None), "when": datetime.datetime(2026, 11, 28, 2, 0, tzinfo=datetime.timezone.utc),
    "interval": datetime.timedelta(minutes=30), "decimal": decimal.Decimal("0.1"),
    "fraction": fractions.Fraction(2, 3), "run_id": uuid.UUID(int=12345), "nan": math.nan,
}


def _save_plain(rank: int, world: int, ckpt: str) -> bool:
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0) + 4 * rank, (0, rank, world)),
             "objects": {k: ShardedObject(f"obj.{k}", v, (world,), (rank,)) for k, v in _VALUES.items()},
             "common": dict(_VALUES)}
    dc.save(state, ckpt)
    return True


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _load_plain(rank: int, world: int, ckpt: str) -> list:
    before = list(torch.serialization.get_safe_globals())
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world)),
               "objects": {k: ShardedObject(f"obj.{k}", None, (world,), (rank,)) for k in _VALUES}}
    loaded = dc.load(request, ckpt)
    common = dc.load_common_state_dict(ckpt)
    assert torch.equal(loaded["w"], torch.arange(4.0) + 4 * rank)
    wrong = [k for k, v in _VALUES.items() if not _same(loaded["objects"][k], v)]
    wrong += [f"common {k}" for k, v in _VALUES.items() if not _same(loaded["common"][k], v)]
    wrong += [f"load_common_state_dict {k}" for k, v in _VALUES.items() if not _same(common["common"][k], v)]
    after = list(torch.serialization.get_safe_globals())
    wrong += [f"left registered: {e!r}" for e in after if e not in before]
    return wrong


def _load_hostile(rank: int, world: int, ckpt: str) -> None:
    dc.load({"o": ShardedObject("obj.hostile", None, (world,), (rank,))}, ckpt)


def _save_hostile(rank: int, world: int, ckpt: str) -> bool:
    dc.save({"o": ShardedObject("obj.hostile", _Reduces(bytes, 2 * 10**9), (world,), (rank,))}, ckpt)
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_plain_values_in_objects_and_common_state_load_by_default(tmp_path, world):
    pool = get_pool(world)
    assert pool.run(_save_plain, str(tmp_path / "c")) == [True] * world
    assert pool.run(_load_plain, str(tmp_path / "c")) == [[]] * world
    assert pool.run(_save_hostile, str(tmp_path / "h")) == [True] * world
    excs = pool.run_expect_error(_load_hostile, str(tmp_path / "h"))
    assert_all_raise(excs, world, "'obj.hostile", "builtins.bytes with a size")
