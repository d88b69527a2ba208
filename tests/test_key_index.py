"""The per-key index ``.metadata.index``: written beside ``.metadata`` at save, used by every
load (each rank learns only the records of the keys it requests), checked like
``.metadata`` (a damaged or hostile index is an error or a fall-back to ``.metadata``,
never wrong data), ignored when it does not index the ``.metadata`` beside it; checkpoints
without one load as before; per-rank index bytes read at load are flat in the world size."""

from __future__ import annotations

import shutil
import statistics
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.core import open_storage
from dist_checkpointing.integrity import checksum
from dist_checkpointing.strategies.torch_dist import key_index
from dist_checkpointing.strategies.torch_dist.index_view import open_index

from .conftest import get_pool
from .helpers import assert_all_raise, index_threshold
from .metadata_read_counter import count_metadata_reads

INDEX = ".metadata.index"


@pytest.fixture(autouse=True, scope="module")
def _always_the_index():
    """These checkpoints are small: without this every rank would read ``.metadata`` itself."""
    with index_threshold([get_pool(w) for w in (1, 2, 4, 8)], 0):
        yield


def _uses_index(rank, world, ckpt):
    from dist_checkpointing.strategies.torch_dist.index_view import indexed_view
    from dist_checkpointing.strategies.torch_dist.load import requested_regions

    return indexed_view(open_storage(ckpt), lambda: requested_regions(_state(rank, world, fill=False))) is not None


def test_the_index_is_used_above_the_metadata_bytes_all_ranks_would_read(tmp_path):
    ckpt = str(tmp_path / "c")
    get_pool(2).run(_save, ckpt)
    size = (tmp_path / "c" / ".metadata").stat().st_size
    for threshold, used in ((64 * 2**20, False), (2 * size, False), (2 * size - 1, True), (0, True)):
        with index_threshold([get_pool(2)], threshold):
            assert get_pool(2).run(_uses_index, ckpt) == [used, used], threshold
            assert get_pool(2).run(_load_and_check, ckpt, 2) == [True, True]


def _state(rank: int, world: int, fill: bool = True, keys: int = 6) -> dict:
    def data(*shape):
        return torch.full(shape, float(rank + 1)) if fill else torch.zeros(*shape)

    sd = {f"w{k}": ShardedTensor.from_rank_offsets(f"w{k}", data(2, 4), (0, rank, world)) for k in range(keys)}
    flat = torch.arange(24.0) if fill else torch.zeros(24)
    per = 24 // world
    sd["flat"] = ShardedTensor.from_rank_offsets_flat(
        "flat", flat[rank * per:(rank + 1) * per].clone(), (4, 6), flattened_range=slice(rank * per, (rank + 1) * per))
    sd["norm"] = ShardedTensor.from_rank_offsets("norm", torch.ones(3) if fill else torch.zeros(3), replica_id=rank)
    sd["rng"] = ShardedObject("rng", {"rank": rank} if fill else None, (world,), (rank,))
    sd["step"] = 3
    return sd


def _save(rank, world, ckpt):
    dc.save(_state(rank, world), ckpt)


def _load_and_check(rank, world, ckpt, saved_world):
    """Load with another layout (whole rows of w*, flat read whole) and check the values."""
    req = {f"w{k}": ShardedTensor.from_rank_offsets(f"w{k}", torch.zeros(2 * saved_world, 4), replica_id=rank)
           for k in range(6)}
    req["flat"] = ShardedTensor.from_rank_offsets("flat", torch.zeros(4, 6), replica_id=rank)
    req["rng"] = ShardedObject("rng", None, (saved_world,), (saved_world - 1,), replica_id=rank)
    out = dc.load(req, ckpt)
    expected = torch.cat([torch.full((2, 4), float(r + 1)) for r in range(saved_world)])
    assert all(torch.equal(out[f"w{k}"], expected) for k in range(6))
    assert torch.equal(out["flat"], torch.arange(24.0).reshape(4, 6))
    assert out["rng"] == {"rank": saved_world - 1} and out["step"] == 3
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_index_round_trip_with_resharding(world, tmp_path):
    ckpt = str(tmp_path / "c")
    get_pool(world).run(_save, ckpt)
    assert (tmp_path / "c" / INDEX).is_file() and (tmp_path / "c" / (INDEX + ".checksum")).is_file()
    reader, header = open_index(open_storage(ckpt))
    records = key_index.read_buckets(reader, header, range(header.n_buckets), "idx")
    reader.close()
    assert set(records) == {f"w{k}" for k in range(6)} | {"flat", "norm"} | {f"rng/shard_{r}_{world}" for r in range(world)}
    assert len(records["w0"][4]) == world and records["flat"][3] == [4, 6]
    for load_world in {1, 2, world}:
        assert get_pool(load_world).run(_load_and_check, ckpt, world) == [True] * load_world


def test_records_are_cut_to_the_requested_chunks(tmp_path):
    ckpt = str(tmp_path / "c")
    get_pool(4).run(_save, ckpt)
    reader, header = open_index(open_storage(ckpt))
    rec = key_index.read_buckets(reader, header, range(header.n_buckets), "idx")
    reader.close()
    assert [c[0] for c in key_index.select_chunks(rec["w1"], [((2, 0), (2, 4))])[4]] == [[2, 0]]
    assert len(key_index.select_chunks(rec["w1"], [((1, 0), (2, 4))])[4]) == 2
    assert len(key_index.select_chunks(rec["w1"], None)[4]) == 4
    # stored flattened as (1, 1, 24): one grid cell, its row kept whole
    assert len(key_index.select_chunks(rec["flat"], [((0, 0), (1, 1))])[4]) == 4


def test_checkpoints_without_the_index_load_as_before(tmp_path):
    ckpt = tmp_path / "c"
    get_pool(2).run(_save, str(ckpt))
    (ckpt / INDEX).unlink()
    assert get_pool(2).run(_load_and_check, str(ckpt), 2) == [True, True]
    assert get_pool(1).run(_load_and_check, str(ckpt), 2) == [True]


def test_an_index_of_another_metadata_is_ignored(tmp_path):
    """An index copied from another checkpoint, or left by a tool that rewrote .metadata,
    does not index the .metadata beside it: loads read .metadata (right values)."""
    get_pool(2).run(_save, str(tmp_path / "a"))
    get_pool(1).run(_save, str(tmp_path / "b"))
    shutil.copy(tmp_path / "b" / INDEX, tmp_path / "a" / INDEX)
    shutil.copy(tmp_path / "b" / (INDEX + ".checksum"), tmp_path / "a" / (INDEX + ".checksum"))
    assert open_index(open_storage(str(tmp_path / "a"))) is None
    assert get_pool(2).run(_load_and_check, str(tmp_path / "a"), 2) == [True, True]


def test_removing_tensors_rewrites_the_index(tmp_path):
    ckpt = str(tmp_path / "c")
    get_pool(1).run(_save, ckpt)
    dc.remove_sharded_tensors(ckpt, "w5")
    reader, header = open_index(open_storage(ckpt))
    records = key_index.read_buckets(reader, header, range(header.n_buckets), "idx")
    reader.close()
    assert "w5" not in records and "w4" in records


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def _load_plain(rank, world, ckpt):
    return _load_and_check(rank, world, ckpt, 2)


@pytest.mark.parametrize("where", ["first bucket", "last bucket", "table entry"])
def test_a_damaged_index_is_an_error_on_every_rank(where, tmp_path):
    ckpt = tmp_path / "c"
    get_pool(2).run(_save, str(ckpt))
    raw = (ckpt / INDEX).read_bytes()
    n_buckets = struct.unpack_from("<I", raw, 12)[0]
    first = key_index.HEADER_BYTES + n_buckets * 24
    at = {"first bucket": first + 3, "last bucket": len(raw) - 2, "table entry": key_index.HEADER_BYTES + 20}[where]
    _flip(ckpt / INDEX, at)
    excs = get_pool(2).run_expect_error(_load_plain, str(ckpt))
    assert_all_raise(excs, 2, INDEX)
    assert_all_raise(get_pool(1).run_expect_error(_load_plain, str(ckpt)), 1, INDEX, "corrupted")


@pytest.mark.parametrize("at", [0, 9, 14, 30, 60])
def test_a_damaged_index_header_falls_back_to_the_metadata(at, tmp_path):
    ckpt = tmp_path / "c"
    get_pool(2).run(_save, str(ckpt))
    _flip(ckpt / INDEX, at)
    assert open_index(open_storage(str(ckpt))) is None
    assert get_pool(2).run(_load_plain, str(ckpt)) == [True, True]


def _rewrite_bucket(ckpt: Path, edit) -> None:
    """Re-encode every bucket after ``edit(doc)`` with valid checksums (a crafted index)."""
    import json

    raw = (ckpt / INDEX).read_bytes()
    n = struct.unpack_from("<I", raw, 12)[0]
    table = key_index.HEADER_BYTES
    parts, entries, at = [], [], table + n * 24
    for b in range(n):
        off, length, _ = struct.unpack_from("<QQQ", raw, table + 24 * b)
        doc = json.loads(raw[off:off + length])
        edit(doc)
        part = json.dumps(doc).encode()
        entries.append(struct.pack("<QQQ", at, len(part), checksum(part)))
        parts.append(part)
        at += len(part)
    (ckpt / INDEX).write_bytes(raw[:table] + b"".join(entries) + b"".join(parts))
    (ckpt / (INDEX + ".checksum")).unlink()


def _chunk_outside(doc):
    for key, rec in doc:
        if rec[0] == "t":
            rec[4][0][1] = [10 ** 6] * len(rec[4][0][1])


def _negative_offset(doc):
    for key, rec in doc:
        if rec[0] == "t":
            rec[4][0][3] = -5


def _outside_file(doc):
    for key, rec in doc:
        for chunk in rec[4] if rec[0] == "t" else ():
            chunk[2] = "../../etc/passwd"


def _bad_dtype(doc):
    for key, rec in doc:
        if rec[0] == "t":
            rec[1] = "Tensor"


def _bad_type(doc):
    for key, rec in doc:
        if rec[0] == "t":
            rec[2] = "big"


@pytest.mark.parametrize("edit", [_chunk_outside, _negative_offset, _outside_file, _bad_dtype, _bad_type])
def test_a_crafted_index_is_refused_on_every_rank(edit, tmp_path):
    ckpt = tmp_path / "c"
    get_pool(2).run(_save, str(ckpt))
    _rewrite_bucket(ckpt, edit)
    excs = get_pool(2).run_expect_error(_load_plain, str(ckpt))
    assert_all_raise(excs, 2, "malformed")


def test_a_bucket_claiming_more_than_the_file_is_refused_before_reading(tmp_path):
    ckpt = tmp_path / "c"
    get_pool(1).run(_save, str(ckpt))
    raw = bytearray((ckpt / INDEX).read_bytes())
    struct.pack_into("<Q", raw, key_index.HEADER_BYTES + 8, 1 << 40)
    (ckpt / INDEX).write_bytes(bytes(raw))
    assert_all_raise(get_pool(1).run_expect_error(_load_plain, str(ckpt)), 1, INDEX, "claims bytes")


def _strict(rank, world, ckpt):
    req = _state(rank, world, fill=False)
    del req["w2"]
    req["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(2), replica_id=rank)
    _, missing, unexpected = dc.load(req, ckpt, strict="return_all")
    return missing, unexpected


def _strict_raise(rank, world, ckpt):
    req = _state(rank, world, fill=False)
    req["x"] = ShardedTensor.from_rank_offsets("x", torch.zeros(1), replica_id=rank)
    del req["norm"]
    dc.load(req, ckpt, strict="raise_all")


@pytest.mark.parametrize("index", [True, False], ids=["index", "no-index"])
def test_strict_key_lists_are_the_same_with_and_without_the_index(index, tmp_path):
    ckpt = tmp_path / "c"
    get_pool(2).run(_save, str(ckpt))
    if not index:
        (ckpt / INDEX).unlink()
    assert get_pool(2).run(_strict, str(ckpt)) == [({"w2"}, {"extra"})] * 2
    excs = get_pool(2).run_expect_error(_strict_raise, str(ckpt))
    assert_all_raise(excs, 2, "'x'", "rank 0", "rank 1", "Missing keys", "'norm'")


def test_plain_dcp_reads_a_checkpoint_with_the_index(tmp_path):
    ckpt = tmp_path / "c"
    get_pool(2).run(_save, str(ckpt))
    state = {"w0": torch.zeros(4, 4), "norm": torch.zeros(3)}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    assert torch.equal(state["w0"], torch.cat([torch.full((2, 4), 1.0), torch.full((2, 4), 2.0)]))
    assert torch.equal(state["norm"], torch.ones(3))


def _count_metadata_reads(rank, world, ckpt, keys):
    """Bytes this rank reads from ``.metadata*`` files during a load of its own slice."""
    with count_metadata_reads() as counted:
        out = dc.load(_state(rank, world, fill=False, keys=keys), ckpt)
    assert torch.equal(out["w0"], torch.full((2, 4), float(rank + 1)))
    return counted["bytes"]


def _save_keys(rank, world, ckpt, keys):
    dc.save(_state(rank, world, keys=keys), ckpt)


def test_index_bytes_read_per_rank_are_flat_from_world_2_to_8(tmp_path):
    keys = 40
    per_rank, index_size = {}, {}
    for world in (2, 8):
        ckpt = str(tmp_path / f"w{world}")
        get_pool(world).run(_save_keys, ckpt, keys)
        per_rank[world] = get_pool(world).run(_count_metadata_reads, ckpt, keys)
        index_size[world] = (tmp_path / f"w{world}" / INDEX).stat().st_size
        assert (tmp_path / f"w{world}" / ".metadata").stat().st_size > per_rank[world][1]
        # the index once in all (each bucket read by one rank), plus a header and sidecar per rank
        assert sum(per_rank[world]) <= index_size[world] + world * 400, (world, per_rank[world], index_size[world])
    median = {w: statistics.median(r) for w, r in per_rank.items()}
    assert median[8] <= 1.1 * median[2], (median, index_size)
