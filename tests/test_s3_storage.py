"""The S3 storage (``s3://bucket/prefix`` through obstore) against a real SeaweedFS server
(``tests/s3_server.py``; skipped when SeaweedFS or obstore is not installed): the protocol's
contract, multipart uploads and their abort, exclusive creation, prefixes as directories, and
whole saves and loads at world 1 and 2."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
import uuid

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.storage import storage_for

from .conftest import get_pool
from .helpers import slack
from .s3_server import FaultProxy
from .test_storage import check_storage_contract, check_subdirectory

pytest.importorskip("obstore")
from dist_checkpointing.storage import s3_reader  # noqa: E402
from dist_checkpointing.storage.s3 import PART_BYTES, S3Storage  # noqa: E402

_TIMEOUT = 120.0


def _url(s3_server, name: str = "") -> str:
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:10]}{name}"


def _unfinished_uploads(s3_server) -> list:
    """The multipart uploads in progress (SeaweedFS keeps them under the bucket's .uploads/
    in its filer)."""
    req = urllib.request.Request(f"http://127.0.0.1:{s3_server.ports['filer']}/buckets/{s3_server.bucket}/.uploads/",
                                 headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=slack(10)) as resp:
        return json.loads(resp.read())["Entries"] or []


def _wait_for(condition, seconds: float = 30.0) -> bool:
    """Whether ``condition()`` becomes true within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_s3_storage_contract(s3_server, s3_env):
    storage = storage_for(_url(s3_server))
    assert isinstance(storage, S3Storage) and storage.kind() is None
    check_storage_contract(storage)
    assert storage.list() == ["data", "small"] and storage.info("dropped") is None  # the aborted upload left nothing
    assert storage.describe("data") == f"s3://{s3_server.bucket}/{storage.prefix}/data"
    check_subdirectory(storage)


def test_multipart_upload_of_several_parts_and_its_abort(s3_server, s3_env, monkeypatch):
    storage = S3Storage(_url(s3_server))
    data = torch.randint(0, 255, (2 * PART_BYTES + 12345,), dtype=torch.uint8).numpy().tobytes()
    stream = storage.create_stream("big")
    for i in range(0, len(data), 3 << 20):  # writes that straddle the parts
        stream.write(memoryview(data)[i:i + (3 << 20)])
    stream.close()
    assert storage.info("big").size == len(data) and storage.read_bytes("big") == data
    reader = storage.open_reader("big")
    buf = bytearray(PART_BYTES)
    assert reader.readinto(buf, PART_BYTES - 7) == PART_BYTES and buf == data[PART_BYTES - 7:2 * PART_BYTES - 7]
    whole = bytearray(len(data) + 10)
    assert reader.readinto(whole, 0) == len(data) and whole[:len(data)] == data  # three parts, fetched in parallel
    reader.close()
    monkeypatch.setattr(s3_reader, "PARTS_IN_FLIGHT", 2)
    reader = storage.open_reader("big")
    assert reader.readinto(whole, 0) == 2 * PART_BYTES  # at most PARTS_IN_FLIGHT parts per call
    reader.close()
    # read front to back in 1 MiB pieces (as a checksummed record is), by several threads:
    # each piece comes from a shared block of PART_BYTES fetched once, the end from a small block
    reader, got, gets = storage.open_reader("big"), bytearray(len(data)), []
    obstore = s3_reader._obstore()

    class CountingObstore:
        def __getattr__(self, name):
            return getattr(obstore, name)

        def get_range(self, *args, **kwargs):
            gets.append((kwargs["start"], kwargs["length"]))
            return obstore.get_range(*args, **kwargs)

    monkeypatch.setattr(s3_reader, "_obstore", CountingObstore)

    _read_by_threads(reader, got, 0, lambda first: range(first << 20, len(data), 4 << 20))
    assert got == data and sorted(gets) == [(0, PART_BYTES), (PART_BYTES, PART_BYTES), (2 * PART_BYTES, 12345)]
    reader.close()
    monkeypatch.undo()

    stream = storage.create_stream("aborted")
    stream.write(data)
    assert _wait_for(lambda: _unfinished_uploads(s3_server) != []), "the multipart upload was never started"
    stream.abort()
    # SeaweedFS's filer may drop the aborted upload's folder a moment after the abort returns
    assert _wait_for(lambda: _unfinished_uploads(s3_server) == []), _unfinished_uploads(s3_server)
    assert storage.info("aborted") is None


def test_large_writes_are_sent_from_the_callers_memory(s3_server, s3_env, monkeypatch):
    """Writes of several sizes from several positions: a write reaching a part past the
    position is sent from its own memory up to its last part boundary (the parts mix copied
    and direct bytes), and write() returns only once that memory is no longer needed."""
    storage = S3Storage(_url(s3_server))
    # the last two: up to a part boundary, then two parts from it
    sizes = [100, PART_BYTES + 5, 3 * PART_BYTES - 100, 1, 2 * PART_BYTES, PART_BYTES - 1, PART_BYTES, 5 << 20,
             PART_BYTES - 5 - (5 << 20), 2 * PART_BYTES]
    copied, direct = [], []
    stream = storage.create_stream("mixed")
    copy, send_direct = stream._copy, stream._send_direct
    monkeypatch.setattr(stream, "_copy", lambda src: copied.append(src.nbytes) or copy(src))
    monkeypatch.setattr(stream, "_send_direct", lambda src: direct.append(src.nbytes) or send_direct(src))
    expected = bytearray()
    for size in sizes:
        buf = bytearray(torch.randint(0, 255, (size,), dtype=torch.uint8).numpy().tobytes())
        expected += buf
        stream.write(buf)
        buf[:] = bytes(size)  # the caller reuses its memory as soon as write() returns
    stream.close()
    assert storage.read_bytes("mixed") == expected
    assert direct == [3 * PART_BYTES - 105, 2 * PART_BYTES - 6, 2 * PART_BYTES]
    assert sum(copied) + sum(direct) == len(expected)


def test_a_failed_direct_part_aborts_the_upload(s3_server, s3_env, monkeypatch):
    """Part 2 of the upload, sent from the caller's memory, fails beyond the retries: the
    stream raises, the upload is aborted and no object is created."""
    fail_part_2 = lambda method, target, n: "500" if method == "PUT" and "partNumber=2&" in target + "&" else None
    with FaultProxy(s3_server.ports["s3"], fail_part_2) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint_url)
        storage = S3Storage(_url(s3_server), {"retry_config": {"max_retries": 1, "retry_timeout": 10,
                                                               "backoff": {"init_backoff": 0.02, "max_backoff": 0.1}}})
        stream = storage.create_stream("failed")
        stream.write(b"x" * 100)
        with pytest.raises(OSError, match="500|Internal"):
            stream.write(bytes(3 * PART_BYTES))  # parts 1 (mixed), 2 and 3 (direct)
            stream.close()
        stream.abort()
        assert proxy.count("500") >= 2  # the first attempt and the retry
        assert _wait_for(lambda: _unfinished_uploads(s3_server) == []), _unfinished_uploads(s3_server)
        assert storage.info("failed") is None


def test_a_range_announced_by_one_thread_is_fetched_concurrently(s3_server, s3_env, monkeypatch):
    """After will_read(), one thread reading 1 MiB pieces (as a checksummed record is read)
    gets pieces of PART_BYTES fetched in parallel: the first two GETs wait for each other."""
    storage = S3Storage(_url(s3_server))
    data = torch.randint(0, 255, (3 * PART_BYTES + 12345,), dtype=torch.uint8).numpy().tobytes()
    storage.write_atomic("big", data)
    obstore, gets, both_in_flight = s3_reader._obstore(), [], threading.Barrier(2, timeout=slack(20))

    class CountingObstore:
        def __getattr__(self, name):
            return getattr(obstore, name)

        def get_range(self, *args, **kwargs):
            gets.append((kwargs["start"], kwargs["length"]))
            if len(gets) <= 2:
                both_in_flight.wait()  # raises BrokenBarrierError if the GETs ran one after another
            return obstore.get_range(*args, **kwargs)

    monkeypatch.setattr(s3_reader, "_obstore", CountingObstore)
    reader, got = storage.open_reader("big"), bytearray(len(data) - 100)
    reader.will_read(100, len(got))
    view, done = memoryview(got), 0
    while done < len(got):
        done += reader.readinto(view[done:done + (1 << 20)], 100 + done)
    reader.close()
    assert got == data[100:]
    assert sorted(gets) == [(100 + k * PART_BYTES, min(PART_BYTES, len(got) - k * PART_BYTES)) for k in range(4)]


def _read_by_threads(reader, got: bytearray, start: int, offsets_of) -> None:
    """4 threads fill ``got`` (the object's bytes from ``start``) by ``readinto`` of 1 MiB
    pieces: thread ``t`` reads the pieces at the object offsets ``offsets_of(t)``."""
    def read(thread: int) -> None:
        for at in offsets_of(thread):
            view, done = memoryview(got)[at - start:at - start + (1 << 20)], 0
            while done < view.nbytes:
                done += reader.readinto(view[done:], at + done)

    threads = [threading.Thread(target=read, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class _CountingObstore:
    """obstore with its ``get_range`` calls recorded (``gets``: ``(start, length)``), the most
    running at once (``peak``), and ``held()`` sampled at each call (``held_peak``)."""

    def __init__(self, held=lambda: 0):
        self._obstore, self._held, self._lock = s3_reader._obstore(), held, threading.Lock()
        self.gets, self.running, self.peak, self.held_peak = [], 0, 0, 0

    def __getattr__(self, name):
        return getattr(self._obstore, name)

    def get_range(self, *args, **kwargs):
        with self._lock:
            self.gets.append((kwargs["start"], kwargs["length"]))
            self.running += 1
            self.peak, self.held_peak = max(self.peak, self.running), max(self.held_peak, self._held())
        try:
            time.sleep(0.02)  # (a slower server: GETs that can overlap do)
            return self._obstore.get_range(*args, **kwargs)
        finally:
            with self._lock:
                self.running -= 1


def test_a_planned_range_read_by_several_threads(s3_server, s3_env, monkeypatch):
    """A range planned with will_read_ranges and read by 4 threads in interleaved 1 MiB pieces
    (as the loader reads consecutive records): every block fetched once, several at once,
    at most SPAN_BLOCKS_KEPT held, each dropped once read to its last byte."""
    storage = S3Storage(_url(s3_server))
    data = torch.randint(0, 255, (6 * PART_BYTES + 777,), dtype=torch.uint8).numpy().tobytes()
    storage.write_atomic("big", data)
    reader = storage.open_reader("big")
    counting = _CountingObstore(lambda: len(reader._span_blocks))
    monkeypatch.setattr(s3_reader, "_obstore", lambda: counting)
    start, got = 10, bytearray(len(data) - 10)
    reader.will_read_ranges([(start, len(got))])
    pieces = list(range(start, len(data), 1 << 20))
    _read_by_threads(reader, got, start, lambda thread: pieces[thread::4])
    assert got == data[start:]
    # 6 blocks: the last takes in the rest of 767 bytes
    assert sorted(counting.gets) == [(start + k * PART_BYTES, PART_BYTES + (767 if k == 5 else 0)) for k in range(6)]
    assert counting.peak >= 2 and counting.held_peak <= s3_reader.SPAN_BLOCKS_KEPT
    assert not reader._span_blocks  # every block read to its last byte was dropped
    assert reader.read(0, 20) == data[:20]  # outside the planned range: its own GET
    reader.close()


def test_a_planned_range_hands_over_to_the_next_once_fetched(s3_server, s3_env):
    """will_read_ranges' ``then`` (the loader opens its next file there) is called once, when
    the last planned block has been started and the reads have caught up with the fetches,
    not while blocks of the range are still to be fetched."""
    storage = S3Storage(_url(s3_server))
    data = bytes(range(256)) * (6 * PART_BYTES // 256)
    storage.write_atomic("big", data)
    reader, calls = storage.open_reader("big"), []
    reader.will_read_ranges([(0, len(data))], then=lambda: calls.append(len(calls)))
    got = bytearray(len(data))
    assert calls == []  # 4 blocks in flight, 2 not started
    for at in range(0, len(data), 1 << 20):
        done, view = 0, memoryview(got)[at:at + (1 << 20)]
        while done < view.nbytes:
            done += reader.readinto(view[done:], at + done)
    assert got == data and calls == [0]
    reader.close()


def test_read_ahead_of_several_threads_is_capped(s3_server, s3_env, monkeypatch):
    """4 threads each announce (will_read) and read their own range of 4 parts: every piece
    is fetched once, and the pieces held for all of them stay within AHEAD_PIECES_KEPT (plus
    the one piece each thread needs next)."""
    storage = S3Storage(_url(s3_server))
    data = torch.randint(0, 255, (16 * PART_BYTES,), dtype=torch.uint8).numpy().tobytes()
    storage.write_atomic("big", data)
    reader = storage.open_reader("big")
    counting = _CountingObstore(lambda: reader._ahead_pieces)
    monkeypatch.setattr(s3_reader, "_obstore", lambda: counting)
    got = bytearray(len(data))

    def announced(thread: int) -> range:
        reader.will_read(thread * 4 * PART_BYTES, 4 * PART_BYTES)  # (called in the reading thread)
        return range(thread * 4 * PART_BYTES, (thread + 1) * 4 * PART_BYTES, 1 << 20)

    _read_by_threads(reader, got, 0, announced)
    assert got == data
    assert sorted(counting.gets) == [(k * PART_BYTES, PART_BYTES) for k in range(16)]
    assert counting.held_peak <= s3_reader.AHEAD_PIECES_KEPT + 4 and reader._ahead_pieces == 0
    reader.close()


def test_a_load_fetches_small_records_in_large_parallel_gets(s3_server, s3_env, monkeypatch):
    """A load plans the records it reads: 48 records of 1 MiB (and their headers), in
    two data files, arrive in GETs of PART_BYTES, several at once, each byte fetched once."""
    url, n = _url(s3_server), (1 << 20) // 4
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((n,), float(i))) for i in range(48)}
    dc.save(state, url)
    counting = _CountingObstore()
    monkeypatch.setattr(s3_reader, "_obstore", lambda: counting)
    request = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(n)) for i in range(48)}
    loaded = dc.load(request, url)
    assert all(torch.equal(loaded[f"t{i}"], torch.full((n,), float(i))) for i in range(48))
    sizes = [storage_for(url).info(name).size for name in storage_for(url).list() if name.endswith(".distcp")]
    assert sum(length for _, length in counting.gets) <= sum(sizes)
    assert len(counting.gets) <= sum(-(-size // PART_BYTES) for size in sizes) and counting.peak >= 2


def test_exclusive_create_conflict(s3_server, s3_env):
    storage = S3Storage(_url(s3_server))
    storage.create_exclusive("claim", b"first")
    with pytest.raises(FileExistsError):
        storage.create_exclusive("claim", b"second")
    assert storage.read_bytes("claim") == b"first"


def test_a_prefix_is_a_directory(s3_server, s3_env):
    base = _url(s3_server)
    S3Storage(base + "/iter_10").write_atomic("x", b"1")
    S3Storage(base + "/iter_1x").write_atomic("y", b"2")
    iter_1 = S3Storage(base + "/iter_1/")  # a trailing slash is the same prefix
    assert iter_1.list() == [] and iter_1.kind() is None and iter_1.info("x") is None
    assert S3Storage(base).list() == ["iter_10", "iter_1x"] and S3Storage(base).kind("iter_10") == "dir"
    assert S3Storage(base + "/iter_10").list() == ["x"]


def _state(rank: int, world: int, fill: float) -> dict:
    n = 5 << 20  # 20 MiB of float32 per rank: a data file of two parts, read in two requests
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((n,), fill + rank), (0, rank, world)),
        "o": ShardedObject("o", {"rank": rank, "fill": fill}, (world,), (rank,)),
        "step": 7,
    }


def _save_load(rank, world, env, url):
    os.environ.update(env)
    dc.save(_state(rank, world, 1.0), url)
    request = _state(rank, world, 0.0)
    request["w"].data.zero_()
    loaded = dc.load(request, url)
    return float(loaded["w"][0]), float(loaded["w"][-1]), loaded["o"], loaded["step"]


@pytest.mark.parametrize("world", [1, 2])
def test_save_and_load_round_trip(world, s3_server, s3_env):
    url = _url(s3_server)
    results = get_pool(world).run(_save_load, s3_server.env(), url, timeout=_TIMEOUT)
    assert results == [(1.0 + r, 1.0 + r, {"rank": r, "fill": 1.0}, 7) for r in range(world)]
    assert dc.check_is_distributed_checkpoint(url)
    assert dc.load_common_state_dict(url)["step"] == 7
    with pytest.raises(CheckpointingException, match="not empty"):
        dc.save(_state(0, 1, 2.0), url)

    # the same objects without the commit (metadata.json): nothing loads
    incomplete = S3Storage(_url(s3_server))
    for name in S3Storage(url).list():
        if name != "metadata.json":
            incomplete.write_atomic(name, S3Storage(url).read_bytes(name))
    assert not dc.check_is_distributed_checkpoint(incomplete.describe())
    with pytest.raises(CheckpointingException, match="incomplete checkpoint|not a distributed checkpoint"):
        dc.load(_state(0, 1, 0.0), incomplete.describe())


_STRADDLING = [PART_BYTES + 3, 2 * PART_BYTES - 5, 7, PART_BYTES - 1, PART_BYTES + (5 << 20)]  # bytes per rank


def _straddling_state(rank: int, world: int, seed: int) -> dict:
    """Tensors of sizes that start and end all over the parts of the data file."""
    gen = torch.Generator().manual_seed(seed + rank)
    return {f"t{i}": ShardedTensor.from_rank_offsets(
        f"t{i}", torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen), (0, rank, world))
        for i, n in enumerate(_STRADDLING)}


def _save_load_straddling(rank, world, env, url):
    os.environ.update(env)
    dc.save(_straddling_state(rank, world, 1), url)
    request = _straddling_state(rank, world, 2)
    loaded = dc.load(request, url)
    expected = _straddling_state(rank, world, 1)
    return all(torch.equal(loaded[k], expected[k].data) for k in expected)


@pytest.mark.parametrize("world", [1, 2])
def test_tensors_straddling_parts_round_trip_bit_exactly(world, s3_server, s3_env):
    results = get_pool(world).run(_save_load_straddling, s3_server.env(), _url(s3_server), timeout=_TIMEOUT)
    assert results == [True] * world


def test_missing_obstore_says_how_to_install(monkeypatch):
    for name in ("obstore", "obstore.store"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it fails
    with pytest.raises(ImportError, match=r"pip install 'dist_checkpointing\[s3\]'.*pip install -e '\.\[s3\]'"):
        storage_for("s3://bucket/prefix")
