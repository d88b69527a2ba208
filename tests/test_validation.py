"""Save-time sharding validation, common-state consistency and checksums, on real ranks."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.dict_utils import nested_values
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from dist_checkpointing.validation import validate_sharding_integrity

from .conftest import get_pool
from .helpers import flip_byte

WORLDS = [2, 4]


def _st(key, offset, size, global_size, rank_replica=0, dtype=torch.float32):
    return ShardedTensor(key, torch.zeros(size, dtype=dtype), dtype, (size,), (global_size,), (offset,), None,
                         replica_id=rank_replica)


def _all_raise(world, fn, *args, fragments=()):
    excs = get_pool(world).run_expect_error(fn, *args)
    for e in excs:
        assert isinstance(e, CheckpointingException), repr(e)
        for frag in fragments:
            assert frag in str(e), (frag, str(e))
    return excs


# Each case: a function building rank's state; the save must fail on every rank, write nothing.

def _two_main_replicas_of_one_chunk(rank, world, ckpt):
    # ranks 0 and 1 both claim the main replica of chunk [0, 4); others hold the rest
    sd = {"w": _st("w", 0, 4, 4 * (world - 1))} if rank in (0, 1) else {"w": _st("w", 4 * (rank - 1), 4, 4 * (world - 1))}
    dc.save(sd, ckpt)


def _chunk_without_main_replica(rank, world, ckpt):
    dc.save({"w": _st("w", 4 * rank, 4, 4 * world, rank_replica=1 if rank == world - 1 else 0)}, ckpt)


def _duplicate_sharded_object(rank, world, ckpt):
    dc.save({"o": ShardedObject("rng", {"r": rank}, (world,), (min(rank, world - 2),))}, ckpt)


def _missing_sharded_object_piece(rank, world, ckpt):
    dc.save({"o": ShardedObject("rng", {"r": rank}, (world + 1,), (rank,))}, ckpt)


def _different_global_shapes(rank, world, ckpt):
    dc.save({"w": _st("w", 4 * rank, 4, 4 * world + (1 if rank == 1 else 0))}, ckpt)


def _different_dtypes(rank, world, ckpt):
    dc.save({"w": _st("w", 4 * rank, 4, 4 * world, dtype=torch.float16 if rank == 1 else torch.float32)}, ckpt)


def _overlap_and_gap_same_volume(rank, world, ckpt):
    # every rank's chunk is 4 long, but rank 1 sits on rank 0's chunk: same total volume
    offset = 0 if rank == 1 else 4 * rank
    dc.save({"w": _st("w", offset, 4, 4 * world)}, ckpt)


CASES = {
    "two_main_replicas_of_one_chunk": (_two_main_replicas_of_one_chunk, ["'w'", "overlap", "ranks"]),
    "chunk_without_main_replica": (_chunk_without_main_replica, ["'w'", "no main replica"]),
    "duplicate_sharded_object": (_duplicate_sharded_object, ["ShardedObject 'rng'", "duplicate"]),
    "missing_sharded_object_piece": (_missing_sharded_object_piece, ["ShardedObject 'rng'", "no main replica"]),
    "different_global_shapes": (_different_global_shapes, ["'w'", "disagree", "rank 1"]),
    "different_dtypes": (_different_dtypes, ["'w'", "disagree", "torch.float16"]),
    "overlap_and_gap_same_volume": (_overlap_and_gap_same_volume, ["'w'", "overlap and leave gaps"]),
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_sharding_raises_everywhere_and_writes_nothing(case, world, tmp_path):
    fn, fragments = CASES[case]
    ckpt = tmp_path / "ckpt"
    _all_raise(world, fn, str(ckpt), fragments=fragments)
    assert not ckpt.exists(), "validation must fail before anything is written"


def _gap_without_validation(rank, world, ckpt):
    dc.save({"w": _st("w", 4 * rank, 4, 4 * world + 4)}, ckpt, validate_access_integrity=False)


def test_validation_can_be_switched_off(tmp_path):
    ckpt = tmp_path / "ckpt"
    get_pool(2).run(_gap_without_validation, str(ckpt))
    with pytest.raises(CheckpointingException, match="does not cover"):
        dc.load_plain_tensors(ckpt)


def _validate_many_keys(rank, world, n_keys):
    sd = {}
    for k in range(n_keys):
        sd[f"layer{k}.weight"] = ShardedTensor.from_rank_offsets(f"layer{k}.weight", torch.zeros(2, 3), (0, rank, world))
    for k in range(10):
        sd[f"norm{k}"] = ShardedTensor.from_rank_offsets(f"norm{k}", torch.zeros(3), replica_id=rank)
    items = list(nested_values(sd))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        validate_sharding_integrity(items)
        times.append(time.perf_counter() - start)
    return min(times)


def test_validation_of_1000_keys_at_world4_is_fast():
    seconds = max(get_pool(4).run(_validate_many_keys, 1000))
    assert seconds < 3.0, f"validating 1,000 keys on 4 ranks took {seconds:.2f} s"


# ----------------------------------------------------------------------------- common state


def _save_diverging_common(rank, world, ckpt, exclude):
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("dist_checkpointing.validation")
    logger.addHandler(handler)
    try:
        common = {"iteration": 10, "lr": 0.1, "rank_local": {"seed": rank}}
        if rank == 1:
            common["only_on_1"] = True
            common["lr"] = 0.2
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, world)), **common}
        preprocess = (lambda c: {k: v for k, v in c.items() if k not in ("rank_local", "lr", "only_on_1")}) if exclude else None
        dc.save(sd, ckpt, preprocess_common_before_consistancy_check=preprocess)
    finally:
        logger.removeHandler(handler)
    return records


@pytest.mark.parametrize("world", WORLDS)
def test_common_state_disagreement_warns_with_keys_and_saves_rank0(world, tmp_path):
    logs = get_pool(world).run(_save_diverging_common, str(tmp_path / "a"), False)
    assert logs[0] == []
    report = " ".join(logs[1])
    assert "Rank 1" in report and "only_on_1" in report and "lr" in report and "rank_local" in report
    for r in range(2, world):  # other ranks differ only in rank_local
        assert "rank_local" in " ".join(logs[r]) and "only_on_1" not in " ".join(logs[r])
    common = dc.load_common_state_dict(tmp_path / "a")
    assert common == {"iteration": 10, "lr": 0.1, "rank_local": {"seed": 0}}
    quiet = get_pool(world).run(_save_diverging_common, str(tmp_path / "b"), True)
    assert all(logs == [] for logs in quiet), "excluded keys must not be reported"


# ----------------------------------------------------------------------------- checksums


def _save_for_integrity(rank, world, ckpt):
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4096.0) + rank, (0, rank, world)),
             "o": ShardedObject("obj", {"rank": rank, "blob": list(range(100))}, (world,), (rank,)),
             "step": 3}, ckpt)


def _load_for_integrity(rank, world, ckpt, verify):
    strategy = TorchDistLoadShardedStrategy(verify_checksums=verify)
    # rank 0 reads everything (whole tensor, every object); the others read their own chunk
    if rank == 0:
        request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4096 * world)),
                   "o": [ShardedObject("obj", None, (world,), (r,)) for r in range(world)]}
    else:
        request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4096), (0, rank, world), replica_id=1)}
    return dc.load(request, ckpt, sharded_strategy=strategy)["step"]


def _item_location(ckpt: Path, key: str):
    from dist_checkpointing.strategies.torch import read_metadata

    md = read_metadata(ckpt)
    index = next(i for i in md.storage_data if i.fqn == key or i.fqn.startswith(key + "/"))
    info = md.storage_data[index]
    return ckpt / info.relative_path, info.offset, info.length


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("target", ["tensor_data", "object", "common.pt", ".metadata"])
def test_flipped_byte_is_an_error_on_every_rank(world, target, tmp_path):
    ckpt = tmp_path / "ckpt"
    pool = get_pool(world)
    pool.run(_save_for_integrity, str(ckpt))
    assert pool.run(_load_for_integrity, str(ckpt), True) == [3] * world
    if target == "tensor_data":
        path, offset, length = _item_location(ckpt, "w")
        flip_byte(path, offset + length - 5000)  # inside the float data (the zip trailer is ~1 KiB)
        fragments = ["Checksum mismatch", "'w'", path.name]
    elif target == "object":
        path, offset, length = _item_location(ckpt, "obj")
        flip_byte(path, offset + length // 2)
        fragments = ["obj/shard_", path.name]
    else:
        path = ckpt / target
        flip_byte(path, os.path.getsize(path) // 2)
        fragments = ["Checksum mismatch", target]
    excs = _all_raise(world, _load_for_integrity, str(ckpt), True, fragments=fragments)
    assert len(excs) == world
    if target == "tensor_data":  # without verification the corruption goes unnoticed: the switch works
        pool.run(_load_for_integrity, str(ckpt), False)


def _diverging_unpicklable_common(rank, world, ckpt):
    extra = {"fn": (lambda: None)} if rank == 0 else {"fn": "string"}
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, world)), **extra}, ckpt)


def test_unpicklable_diverging_common_state_fails_cleanly(pool2, tmp_path):
    """Rank 0's common state cannot be pickled: every rank gets an error, nobody hangs."""
    excs = pool2.run_expect_error(_diverging_unpicklable_common, str(tmp_path / "c"))
    assert all(isinstance(e, CheckpointingException) and "common state" in str(e) for e in excs), excs


def test_remove_sharded_tensors_refuses_crafted_paths(tmp_path):
    import pickle

    from dist_checkpointing.strategies.torch import read_metadata

    ckpt = tmp_path / "ckpt"
    dc.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2)),
             "b": ShardedTensor.from_rank_offsets("b", torch.ones(2))}, ckpt)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    md = read_metadata(ckpt)
    index = next(i for i in md.storage_data if i.fqn == "b")
    md.storage_data[index].relative_path = "../victim.txt"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    (ckpt / ".metadata.checksum").unlink()
    with pytest.raises(CheckpointingException, match="victim.txt"):
        dc.remove_sharded_tensors(ckpt, "b")
    assert victim.read_text() == "keep"


def test_checksums_of_tiny_tensors_whose_size_matches_zip_records(tmp_path):
    """torch.save's small header records (1, 2, 6, ... bytes) must not be hashed in place
    of a tensor's data of the same size."""
    tensors = {f"t{n}": torch.arange(n, dtype=torch.uint8) for n in range(0, 80)}
    dc.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, tmp_path / "ckpt")
    loaded = dc.load_plain_tensors(tmp_path / "ckpt")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
