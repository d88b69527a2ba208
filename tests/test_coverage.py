"""Loads check that the stored chunks cover every requested element exactly once (issue 43,
item 1): a checkpoint saved with ``validate_access_integrity=False`` whose chunks leave a
gap hidden by an overlap of the same size loads nothing silently. Every load path (plain,
fully parallel, offline ``load_plain_tensors``) refuses on every rank a request that
touches the gap or the overlap, naming the key and the boxes; ``validate`` reports both;
requests away from them load the stored values."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing.cli import main as cli_main
from dist_checkpointing.strategies.torch_dist.coverage import coverage_faults, tiles
from dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from dist_checkpointing.tools import validate_checkpoint

from .conftest import get_pool

_TIMEOUT = 60.0

# Each case: the stored chunks (offsets, sizes) of one key, a part of them that holds no
# fault, and the faults the whole tensor has.
_Chunk = Tuple[Tuple[int, ...], Tuple[int, ...]]
CASES: Dict[str, Tuple[Tuple[int, ...], List[_Chunk], _Chunk, List[str]]] = {
    "1d": ((10,), [((0,), (4,)), ((8,), (2,)), ((2,), (4,))], ((0,), (2,)),
           ["elements [2:4] are stored in 2 chunks", "elements [6:8] are stored in no chunk"]),
    "2d": ((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 3)), ((1, 3), (2, 3))], ((0, 0), (1, 6)),
           ["elements [1:2, 3:6] are stored in 2 chunks", "elements [3:4, 3:6] are stored in no chunk"]),
    "3d": ((2, 4, 4), [((0, 0, 0), (2, 2, 4)), ((0, 2, 0), (1, 2, 4)), ((1, 2, 0), (1, 1, 4)), ((0, 3, 2), (2, 1, 2))],
           ((0, 0, 0), (2, 2, 4)),
           ["elements [0:1, 3:4, 2:4] are stored in 2 chunks", "elements [1:2, 3:4, 0:2] are stored in no chunk"]),
}


def _values(shape: Tuple[int, ...]) -> torch.Tensor:
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def _chunk_tensor(shape, offsets, sizes, replica_id=0) -> ShardedTensor:
    index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
    return ShardedTensor("w", _values(shape)[index].clone(), torch.float32, tuple(sizes), shape, tuple(offsets),
                         None, replica_id=replica_id)


def _save_case(rank: int, world: int, ckpt: str, case: str) -> None:
    shape, chunks, _, _ = CASES[case]
    mine = {f"c{i}": _chunk_tensor(shape, *c) for i, c in enumerate(chunks) if i % world == rank}
    dc.save(mine, ckpt, validate_access_integrity=False)


def _flat_piece(rank_row: int, a: int, b: int, replica: int = 0) -> ShardedTensor:
    local = _values((8, 4))[4 * rank_row:4 * rank_row + 4]
    return ShardedTensor.from_rank_offsets_flat("f", local.reshape(-1)[a:b].clone(), (4, 4), (0, rank_row, 2),
                                                flattened_range=slice(a, b), replica_id=(0, replica))


# a flattened (distributed-optimizer) key: chunk 0's slices overlap on [4, 6) and leave [10, 12) out
_FLAT = [(0, 0, 6), (0, 4, 10), (0, 12, 16), (1, 0, 16)]


def _save_flat(rank: int, world: int, ckpt: str) -> None:
    mine = {f"p{i}": _flat_piece(*p) for i, p in enumerate(_FLAT) if i % world == rank}
    dc.save(mine, ckpt, validate_access_integrity=False)


def _load(rank: int, world: int, ckpt: str, request: _Chunk, shape, fully_parallel: bool):
    strategy = FullyParallelLoadStrategyWrapper(dc.strategies.torch.TorchDistLoadShardedStrategy()) \
        if fully_parallel else None
    sh = _chunk_tensor(shape, *request, replica_id=rank)
    sh.data.fill_(-1)
    return dc.load({"w": sh}, ckpt, sharded_strategy=strategy)["w"]


def _load_flat(rank: int, world: int, ckpt: str, how: str, fully_parallel: bool):
    strategy = FullyParallelLoadStrategyWrapper(dc.strategies.torch.TorchDistLoadShardedStrategy()) \
        if fully_parallel else None
    if how == "whole":  # another grid, not flattened
        sh = ShardedTensor.from_rank_offsets("f", torch.full((8, 4), -1.0), replica_id=rank)
    elif how == "same_grid":  # as saved, another DP split
        sh = _flat_piece(0, 2, 12, rank)
    elif how == "other_grid":  # a flattened request on another grid (4 fragments)
        sh = ShardedTensor.from_rank_offsets_flat("f", torch.full((6,), -1.0), (2, 4), (0, 1, 4),
                                                  flattened_range=slice(1, 7), replica_id=rank)
    else:  # the chunk without faults, flattened at another split
        sh = _flat_piece(1, 3, 13, rank)
    return dc.load({"f": sh}, ckpt, sharded_strategy=strategy)["f"]


def _expect_everywhere(world: int, fn, *args, fragments: List[str]) -> None:
    errors = get_pool(world).run_expect_error(fn, *args, timeout=_TIMEOUT)
    for e in errors:
        assert isinstance(e, CheckpointingException), repr(e)
        for fragment in fragments:
            assert fragment in str(e), (fragment, str(e))


def test_coverage_faults_are_boxes():
    """Gaps and overlaps are found exactly in any number of dimensions (also hidden by
    each other), merged along the axes, and a clean tiling has none."""
    assert coverage_faults(((0,), (10,)), [((0,), (10,))]) == []
    assert coverage_faults(((0, 0), (4, 4)), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((2, 2), (2, 2))]) == []
    assert coverage_faults(((2,), (4,)), [((0,), (3,)), ((3,), (7,))]) == []  # chunks beyond the region
    gap = coverage_faults(((0, 0), (4, 4)), [((0, 0), (2, 2)), ((2, 0), (2, 2)), ((0, 2), (2, 2))])
    assert [(f.offsets, f.sizes, f.count) for f in gap] == [((2, 2), (2, 2), 0)]
    triple = coverage_faults(((0,), (4,)), [((0,), (4,)), ((1,), (2,)), ((1,), (1,))])
    assert [(f.offsets, f.sizes, f.count) for f in triple] == [((1,), (1,), 3), ((2,), (1,), 2)]
    scalar = coverage_faults(((), ()), [((), ()), ((), ())])
    assert [f.count for f in scalar] == [2] and scalar[0].describe() == "the element (a 0-d tensor) is stored in 2 chunks"
    grid = [((i * 4, j * 8), (4, 8)) for i in range(64) for j in range(64)]
    assert coverage_faults(((0, 0), (256, 512)), grid) == []
    assert len(coverage_faults(((0,), (100,)), [((2 * i,), (1,)) for i in range(50)], limit=3)) == 3
    # the quick confirmation never accepts what the sweep refuses
    assert tiles(((0, 0), (8, 8)), [((0, 0), (4, 8)), ((4, 0), (4, 8))])
    assert not tiles(((0,), (10,)), [((0,), (4,)), ((8,), (2,)), ((2,), (4,))])  # same volume, overlapping
    assert not tiles(((0,), (40,)), [((i,), (1,)) for i in range(40)])  # many: left to the sweep
    assert coverage_faults(((0,), (40,)), [((i,), (1,)) for i in range(40)]) == []


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gap_hidden_by_overlap_is_refused_everywhere(case, world, tmp_path):
    shape, _, clean, faults = CASES[case]
    ckpt = tmp_path / "ckpt"
    get_pool(world).run(_save_case, str(ckpt), case, timeout=_TIMEOUT)
    whole = ((0,) * len(shape), shape)
    for fully_parallel in (False, True):
        _expect_everywhere(world, _load, str(ckpt), whole, shape, fully_parallel, fragments=["'w'"] + faults)
        loaded = get_pool(world).run(_load, str(ckpt), clean, shape, fully_parallel, timeout=_TIMEOUT)
        index = tuple(slice(o, o + s) for o, s in zip(*clean))
        assert all(torch.equal(t, _values(shape)[index]) for t in loaded)
    with pytest.raises(CheckpointingException) as e:
        dc.load_plain_tensors(ckpt)
    assert all(f in str(e.value) for f in faults) and "'w'" in str(e.value)
    report = validate_checkpoint(ckpt)
    assert not report.ok and all(any(f in p and "'w'" in p for p in report.problems) for f in faults), report.problems


@pytest.mark.parametrize("world", [2, 4])
def test_fully_parallel_load_refuses_on_every_rank(world, tmp_path):
    """At world 4 the fully parallel wrapper assigns the faulty shard's read to one rank:
    the others learn of the refusal in the agreed planning step, nobody hangs."""
    ckpt = tmp_path / "ckpt"
    get_pool(2).run(_save_case, str(ckpt), "1d", timeout=_TIMEOUT)
    _expect_everywhere(world, _load, str(ckpt), ((6,), (2,)), (10,), True,
                       fragments=["'w'", "elements [6:8] are stored in no chunk"])


@pytest.mark.parametrize("world", [1, 2])
def test_flattened_gap_hidden_by_overlap(world, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    get_pool(world).run(_save_flat, str(ckpt), timeout=_TIMEOUT)
    stored = ["'f'", "elements [0:1, 0:1, 4:6] are stored in 2 chunks", "elements [0:1, 0:1, 10:12] are stored in no chunk"]
    for fully_parallel in (False, True):
        _expect_everywhere(world, _load_flat, str(ckpt), "whole", fully_parallel, fragments=stored)
        _expect_everywhere(world, _load_flat, str(ckpt), "same_grid", fully_parallel, fragments=stored)
        _expect_everywhere(world, _load_flat, str(ckpt), "other_grid", fully_parallel,
                           fragments=["'f'", "elements [0:1, 0:1, 10:12] are stored in no chunk"])
        loaded = get_pool(world).run(_load_flat, str(ckpt), "clean", fully_parallel, timeout=_TIMEOUT)
        assert all(torch.equal(t, _values((8, 4))[4:].reshape(-1)[3:13]) for t in loaded)
    with pytest.raises(CheckpointingException, match=r"'f'.*\[0:1, 0:1, 10:12\] are stored in no chunk"):
        dc.load_plain_tensors(ckpt)
    assert cli_main(["validate", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "[0:1, 0:1, 4:6] are stored in 2 chunks" in out and "[0:1, 0:1, 10:12] are stored in no chunk" in out


def test_clean_resharding_is_unaffected(tmp_path):
    """A checkpoint whose chunks tile the tensor loads under other layouts as before."""
    ckpt = Path(tmp_path) / "ckpt"
    chunks = [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 6))]
    dc.save({f"c{i}": _chunk_tensor((4, 6), *c) for i, c in enumerate(chunks)}, ckpt)
    out = dc.load({"w": _chunk_tensor((4, 6), (1, 2), (3, 3))}, ckpt)["w"]
    assert torch.equal(out, _values((4, 6))[1:4, 2:5])
    assert validate_checkpoint(ckpt).ok
