"""Item checksums cover every stored byte of an item's record, and claimed byte ranges are
checked against the files before anything is read.

One checkpoint is saved at world size 2 (two chunks of ``w``, one object per rank); each
case copies it, damages one byte of rank 0's records (or crafts its ``.metadata``), and
loads it on real gloo ranks and validates it offline.
"""

from __future__ import annotations

import copy
import io
import pickle
import shutil
import struct
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.integrity.checksums import checksum, write_file_with_checksum
from dist_checkpointing.storage import PosixStorage
from dist_checkpointing.storage.buffers import WRITE_BUFFER_BYTES
from dist_checkpointing.strategies.filesystem_async import write_file
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, read_metadata
from dist_checkpointing.strategies.torch_dist.torch_blob import read_tensor_header
from dist_checkpointing.tools import validate_checkpoint

from .conftest import get_pool
from .helpers import assert_all_raise, flip_byte

N = 1024  # elements per saved chunk of "w" (two chunks)
SAVED_WORLD = 2


def _values() -> torch.Tensor:
    return torch.arange(SAVED_WORLD * N, dtype=torch.float32) * 0.5


def _save(rank, world, ckpt):
    dc.save({"w": ShardedTensor.from_rank_offsets("w", _values().chunk(world)[rank].clone(), (0, rank, world)),
             "o": ShardedObject("obj", {"rank": rank, "blob": list(range(50))}, (world,), (rank,)),
             "step": 7}, ckpt)


def _load(rank, world, ckpt, verify=True):
    """Each rank loads its share of ``w`` and of the objects (world 1: everything)."""
    strategy = TorchDistLoadShardedStrategy(verify_checksums=verify)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(SAVED_WORLD * N // world), (0, rank, world)),
               "o": [ShardedObject("obj", None, (SAVED_WORLD,), (r,))
                     for r in range(SAVED_WORLD) if r % world == rank]}
    out = dc.load(request, ckpt, sharded_strategy=strategy)
    assert torch.equal(out["w"], _values().chunk(world)[rank])
    assert [o["rank"] for o in out["o"]] == [r for r in range(SAVED_WORLD) if r % world == rank]
    return True


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("record_checksums") / "clean"
    get_pool(SAVED_WORLD).run(_save, str(ckpt))
    return ckpt


def _copy(clean: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(clean, ckpt)
    return ckpt


def _location(ckpt: Path, fqn: str):
    """``(index, storage)`` of rank 0's item under ``fqn`` (chunk at 0 / shard 0)."""
    md = read_metadata(ckpt)
    index = next(i for i in md.storage_data
                 if (i.fqn == fqn and tuple(i.offset or (0,)) == (0,)) or i.fqn.startswith(f"{fqn}/shard_0_"))
    return index, md.storage_data[index]


def _payload_start(blob: bytes, info: zipfile.ZipInfo) -> int:
    name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len


def _tensor_record_positions(blob: bytes) -> dict:
    """A byte inside each region of a ``torch.save`` blob, by region."""
    infos = {i.filename: i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist()}
    pkl = next(i for n, i in infos.items() if n.endswith("/data.pkl"))
    data = next(i for n, i in infos.items() if "/data/" in n)
    after = min((i for i in infos.values() if i.header_offset > data.header_offset), key=lambda i: i.header_offset)
    padding = after.header_offset + 30 + len(after.filename) + 4  # the next record's alignment padding
    assert blob[padding:padding + 1] == b"Z"
    pkl_start = _payload_start(blob, pkl)
    return {
        "local_header": pkl.header_offset + 30 + 3,  # a letter of the record's file name
        "data_pkl": pkl_start + blob[pkl_start:pkl_start + pkl.file_size].index(b"cpu"),  # parses either way
        "tensor_data": _payload_start(blob, data) + data.file_size // 2,
        "padding_after_data": padding,
        "central_directory": blob.rindex(b"PK\x01\x02") + 46 + 3,
        "end_record": blob.rindex(b"PK\x05\x06") + 4,
    }


def _damage(ckpt: Path, region: str):
    """Flip one byte of rank 0's record in ``region``; returns (key fragment, data file)."""
    if region == "object":
        _, storage = _location(ckpt, "obj")
        flip_byte(ckpt / storage.relative_path, storage.offset + storage.length // 2)
        return "obj/shard_0_", storage.relative_path
    _, storage = _location(ckpt, "w")
    path = ckpt / storage.relative_path
    blob = path.read_bytes()[storage.offset:storage.offset + storage.length]
    flip_byte(path, storage.offset + _tensor_record_positions(blob)[region])
    return "'w'", storage.relative_path


REGIONS = ["local_header", "data_pkl", "tensor_data", "padding_after_data", "central_directory", "end_record",
           "object"]


@pytest.mark.parametrize("region", REGIONS)
def test_flipped_byte_anywhere_in_a_record_is_detected(clean, region, tmp_path):
    ckpt = _copy(clean, tmp_path)
    key, fname = _damage(ckpt, region)
    for world in (1, 2):
        assert_all_raise(get_pool(world).run_expect_error(_load, str(ckpt)), world, key, fname)
    report = validate_checkpoint(ckpt)
    assert not report.ok
    assert any(key in p and fname in p for p in report.problems), report.problems


def test_writer_checksums_are_those_of_whole_records(tmp_path):
    """Hashed write by write as they are staged, the checksums equal the one-shot digest
    of each record: small ones, one that straddles two write buffers, bytes payloads."""
    payloads = [torch.arange(10.0), b"x" * 100, torch.ones(WRITE_BUFFER_BYTES - 1000, dtype=torch.uint8),
                torch.arange(3, dtype=torch.int64), torch.empty(0), b"y" * (70 << 10)]
    spans = write_file(PosixStorage(tmp_path), "f", payloads)
    raw = (tmp_path / "f").read_bytes()
    assert sum(length for _, length, _ in spans) == len(raw)
    assert [checksum(raw[offset:offset + length]) for offset, length, _ in spans] == [cs for _, _, cs in spans]


def test_undamaged_checkpoint_loads_and_validates(clean):
    for world in (1, 2):
        assert get_pool(world).run(_load, str(clean)) == [True] * world
    assert validate_checkpoint(clean).ok
    table = read_metadata(clean).checksums
    assert table["scope"] == "record" and len(table["items"]) == 4


def _data_only_checksums(ckpt: Path) -> None:
    """Rewrite the checksum table as older versions wrote it: no scope, a tensor's checksum
    over its data bytes only."""
    md = copy.copy(read_metadata(ckpt))
    items = {}
    for index, storage in md.storage_data.items():
        file = PosixStorage(ckpt).open_reader(storage.relative_path)
        try:
            header = read_tensor_header(file, storage.offset, storage.length) if index.offset is not None else None
            if header is None:
                data = file.read(storage.offset, storage.length)
            else:
                data = file.read(header.data_offset, header.span_elements() * header.dtype.itemsize)
        finally:
            file.close()
        items[(storage.relative_path, storage.offset)] = checksum(data)
    md.checksums = {"algorithm": "xxh3_64", "items": items}
    write_file_with_checksum(ckpt, ".metadata", pickle.dumps(md))


def test_data_only_checksums_of_older_checkpoints_still_verify(clean, tmp_path):
    ckpt = _copy(clean, tmp_path)
    _data_only_checksums(ckpt)
    for world in (1, 2):
        assert get_pool(world).run(_load, str(ckpt)) == [True] * world
    assert validate_checkpoint(ckpt).ok
    key, fname = _damage(ckpt, "tensor_data")
    for world in (1, 2):
        assert_all_raise(get_pool(world).run_expect_error(_load, str(ckpt)), world, "Checksum mismatch", key, fname)
    assert not validate_checkpoint(ckpt).ok


def _partial_request():
    """Elements N/4 .. N/2 of chunk 0 only (a resharding read of part of a stored chunk)."""
    data = torch.zeros(N // 4)
    return {"w": ShardedTensor("w", data, torch.float32, (N // 4,), (SAVED_WORLD * N,), (N // 4,), None)}


@pytest.mark.parametrize("region", ["tensor_data", "padding_after_data", "central_directory"])
def test_partial_read_verifies_the_whole_record(clean, region, tmp_path):
    ckpt = _copy(clean, tmp_path)
    out = dc.load(_partial_request(), ckpt)
    assert torch.equal(out["w"], _values()[N // 4:N // 2])
    _, storage = _location(ckpt, "w")
    blob = (ckpt / storage.relative_path).read_bytes()[storage.offset:storage.offset + storage.length]
    position = _tensor_record_positions(blob)[region]
    if region == "tensor_data":  # outside the requested elements
        position = _payload_start(blob, next(i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist()
                                             if "/data/" in i.filename)) + 4 * N - 3
    flip_byte(ckpt / storage.relative_path, storage.offset + position)
    with pytest.raises(CheckpointingException, match="Checksum mismatch for tensor 'w'"):
        dc.load(_partial_request(), ckpt)
    unverified = TorchDistLoadShardedStrategy(verify_checksums=False)  # the damage is outside what is needed
    assert torch.equal(dc.load(_partial_request(), ckpt, sharded_strategy=unverified)["w"], _values()[N // 4:N // 2])


def _craft_storage(ckpt: Path, fqn: str, offset=None, length=None) -> None:
    md = copy.deepcopy(read_metadata(ckpt))
    index, storage = _location(ckpt, fqn)
    size = (ckpt / storage.relative_path).stat().st_size
    md.storage_data[index].offset = size + 10 if offset == "past_eof" else (offset if offset is not None else storage.offset)
    md.storage_data[index].length = length if length is not None else storage.length
    write_file_with_checksum(ckpt, ".metadata", pickle.dumps(md))


@pytest.mark.parametrize("fqn", ["w", "obj"])
@pytest.mark.parametrize("claim", ["past_eof", "huge_length", "negative_offset"])
def test_claimed_byte_ranges_are_checked_before_reading(clean, fqn, claim, tmp_path):
    ckpt = _copy(clean, tmp_path)
    _craft_storage(ckpt, fqn, **{"past_eof": {"offset": "past_eof"}, "huge_length": {"length": 1 << 40},
                                  "negative_offset": {"offset": -1}}[claim])
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointingException) as info:
            _load(0, 1, ckpt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 10
    assert peak < 16 << 20, peak
    assert fqn in str(info.value)
    assert not validate_checkpoint(ckpt).ok


def test_record_sizes_inside_a_blob_are_bounded_by_the_blob(clean, tmp_path):
    """A central directory that claims a 2 GiB ``data.pkl``: refused without reading it,
    also with checksum verification off."""
    ckpt = _copy(clean, tmp_path)
    _, storage = _location(ckpt, "w")
    path = ckpt / storage.relative_path
    blob = path.read_bytes()[storage.offset:storage.offset + storage.length]
    entry = blob.index(b"PK\x01\x02")
    assert blob[entry + 46:entry + 46 + 16] == b"archive/data.pkl"
    with open(path, "r+b") as f:
        f.seek(storage.offset + entry + 20)  # compressed and uncompressed sizes
        f.write(struct.pack("<II", 0x7FFFFFF0, 0x7FFFFFF0))
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointingException, match="'w'.*damaged.*extends past the blob"):
            _load(0, 1, ckpt, verify=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
