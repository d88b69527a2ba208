"""``load(..., strict=...)``: every StrictHandling mode against exact, unexpected and
missing keys, through real gloo process groups.

Unexpected = requested on this rank but not in the checkpoint (per rank); missing = in the
checkpoint but requested by no rank (global). The checkpoint holds ShardedTensors 'a'
(split over ranks) and 'b' (replicated), a ShardedObject 'obj' (one piece per rank) and a
common entry 'it'.
"""

from __future__ import annotations

import logging

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.validation import StrictHandling

from .conftest import get_pool

S = StrictHandling
ALL_MODES = list(StrictHandling)
RAISING = {S.RAISE_UNEXPECTED, S.RAISE_ALL}
RETURNING = {S.RETURN_UNEXPECTED, S.RETURN_ALL}
LOGGING = {S.LOG_UNEXPECTED, S.LOG_ALL}
NEED_MISSING = {S.LOG_ALL, S.RAISE_ALL, S.RETURN_ALL}
VALIDATION_LOGGER = "dist_checkpointing.validation"


# ----------------------------------------------------------------------------- rank functions


def _a_global(world: int) -> torch.Tensor:
    return torch.arange(world * 2 * 3, dtype=torch.float32).reshape(world * 2, 3)


B_GLOBAL = torch.tensor([10.0, 11.0, 12.0, 13.0])


def _st_a(rank, world, fill):
    data = _a_global(world)[2 * rank: 2 * rank + 2].clone()
    return ShardedTensor.from_rank_offsets("a", data if fill else torch.zeros_like(data), (0, rank, world))


def _st_b(rank, fill):
    return ShardedTensor.from_rank_offsets("b", B_GLOBAL.clone() if fill else torch.zeros(4), replica_id=rank)


def _obj(rank, world, fill):
    return ShardedObject("obj", {"r": rank} if fill else None, (world,), (rank,))


def _save(rank, world, ckpt):
    dc.save({"a": _st_a(rank, world, True), "b": _st_b(rank, True), "obj": _obj(rank, world, True), "it": 5}, ckpt)


def _request(rank, world, situation, extra_ranks):
    """The request of ``rank`` for a situation:

    exact      -- every checkpoint key on every rank
    unexpected -- exact, plus 'extra.w' (tensor) and 'extra_obj' (object) on ``extra_ranks``
    missing    -- nobody requests 'b'
    partial    -- 'b' and 'obj' requested by rank 0 only (so nothing is missing)
    both       -- missing 'b' and the extras on ``extra_ranks``
    only_a     -- nobody requests 'b' nor the object 'obj'
    """
    sd = {"a": _st_a(rank, world, False)}
    if situation in ("exact", "unexpected") or (situation == "partial" and rank == 0):
        sd["b"] = _st_b(rank, False)
    if situation != "only_a" and (situation != "partial" or rank == 0):
        sd["obj"] = _obj(rank, world, False)
    if situation in ("unexpected", "both") and rank in extra_ranks:
        replica = list(extra_ranks).index(rank)  # one main replica among the requesting ranks
        sd["extra"] = {"w": ShardedTensor.from_rank_offsets("extra.w", torch.zeros(3), replica_id=replica)}
        sd["extra_obj"] = ShardedObject("extra_obj", None, (1,), (0,), replica_id=replica)
    return sd


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _load(rank, world, ckpt, strict, situation, extra_ranks=(1,)):
    """Load the situation's request; check the legitimate values; report what came back."""
    request = _request(rank, world, situation, extra_ranks)
    requested = set(request)
    handler = _Capture()
    log = logging.getLogger(VALIDATION_LOGGER)
    log.addHandler(handler)
    try:
        out = dc.load(request, ckpt, strict=strict)
    finally:
        log.removeHandler(handler)
    report = {"logs": handler.messages, "is_tuple": isinstance(out, tuple)}
    if isinstance(out, tuple):
        assert len(out) == 3, out
        out, missing, unexpected = out
        assert isinstance(missing, set) and isinstance(unexpected, set)
        report["missing"], report["unexpected"] = set(missing), set(unexpected)
    assert isinstance(out, dict), type(out)
    # legitimate keys hold the right values
    assert torch.equal(out["a"], _a_global(world)[2 * rank: 2 * rank + 2])
    if "b" in requested:
        assert torch.equal(out["b"], B_GLOBAL)
    else:
        assert "b" not in out
    if "obj" in requested:
        assert out["obj"] == {"r": rank}
    assert out["it"] == 5
    # unexpected keys are dropped from the result
    assert "extra_obj" not in out
    assert "w" not in out.get("extra", {})
    leftovers = [k for k, v in out.items() if isinstance(v, (ShardedTensor, ShardedObject))]
    assert not leftovers, leftovers
    report["keys"] = sorted(out)
    return report


# ----------------------------------------------------------------------------- fixtures

_CKPTS: dict = {}


@pytest.fixture(scope="module")
def ckpt_for(tmp_path_factory):
    """``ckpt_for(world)``: the path of a checkpoint saved once per world size."""

    def get(world, location=None):
        """``location``: a ``ckpt_location`` (tests/locations.py) to save in; else a local directory."""
        kind = "posix" if location is None else location.kind
        if (world, kind) not in _CKPTS:
            path = location(f"strict_w{world}") if location is not None else str(
                tmp_path_factory.mktemp(f"strict_w{world}") / "ckpt")
            get_pool(world).run(_save, path)
            _CKPTS[world, kind] = path
        return _CKPTS[world, kind]

    yield get
    _CKPTS.clear()


def _ids(m):
    return m.value


# ----------------------------------------------------------------------------- (a) exact match


@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_exact_match_every_mode_loads(ckpt_for, mode):
    reports = get_pool(2).run(_load, str(ckpt_for(2)), mode, "exact")
    for rank, rep in enumerate(reports):
        assert rep["logs"] == [], (rank, rep["logs"])
        assert rep["keys"] == ["a", "b", "it", "obj"]
        assert rep["is_tuple"] == (mode in RETURNING)
        if mode in RETURNING:
            assert rep["missing"] == set() and rep["unexpected"] == set()


# ----------------------------------------------------------------------------- (b) unexpected keys


@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_unexpected_keys_on_one_rank(ckpt_for, mode):
    pool = get_pool(2)
    ckpt = str(ckpt_for(2))
    if mode in RAISING or mode == S.ASSUME_OK_UNEXPECTED:
        excs = pool.run_expect_error(_load, ckpt, mode, "unexpected")
        for rank, exc in enumerate(excs):
            assert isinstance(exc, CheckpointingException), (rank, repr(exc))
            assert "extra.w" in str(exc) and "rank 1" in str(exc), (rank, str(exc))
            if mode in RAISING:
                msg = str(exc)
                assert "extra.w" in msg and "extra_obj" in msg, (rank, msg)
                assert "rank 1" in msg, (rank, msg)
                assert "rank 0" not in msg, (rank, msg)
                # the same agreed message on every rank
                assert msg == str(excs[0])
        return
    reports = pool.run(_load, ckpt, mode, "unexpected")
    r0, r1 = reports
    for rank, rep in enumerate(reports):
        assert rep["keys"] == ["a", "b", "it", "obj"], (rank, rep["keys"])
        assert rep["is_tuple"] == (mode in RETURNING)
    if mode in LOGGING:
        assert r0["logs"] == [], r0["logs"]
        assert len(r1["logs"]) == 1, r1["logs"]
        assert "extra.w" in r1["logs"][0] and "extra_obj" in r1["logs"][0], r1["logs"]
        assert "missing" not in r1["logs"][0], r1["logs"]
    else:
        assert r0["logs"] == [] and r1["logs"] == [], (r0["logs"], r1["logs"])
    if mode in RETURNING:
        assert r0["unexpected"] == set() and r0["missing"] == set()
        assert r1["unexpected"] == {"extra.w", "extra_obj"} and r1["missing"] == set()


# ----------------------------------------------------------------------------- (c) missing keys


@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_missing_key(ckpt_for, mode):
    pool = get_pool(2)
    ckpt = str(ckpt_for(2))
    if mode == S.RAISE_ALL:
        excs = pool.run_expect_error(_load, ckpt, mode, "missing")
        for rank, exc in enumerate(excs):
            assert isinstance(exc, CheckpointingException), (rank, repr(exc))
            msg = str(exc)
            assert "'b'" in msg and "missing" in msg, (rank, msg)
            assert "'a'" not in msg and "obj" not in msg.split("missing", 1)[1], (rank, msg)
        return
    reports = pool.run(_load, ckpt, mode, "missing")
    for rank, rep in enumerate(reports):
        assert rep["keys"] == ["a", "it", "obj"], (rank, rep["keys"])
        assert rep["is_tuple"] == (mode in RETURNING)
        if mode == S.LOG_ALL:
            assert len(rep["logs"]) == 1, (rank, rep["logs"])
            assert "'b'" in rep["logs"][0] and "missing" in rep["logs"][0], (rank, rep["logs"])
            assert "unexpected" not in rep["logs"][0], (rank, rep["logs"])
        else:
            assert rep["logs"] == [], (rank, rep["logs"])
        if mode == S.RETURN_ALL:
            assert rep["missing"] == {"b"} and rep["unexpected"] == set(), rank
        elif mode == S.RETURN_UNEXPECTED:
            assert rep["missing"] == set() and rep["unexpected"] == set(), rank


@pytest.mark.parametrize("mode", ALL_MODES, ids=_ids)
def test_key_requested_by_one_rank_is_not_missing(ckpt_for, mode):
    """'b' and 'obj' requested by rank 0 only: nothing is missing, no mode complains."""
    reports = get_pool(2).run(_load, str(ckpt_for(2)), mode, "partial")
    assert reports[0]["keys"] == ["a", "b", "it", "obj"]
    assert reports[1]["keys"] == ["a", "it"]
    for rank, rep in enumerate(reports):
        assert rep["logs"] == [], (rank, rep["logs"])
        if mode in RETURNING:
            assert rep["missing"] == set() and rep["unexpected"] == set(), rank


@pytest.mark.parametrize("mode", [S.RETURN_ALL, S.RAISE_ALL, S.RETURN_UNEXPECTED, S.IGNORE_ALL], ids=_ids)
def test_missing_object_counts_by_base_key(ckpt_for, mode):
    pool = get_pool(2)
    ckpt = str(ckpt_for(2))
    if mode == S.RAISE_ALL:
        for exc in pool.run_expect_error(_load, ckpt, mode, "only_a"):
            assert isinstance(exc, CheckpointingException) and "['b', 'obj']" in str(exc), str(exc)
            assert "shard_" not in str(exc), str(exc)
        return
    for rank, rep in enumerate(pool.run(_load, ckpt, mode, "only_a")):
        assert rep["keys"] == ["a", "it"], rank
        if mode in RETURNING:
            assert rep["missing"] == ({"b", "obj"} if mode == S.RETURN_ALL else set()), (rank, rep["missing"])
            assert rep["unexpected"] == set()


# ----------------------------------------------------------------------------- combined / strings


@pytest.mark.parametrize("mode", [S.LOG_ALL, S.RAISE_UNEXPECTED, S.RAISE_ALL, S.RETURN_ALL, S.RETURN_UNEXPECTED],
                         ids=_ids)
def test_missing_and_unexpected_together(ckpt_for, mode, ckpt_location):
    pool = get_pool(2)
    ckpt = str(ckpt_for(2, ckpt_location))
    if mode in RAISING:
        excs = pool.run_expect_error(_load, ckpt, mode, "both")
        for rank, exc in enumerate(excs):
            msg = str(exc)
            assert isinstance(exc, CheckpointingException)
            assert "extra.w" in msg and "rank 1" in msg, (rank, msg)
            assert ("'b'" in msg) == (mode == S.RAISE_ALL), (rank, msg)
        return
    r0, r1 = pool.run(_load, ckpt, mode, "both")
    if mode == S.LOG_ALL:
        # rank 0 has no unexpected keys but still reports the (global) missing one
        assert len(r0["logs"]) == 1 and "'b'" in r0["logs"][0] and "extra" not in r0["logs"][0]
        assert len(r1["logs"]) == 1 and "'b'" in r1["logs"][0] and "extra.w" in r1["logs"][0]
    else:
        want_missing = {"b"} if mode == S.RETURN_ALL else set()
        assert r0["missing"] == want_missing == r1["missing"]
        assert r0["unexpected"] == set() and r1["unexpected"] == {"extra.w", "extra_obj"}


@pytest.mark.parametrize("mode", [S.RAISE_ALL, S.RETURN_ALL, S.LOG_UNEXPECTED], ids=_ids)
def test_strict_accepts_string_values(ckpt_for, mode):
    pool = get_pool(2)
    ckpt = str(ckpt_for(2))
    if mode == S.RAISE_ALL:
        excs = pool.run_expect_error(_load, ckpt, mode.value, "missing")
        assert all(isinstance(e, CheckpointingException) and "'b'" in str(e) for e in excs), excs
        return
    r0, r1 = pool.run(_load, ckpt, mode.value, "both")
    if mode == S.RETURN_ALL:
        assert r0["is_tuple"] and r0["missing"] == {"b"} and r1["unexpected"] == {"extra.w", "extra_obj"}
    else:
        assert not r0["is_tuple"] and r0["logs"] == [] and "extra.w" in r1["logs"][0]


def test_unknown_strict_string_raises(ckpt_for):
    excs = get_pool(2).run_expect_error(_load, str(ckpt_for(2)), "raise_everything", "exact")
    for exc in excs:
        assert isinstance(exc, CheckpointingException) and "raise_everything" in str(exc), repr(exc)


def test_unknown_strict_string_raises_without_group(tmp_path):
    with pytest.raises(CheckpointingException, match="bogus"):
        dc.load({}, tmp_path, strict="bogus")


# ----------------------------------------------------------------------------- world size 4


def test_world4_raise_unexpected_names_every_offending_rank(ckpt_for):
    excs = get_pool(4).run_expect_error(_load, str(ckpt_for(4)), S.RAISE_UNEXPECTED, "unexpected", (1, 3))
    assert len(excs) == 4
    for rank, exc in enumerate(excs):
        msg = str(exc)
        assert isinstance(exc, CheckpointingException), (rank, repr(exc))
        assert "rank 1" in msg and "rank 3" in msg and "extra.w" in msg, (rank, msg)
        assert "rank 0" not in msg and "rank 2" not in msg, (rank, msg)


def test_world4_return_all(ckpt_for, ckpt_location):
    reports = get_pool(4).run(_load, str(ckpt_for(4, ckpt_location)), S.RETURN_ALL, "both", (2,))
    for rank, rep in enumerate(reports):
        assert rep["missing"] == {"b"}, rank
        assert rep["unexpected"] == ({"extra.w", "extra_obj"} if rank == 2 else set()), rank
        assert rep["keys"] == ["a", "it", "obj"], rank


def test_world4_partial_requests_not_missing(ckpt_for):
    reports = get_pool(4).run(_load, str(ckpt_for(4)), S.RETURN_ALL, "partial")
    for rank, rep in enumerate(reports):
        assert rep["missing"] == set() and rep["unexpected"] == set(), rank
