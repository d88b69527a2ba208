"""The tools writing to URLs, against a real SeaweedFS server (``tests/s3_server.py``):
``export`` (safetensors, single and sharded, and the torch format) and ``convert`` into
``s3://`` prefixes, through the API and the command line; an occupied prefix refused unless
forced (the old output then replaced); a failure in the middle (a damaged source, the
server failing every upload of one file) leaves nothing that looks complete and no
unfinished upload; and the same through fsspec (``memory://``)."""

from __future__ import annotations

import io
import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.tools.convert import convert_checkpoint
from dist_checkpointing.storage import storage_for
from dist_checkpointing.tools import OutputExistsError, export_checkpoint, validate_checkpoint

from .helpers import flip_byte
from .s3_server import FaultProxy
from .test_s3_faults import _FAST
from .test_s3_storage import _unfinished_uploads, _wait_for
from .test_tools import _storage

pytest.importorskip("obstore")
safetensors_torch = pytest.importorskip("safetensors.torch")

INDEX = "model.safetensors.index.json"


def _url(s3_server) -> str:
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:10]}"


def _options(s3_server, endpoint: str = "") -> dict:
    """The server's settings as storage options (small retry budget), optionally through a proxy."""
    return {**_FAST, "endpoint": endpoint or s3_server.endpoint_url, "access_key_id": s3_server.access_key,
            "secret_access_key": s3_server.secret_key, "region": s3_server.region,
            "client_options": {**_FAST["client_options"], "allow_http": True}}


EXPECTED = {
    "model.a": torch.arange(24.0).reshape(4, 6),
    "model.b": torch.arange(10, dtype=torch.bfloat16),
    "model.c": torch.arange(64, dtype=torch.int32).reshape(8, 8),
}


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A local checkpoint of EXPECTED (``model.a`` saved flattened) and an object."""
    a = EXPECTED["model.a"]
    state = {
        "a0": ShardedTensor.from_rank_offsets_flat("model.a", a.flatten()[:10].clone(), (4, 6), (0, 0, 1),
                                                   flattened_range=slice(0, 10)),
        "a1": ShardedTensor.from_rank_offsets_flat("model.a", a.flatten()[10:].clone(), (4, 6), (0, 0, 1),
                                                   flattened_range=slice(10, 24)),
        "b": ShardedTensor.from_rank_offsets("model.b", EXPECTED["model.b"].clone()),
        "c": ShardedTensor.from_rank_offsets("model.c", EXPECTED["model.c"].clone()),
        "o": ShardedObject("rng", {"seed": 3}, (1,), (0,)),
        "step": 11,
    }
    dc.save(state, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _safetensors_at(url: str) -> dict:
    """Every tensor of the safetensors files stored at ``url``."""
    storage = storage_for(url)
    out = {}
    for name in storage.list():
        if name.endswith(".safetensors"):
            out.update(safetensors_torch.load(storage.read_bytes(name)))
    return out


def _assert_expected(got: dict) -> None:
    assert sorted(got) == sorted(EXPECTED)
    for key, value in EXPECTED.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


# ----------------------------------------------------------------------------- export


def test_export_to_url_single_sharded_and_torch(ckpt, s3_server, s3_env):
    url = _url(s3_server)
    assert export_checkpoint(ckpt, url) == [f"{url}/model.safetensors"]
    assert storage_for(url).list() == ["model.safetensors"]
    _assert_expected(_safetensors_at(url))

    sharded = _url(s3_server)
    files = export_checkpoint(ckpt, sharded, max_shard_bytes=100)
    names = storage_for(sharded).list()
    assert files == [f"{sharded}/{n}" for n in names] and len(names) == 4 and names[-1] == INDEX
    index = json.loads(storage_for(sharded).read_bytes(INDEX))
    assert sorted(index["weight_map"]) == sorted(EXPECTED) and set(index["weight_map"].values()) == set(names[:-1])
    _assert_expected(_safetensors_at(sharded))

    obj = f"{_url(s3_server)}/sub/full.pt"
    assert export_checkpoint(ckpt, obj, format="torch", key_prefix="model.b") == [obj]
    parent, name = obj.rsplit("/", 1)
    state = torch.load(io.BytesIO(storage_for(parent).read_bytes(name)), weights_only=True)
    assert list(state) == ["model.b"] and torch.equal(state["model.b"], EXPECTED["model.b"])
    # a URL source exported to a URL
    src, again = _url(s3_server), _url(s3_server)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(5.0))}, src)
    export_checkpoint(src, again)
    assert torch.equal(_safetensors_at(again)["w"], torch.arange(5.0))


def test_export_refuses_an_occupied_output_unless_forced(ckpt, s3_server, s3_env):
    url = _url(s3_server)
    storage = storage_for(url)
    storage.write_atomic("keep.txt", b"precious")
    with pytest.raises(OutputExistsError, match=url):
        export_checkpoint(ckpt, url)
    assert storage.list() == ["keep.txt"] and storage.read_bytes("keep.txt") == b"precious"
    export_checkpoint(ckpt, url, max_shard_bytes=100, force=True)  # the old objects go
    assert len(storage.list()) == 4 and INDEX in storage.list()
    export_checkpoint(ckpt, url, force=True)  # a sharded export replaced by one file
    assert storage.list() == ["model.safetensors"]
    _assert_expected(_safetensors_at(url))
    storage.write_atomic("sub/x", b"x")
    with pytest.raises(CheckpointingException, match="sub is not a file"):
        export_checkpoint(ckpt, url, force=True)
    assert storage.list() == ["model.safetensors", "sub"]  # nothing deleted
    # the torch format: an existing object is replaced only with force; a prefix is no object
    obj = f"{url}/model.safetensors"
    with pytest.raises(OutputExistsError, match=obj):
        export_checkpoint(ckpt, obj, format="torch")
    export_checkpoint(ckpt, obj, format="torch", force=True)
    assert set(torch.load(io.BytesIO(storage.read_bytes("model.safetensors")), weights_only=True)) == set(EXPECTED)
    with pytest.raises(CheckpointingException, match="prefix that holds objects"):
        export_checkpoint(ckpt, url, format="torch", force=True)
    with pytest.raises(CheckpointingException, match="URL of an object"):
        export_checkpoint(ckpt, f"s3://{s3_server.bucket}", format="torch")


def test_a_failed_export_leaves_nothing_that_looks_complete(ckpt, s3_server, no_aws_env):
    """The server fails every upload of the second shard (beyond the retry budget), or the
    source is damaged: the export raises naming the object, leaves no index, no file and no
    unfinished upload; a forced export over an old one fails the same way."""
    def fail_second_shard(method, target, n):
        return "500" if "model-00002" in target and method in ("PUT", "POST") else None

    with FaultProxy(s3_server.ports["s3"], fail_second_shard) as proxy:
        options = _options(s3_server, proxy.endpoint_url)
        url = _url(s3_server)
        with pytest.raises(CheckpointingException, match=f"{url}/model-00002-of-00003.safetensors"):
            export_checkpoint(ckpt, url, max_shard_bytes=40, storage_options=options)
        assert proxy.count("500") >= 4  # the first attempt and the retries
    storage = storage_for(url, _options(s3_server))
    assert storage.list() == []
    assert _wait_for(lambda: _unfinished_uploads(s3_server) == []), _unfinished_uploads(s3_server)

    damaged = ckpt.parent / "damaged"
    shutil.copytree(ckpt, damaged)
    _flip_tensor_of(damaged)
    export_checkpoint(ckpt, url, storage_options=_options(s3_server))
    with pytest.raises(CheckpointingException, match="model.c"):
        export_checkpoint(damaged, url, max_shard_bytes=40, force=True, storage_options=_options(s3_server))
    assert storage.list() == []  # the old export was deleted first, the new one's files after the failure


def _flip_tensor_of(d: Path) -> None:
    """Damage one byte of ``model.c`` (the last tensor: earlier shards are written first)."""
    _, info = _storage(d, "model.c")
    flip_byte(d / info.relative_path, info.offset + info.length // 2)


# ----------------------------------------------------------------------------- convert


def test_convert_to_url(ckpt, s3_server, no_aws_env):
    options = _options(s3_server)
    url = _url(s3_server)
    result = convert_checkpoint(ckpt, url, storage_options=options)
    assert (result.tensors, result.flattened, result.objects) == (3, 1, 2)
    storage = storage_for(url, options)
    assert ".save_claim" not in storage.list() and "metadata.json" in storage.list()
    _assert_expected(dc.load_plain_tensors(storage))
    assert dc.load_common_state_dict(storage)["step"] == 11
    assert validate_checkpoint(url, storage_options=options).ok
    with pytest.raises(OutputExistsError, match=url):
        convert_checkpoint(ckpt, url, storage_options=options)
    # a URL source, converted over the old output
    convert_checkpoint(url, url + "-2", storage_options=options)
    convert_checkpoint(url + "-2", url, force=True, storage_options=options)
    _assert_expected(dc.load_plain_tensors(storage))


def test_a_failed_convert_leaves_nothing_that_loads(ckpt, s3_server, no_aws_env):
    url = _url(s3_server)
    convert_checkpoint(ckpt, url, storage_options=_options(s3_server))

    def fail_data(method, target, n):
        return "503" if ".distcp" in target and method in ("PUT", "POST") else None

    with FaultProxy(s3_server.ports["s3"], fail_data) as proxy:
        with pytest.raises(CheckpointingException, match=f"{url}/__0_0.distcp"):
            convert_checkpoint(ckpt, url, force=True, storage_options=_options(s3_server, proxy.endpoint_url))
    storage = storage_for(url, _options(s3_server))
    assert not dc.check_is_distributed_checkpoint(storage)
    with pytest.raises(CheckpointingException, match="not a distributed checkpoint|incomplete"):
        dc.load_plain_tensors(storage)
    assert _wait_for(lambda: _unfinished_uploads(s3_server) == []), _unfinished_uploads(s3_server)
    convert_checkpoint(ckpt, url, force=True, storage_options=_options(s3_server))  # works again
    _assert_expected(dc.load_plain_tensors(storage))


# ----------------------------------------------------------------------------- command line, fsspec


def test_cli_export_and_convert_to_urls(ckpt, s3_server, no_aws_env, capsys):
    flags = [f"--storage-option={k}={v}" for k, v in _options(s3_server).items()
             if k in ("endpoint", "access_key_id", "secret_access_key", "region")]
    flags.append("--storage-option=client_options.allow_http=true")
    url = _url(s3_server)
    assert main(["export", str(ckpt), url, *flags]) == 0
    assert capsys.readouterr().out.split() == [f"{url}/model.safetensors"]
    assert main(["export", str(ckpt), url, *flags]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(ckpt), url, "--force", "--format", "torch", *flags]) == 1  # a prefix, not an object
    assert "prefix that holds objects" in capsys.readouterr().err
    converted = _url(s3_server)
    assert main(["convert", str(ckpt), converted, *flags]) == 0
    assert "3 tensors" in capsys.readouterr().out
    assert main(["validate", converted, *flags]) == 0
    assert main(["convert", converted, url, *flags]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", converted, url, "--force", *flags]) == 0
    assert f"{url}: 3 tensors" in capsys.readouterr().out
    assert main(["inspect", url, "--json", *flags]) == 0
    assert sorted(t["key"] for t in json.loads(capsys.readouterr().out)["tensors"]) == sorted(EXPECTED)


def test_export_and_convert_through_fsspec(ckpt):
    pytest.importorskip("fsspec")
    root = f"memory://dist-ckpt-tools/{uuid.uuid4().hex[:10]}"
    export_checkpoint(ckpt, f"{root}/hf", max_shard_bytes=100)
    assert storage_for(f"{root}/hf").list()[-1] == INDEX
    _assert_expected(_safetensors_at(f"{root}/hf"))
    convert_checkpoint(ckpt, f"{root}/converted")
    _assert_expected(dc.load_plain_tensors(f"{root}/converted"))
    with pytest.raises(OutputExistsError):
        convert_checkpoint(ckpt, f"{root}/converted")
