"""The fsspec storage (every scheme fsspec knows but ``s3``): the protocol's contract on
``memory://`` and ``file://``, saves and loads in one process on ``memory://`` (sync and
async: an async save of a storage that is not fork-safe is written from a thread), and
across ranks on ``file://`` (``memory://`` is per process), resharded."""

from __future__ import annotations

import importlib.util
import uuid

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.storage import storage_for
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from .conftest import get_pool
from .test_storage import check_storage_contract, check_subdirectory

pytest.importorskip("fsspec")
from dist_checkpointing.storage.fsspec import FsspecStorage  # noqa: E402

N = 1000


def _memory_url() -> str:
    return f"memory://dist-ckpt-tests/{uuid.uuid4().hex[:10]}"


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_fsspec_storage_contract(scheme, tmp_path):
    url = _memory_url() if scheme == "memory" else f"file://{tmp_path}/ckpt"
    storage = storage_for(url)
    assert isinstance(storage, FsspecStorage) and storage.kind() is None and not storage.fork_safe
    check_storage_contract(storage)
    assert storage.list() == ["data", "small"]  # the aborted stream was dropped
    check_subdirectory(storage)
    assert storage.describe("data") == f"{url}/data"


def _state(rank: int, world: int, fill: float) -> dict:
    """``w`` split over ``world`` ranks along axis 0, ``o`` one object per rank."""
    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", torch.arange(rank * N // world, (rank + 1) * N // world, dtype=torch.float32) + fill, (0, rank, world)),
        "o": ShardedObject("o", {"rank": rank}, (world,), (rank,)),
        "step": 3,
    }


def test_memory_save_load_and_refusals():
    url = _memory_url()
    dc.save(_state(0, 1, 0.5), url)
    assert dc.check_is_distributed_checkpoint(url)
    request = _state(0, 1, 0.0)
    request["w"].data.zero_()
    loaded = dc.load(request, url)
    assert torch.equal(loaded["w"], torch.arange(N, dtype=torch.float32) + 0.5) and loaded["step"] == 3
    assert torch.equal(dc.load_plain_tensors(url)["w"], loaded["w"])
    with pytest.raises(CheckpointingException, match="not empty"):
        dc.save(_state(0, 1, 1.0), url)
    with pytest.raises(CheckpointingException, match="storage_options apply to URL locations only"):
        dc.load(request, storage_for(url), storage_options={"x": 1})


def test_memory_async_save_is_written_from_a_thread():
    url = _memory_url()
    queue = AsyncCallsQueue()
    try:
        state = _state(0, 1, 2.0)
        request = dc.save(state, url, async_sharded_save=True)
        state["w"].data.fill_(-1)  # the save holds its own copy
        assert not dc.check_is_distributed_checkpoint(url)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    # a forked writer's memory:// files would have stayed in the child
    assert torch.equal(dc.load_plain_tensors(url)["w"], torch.arange(N, dtype=torch.float32) + 2.0)


def _save(rank, world, url):
    dc.save(_state(rank, world, 1.0), url)


def _load(rank, world, url):
    request = {"w": _state(rank, world, 0.0)["w"]}  # (the objects' grid is the saving world's)
    request["w"].data.zero_()
    return dc.load(request, url)["w"].tolist()


@pytest.mark.parametrize("save_world,load_world", [(2, 1), (1, 2)])
def test_file_url_across_ranks_resharded(save_world, load_world, tmp_path):
    url = f"file://{tmp_path}/ckpt"
    get_pool(save_world).run(_save, url)
    results = get_pool(load_world).run(_load, url)
    full = [float(i) + 1.0 for i in range(N)]
    assert results == [full[rank * N // load_world:(rank + 1) * N // load_world] for rank in range(load_world)]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[-1] == "metadata.json"


def test_a_scheme_without_its_package_is_a_clear_error():
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    with pytest.raises(CheckpointingException, match="gs://bucket/x.*gcsfs"):
        dc.save(_state(0, 1, 0.0), "gs://bucket/x")
    with pytest.raises(CheckpointingException, match="No storage is registered for nosuch://"):
        dc.load_common_state_dict("nosuch://bucket/x")
