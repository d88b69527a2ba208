"""The 8,192-rank simulation (``benchmarks/_scale_sim.py``) at world 4, against real gloo ranks.

The same tiny GPT jobs are run both ways: each rank of a real world-4 pool builds its state
with the simulation's own ``rank_items`` and validates / saves it, counting the bytes it
receives (``collective_counter``); the simulation feeds each rank what the others would send.
The simulated bytes must equal the counted ones, every judged key must get a ``None``
verdict, and the ``.metadata`` that the simulated rank 0 writes from simulated item
locations must describe the same tensors, chunks and files as the real save's.
"""

from __future__ import annotations

import pickle

import pytest

import dist_checkpointing as dc
from benchmarks import _scale_sim as sim
from dist_checkpointing.storage import storage_for
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy, read_metadata
from dist_checkpointing import validation
from dist_checkpointing.validation import _Combined, _verdict, validate_sharding_integrity

from .collective_counter import count_collectives
from .conftest import get_pool
from .helpers import index_threshold

_SMALL = dict(hidden=32, vocab=64, seq=16, data="zeros")
CONFIGS = {
    "non-flat tp2 pp2": sim.GPTConfig(tp=2, pp=2, dp=1, layers=4, **_SMALL),
    "distopt tp2 dp2 buckets": sim.GPTConfig(tp=2, pp=1, dp=2, layers=2, distributed_optimizer=True,
                                             bucket_size=4000, **_SMALL),
    "distopt stacked pp2 dp2 even": sim.GPTConfig(tp=1, pp=2, dp=2, layers=4, distributed_optimizer=True,
                                                  dp_split="even", stacked_layers=True, **_SMALL),
}


def _real_validation(rank: int, world: int, cfg: sim.GPTConfig) -> int:
    items = sim.rank_items(cfg, rank)
    validation._LAST_VALID.clear()  # a first validation, whatever this process validated before
    with count_collectives() as count:
        validate_sharding_integrity(items)
    return count.received


def _real_save(rank: int, world: int, cfg: sim.GPTConfig, ckpt: str) -> None:
    state = {f"item{i}": item for i, item in enumerate(sim.rank_items(cfg, rank))}
    dc.save(state, ckpt, sharded_strategy=TorchDistSaveShardedStrategy(thread_count=sim.THREADS))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_simulated_validation_receives_what_real_ranks_receive(name):
    cfg = CONFIGS[name]
    assert cfg.world == 4
    real = get_pool(4).run(_real_validation, cfg)
    judged = 0
    for rank in range(cfg.world):
        inbox = sim.validation_inbox(cfg, rank)
        combined = {}
        for payload in inbox[1]:  # the combinations of the keys this rank judges
            for key, wire in (pickle.loads(payload) if payload else {}).items():
                combined.setdefault(key, _Combined()).merge(wire)
        assert all(_verdict(key, c, False) is None for key, c in combined.items()), name
        judged += len(combined)
        net = sim.SimulatedNetwork(rank, cfg.world, inbox)
        validation._LAST_VALID.clear()
        with sim.simulated(net):
            validate_sharding_integrity(sim.rank_items(cfg, rank))
        assert net.self_payload_ok, f"rank {rank}: its own summaries differ from the simulated ones"
        assert net.received == real[rank], f"rank {rank}: simulated {net.received} bytes, real {real[rank]}"
    names = {n for pp in range(cfg.pp) for n, _ in sim.stage_names(cfg, pp)}
    assert judged == len(names), "every key is judged once"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_simulated_rank0_metadata_matches_a_real_save(name, tmp_path):
    cfg = CONFIGS[name]
    get_pool(4).run(_real_save, cfg, str(tmp_path / "real"))
    real = read_metadata(tmp_path / "real")
    simulated_dir = tmp_path / "simulated"
    simulated_dir.mkdir()
    gathered = [b""] + [sim.sender_payload(cfg, r) for r in range(1, cfg.world)]
    with sim.simulated(sim.SimulatedNetwork(0, cfg.world, gathered=gathered)):
        TorchDistSaveShardedStrategy(thread_count=sim.THREADS)._publish(
            sim.sender_locations(cfg, 0), None, storage_for(simulated_dir))
    simulated = read_metadata(simulated_dir)
    assert simulated.state_dict_metadata == real.state_dict_metadata
    assert simulated.mcore_data == real.mcore_data
    files = {index: info.relative_path for index, info in real.storage_data.items()}
    assert {index: info.relative_path for index, info in simulated.storage_data.items()} == files


def _real_index_view(rank: int, world: int, cfg: sim.GPTConfig, ckpt: str) -> dict:
    from dist_checkpointing.strategies.torch_dist.index_view import indexed_view
    from dist_checkpointing.strategies.torch_dist.load import requested_regions

    view = indexed_view(storage_for(ckpt), lambda: requested_regions(sim.rank_items(cfg, rank)))
    return {key: sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(md, "chunks", ()))
            for key, md in view.metadata.state_dict_metadata.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_simulated_index_answers_are_what_real_ranks_get(name, tmp_path):
    """The simulation's answers for a rank at load (its keys' records cut to its regions)
    are the partial metadata real ranks build from their readers' answers."""
    cfg = CONFIGS[name]
    ckpt = str(tmp_path / "real")
    get_pool(4).run(_real_save, cfg, ckpt)
    with index_threshold([get_pool(4)], 0):  # (a small checkpoint: the index is used above 64 MiB read in all)
        real = get_pool(4).run(_real_index_view, cfg, ckpt)
    for rank in range(cfg.world):
        requests, answers = sim.index_answers(cfg, ckpt, rank)
        assert set(answers) == set(requests) == set(real[rank]), rank
        simulated = {k: sorted((tuple(c[0]), tuple(c[1])) for c in rec[4]) if rec[0] == "t" else []
                     for k, rec in answers.items()}
        assert simulated == real[rank], rank


def _real_plan(rank: int, world: int, cfg: sim.GPTConfig) -> int:
    from dist_checkpointing.exchange_utils import local_tensor_summary
    from dist_checkpointing.exchange.plan import plan_shards

    summary = local_tensor_summary({str(i): sh for i, sh in enumerate(sim.rank_items(cfg, rank))})
    with count_collectives() as count:
        plan_shards(summary)
    return count.received


@pytest.mark.parametrize("dp_split", ["buckets", "even"])
def test_simulated_fully_parallel_planning_receives_what_real_ranks_receive(dp_split):
    from benchmarks import _plan_sim

    cfg = sim.GPTConfig(tp=1, pp=1, dp=4, layers=2, distributed_optimizer=True, bucket_size=4000,
                        dp_split=dp_split, **_SMALL)
    real = get_pool(4).run(_real_plan, cfg)
    summaries = _plan_sim.group_summaries(cfg, tp=0, pp=0)
    for member in range(4):
        res = _plan_sim.measure(cfg, summaries, member, repeats=1)
        assert res["own_payload_matches"] is not False, member
        assert res["received_bytes"] == real[member], (member, res["received_bytes"], real[member])
