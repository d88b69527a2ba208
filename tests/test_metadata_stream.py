"""Rank 0's ``.metadata`` streamed from columns (``location_table``, ``metadata_writer``,
``key_index.encode_table_index``) is the ``Metadata`` that ``build_metadata`` builds object
by object: it unpickles (stock ``pickle``, our safe reader, DCP's ``FileSystemReader``) to
equal fields, its index holds the same records, the checks refuse exactly what
``build_metadata`` refuses with the same error naming key and rank; and on real gloo ranks
saves (incl. repeated ``cached_metadata`` saves) load back, also with plain DCP."""

from __future__ import annotations

import io
import json
import math
import pickle
import pickletools
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import StorageMeta

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.core import CheckpointingException
from dist_checkpointing.storage import storage_for
from dist_checkpointing.pickling.safe_load import load_dcp_metadata
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from dist_checkpointing.strategies.torch_dist import key_index
from dist_checkpointing.strategies.torch_dist.location_table import LocationTable, encode_checksums, encode_locations
from dist_checkpointing.strategies.torch_dist.metadata import assemble_table, build_metadata, data_file_sizes
from dist_checkpointing.strategies.torch_dist.metadata_writer import metadata_bytes

from .conftest import get_pool
from .helpers import assert_all_raise

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16]
NAMES = ["w", "décodeur.poids", 'q"uote\\d', "optimizer.state.exp_avg.layers.0.w", "\u2603/x"]


def _fields(md) -> dict:
    return {k: v for k, v in md.__dict__.items() if k != "storage_meta"}


def _index_records(raw: bytes) -> dict:
    n = struct.unpack_from("<I", raw, 12)[0]
    out = {}
    for b in range(n):
        off, length, _ = struct.unpack_from("<QQQ", raw, key_index.HEADER_BYTES + 24 * b)
        out.update({k: rec for k, rec in json.loads(raw[off:off + length])})
    return out


def _streamed(per_rank, tmp: Path):
    """(unpickled streamed .metadata, reference Metadata, streamed bytes) of ``per_rank``."""
    table = LocationTable([encode_locations(locs) for locs in per_rank])
    ref = build_metadata(per_rank, storage_for(tmp))
    assert not table.problem
    data = metadata_bytes(table, table.checksums, ref.storage_meta)
    return pickle.loads(data), ref, data, table


def _check_equal(per_rank, tmp: Path) -> None:
    got, ref, data, table = _streamed(per_rank, tmp)
    assert _fields(got) == _fields(ref)
    assert got.storage_meta == ref.storage_meta
    assert list(got.state_dict_metadata) == list(ref.state_dict_metadata)  # the keys' order too
    for key, md in ref.state_dict_metadata.items():  # each key's chunks in the same order
        assert getattr(got.state_dict_metadata[key], "chunks", None) == getattr(md, "chunks", None)
    pickletools.dis(data, out=io.StringIO())  # a well-formed opcode stream (marks, memo)
    index = key_index.encode_table_index(table, table.checksums, 7)
    assert index[:key_index.HEADER_BYTES] == key_index.encode_index(ref, 7)[:key_index.HEADER_BYTES]
    assert _index_records(index) == _index_records(key_index.encode_index(ref, 7))
    # every stored item lies inside its file (the table also counts the repeated empty
    # chunks that .metadata leaves out: they are written too)
    sizes = table.data_file_sizes()
    assert sizes.keys() == data_file_sizes(ref).keys()
    assert all(sizes[f] >= n for f, n in data_file_sizes(ref).items())


def _tensor_locations(name, dtype, shape, grid, ranks, flat=False, checksums=True, base=0):
    """Locations of a tensor of ``shape`` cut into ``grid`` chunks along axis 0, spread over
    ``ranks`` (``flat``: stored N-D reformulated, one extra axis)."""
    per_rank = [[] for _ in range(ranks)]
    rows = shape[0] // grid if grid else 0
    for i in range(grid):
        offsets, sizes = (i * rows,) + (0,) * (len(shape) - 1), (rows,) + tuple(shape[1:])
        meta = (tuple(shape), dtype, offsets, sizes, None)
        if flat:
            meta = (tuple(shape) + (1,), dtype, offsets + (0,), sizes + (1,), (shape[0] * 2,) + tuple(shape[1:]))
        r = i % ranks
        off = base + 1000 * i
        per_rank[r].append((name, meta, f"__{r}_{i % 2}.distcp", off, 100 + i, (off * 7919 + 2 ** 63) % 2 ** 64
                            if checksums else None))
    return per_rank


def _merge(*layouts):
    out = [[] for _ in range(max(len(x) for x in layouts))]
    for layout in layouts:
        for r, locs in enumerate(layout):
            out[r] += locs
    return out


@pytest.mark.parametrize("checksums", [True, False])
def test_streamed_metadata_equals_the_built_one_on_varied_layouts(checksums, tmp_path):
    layout = _merge(
        _tensor_locations("a", torch.float32, (8, 4), 4, 3, checksums=checksums),
        _tensor_locations("b.flat", torch.bfloat16, (6, 5, 2), 3, 3, flat=True, checksums=checksums, base=50),
        _tensor_locations("c.6d", torch.int64, (4, 1, 2, 1, 3, 2), 2, 3, checksums=checksums, base=70),
        [[("obj/shard_0_2", None, "__0_0.distcp", 10 ** 12, 9, 5 if checksums else None)],
         [("obj/shard_1_2", None, "__1_0.distcp", 3, 9, None)], []],
        [[("scalar", ((), torch.float16, (), (), None), "__0_1.distcp", 2 ** 40, 4, 2 ** 64 - 1)], [], []],
    )
    # an empty tensor: every rank's empty chunk at offset 0, one of them recorded
    layout = _merge(layout, [[("empty", ((0, 3), torch.float32, (0, 0), (0, 3), None), f"__{r}_0.distcp",
                               5000 + r, 1, None)] for r in range(3)])
    _check_equal(layout, tmp_path)


def test_no_locations_and_objects_only(tmp_path):
    _check_equal([[], []], tmp_path)
    _check_equal([[("o/shard_0_1", None, "f", 0, 10, 3)], []], tmp_path)
    _check_equal([[("o/shard_0_1", None, "f", 0, 0, None)]], tmp_path)  # a file named only by an empty item: 0 bytes


@st.composite
def layouts(draw):
    ranks = draw(st.integers(1, 4))
    parts = []
    base = 0
    for k in range(draw(st.integers(0, 5))):
        name = draw(st.sampled_from(NAMES)) + f".{k}"
        if draw(st.booleans()):
            parts.append([[(f"{name}/shard_0_1", None, "__0_0.distcp", base, draw(st.integers(0, 2 ** 33)),
                            draw(st.none() | st.integers(0, 2 ** 64 - 1)))]])
        else:
            ndim = draw(st.integers(1, 5))
            grid = draw(st.integers(1, 4))
            shape = (grid * draw(st.integers(0, 3)),) + tuple(draw(st.integers(0, 2 ** 20)) for _ in range(ndim - 1))
            if math.prod(shape) == 0:
                grid = 1
            parts.append(_tensor_locations(name, draw(st.sampled_from(DTYPES)), shape, grid, ranks,
                                           flat=draw(st.booleans()), checksums=draw(st.booleans()),
                                           base=base + 1 + draw(st.integers(0, 2 ** 40))))
        base += 2 ** 41  # each part in its own range: no two records at one (file, offset), as in a save
    return _merge([[] for _ in range(ranks)], *parts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layouts())
def test_streamed_metadata_equals_the_built_one_hypothesis(tmp_path, layout):
    _check_equal(layout, tmp_path)


def test_every_reader_reads_the_streamed_metadata(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    layout = _merge(_tensor_locations("a", torch.float32, (8, 4), 4, 2),
                    [[("o/shard_0_1", None, "__0_0.distcp", 10 ** 6, 9, 1)], []])
    got, ref, data, _ = _streamed(layout, tmp_path)
    (tmp_path / ".metadata").write_bytes(data)
    assert _fields(load_dcp_metadata(str(tmp_path), verify_checksum=False)) == _fields(ref)
    assert _fields(pickle._Unpickler(io.BytesIO(data)).load()) == _fields(ref)  # the strict Python unpickler
    assert data[2:3] == b"\x95" and int.from_bytes(data[3:11], "little") == len(data) - 11  # one frame
    plain = FileSystemReader(str(tmp_path)).read_metadata()
    assert plain.state_dict_metadata == ref.state_dict_metadata and plain.storage_data == ref.storage_data


# ----------------------------------------------------------------------------- refusals


def _conflicts():
    a = _tensor_locations("a", torch.float32, (8, 4), 2, 2)
    return {
        "dtype": _merge(a, [[], [("a", ((8, 4), torch.float16, (4, 0), (4, 4), None), "__1_1.distcp", 0, 1, None)]]),
        "shape": _merge(a, [[], [("a", ((9, 4), torch.float32, (4, 0), (4, 4), None), "__1_1.distcp", 0, 1, None)]]),
        "flattening": _merge(a, [[], [("a", ((8, 4, 1), torch.float32, (6, 0, 0), (2, 4, 1), (16, 4)),
                                       "__1_1.distcp", 0, 1, None)]]),
        "tensor then object": _merge(a, [[], [("a", None, "__1_1.distcp", 0, 1, None)]]),
        "object then tensor": [[("a", None, "__0_1.distcp", 0, 1, None)], a[1]],
        "twice": _merge(a, [[], [("a", ((8, 4), torch.float32, (0, 0), (4, 4), None), "__1_1.distcp", 0, 1, None)]]),
        "object twice": [[("o", None, "f0", 0, 1, None)], [("o", None, "f1", 0, 1, None)]],
        "empty twice, one not empty": [[("e", ((0, 3), torch.float32, (0, 0), (0, 3), None), "f0", 0, 1, None)],
                                       [("e", ((0, 3), torch.float32, (0, 0), (1, 3), None), "f1", 0, 1, None)]],
        "scalar twice": [[("s", ((), torch.float32, (), (), None), "f0", 0, 1, None)],
                         [("s", ((), torch.float32, (), (), None), "f1", 0, 1, None)]],
    }


@pytest.mark.parametrize("case", list(_conflicts()))
def test_refusals_name_key_and_rank_as_build_metadata_does(case, tmp_path):
    layout = _conflicts()[case]
    with pytest.raises(CheckpointingException) as expected:
        build_metadata(layout, storage_for(tmp_path))
    assert LocationTable([encode_locations(locs) for locs in layout]).problem
    with pytest.raises(CheckpointingException) as got:
        assemble_table([encode_locations(locs) for locs in layout], storage_for(tmp_path))
    assert str(got.value) == str(expected.value)
    assert "rank" in str(got.value) or "both as a tensor and as an object" in str(got.value)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["a", "b"]), st.booleans(), st.integers(1, 2),
                          st.integers(0, 1), st.integers(0, 2), st.sampled_from(DTYPES[:2]), st.booleans()),
                max_size=8))
def test_the_columns_refuse_exactly_what_build_metadata_refuses(tmp_path, items):
    """Random (often inconsistent) locations: refused by the columns' checks exactly when
    ``build_metadata`` refuses them, with its message."""
    layout = [[], [], []]
    for n, (rank, key, is_tensor, rows, offset, size, dtype, flat) in enumerate(items):
        meta = None
        if is_tensor:
            meta = ((rows, 4), dtype, (offset, 0), (size, 4), (rows * 8,) if flat else None)
        layout[rank].append((key, meta, f"__{rank}_0.distcp", 100 * n, 10, None))
    try:
        build_metadata(layout, storage_for(tmp_path))
        refused = None
    except CheckpointingException as e:
        refused = str(e)
    sent = [encode_locations(locs) for locs in layout]
    assert LocationTable(sent).problem == (refused is not None)
    if refused is not None:
        with pytest.raises(CheckpointingException) as got:
            assemble_table(sent, storage_for(tmp_path))
        assert str(got.value) == refused
    else:
        _check_equal(layout, tmp_path)


def test_a_location_whose_dimensions_disagree_is_refused():
    with pytest.raises(CheckpointingException, match="'a'.*differ in length"):
        encode_locations([("a", ((4, 4), torch.float32, (0,), (4, 4), None), "f", 0, 1, None)])


def test_unchanged_layout_must_name_the_same_items(tmp_path):
    layout = _tensor_locations("a", torch.float32, (8, 4), 2, 2)
    table = LocationTable([encode_locations(locs) for locs in layout])
    moved = [[loc[:3] + (loc[3] + 1,) + loc[4:] for loc in locs] for locs in layout]
    from dist_checkpointing.strategies.torch_dist.location_table import ChecksumColumns

    with pytest.raises(CheckpointingException, match="differ from the previous save"):
        table.check_same_items(ChecksumColumns.gather([encode_checksums(locs) for locs in moved]))
    again = ChecksumColumns.gather([encode_checksums([loc[:5] + (11,) for loc in locs]) for locs in layout])
    table.check_same_items(again)
    md = pickle.loads(metadata_bytes(table, table.checksums, StorageMeta()))
    assert set(md.checksums["items"].values()) == {11}


# ----------------------------------------------------------------------------- real gloo ranks


def _state(rank, world, fill=True, bump=0):
    def data(*shape):
        return torch.full(shape, float(rank + 1 + bump)) if fill else torch.zeros(*shape)

    sd = {
        "w": ShardedTensor.from_rank_offsets("w", data(2, 3), (0, rank, world)),
        "big": ShardedTensor.from_rank_offsets("big", data(2, 4, 3), (1, rank, world), (0, 0, 1)),
        "norm": ShardedTensor.from_rank_offsets("norm", data(5), replica_id=rank),
        "empty": ShardedTensor.from_rank_offsets("empty", data(0, 3), (1, rank, world)),
        "rng": ShardedObject("rng", {"rank": rank} if fill else None, (world,), (rank,)),
        "step": 7,
    }
    rows = 4 // world  # a distributed-optimizer style slice: the whole local chunk, flattened
    local = _flat_rows(rank, rows) if fill else torch.zeros(rows, 6)
    sd["flat"] = ShardedTensor.from_rank_offsets_flat("flat", local.flatten(), (rows, 6), (0, rank, world),
                                                      flattened_range=slice(0, 6 * rows))
    return sd


def _flat_rows(rank, rows):
    return torch.arange(24.0).reshape(4, 6)[rank * rows:(rank + 1) * rows]


def _save_load(rank, world, ckpt, cached):
    """Save (twice with ``cached``: the same layout, other values: the second reuses rank 0's
    table with the new checksums), load each back."""
    strategy = TorchDistSaveShardedStrategy(cached_metadata=cached)
    tables = []
    for n in range(2 if cached else 1):
        dc.save(_state(rank, world, bump=10 * n), f"{ckpt}/{n}", sharded_strategy=strategy)
        tables.append(strategy._cache[1] if cached else None)
    out = []
    for n in range(2 if cached else 1):
        loaded = dc.load(_state(rank, world, fill=False), f"{ckpt}/{n}")
        out.append((loaded["w"].tolist(), loaded["big"].sum().item(), loaded["rng"], loaded["empty"].shape,
                    loaded["flat"].tolist()))
    return out, rank != 0 or not cached or tables[1] is tables[0]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cached", [False, True])
def test_real_saves_load_back_and_plain_dcp_reads_them(world, cached, tmp_path):
    results = get_pool(world).run(_save_load, str(tmp_path), cached)
    assert all(reused for _, reused in results)
    for rank, (per_save, _) in enumerate(results):
        for n, (w, big, rng, empty, flat) in enumerate(per_save):
            assert w == [[float(rank + 1 + 10 * n)] * 3] * 2
            assert big == 24 * (rank + 1 + 10 * n)
            assert rng == {"rank": rank} and tuple(empty) == (0, 3)
            assert flat == _flat_rows(rank, 4 // world).flatten().tolist()
    first = load_dcp_metadata(str(tmp_path / "0"))
    with open(tmp_path / "0" / ".metadata", "rb") as f:
        assert _fields(pickle.load(f)) == _fields(first)
    if cached:  # the repeated save: the same entries, its own checksums
        second = load_dcp_metadata(str(tmp_path / "1"))
        assert second.state_dict_metadata == first.state_dict_metadata
        assert second.storage_data == first.storage_data
        assert second.checksums["items"].keys() == first.checksums["items"].keys()
        assert second.checksums["items"] != first.checksums["items"]
    plain = {"w": torch.zeros(2 * world, 3), "norm": torch.zeros(5)}
    dcp.load(plain, checkpoint_id=str(tmp_path / "0"), no_dist=True)
    assert plain["w"][::2, 0].tolist() == [float(r + 1) for r in range(world)]


def _save_twice_main(rank, world, ckpt):
    """Every rank saves chunk 0 of ``x`` as main replica."""
    sd = {"x": ShardedTensor.from_rank_offsets("x", torch.ones(2, 2), (0, 0, world))}
    dc.save(sd, ckpt, validate_access_integrity=False)


def _save_other_dtype(rank, world, ckpt):
    sd = {"x": ShardedTensor.from_rank_offsets("x", torch.ones(2, 2, dtype=torch.float16 if rank else torch.float32),
                                               (0, rank, world))}
    dc.save(sd, ckpt, validate_access_integrity=False)


@pytest.mark.parametrize("world", [2, 4])
def test_real_refusals_name_key_and_rank_on_every_rank(world, tmp_path):
    excs = get_pool(world).run_expect_error(_save_twice_main, str(tmp_path / "a"))
    assert_all_raise(excs, world, "'x'", "saved as main replica by both rank 0 and rank 1")
    excs = get_pool(world).run_expect_error(_save_other_dtype, str(tmp_path / "b"))
    assert_all_raise(excs, world, "'x'", "rank 0 saves global shape", "rank 1 saves")


def test_cached_global_metadata_is_the_written_metadata(tmp_path):
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3))}, tmp_path / "c", sharded_strategy=strategy)
    assert _fields(strategy.cached_global_metadata) == _fields(load_dcp_metadata(str(tmp_path / "c")))
    loaded = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}, tmp_path / "c",
                     sharded_strategy=TorchDistLoadShardedStrategy())
    assert loaded["w"].sum().item() == 6
