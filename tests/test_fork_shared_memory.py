"""Fork snapshots of tensors in memory a fork does not isolate (``memory_maps``).

An async save with ``async_snapshot="fork"`` (the default) relies on copy-on-write for
private anonymous memory only; a tensor in a shared mapping (``np.memmap``,
``torch.from_file(shared=True)``, ``mmap``, ``share_memory_()``) or in a file-backed private
one (``torch.load(mmap=True)``, ``np.memmap`` mode ``c``) must be copied before the fork,
or the checkpoint holds what was written after ``save`` returned.
"""

from __future__ import annotations

import mmap
import os
import time
from unittest import mock

import numpy as np
import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedTensor
from dist_checkpointing.strategies.torch_dist import writing as torch_dist_writing
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.runtime import memory_maps
from dist_checkpointing.runtime.memory_maps import UnisolatedMemory, byte_extent, not_isolated_by_fork

from .conftest import get_pool

N = 4096  # float32 elements per rank: four pages


# ----------------------------------------------------------------------------- the detector


_MAPS = """\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
01000000-01100000 rw-p 00000000 00:00 0           [heap]
10000000-10002000 rw-s 00000000 00:05 1234        /dev/zero (deleted)
10002000-10004000 rw-p 00000000 00:00 0
20000000-20003000 rw-p 00001000 08:02 99          /data/model weights.pt
30000000-30001000 rw-s 00000000 00:01 7           /memfd:pool (deleted)
30001000-30002000 rw-s 00000000 00:00 0           /SYSV00000000 (deleted)
40000000-40010000 rw-p 00000000 00:00 0           [anon:torch]
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0   [stack]
"""


def test_parse_keeps_shared_and_file_backed_mappings():
    memory = UnisolatedMemory.parse(_MAPS)
    inside = [0x00400010, 0x10000000, 0x10001fff, 0x20000000, 0x30000800, 0x30001000]
    outside = [0x01000000, 0x10002000, 0x10003fff, 0x40000000, 0x7ffc00000000, 0x0, 0x50000000]
    assert [memory.overlaps(a, a + 1) for a in inside] == [True] * len(inside)
    assert [memory.overlaps(a, a + 1) for a in outside] == [False] * len(outside)


@pytest.mark.parametrize("start, end, expected", [
    (0x0fff0000, 0x10000001, True),     # ends one byte into a shared range
    (0x10001fff, 0x10003000, True),     # starts in its last byte
    (0x0fff0000, 0x10003000, True),     # covers it
    (0x10002000, 0x10004000, False),    # the private range right after it
    (0x0fff0000, 0x10000000, False),    # ends where it starts
    (0x1fff0000, 0x20000010, True),     # reaches into the file-backed private range
    (0x20003000, 0x30000000, False),    # the gap between two ranges
    (0x40000000, 0x7ffc00001000, False),
    (0x10000000, 0x10000000, False),    # empty
])
def test_overlap_at_the_edges(start, end, expected):
    assert UnisolatedMemory.parse(_MAPS).overlaps(start, end) is expected


def test_byte_extent_of_views():
    base = torch.zeros(10, 8, dtype=torch.float32)
    ptr = base.data_ptr()
    assert byte_extent(base) == (ptr, ptr + 320)
    assert byte_extent(base[2:4]) == (ptr + 64, ptr + 128)
    assert byte_extent(base[:, 3]) == (ptr + 12, ptr + 12 + (9 * 8 + 1) * 4)  # strided: more than nbytes
    assert byte_extent(base.t()) == (ptr, ptr + 320)
    assert byte_extent(base[0].expand(5, 8)) == (ptr, ptr + 32)
    assert byte_extent(base[3:3]) == (0, 0)


def test_unreadable_maps_copy_every_tensor(tmp_path):
    tensors = [torch.zeros(3), torch.zeros(0)]
    assert not_isolated_by_fork(tensors, maps_path=str(tmp_path / "no_such_maps")) == [True, True]
    assert not_isolated_by_fork([], maps_path=str(tmp_path / "no_such_maps")) == []


def test_this_process(tmp_path):
    path = tmp_path / "m.bin"
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="w+", shape=(N,)))
    anonymous_shared = torch.frombuffer(mmap.mmap(-1, 4 * N), dtype=torch.float32)  # MAP_SHARED
    ordinary, large = torch.zeros(N), torch.zeros(1 << 20)
    tensors = [mapped, mapped[1000:2000], mapped[::7], anonymous_shared, ordinary, large[100:],
               large.view(2, -1)[:, 5]]
    assert not_isolated_by_fork(tensors) == [True, True, True, True, False, False, False]


def test_cost_of_one_call_for_2000_tensors():
    """One read of /proc/self/maps and a binary search per tensor: ~5 ms here; the bound
    only catches a gross regression on a loaded machine."""
    tensors = [torch.empty(64 << 10 if i % 2 else 64) for i in range(2000)]
    not_isolated_by_fork(tensors)
    start = time.perf_counter()
    assert not any(not_isolated_by_fork(tensors))
    assert time.perf_counter() - start < 1.0


# ----------------------------------------------------------------------------- async fork saves


def _memmap(path, values, mode, length=N):
    np.resize(values.numpy(), length).tofile(path)
    return torch.from_numpy(np.memmap(path, dtype=np.float32, mode=mode, shape=(length,)))


def _memmap_w(path, values):
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="w+", shape=(N,)))
    return mapped.copy_(values), None


def _memmap_r(path, values):
    return _memmap(path, values, "r+"), None


def _memmap_copy_on_write(path, values):
    return _memmap(path, values, "c"), path


def _from_file_shared(path, values):
    values.numpy().tofile(path)
    return torch.from_file(str(path), shared=True, size=N, dtype=torch.float32), None


def _mmap_frombuffer(path, values):
    values.numpy().tofile(path)
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0)
    return torch.frombuffer(mapping, dtype=torch.float32), None


def _torch_load_mmap(path, values):
    torch.save({"t": values}, path)
    return torch.load(path, mmap=True)["t"], path


def _torch_load_mmap_shared(path, values):
    torch.save({"t": values}, path)
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        return torch.load(path, mmap=True)["t"], None


def _share_memory(path, values):
    return values.clone().share_memory_(), None


def _view_into_mapping(path, values):
    return _memmap(path, values, "r+", 4 * N)[N + 3:2 * N + 3].copy_(values), None


def _ordinary(path, values):
    return values.clone(), None


#: name -> fn(path, values) -> (tensor holding values, the file to rewrite in place to change
#: it, or None: change the tensor)
KINDS = {f.__name__.lstrip("_"): f for f in (
    _memmap_w, _memmap_r, _memmap_copy_on_write, _from_file_shared, _mmap_frombuffer, _torch_load_mmap,
    _torch_load_mmap_shared, _share_memory, _view_into_mapping, _ordinary)}


def _writes_wait_for(gate: str):
    """A context in which the forked writer (which inherits it) waits for ``gate`` to exist
    before it writes anything, so the caller's changes made before the gate are seen by it."""
    orig = torch_dist_writing.write_file

    def gated(*args, **kwargs):
        deadline = time.monotonic() + 30
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.002)
        return orig(*args, **kwargs)

    return mock.patch.object(torch_dist_writing, "write_file", gated)


def _change(t: torch.Tensor, rewrite) -> None:
    """Change what ``t`` holds: in memory, or (private file mapping) in the file under it."""
    if rewrite is None:
        t.fill_(-1.0)
        return
    with open(rewrite, "r+b") as f:
        content = f.read()
        f.seek(content.index(t.numpy().tobytes()))
        f.write(torch.full_like(t, -1.0).numpy().tobytes())
    assert t[0].item() == -1.0, "the test's premise: a private mapping sees the rewritten file"


def _save_change_load(rank, world, root, kind):
    path = os.path.join(root, f"{kind}_{rank}.bin")
    expected = torch.arange(N, dtype=torch.float32) + 1000 * rank
    t, rewrite = KINDS[kind](path, expected)
    assert torch.equal(t, expected)
    assert memory_maps.needs_host_copy([t]) == [kind != "ordinary"]
    ckpt, gate = os.path.join(root, "ckpt"), os.path.join(root, f"gate_{rank}")
    queue = AsyncCallsQueue()
    try:
        with _writes_wait_for(gate):
            request = dc.save({"t": ShardedTensor.from_rank_offsets("t", t, (0, rank, world))}, ckpt,
                              async_sharded_save=True)
        try:
            _change(t, rewrite)
        finally:
            open(gate, "w").close()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    loaded = dc.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(N), (0, rank, world))}, ckpt)["t"]
    assert torch.equal(loaded, expected), f"{kind}: the checkpoint holds values changed after save: {loaded[:4]}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_fork_save_holds_the_values_at_save_time(tmp_path, kind):
    if kind == "torch_load_mmap_shared" and not hasattr(torch.serialization, "set_default_mmap_options"):
        pytest.skip("this torch cannot map torch.load's file shared")
    get_pool(1).run(_save_change_load, str(tmp_path), kind)


@pytest.mark.parametrize("kind", ["memmap_r", "torch_load_mmap"])
def test_fork_save_of_mappings_on_two_ranks(pool2, tmp_path, kind):
    pool2.run(_save_change_load, str(tmp_path), kind)
