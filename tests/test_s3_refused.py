"""A request the S3 server refuses (wrong credentials, no such bucket) fails at once, saying
what was refused and what to check; only transient errors are retried (real SeaweedFS)."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.tools import inspect_checkpoint, validate_checkpoint

pytest.importorskip("obstore")

CASES = {
    "wrong secret": ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, None, ["HTTP 403", "credentials"]),
    "unknown key id": ({"AWS_ACCESS_KEY_ID": "nobody"}, None, ["HTTP 403", "credentials"]),
    "no such bucket": ({}, "no-such-bucket-x", ["HTTP 404 NoSuchBucket", "bucket", "AWS_ENDPOINT_URL"]),
}


@pytest.fixture(scope="module")
def saved(s3_server):
    """A checkpoint on the server (written with the right credentials)."""
    url = f"s3://{s3_server.bucket}/refused-{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_server.env().items():
            mp.setenv(name, value)
        dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, url)
    return url


def _case(name, saved, s3_env, monkeypatch):
    env, bucket, fragments = CASES[name]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    url = saved if bucket is None else saved.replace(saved.split("/")[2], bucket, 1)
    return url, fragments


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("call", ["load", "save", "inspect", "validate"])
def test_refused_requests_fail_at_once_naming_what_to_check(saved, s3_env, monkeypatch, name, call):
    url, fragments = _case(name, saved, s3_env, monkeypatch)
    start = time.monotonic()
    if call == "validate":
        report = validate_checkpoint(url)
        assert not report.ok
        message = " ".join(report.problems)
    else:
        with pytest.raises(CheckpointingException) as e:
            if call == "load":
                dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4))}, url)
            elif call == "save":
                dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, url + "-new")
            else:
                inspect_checkpoint(url)
        message = str(e.value)
    assert time.monotonic() - start < 5, "a refused request must not be retried"
    for fragment in fragments:
        assert fragment in message, message
    assert "GenericError" not in message and "[Errno" not in message


@pytest.mark.parametrize("command", ["inspect", "validate"])
def test_cli_says_what_was_refused_in_one_line(saved, s3_env, monkeypatch, capsys, command):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    assert main([command, saved]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "OSError" not in err and "\n" not in err, err
    assert "HTTP 403" in err and "credentials" in err
