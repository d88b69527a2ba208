"""Behaviours that Megatron-Core's own ``dist_checkpointing`` unit tests rely on, found by
running them (Megatron-Core 0.15.3 and 0.19.2, CPU/gloo) against this package through the
switch: each is tested here with our own cases, at several worlds and with the fully
parallel wrappers."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from typing import Any, List

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    _sharded_tensor_shard_id,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

from dist_checkpointing.tools.whole_tensors import TensorReader
from dist_checkpointing.validation import INTEGRITY_FNAME, save_integrity_manifest, verify_integrity_manifest

from . import launch
from .conftest import get_pool
from .helpers import slack
from .peers import require
from .test_mcore_names import ROOT, _run_with_mcore, needs_mcore

# ----------------------------------------------------------------------------- allow_shape_mismatch

_COLS = 12  # the saved tensor: (3, _COLS), split along axis 1 over the saving ranks


def _saved_values(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(3 * _COLS).reshape(3, _COLS) + 1).to(dtype)


def _save_mismatch(rank: int, world: int, ckpt: str) -> None:
    cols = _COLS // world
    sd = {"e": ShardedTensor.from_rank_offsets("e", _saved_values()[:, rank * cols:(rank + 1) * cols].clone(),
                                               (1, rank, world), allow_shape_mismatch=True)}
    dc.save(sd, ckpt)


def _load_mismatch(rank: int, world: int, ckpt: str, groups: int) -> List[str]:
    """Load chunks of a (3, cols * groups) request for several ``cols``: ranks form
    ``groups`` groups along the sharded axis, each rank in a group a replica of its chunk;
    returns the cases that went wrong."""
    members = world // groups
    group, replica = rank // members, rank % members
    wrong = []
    for cols, dtype, fully_parallel, dataless in [(7, torch.float32, False, False), (7, torch.float32, True, False),
                                                  (3, torch.float32, False, False), (3, torch.float32, True, False),
                                                  (7, torch.bfloat16, True, False), (7, torch.float32, False, True),
                                                  (4, torch.float16, True, True)]:
        data = None if dataless else torch.full((3, cols), 7.0, dtype=dtype)
        sh = ShardedTensor("e", data, dtype, (3, cols), (3, cols * groups), (0, group * cols), None,
                           replica_id=replica, allow_shape_mismatch=True)
        strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()) if fully_parallel else None
        out = dc.load({"e": sh}, ckpt, sharded_strategy=strategy)["e"]
        expected = torch.zeros(3, cols * groups, dtype=dtype)
        stored = min(_COLS, cols * groups)
        expected[:, :stored] = _saved_values(dtype)[:, :stored]
        if not torch.equal(out, expected[:, group * cols:(group + 1) * cols]) or \
                not (dataless or out.data_ptr() == data.data_ptr()):
            wrong.append(f"cols={cols} {dtype} fully_parallel={fully_parallel} dataless={dataless}: {out}")
    return wrong


@pytest.mark.parametrize("world,groups", [(1, 1), (2, 2), (4, 2), (4, 4)])
def test_allow_shape_mismatch_reads_what_is_stored_and_zeros_the_rest(tmp_path, world, groups):
    """Megatron-Core zeroes a request tensor with ``allow_shape_mismatch`` before reading
    into it (e.g. a padded vocabulary grown between runs): the elements the checkpoint does
    not hold read as zeros, not as what the tensor held before; in place, any dtype, plain
    and fully parallel loads, requests wider and narrower than what was saved."""
    pool = get_pool(world)
    ckpt = str(tmp_path / "c")
    pool.run(_save_mismatch, ckpt)
    assert pool.run(_load_mismatch, ckpt, groups) == [[]] * world


# ----------------------------------------------------------------------------- dict_utils.diff

_DIFF_COMPARE = """
    import numpy as np, torch
    from dist_checkpointing.dict_utils import diff as ours
    from megatron.core.dist_checkpointing.dict_utils import diff as theirs

    def norm(result):
        left, right, mismatch = result
        return (sorted(map(str, left)), sorted(map(str, right)),
                sorted(str((m[0], m[1], m[2], *[int(v) if isinstance(v, torch.Tensor) else v for v in m[3:]]))
                       for m in mismatch))

    t = torch.arange(6).reshape(2, 3)
    cases = [
        ({'a': t, 'b': {'c': 1.5, 'd': 's'}}, {'a': t.float(), 'b': {'c': 1.5, 'd': 's'}}),  # dtypes only
        ({'a': t}, {'a': t.to(torch.bfloat16) + torch.tensor([[0, 0, 1], [0, 0, 0]])}),     # one value
        ({'a': t, 'x': 1}, {'a': t.clone(), 'y': 2}),                                          # keys
        ({'l': [1, 'a', t]}, {'l': [2, 'a', t.double()]}),
        ({'t': (1, 2, (3, t))}, {'t': (1, 2, (4, t + 1))}),
        ({'n': np.array([1, 2, 3])}, {'n': np.array([1, 0, 3])}),
        ({'b': torch.tensor([True, False])}, {'b': torch.tensor([1, 1], dtype=torch.uint8)}),
        ({'s': 'a', 'i': 3, 'f': None}, {'s': 'b', 'i': 3.0, 'f': None}),
        ({'e': torch.zeros(0, 2)}, {'e': torch.zeros(0, 2, dtype=torch.int8)}),
    ]
    for i, (x, y) in enumerate(cases):
        for a, b in ((x, y), (y, x)):
            assert norm(ours(a, b, ('p',))) == norm(theirs(a, b, ('p',))), (i, norm(ours(a, b)), norm(theirs(a, b)))
    print('compared', len(cases))
"""


@needs_mcore
def test_diff_answers_as_megatron_cores():
    """``dict_utils.diff`` against Megatron-Core 0.15.3's on the same inputs (where its
    answer is defined: it asserts on containers of different types and, for sequences of
    different lengths, gives bare indices; newer Megatron-Core gives paths, as here):
    the same paths only on one side, the same mismatch entries and details."""
    assert "compared 9" in _run_with_mcore(_DIFF_COMPARE)


# ----------------------------------------------------------------------------- load_tensors_metadata of flattened keys

def _save_flat(rank: int, world: int, ckpt: str) -> None:
    """``w`` (4, 6), one chunk stored flattened: each rank saves a DP-style slice of its
    elements; ``r``: a regular tensor split over the ranks."""
    whole = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    rng = slice(rank * 24 // world, (rank + 1) * 24 // world)
    sd = {"w": ShardedTensor.from_rank_offsets_flat("w", whole.flatten()[rng].clone(), (4, 6), flattened_range=rng),
          "r": ShardedTensor.from_rank_offsets("r", torch.ones(2) * rank, (0, rank, world))}
    dc.save(sd, ckpt)


def _load_metadata_request(rank: int, world: int, ckpt: str) -> List[Any]:
    md = dc.load_tensors_metadata(ckpt)
    loaded = dc.load(md, ckpt, validate_access_integrity=False)  # every rank: whole tensors
    return [md["w"].flattened_range, tuple(md["w"].global_shape), md["r"].flattened_range,
            loaded["w"].tolist(), loaded["r"].tolist()]


@pytest.mark.parametrize("world", [1, 2])
def test_load_tensors_metadata_describes_flattened_keys_flattened(tmp_path, world):
    """As Megatron-Core: a key stored flattened is described with the whole range
    (``flattened_range=slice(0, numel)``, original global shape), so loading the
    description gives it 1-D; ``load_plain_tensors(original_shape=True)`` gives it N-D."""
    pool = get_pool(world)
    ckpt = str(tmp_path / "c")
    pool.run(_save_flat, ckpt)
    flat = list(map(float, range(24)))
    regular = [float(r) for r in range(world) for _ in range(2)]
    assert pool.run(_load_metadata_request, ckpt) == [[slice(0, 24), (4, 6), None, flat, regular]] * world
    assert dc.load_plain_tensors(ckpt)["w"].tolist() == flat
    assert dc.load_plain_tensors(ckpt, original_shape=True)["w"].tolist() == torch.tensor(flat).reshape(4, 6).tolist()
    reader = TensorReader(ckpt, ["w"])
    try:
        assert reader.read("w").tolist() == torch.tensor(flat).reshape(4, 6).tolist()
    finally:
        reader.close()


_TENSORS_METADATA_COMPARE = """
    import sys, torch
    from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy as Ours
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy as Theirs

    def norm(md):
        return {k: (tuple(v.global_shape), tuple(v.local_shape), v.dtype, v.flattened_range, v.data is None)
                for k, v in md.items()}

    ours, theirs = norm(Ours().load_tensors_metadata(sys.argv[1])), norm(Theirs().load_tensors_metadata(sys.argv[1]))
    assert ours == theirs, (ours, theirs)
    print('same', sorted(ours))
"""


@needs_mcore
def test_load_tensors_metadata_as_megatron_cores(tmp_path):
    ckpt = str(tmp_path / "c")
    get_pool(2).run(_save_flat, ckpt)
    assert "same ['r', 'w']" in _run_with_mcore(_TENSORS_METADATA_COMPARE.replace("sys.argv[1]", repr(ckpt)))


# ----------------------------------------------------------------------------- fully parallel cached distributions

def _distribution_state(rank: int, world: int) -> dict:
    whole = torch.arange(4 * world, dtype=torch.float32)
    return {"split": ShardedTensor.from_rank_offsets("split", whole[4 * rank:4 * rank + 4].clone(), (0, rank, world)),
            "repl": ShardedTensor.from_rank_offsets("repl", torch.ones(6), replica_id=rank),
            "flat": ShardedTensor.from_rank_offsets_flat("flat", whole[rank:rank + 1].clone(), (world,),
                                                         flattened_range=slice(rank, rank + 1))}


def _cached_distributions(rank: int, world: int, ckpt: str) -> List[Any]:
    state = _distribution_state(rank, world)
    save = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), do_cache_distribution=True)
    dc.save(state, ckpt, save)
    load = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), do_cache_distribution=True)
    loaded = dc.load(_distribution_state(rank, world), ckpt, load)
    assert all(torch.equal(loaded[k], state[k].data) for k in state)
    out = []
    for wrapper in (save, load):
        cd = wrapper.cached_distribution
        ids = {k: _sharded_tensor_shard_id(sh) for k, sh in state.items()}
        assert set(cd._fields) == {"main_rank_for_shard", "shards_in_this_group", "shard_to_metadata",
                                   "all_ranks_for_shard"}
        assert all(i in cd.shards_in_this_group and i in cd.shard_to_metadata for i in ids.values()), (cd, ids)
        out.append({k: cd.main_rank_for_shard[i] for k, i in ids.items()})
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_fully_parallel_cached_distributions_as_megatron_cores(tmp_path, world):
    """Both wrappers' ``cached_distribution`` is a ``ShardDistribution`` keyed by
    Megatron-Core's shard ids (``utils._sharded_tensor_shard_id``, also importable from
    ``fully_parallel``): for each shard this rank holds or requests, the group rank that
    writes or reads it. A shard of one rank is its own; a replicated one has one writer."""
    results = get_pool(world).run(_cached_distributions, str(tmp_path / "c"))
    for phase in (0, 1):
        per_rank = [r[phase] for r in results]
        if phase == 0:  # what a rank alone holds, it writes
            assert [d["split"] for d in per_rank] == list(range(world))
        assert len({d["repl"] for d in per_rank}) == 1 and 0 <= per_rank[0]["repl"] < world
        assert all(0 <= d["flat"] < world for d in per_rank)


# ----------------------------------------------------------------------------- Megatron-Core 0.19's integrity names

_INTEGRITY_COMPARE = """
    import sys
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest, verify_integrity_manifest
    ours, theirs = sys.argv[1], sys.argv[2]
    verify_integrity_manifest(ours)              # the manifest written here, verified by Megatron-Core
    save_integrity_manifest(theirs)              # Megatron-Core's own manifest of the same files
    print('verified')
"""


def _save_with_manifest(rank: int, world: int, ckpt: str) -> None:
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0) + rank, (0, rank, world)),
             "step": 3}, ckpt, verify_integrity=True)


def _verify_everywhere(rank: int, world: int, ckpt: str) -> str:
    try:
        verify_integrity_manifest(ckpt)
        return "ok"
    except dc.CheckpointingException as e:
        return str(e)


def test_integrity_manifest_names_of_megatron_core_019(tmp_path):
    """``validation.save_integrity_manifest`` (one process) writes the bytes ``save(...,
    verify_integrity=True)`` writes, and Megatron-Core 0.19's own function writes the same;
    ``validation.verify_integrity_manifest`` (collective) accepts it and refuses a changed
    file or a missing manifest on every rank, naming the file."""
    pool = get_pool(2)
    ckpt = tmp_path / "c"
    pool.run(_save_with_manifest, str(ckpt))
    written = (ckpt / INTEGRITY_FNAME).read_bytes()
    (ckpt / INTEGRITY_FNAME).unlink()
    save_integrity_manifest(str(ckpt))
    assert (ckpt / INTEGRITY_FNAME).read_bytes() == written
    theirs = tmp_path / "theirs"
    shutil.copytree(ckpt, theirs)
    (theirs / INTEGRITY_FNAME).unlink()
    proc = launch.run(["-c", textwrap.dedent(_INTEGRITY_COMPARE), str(ckpt), str(theirs)],
                      env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), require("MCORE19_SITE")]),
                           "PYTHONWARNINGS": "ignore"}, timeout=slack(300))
    assert proc.returncode == 0 and "verified" in proc.stdout, proc.stderr[-3000:]
    assert (theirs / INTEGRITY_FNAME).read_bytes() == written

    assert pool.run(_verify_everywhere, str(ckpt)) == ["ok", "ok"]
    data = sorted(p for p in ckpt.iterdir() if p.suffix == ".distcp")[-1]
    data.write_bytes(data.read_bytes()[:-1] + b"\\0")
    errors = pool.run(_verify_everywhere, str(ckpt))
    assert all(data.name in e and "ok" != e for e in errors), errors
    (ckpt / INTEGRITY_FNAME).unlink()
    assert all("no integrity manifest" in e for e in pool.run(_verify_everywhere, str(ckpt)))


# ----------------------------------------------------------------------------- mcore_to_pyt_state_dict

def _uneven_dcp(rank: int, world: int, plain: str) -> List[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor

    from dist_checkpointing.strategies.dcp.checkpointable import CheckpointableShardedTensor, LocalShardsContainer
    from dist_checkpointing.strategies.dcp.planners import MCoreLoadPlanner, MCoreSavePlanner
    from dist_checkpointing.strategies.dcp.state_dict import mcore_to_pyt_state_dict

    full = torch.arange(16.0)
    sizes = [3, 13] if world == 2 else [16]  # uneven: no axis_fragmentations
    off = sum(sizes[:rank])

    def uneven(data: torch.Tensor, offset: int) -> ShardedTensor:
        return ShardedTensor("u", data, torch.float32, tuple(data.shape), (16,), (offset,), None)

    grid = torch.arange(8.0 * world).reshape(2, 4 * world)
    sd = {"u": uneven(full[off:off + sizes[rank]].clone(), off),
          "two": [ShardedTensor.from_rank_offsets("two", grid[i:i + 1, 4 * rank:4 * rank + 4].clone(), (0, i, 2),
                                                  (1, rank, world)) for i in range(2)],
          "pre": [ShardedTensor.from_rank_offsets("pre", grid[i, 4 * rank:4 * rank + 4].clone(), (0, i, 2),
                                                  (1, rank, world), prepend_axis_num=1) for i in range(2)]}
    pyt = mcore_to_pyt_state_dict(sd)
    kinds = [type(pyt[k]) for k in ("u", "two", "pre")]
    assert kinds == [CheckpointableShardedTensor, LocalShardsContainer, TorchShardedTensor], kinds
    dcp.save(pyt, checkpoint_id=plain, planner=MCoreSavePlanner())
    # read back through plain DCP in another uneven split (the reverse one) ...
    back = [13, 3] if world == 2 else [16]
    boff = sum(back[:rank])
    req = {"u": uneven(torch.zeros(back[rank]), boff)}
    dcp.load(mcore_to_pyt_state_dict(req, is_loading=True), checkpoint_id=plain, planner=MCoreLoadPlanner())
    assert torch.equal(req["u"].data, full[boff:boff + back[rank]])
    # ... and by this library's loader
    loaded = TorchDistLoadShardedStrategy().load_local(
        {k: ShardedTensor.from_rank_offsets(k, torch.zeros(2, 4 * world)) for k in ("two", "pre")}
        | {"u": ShardedTensor.from_rank_offsets("u", torch.zeros(16))}, plain)
    assert torch.equal(loaded["u"], full) and torch.equal(loaded["two"], grid) and torch.equal(loaded["pre"], grid)
    return [k.__name__ for k in kinds]


@pytest.mark.parametrize("world", [1, 2])
def test_mcore_to_pyt_state_dict_takes_any_grid_as_megatron_core(tmp_path, world):
    """As Megatron-Core on torch >= 2.6: a key's ShardedTensors become a
    ``CheckpointableShardedTensor`` (several of a rank: a ``LocalShardsContainer``), uneven
    ones too; prepended-axis ones on a regular grid a torch ShardedTensor. Saved and
    loaded by plain DCP in another uneven split, and read by this library."""
    assert get_pool(world).run(_uneven_dcp, str(tmp_path / "plain")) == \
        [["CheckpointableShardedTensor", "LocalShardsContainer", "ShardedTensor"]] * world


def _exchange_targets(rank: int, world: int) -> List[Any]:
    from dist_checkpointing.exchange_utils import _get_empty_tensor_for_exchange
    from dist_checkpointing.utils import _sharded_tensor_shard_id

    have = ShardedTensor.from_rank_offsets("a", torch.ones(3))                     # needed, with data
    empty = ShardedTensor("b", None, torch.bfloat16, (2,), (2,), (0,), None)       # needed, no data yet
    other = ShardedTensor("c", None, torch.int16, (4,), (4,), (0,), None)          # not needed here
    needed = {_sharded_tensor_shard_id(s): s for s in (have, empty)}
    unneeded = {_sharded_tensor_shard_id(other): other}
    loaded: dict = {}
    out = [_get_empty_tensor_for_exchange(sid, needed, unneeded, loaded) for sid in [*needed, *unneeded]]
    assert out[0][0] is have.data and out[0][1] == torch.device("cpu")      # gloo: the request's own tensor
    assert out[1][0] is empty.data and out[1][0].dtype == torch.bfloat16 and out[1][0].shape == (2,)
    assert out[2][0].shape == (4,) and out[2][0].dtype == torch.int16 and out[2][1] is None and other.data is None
    return sorted(k[0] for k in loaded)


def test_empty_tensor_for_exchange_as_megatron_cores():
    """``exchange_utils._get_empty_tensor_for_exchange`` (Megatron-Core's private helper,
    which its tests import): the tensor a shard is exchanged into, on the group's
    communication device; needed shards' tensors are recorded as loaded."""
    assert get_pool(1).run(_exchange_targets) == [["a", "b"]]


# ----------------------------------------------------------------------------- empty containers, IGNORE_ALL

_EXTRACT_COMPARE = """
    from dist_checkpointing.dict_utils import extract_matching_values as ours
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values as theirs

    cases = [{'E': {}, 'L': [], 'N': {'e': {}, 'x': 1}}, {'l': [{}, [], 1, {'a': 2}, {'b': {}}]},
             [[], {}, 3, [4, {}]], {'a': {'b': {}}}, {'a': [[[]]], 'b': [{'c': []}]}]
    preds = [lambda v: False, lambda v: True, lambda v: isinstance(v, int), lambda v: v == {}]
    n = 0
    for x in cases:
        for pred in preds:
            for as_dicts in (False, True):
                assert ours(x, pred, as_dicts) == theirs(x, pred, as_dicts), (x, as_dicts)
                n += 1
    print('compared', n)
"""


@needs_mcore
def test_extract_matching_values_as_megatron_cores():
    """Empty containers: kept in the rest under dict keys, leaves in lists, as Megatron-Core."""
    assert "compared 40" in _run_with_mcore(_EXTRACT_COMPARE)


def _empty_containers(rank: int, world: int, ckpt: str) -> List[Any]:
    from dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from dist_checkpointing.validation import StrictHandling

    def state() -> dict:
        return {"t": ShardedTensor.from_rank_offsets("t", torch.ones(2) * rank, (0, rank, world)),
                "E": {}, "L": [], "N": {"e": {}, "x": 1, "l": [[], {}]}}

    dc.save(state(), ckpt)
    loaded = dc.load(state(), ckpt)
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(state(), "atomic")
    extra = {**state(), "U": ShardedTensor.from_rank_offsets("U", torch.ones(1), replica_id=rank)}
    ignored = tasd.to_state_dict(sharded_state_dict=extra, algo="atomic", strict=StrictHandling.IGNORE_ALL,
                                 return_mismatch_keys=True)
    returned = tasd.to_state_dict(sharded_state_dict=extra, algo="atomic", strict=StrictHandling.RETURN_ALL,
                                  return_mismatch_keys=True)
    drop_t = lambda d: {k: v for k, v in d.items() if k != "t"}  # noqa: E731
    return [drop_t(loaded), drop_t(dc.load_common_state_dict(ckpt)), tasd.common, drop_t(ignored[0]),
            ignored[1:], returned[1:]]


@pytest.mark.parametrize("world", [1, 2])
def test_empty_containers_and_ignore_all_as_megatron_core(tmp_path, world):
    """The common state keeps empty dicts and lists (save, load, ``load_common_state_dict``,
    ``MCoreTensorAwareStateDict``); ``to_state_dict(strict=IGNORE_ALL)`` reports no keys."""
    common = {"E": {}, "L": [], "N": {"e": {}, "x": 1, "l": [[], {}]}}
    for result in get_pool(world).run(_empty_containers, str(tmp_path / "c")):
        assert result[:4] == [common] * 4
        assert result[4] == (set(), set()) and result[5] == (set(), {"U"})


def _megatron_form(rank: int, world: int) -> List[str]:
    from dist_checkpointing.strategies.torch import mcore_to_pyt_state_dict

    uneven = ShardedTensor("mdp.uneven_key", torch.zeros(4), torch.float32, (4,), (8,), (0,), None)
    grid = [ShardedTensor.from_rank_offsets("w", torch.zeros(1, 2), (0, i, 2)) for i in range(2)]
    megatron_form = mcore_to_pyt_state_dict({"mdp": [uneven], "w": grid})       # {name: [its shards]}
    nested = mcore_to_pyt_state_dict({"a": {"b": uneven}, "w": grid})          # this library's nesting
    return [sorted(megatron_form), sorted(nested)]


def test_mcore_to_pyt_state_dict_keys_as_megatron_core():
    """Megatron-Core passes ``{name: [ShardedTensors of one key]}`` and gets ``name`` back;
    a nested state dict is keyed by the ShardedTensors' keys."""
    assert get_pool(1).run(_megatron_form) == [[["mdp", "w"], ["mdp.uneven_key", "w"]]]


# ----------------------------------------------------------------------------- validate_sharding_integrity(global metadata)

# A (8, 4) tensor "f" in 2 TP chunks of (4, 4), each split flat over 2 DP ranks, and a tensor
# "w" in 2 TP chunks replicated over DP: per case, the flat slice of each (tp, dp) and the
# replica ids of "w"'s chunks on tp 1 (both not 0: that chunk has no main replica).
_OK = {(tp, dp): (8 * dp, 8 * dp + 8) for tp in range(2) for dp in range(2)}
_GLOBAL_CASES = {
    "ok": (_OK, (0, 1)),
    "flat gap": ({**_OK, (0, 0): (0, 7)}, (0, 1)),
    "flat overlap": ({**_OK, (1, 0): (0, 9)}, (0, 1)),
    "flat gap hidden by an overlap": ({**_OK, (0, 0): (0, 9), (0, 1): (8, 15)}, (0, 1)),
    "one slice twice": ({**_OK, (1, 1): (0, 8)}, (0, 1)),
    "chunk without main replica": (_OK, (1, 1)),
}


def _virtual_items(v: int, case: str) -> list:
    """The items of virtual rank ``v`` (tp = v // 2, dp = v % 2) in ``case``."""
    slices, w_replicas = _GLOBAL_CASES[case]
    tp, dp = divmod(v, 2)
    a, b = slices[(tp, dp)]
    return [ShardedTensor.from_rank_offsets_flat("f", torch.ones(b - a), (4, 4), (0, tp, 2), flattened_range=slice(a, b)),
            ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, tp, 2), replica_id=dp if tp == 0 else w_replicas[dp])]


def _global_verdicts(rank: int, world: int) -> dict:
    from dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

    verdicts = {}
    for case in _GLOBAL_CASES:
        sd = {f"{v}.{i}": item for v in range(4) if v % world == rank for i, item in enumerate(_virtual_items(v, case))}
        try:  # (with Megatron-Core's common_state_dict: compared with rank 0's, a warning if it differs)
            validate_sharding_integrity(determine_global_metadata(sd)[1], common_state_dict={"step": rank % 2})
            verdicts[case] = "ok"
        except dc.CheckpointingException as e:
            verdicts[case] = f"raises: {e}"
    return verdicts


_GLOBAL_COMPARE = """
    import json, sys, tempfile, numpy, torch, torch.distributed as dist
    numpy.product = numpy.prod  # Megatron-Core 0.15's flattened check calls np.product, which NumPy 2 removed
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.validation import validate_sharding_integrity
    dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1)
    cases = json.loads(sys.argv[1])
    verdicts = {}
    for case, (slices, w_replicas) in cases.items():
        global_metadata = []
        for v in range(4):
            tp, dp = divmod(v, 2)
            a, b = slices[f'{tp},{dp}']
            global_metadata.append([
                ShardedTensor.from_rank_offsets_flat('f', torch.ones(b - a), (4, 4), (0, tp, 2), flattened_range=slice(a, b)),
                ShardedTensor.from_rank_offsets('w', torch.ones(2), (0, tp, 2), replica_id=dp if tp == 0 else w_replicas[dp])])
        try:
            validate_sharding_integrity(global_metadata)   # rank 0 judges
            verdicts[case] = 'ok'
        except Exception as e:
            verdicts[case] = 'raises: ' + type(e).__name__
    print(json.dumps(verdicts))
"""


@needs_mcore
@pytest.mark.parametrize("world", [1, 2, 4])
def test_global_metadata_form_validates_as_megatron_core(world):
    """``validate_sharding_integrity(determine_global_metadata(sd)[1])``, Megatron-Core's
    calling convention (its ``test_flattened_tensors_are_properly_validated``): a gap or an
    overlap of flattened ranges, a gap hidden by an overlap, a chunk without main replica
    are refused as Megatron-Core 0.15 refuses them — here on every rank, naming the key —
    and a correct layout passes."""
    ours = get_pool(world).run(_global_verdicts, timeout=120)
    assert all(r == ours[0] for r in ours), ours  # the same verdict on every rank
    spec = {case: ({f"{tp},{dp}": s for (tp, dp), s in slices.items()}, list(replicas))
            for case, (slices, replicas) in _GLOBAL_CASES.items()}
    proc = launch.run(["-c", textwrap.dedent(_GLOBAL_COMPARE), json.dumps(spec)],
                      env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), require("MCORE_SITE")]),
                           "PYTHONWARNINGS": "ignore"}, timeout=slack(300))
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert theirs == {c: "ok" if c == "ok" else "raises: CheckpointingException" for c in _GLOBAL_CASES}, theirs
    for case, verdict in ours[0].items():
        assert verdict.split(":")[0] == theirs[case].split(":")[0], (case, verdict, theirs[case])
        if case != "ok":
            assert ("'f'" if case != "chunk without main replica" else "'w'") in verdict, verdict
