"""The storage layer: the POSIX implementation's contract, and saves and loads under
injected storage faults (a :class:`~tests.faulty_storage.FaultyStorage` passed where the
checkpoint directory goes): every rank raises a CheckpointingException naming the file,
nothing loads as complete, an earlier checkpoint is untouched."""

from __future__ import annotations

import errno

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.core import open_storage
from dist_checkpointing.storage import PosixStorage, Storage, register_storage, storage_for
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from dist_checkpointing.tools import inspect_checkpoint, validate_checkpoint

from .conftest import get_pool
from .faulty_storage import FaultyStorage

_TIMEOUT = 60.0
N = 1 << 16  # elements per rank: several write-buffer writes per file


def check_storage_contract(storage: Storage) -> None:
    """The protocol's contract on an empty location ``storage`` (shared with the S3 tests)."""
    assert storage.list() == [] and storage.info("data") is None
    storage.make_root()
    stream = storage.create_stream("data")
    stream.write(b"abc" * 1000)
    assert stream.tell() == 3000
    stream.close()
    assert storage.kind() == "dir"
    with pytest.raises(FileExistsError):
        storage.create_stream("data")  # a new file only
    storage.write_atomic("small", b"1")
    storage.write_atomic("small", b"22")  # replaced whole
    storage.create_exclusive("claim", b"x")
    with pytest.raises(FileExistsError):
        storage.create_exclusive("claim", b"y")
    assert storage.read_bytes("claim") == b"x"
    assert storage.read_bytes("small") == b"22"
    assert storage.read_bytes("data", max_bytes=10) == (b"abc" * 4)[:11]  # one byte more: the caller sees it is too large
    reader = storage.open_reader("data")
    buf = bytearray(4)
    assert reader.size == 3000 and reader.read(2998, 10) == b"bc" and reader.readinto(buf, 1) == 4 and buf == b"bcab"
    assert reader.readinto(bytearray(8), 3000) == 0 and reader.read(3000, 5) == b""
    mapped = reader.map()  # optional: None where the storage cannot map files
    reader.close()
    if mapped is not None:  # a private map: valid after close, writes never reach the file
        assert bytes(mapped) == b"abc" * 1000
        mapped[0] = ord("z")
        assert storage.read_bytes("data", max_bytes=3) == b"abca"
    assert storage.list() == ["claim", "data", "small"]  # no temporary files left
    assert storage.info("data").size == 3000 and storage.info("nope") is None and storage.kind("data") == "file"
    assert storage.kind("nope") is None
    version = storage.info("small").version
    storage.write_atomic("small", b"333")
    assert storage.info("small").version != version
    storage.delete("claim")
    storage.delete("claim")  # missing: nothing
    assert storage.list() == ["data", "small"]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("claim")
    stream = storage.create_stream("dropped")
    stream.write(b"x" * 100)
    stream.abort()  # the implementation's tests check what is left of "dropped"


def check_subdirectory(storage: Storage) -> None:
    """``subdirectory`` opens a directory under the root as the root was opened (run last:
    it leaves ``sub/a``)."""
    sub = storage.subdirectory("sub")
    sub.make_root()
    sub.write_atomic("a", b"a")
    again = storage.subdirectory("sub")
    assert storage.kind("sub") == "dir" and again.describe() == storage.describe("sub") and again.list() == ["a"]
    assert again.read_bytes("a") == b"a" and storage.read_bytes("sub/a") == b"a"


@pytest.mark.parametrize("buffered", [True, False])
def test_posix_storage_contract(buffered, tmp_path):
    storage = PosixStorage(tmp_path / "ckpt", buffered=buffered)
    assert storage.kind() is None
    check_storage_contract(storage)
    reader = storage.open_reader("data")
    assert reader.map() is not None  # POSIX maps files
    reader.close()
    assert storage.list() == ["data", "dropped", "small"]  # an aborted stream leaves its partial file
    check_subdirectory(storage)
    assert storage.subdirectory("sub").durable == storage.durable


def test_storage_for_locations(tmp_path):
    assert isinstance(storage_for(tmp_path), PosixStorage) and storage_for(str(tmp_path)).describe() == str(tmp_path)
    faulty = FaultyStorage(tmp_path)
    assert storage_for(faulty) is faulty
    with pytest.raises(CheckpointingException, match="nosuch://"):
        open_storage("nosuch://bucket/prefix")
    register_storage("faultytest", lambda location: FaultyStorage(tmp_path / location.split("://", 1)[1]))
    assert isinstance(storage_for("faultytest://x"), Storage)


def _state(rank: int, world: int, fill: float = 1.0) -> dict:
    data = torch.full((N,), fill + rank)
    return {
        "w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world)),
        "o": ShardedObject("o", {"rank": rank, "fill": fill}, (world,), (rank,)),
        "step": 7,
    }


def _save(rank, world, ckpt, fill, fault=None):
    location = FaultyStorage(ckpt, *fault) if fault is not None else ckpt
    dc.save(_state(rank, world, fill), location, sharded_strategy=TorchDistSaveShardedStrategy(thread_count=1))
    return True


def _load(rank, world, ckpt, fault=None):
    location = FaultyStorage(ckpt, *fault) if fault is not None else ckpt
    request = _state(rank, world, 0.0)
    request["w"].data.zero_()
    loaded = dc.load(request, location)
    return float(loaded["w"][0]), loaded["o"]["fill"], loaded["step"]


# (op, file pattern, nth): a data write of rank 1 (the third write into its file), the
# durable close (fsync) of rank 1's data file, its creation, rank 0's .metadata,
# common.pt, and the commit (metadata.json)
SAVE_FAULTS = {
    "data write": (("stream_write", "__1_0.distcp", 3), "__1_0.distcp"),
    "data fsync": (("stream_close", "__1_0.distcp", 1), "__1_0.distcp"),
    "data create": (("create", "__1_0.distcp", 1), "__1_0.distcp"),
    "metadata write": (("write_atomic", ".metadata", 1), ".metadata"),
    "common state write": (("write_atomic", "common.pt", 1), "common.pt"),
    "commit": (("write_atomic", "metadata.json", 1), "metadata.json"),
}


@pytest.mark.parametrize("case", list(SAVE_FAULTS))
def test_save_fault_fails_everywhere_and_commits_nothing(case, tmp_path):
    fault, fname = SAVE_FAULTS[case]
    pool = get_pool(2)
    earlier, ckpt, later = tmp_path / "earlier", tmp_path / "ckpt", tmp_path / "later"
    pool.run(_save, str(earlier), 1.0, timeout=_TIMEOUT)
    excs = pool.run_expect_error(_save, str(ckpt), 2.0, fault, timeout=_TIMEOUT)
    for rank, e in enumerate(excs):
        assert isinstance(e, CheckpointingException), f"rank {rank}: {e!r}"
        assert fname in str(e) and "injected" in str(e), f"rank {rank}: {e}"
    assert not dc.check_is_distributed_checkpoint(ckpt)
    with pytest.raises(CheckpointingException, match="incomplete checkpoint|not a distributed checkpoint"):
        dc.load_common_state_dict(ckpt)
    assert pool.run(_load, str(earlier), timeout=_TIMEOUT) == [(1.0, 1.0, 7), (2.0, 1.0, 7)]
    pool.run(_save, str(later), 3.0, timeout=_TIMEOUT)  # the group and the library still work
    assert pool.run(_load, str(later), timeout=_TIMEOUT) == [(3.0, 3.0, 7), (4.0, 3.0, 7)]


@pytest.mark.parametrize("fault,fragment", [
    (("read", "__0_0.distcp", 1), "injected read fault"),
    (("read", "__0_0.distcp", 3), "injected read fault"),
    (("short_read", "__0_0.distcp", 1), "__0_0.distcp"),
    (("read", "common.pt", 1), "injected read fault"),
])
def test_load_fault_names_the_file_on_every_rank(fault, fragment, tmp_path):
    pool = get_pool(2)
    ckpt = tmp_path / "ckpt"
    pool.run(_save, str(ckpt), 1.0, timeout=_TIMEOUT)
    excs = pool.run_expect_error(_load, str(ckpt), fault, timeout=_TIMEOUT)
    for rank, e in enumerate(excs):
        assert isinstance(e, CheckpointingException), f"rank {rank}: {e!r}"
        assert fault[1] in str(e) and fragment in str(e), f"rank {rank}: {e}"
    assert pool.run(_load, str(ckpt), timeout=_TIMEOUT) == [(1.0, 1.0, 7), (2.0, 1.0, 7)]


def test_faults_are_os_errors_without_a_file_name(tmp_path):
    """The injected errors carry no file name: the messages above name it by themselves."""
    storage = FaultyStorage(tmp_path, "write_atomic", "x")
    with pytest.raises(OSError) as info:
        storage.write_atomic("x", b"")
    assert info.value.errno == errno.EIO and info.value.filename is None


def test_registered_scheme_carries_a_whole_save_and_load(tmp_path, monkeypatch):
    """Every byte of save, load, the offline readers, inspect and validate goes through the storage a URL
    names: a ``memtest://`` location served by a local directory elsewhere works, and
    nothing is created where the URL would point as a relative path."""
    root = tmp_path / "served"
    monkeypatch.chdir(tmp_path)
    register_storage("memtest", lambda location: PosixStorage(root / location.split("://", 1)[1]))
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0)), "gone": ShardedTensor.from_rank_offsets(
        "gone", torch.ones(2)), "o": ShardedObject("o", [1, 2], (1,), (0,)), "step": 3}
    dc.save(state, "memtest://ckpt", verify_integrity=True)
    assert dc.check_is_distributed_checkpoint("memtest://ckpt")
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8)), "o": ShardedObject("o", None, (1,), (0,))}
    loaded = dc.load(request, "memtest://ckpt", verify_integrity=True)
    assert torch.equal(loaded["w"], torch.arange(8.0)) and loaded["o"] == [1, 2] and loaded["step"] == 3
    assert dc.load_common_state_dict("memtest://ckpt")["step"] == 3
    assert set(dc.load_tensors_metadata("memtest://ckpt")) == {"w", "gone"}
    dc.remove_sharded_tensors("memtest://ckpt", "gone")
    assert set(dc.load_plain_tensors("memtest://ckpt")) == {"w"}
    assert inspect_checkpoint("memtest://ckpt").files["common.pt"] > 0
    assert validate_checkpoint("memtest://ckpt").ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]  # no "memtest:" directory
    with pytest.raises(CheckpointingException, match="not empty"):
        dc.save(state, "memtest://ckpt")
