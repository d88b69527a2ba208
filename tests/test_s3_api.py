"""``s3://`` URLs at every entry point, against a real SeaweedFS server (``tests/s3_server.py``;
skipped without SeaweedFS or obstore): the offline readers and ``remove_sharded_tensors``,
``storage_options`` over the environment, async saves (world 1 and 2, written from a thread:
obstore does not survive a fork) and an async save whose upload fails, the fully parallel
wrappers and the command line."""

from __future__ import annotations

import json
import os
import urllib.error
import uuid

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.storage import storage_for
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

from . import launch
from .conftest import get_pool
from .helpers import assert_all_raise, slack

pytest.importorskip("obstore")

_TIMEOUT = 120.0
N = 1 << 16


def _url(s3_server, bucket: str = "") -> str:
    return f"s3://{bucket or s3_server.bucket}/{uuid.uuid4().hex[:10]}"


def _options(s3_server) -> dict:
    """The server's settings as obstore S3Store options (what the environment would give)."""
    return {"endpoint": s3_server.endpoint_url, "access_key_id": s3_server.access_key,
            "secret_access_key": s3_server.secret_key, "region": s3_server.region,
            "client_options": {"allow_http": True}}


def _state(rank: int, world: int, fill: float) -> dict:
    return {
        "a": ShardedTensor.from_rank_offsets("a", torch.full((N,), fill + rank), (0, rank, world)),
        "b": {"c": ShardedTensor.from_rank_offsets("b.c", torch.full((4, N), fill), replica_id=rank)},
        "o": ShardedObject("o", {"rank": rank}, (world,), (rank,)),
        "step": 5,
    }


def test_readers_and_remove_sharded_tensors(s3_server, s3_env):
    url = _url(s3_server)
    dc.save(_state(0, 1, 1.0), url, content_metadata={"run": "x"})
    assert dc.check_is_distributed_checkpoint(url)
    assert dc.load_common_state_dict(url)["step"] == 5
    assert dc.load_content_metadata(url) == {"run": "x"}
    assert sorted(dc.load_tensors_metadata(url)) == ["a", "b.c"]
    assert sorted(dc.load_sharded_metadata(url)) == ["a", "b.c", "o/shard_0_1"]
    plain = dc.load_plain_tensors(url)
    assert torch.equal(plain["a"], torch.full((N,), 1.0)) and torch.equal(plain["b.c"], torch.full((4, N), 1.0))
    dc.remove_sharded_tensors(url, "b.")
    assert sorted(dc.load_tensors_metadata(url)) == ["a"]
    request = _state(0, 1, 0.0)
    del request["b"]
    assert float(dc.load(request, url)["a"][7]) == 1.0
    assert not dc.check_is_distributed_checkpoint(_url(s3_server))  # an empty prefix
    with pytest.raises(CheckpointingException, match="nosuch://"):
        dc.check_is_distributed_checkpoint("nosuch://bucket/x")


def test_storage_options_override_the_environment(s3_server, no_aws_env):
    url, options = _url(s3_server), _options(s3_server)
    dc.save(_state(0, 1, 3.0), url, storage_options=options)
    request = _state(0, 1, 0.0)
    assert float(dc.load(request, url, storage_options=options)["a"][0]) == 3.0
    assert dc.check_is_distributed_checkpoint(url, storage_options=options)
    assert dc.load_common_state_dict(url, storage_options=options)["step"] == 5
    assert dc.load_content_metadata(url, storage_options=options) is None
    assert sorted(dc.load_tensors_metadata(url, storage_options=options)) == ["a", "b.c"]
    assert sorted(dc.load_sharded_metadata(url, storage_options=options))[0] == "a"
    assert float(dc.load_plain_tensors(url, storage_options=options)["b.c"][3, 3]) == 3.0
    dc.remove_sharded_tensors(url, "a", storage_options=options)
    assert sorted(dc.load_tensors_metadata(url, storage_options=options)) == ["b.c"]
    # the environment alone points nowhere: refused, and nothing hangs
    bad = {**options, "secret_access_key": "wrong", "client_options": {"allow_http": True, "timeout": "5s"}}
    with pytest.raises(CheckpointingException, match=url):
        dc.load_common_state_dict(url, storage_options=bad)
    with pytest.raises(CheckpointingException, match="storage_options apply to URL locations only"):
        dc.save(_state(0, 1, 3.0), "/tmp/never-written", storage_options=options)
    with pytest.raises(CheckpointingException, match="Cannot open checkpoint location"):
        dc.load_common_state_dict(url, storage_options={"no_such_option": 1})


# ----------------------------------------------------------------------------- async

_pending: dict = {}  # per rank process: the async request between two pool calls


def _async_save_load(rank, world, env, url, fully_parallel):
    os.environ.update(env)
    save_strategy = TorchDistSaveShardedStrategy()
    if fully_parallel:
        save_strategy = FullyParallelSaveStrategyWrapper(save_strategy)
    queue = AsyncCallsQueue()
    try:
        state = _state(rank, world, 1.0)
        request = dc.save(state, url, sharded_strategy=save_strategy, async_sharded_save=True)
        state["a"].data.fill_(-1.0)  # the save holds its own copy
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    load_strategy = TorchDistLoadShardedStrategy()
    if fully_parallel:
        load_strategy = FullyParallelLoadStrategyWrapper(load_strategy)
    loaded = dc.load(_state(rank, world, 0.0), url, sharded_strategy=load_strategy)
    return float(loaded["a"][0]), float(loaded["b"]["c"][1, 2]), loaded["o"]


@pytest.mark.parametrize("world,fully_parallel", [(1, False), (2, False), (2, True)])
def test_async_save_and_load(world, fully_parallel, s3_server, s3_env):
    url = _url(s3_server)
    results = get_pool(world).run(_async_save_load, s3_server.env(), url, fully_parallel, timeout=_TIMEOUT)
    assert results == [(1.0 + r, 1.0, {"rank": r}) for r in range(world)]
    assert dc.check_is_distributed_checkpoint(url)


def _start_async_save(rank, world, env, url):
    os.environ.update(env)
    _pending["request"] = dc.save(_state(rank, world, 1.0), url, async_sharded_save=True)


def _finish_async_save(rank, world):
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(_pending.pop("request"))
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close(abort=True)


def test_async_save_whose_upload_fails(s3_server, s3_env):
    """The bucket is deleted after the save started (the directory claimed, nothing
    uploaded yet): every rank raises at finalize, naming its data object; nothing loads."""
    bucket = f"doomed-{uuid.uuid4().hex[:8]}"
    s3_server.request("PUT", f"/{bucket}")
    url = _url(s3_server, bucket)
    pool = get_pool(2)
    pool.run(_start_async_save, s3_server.env(), url, timeout=_TIMEOUT)
    storage = storage_for(url)
    for name in storage.list():
        storage.delete(name)  # (the directory claim: S3 deletes empty buckets only)
    s3_server.request("DELETE", f"/{bucket}")
    excs = pool.run_expect_error(_finish_async_save, timeout=_TIMEOUT)
    assert_all_raise(excs, 2, "__")
    for rank, e in enumerate(excs):
        assert f"{url}/__" in str(e), f"rank {rank}: {e}"
    with pytest.raises(urllib.error.HTTPError):
        s3_server.request("GET", f"/{bucket}")
    assert not dc.check_is_distributed_checkpoint(url)


_ENV_SWITCH_SCRIPT = """
import os, sys, json, torch
import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

right, url, local = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
wrong = dict(right, AWS_SECRET_ACCESS_KEY="not-the-secret")

def async_save(env, where, fill):
    os.environ.update(env)
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.full((1000,), fill))}
    queue = AsyncCallsQueue()
    try:  # "copy": written by this process's persistent writer (started by the first such save)
        strategy = TorchDistSaveShardedStrategy(async_snapshot="copy")
        queue.schedule_async_request(dc.save(state, where, sharded_strategy=strategy, async_sharded_save=True))
        queue.maybe_finalize_async_calls(blocking=True)
        return "saved"
    except CheckpointingException as e:
        return "HTTP 403" if "HTTP 403" in str(e) else str(e)
    finally:
        queue.close(abort=True)

# the writer starts under wrong credentials (a local save), then the credentials are fixed, then broken
results = [async_save(wrong, local, 1.0), async_save(right, url + "/b", 2.0), async_save(wrong, url + "/c", 3.0)]
os.environ.update(right)
loaded = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(1000))}, url + "/b")
print(json.dumps(results + [float(loaded["w"].sum())]))
"""


def test_async_save_writes_with_the_credentials_of_the_save(s3_server, tmp_path):
    """An async save's files are written by the persistent writer, started by the process's
    first such save under the environment of then: each later save is written with the AWS
    environment it was made under (credentials fixed or broken since), as a synchronous
    save would be."""
    args = [json.dumps(s3_server.env()), _url(s3_server), str(tmp_path / "local")]
    proc = launch.run(["-c", _ENV_SWITCH_SCRIPT, *args], timeout=slack(120))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout) == ["saved", "saved", "HTTP 403", 2000.0], proc.stdout


# ----------------------------------------------------------------------------- command line


def test_cli_on_urls(s3_server, no_aws_env, tmp_path, capsys):
    url = _url(s3_server)
    flags = [f"--storage-option={k}={v}" for k, v in _options(s3_server).items() if k != "client_options"]
    flags.append("--storage-option=client_options.allow_http=true")
    source = tmp_path / "model.pt"
    torch.save({"layer": {"weight": torch.arange(6.0).reshape(2, 3)}, "step": 9}, source)
    assert main(["import", str(source), url, *flags]) == 0
    assert main(["import", str(source), url, *flags]) == 1  # exists
    assert main(["import", str(source), url, "--force", *flags]) == 0
    capsys.readouterr()
    assert main(["inspect", url, "--json", *flags]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == url and [t["key"] for t in info["tensors"]] == ["layer.weight"]
    assert main(["validate", url, *flags]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["export", url, str(tmp_path / "out"), *flags]) == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["layer.weight"], torch.arange(6.0).reshape(2, 3))
    capsys.readouterr()
    exported = _url(s3_server)
    assert main(["export", url, exported, *flags]) == 0  # a URL to a URL
    assert capsys.readouterr().out.split() == [f"{exported}/model.safetensors"]
    assert main(["convert", url, str(tmp_path / "converted"), *flags]) == 0  # into a local directory
    assert "1 tensors" in capsys.readouterr().out
    assert main(["validate", str(tmp_path / "converted")]) == 0
    assert main(["convert", url, _url(s3_server), *flags]) == 0
    assert "1 tensors" in capsys.readouterr().out
    assert main(["validate", _url(s3_server), *flags]) == 1  # nothing there
    assert "does not exist" in capsys.readouterr().err
    assert main(["inspect", url]) == 1  # the environment alone points nowhere
    with pytest.raises(SystemExit):
        main(["inspect", url, "--storage-option", "novalue"])
