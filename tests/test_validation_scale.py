"""The per-rank cost of sharding validation and of the common-state check does not grow
with the world size (bytes received and collective calls counted on real gloo ranks), and
invalid shardings are still raised on every rank at world 4."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing.runtime.collectives import exchange_objects
from dist_checkpointing import validation
from dist_checkpointing.validation import check_common_state_consistency, validate_sharding_integrity

from .collective_counter import count_collectives
from .conftest import get_pool

N_SHARDED, N_REPLICATED = 100, 10


def _constant_state(rank: int, world: int) -> List[ShardedTensor]:
    """The same number of keys and elements on every rank, whatever the world size."""
    items = [ShardedTensor.from_rank_offsets(f"layer{k}.weight", torch.zeros(2, 3), (0, rank, world))
             for k in range(N_SHARDED)]
    items += [ShardedTensor.from_rank_offsets(f"norm{k}", torch.zeros(3), replica_id=rank) for k in range(N_REPLICATED)]
    return items


def _counted(fn: Callable[[], Any]) -> Tuple[int, Dict[str, int]]:
    with count_collectives() as count:
        fn()
    return count.received, count.calls


def _count_validation(rank: int, world: int) -> Tuple[int, Dict[str, int]]:
    items = _constant_state(rank, world)
    validation._LAST_VALID.clear()  # a first validation, whatever ran before in this process
    return _counted(lambda: validate_sharding_integrity(items))


def _count_common_check(rank: int, world: int) -> Tuple[int, Dict[str, int]]:
    common = {f"arg{k}": k for k in range(200)}
    return _counted(lambda: check_common_state_consistency(common))


@pytest.mark.parametrize("fn", [_count_validation, _count_common_check], ids=["sharding", "common_state"])
def test_bytes_received_and_calls_do_not_grow_with_the_world(fn):
    results = {world: get_pool(world).run(fn) for world in (2, 4)}
    median = {world: statistics.median(received for received, _ in res) for world, res in results.items()}
    assert median[4] <= 1.3 * median[2] + 64 * 4, f"median bytes received per rank: {median}"
    calls = {world: {str(sorted(c.items())) for _, c in res} for world, res in results.items()}
    assert calls[2] == calls[4] and len(calls[2]) == 1, f"collective calls per rank: {calls}"
    assert "all_gather_object" not in results[4][0][1], "nothing is all-gathered when all is well"


def _validate_two_layouts(rank: int, world: int) -> None:
    items = [ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world))]
    if rank == 2:  # a second, differently shaped piece of the same key
        items.append(ShardedTensor.from_rank_offsets("w", torch.zeros(8), (0, 0, world), replica_id=1))
    validate_sharding_integrity(items)


def test_a_key_in_two_layouts_is_raised_on_every_rank_at_world4():
    for e in get_pool(4).run_expect_error(_validate_two_layouts):
        assert isinstance(e, CheckpointingException), repr(e)
        assert "'w'" in str(e) and "two different layouts" in str(e) and "rank 2" in str(e), str(e)


def _exchange(rank: int, world: int, unpicklable_on: int) -> List[Any]:
    out: List[Any] = [f"{rank}->{dst}" for dst in range(world)]
    if rank == unpicklable_on:
        out[0] = lambda: None
    return exchange_objects(out)


def test_exchange_objects_delivers_each_rank_its_own_objects():
    for rank, received in enumerate(get_pool(4).run(_exchange, -1)):
        assert received == [f"{src}->{rank}" for src in range(4)]


def test_exchange_objects_with_an_unpicklable_object_raises_on_every_rank():
    for e in get_pool(4).run_expect_error(_exchange, 3):
        assert isinstance(e, CheckpointingException) and "rank(s) [3]" in str(e), repr(e)


def _changing_layouts(rank: int, world: int) -> List[Any]:
    """Validate one layout twice, then an invalid change of it on one rank, then the first
    layout again; the counts of each call, or the exception it raised."""
    validation._LAST_VALID.clear()
    good = _constant_state(rank, world)
    bad = _constant_state(rank, world)
    if rank == world - 1:  # its chunk of layer7.weight moves onto rank 0's: an overlap and a gap
        bad[7] = ShardedTensor.from_rank_offsets("layer7.weight", torch.zeros(2, 3), (0, 0, world))
    out: List[Any] = []
    for items in (good, good, bad, good):
        try:
            out.append(_counted(lambda: validate_sharding_integrity(items)))
        except CheckpointingException as e:
            out.append(e)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_repeated_layout_reuses_the_verdict_and_a_change_is_validated(world):
    for rank, (first, again, bad, good) in enumerate(get_pool(world).run(_changing_layouts)):
        assert again[1] == {"all_reduce": 1} and again[0] == 2, (rank, again)  # the 2-byte flag only
        assert "all_to_all_single" in first[1], (rank, first)
        assert isinstance(bad, CheckpointingException), (rank, bad)
        assert "'layer7.weight'" in str(bad) and "overlap" in str(bad), str(bad)
        assert f"main replicas on ranks {list(range(world))}" in str(bad), str(bad)
        assert "all_to_all_single" in good[1], (rank, good)  # validated again after the failure


def _summary_raises_on_last(rank: int, world: int) -> None:
    items = _constant_state(rank, world)
    if rank == world - 1:
        items[3].global_offset = ("not an offset",) + tuple(items[3].global_offset[1:])
    validation._LAST_VALID.clear()
    validate_sharding_integrity(items)


def test_a_rank_whose_state_cannot_be_summarised_is_named_on_every_rank():
    for e in get_pool(4).run_expect_error(_summary_raises_on_last):
        assert isinstance(e, CheckpointingException), repr(e)
        assert "Summarizing the sharded items failed on 1 rank(s): rank 3" in str(e), str(e)
