"""``exchange.plan.plan_shards`` on real gloo groups: every rank's part of the plan is
consistent with the others' and equal to the greedy assignment over every rank's summary
at once (what the fully parallel wrappers computed from an all-gather before), and the
bytes a rank receives while planning do not grow with the group size."""

from __future__ import annotations

import statistics
from typing import Dict, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_checkpointing import CheckpointingException
from dist_checkpointing.exchange_utils import ShardInfo, distribution_from_summaries
from dist_checkpointing.exchange.plan import plan_shards

from .collective_counter import count_collectives
from .conftest import get_pool

# A layout: shard index -> (holder ranks, size in elements, rank holding the main replica or -1)
Layout = Dict[int, Tuple[Tuple[int, ...], int, int]]


def _sid(i: int):
    return (f"w{i}", (i % 3, 0), ())


def _summary(rank: int, layout: Layout, shape_on: int = -1):
    out = []
    for i, (holders, n, main) in sorted(layout.items()):
        if rank in holders:
            n_here = n + 1 if rank == shape_on and i == 0 else n
            out.append((_sid(i), ShardInfo((n_here,), torch.float32, 4 * n_here), rank == main))
    return out


def _plan_rank(rank: int, world: int, layout: Layout):
    plan = plan_shards(_summary(rank, layout))
    return (plan.reader, sorted(plan.in_group), sorted(plan.whole_group),
            {sid: sorted(r) for sid, r in plan.send_to.items()})


def _check_plans(layout: Layout, plans: list, world: int) -> None:
    for i, (holders, _, main) in layout.items():
        sid = _sid(i)
        readers = {plans[r][0][sid] for r in holders}
        assert len(readers) == 1 and readers <= set(holders), (sid, holders, readers)
        reader = readers.pop()
        for r in holders:
            assert (sid in plans[r][1]) == (main >= 0), (sid, r, "in_group")
            assert (sid in plans[r][2]) == (len(holders) == world), (sid, r, "whole_group")
        expected_send = [] if len(holders) == world else sorted(set(holders) - {reader})
        assert plans[reader][3].get(sid, []) == expected_send, (sid, plans[reader][3].get(sid))
        for r in set(holders) - {reader}:
            assert sid not in plans[r][3], (sid, r)
    for rank, (reader, _, _, _) in enumerate(plans):
        assert set(reader) == {_sid(i) for i, (h, _, _) in layout.items() if rank in h}, rank
    # the same assignment as the greedy over every rank's summary at once (the old all-gather plan)
    everything = distribution_from_summaries([_summary(r, layout) for r in range(world)])
    for rank, (reader, _, _, _) in enumerate(plans):
        assert reader == {sid: everything.main_rank_for_shard[sid] for sid in reader}, rank


@st.composite
def _layouts(draw, world: int) -> Layout:
    n = draw(st.integers(0, 12))
    layout: Layout = {}
    for i in range(n):
        holders = tuple(sorted(draw(st.sets(st.integers(0, world - 1), min_size=1))))
        main = draw(st.sampled_from(holders + (-1,)))
        layout[i] = (holders, draw(st.integers(0, 5000)), main)
    return layout


@settings(max_examples=25, deadline=None)
@given(layout=_layouts(4))
def test_every_rank_agrees_on_the_plan(layout):
    _check_plans(layout, get_pool(4).run(_plan_rank, layout), 4)


def test_identical_lists_give_the_global_assignment():
    world = 4
    layout = {i: (tuple(range(world)), 1000 + 317 * i, i % world if i % 5 else -1) for i in range(20)}
    plans = get_pool(world).run(_plan_rank, layout)
    _check_plans(layout, plans, world)
    expected = distribution_from_summaries([_summary(r, layout) for r in range(world)])
    assert plans[0][0] == expected.main_rank_for_shard
    assert set(plans[0][1]) == expected.shards_in_this_group


def _differing_rank(rank: int, world: int, layout: Layout):
    plan_shards(_summary(rank, layout, shape_on=world - 1))


def test_a_shard_differing_between_holders_is_named_with_both_ranks():
    world = 4
    layout = {0: (tuple(range(world)), 10, 0), 1: ((0, 1), 20, 0)}
    errors = get_pool(world).run_expect_error(_differing_rank, layout)
    # the rank that plans w0 names both shapes; its other holders name it (the fully
    # parallel wrappers then agree the messages over every rank)
    assert all(isinstance(e, CheckpointingException) and "'w0'" in str(e) for e in errors[:1]), errors
    judges = [e for e in errors if "differs between ranks" in str(e)]
    assert len(judges) == 1 and "group rank 0 has shape (10,)" in str(judges[0]) \
        and f"group rank {world - 1} has shape (11,)" in str(judges[0]), errors
    assert all("'w0'" in str(e) for e in errors if e is not None), errors


def _constant_layout(world: int, shared: bool) -> Layout:
    """24 shards per rank, whatever the world size: replicated on every rank (``shared``), or
    each rank's own 16 plus 8 shared with its right-hand neighbour."""
    if shared:
        return {i: (tuple(range(world)), 1000 + i, i % world) for i in range(24)}
    layout: Layout = {}
    for r in range(world):
        for k in range(16):
            layout[len(layout)] = ((r,), 500 + k, r)
        for k in range(8):
            layout[len(layout)] = (tuple(sorted({r, (r + 1) % world})), 300 + k, r)
    return layout


def _count_plan(rank: int, world: int, shared: bool) -> Tuple[int, int]:
    summary = _summary(rank, _constant_layout(world, shared))
    with count_collectives() as count:
        plan_shards(summary)
    return count.received, count.n_calls


@pytest.mark.parametrize("shared", [True, False], ids=["replicated", "distinct"])
def test_planning_bytes_do_not_grow_with_the_group(shared):
    results = {world: get_pool(world).run(_count_plan, shared) for world in (2, 8)}
    median = {w: statistics.median(b for b, _ in res) for w, res in results.items()}
    # beyond the 8-byte counts per rank of the all_to_all_single calls
    assert median[8] <= 1.5 * median[2] + 2 * 8 * 8, median
    calls = {w: {c for _, c in res} for w, res in results.items()}
    assert calls[2] == calls[8] and len(calls[8]) == 1, calls
