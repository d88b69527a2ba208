"""Faults of object storage, against a real SeaweedFS (``tests/s3_server.py``; skipped when
SeaweedFS or obstore is not installed): bad locations and credentials, an occupied prefix,
the server killed in the middle of a save and restarted, objects deleted, truncated or
damaged after a save, and a fault-injecting proxy in front of the server that fails
requests (retried: the save succeeds) or fails more than the retry budget (a clean error,
nothing that loads, no multipart upload left). Every error is a ``CheckpointingException``
on every rank naming the URL or the object. Short retry budgets and timeouts (storage
options) keep it quick."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor

from .conftest import get_pool
from .helpers import assert_all_raise
from .s3_server import FaultProxy, SeaweedFS, weed_binary
from .test_s3_storage import _unfinished_uploads, _wait_for

pytest.importorskip("obstore")
from dist_checkpointing.storage.s3 import PART_BYTES, S3Storage  # noqa: E402

_TIMEOUT = 120.0
# a small retry budget: a dead server is an error within seconds
_FAST = {"retry_config": {"max_retries": 3, "retry_timeout": 10,
                          "backoff": {"init_backoff": 0.02, "max_backoff": 0.2, "base": 2}},
         "client_options": {"connect_timeout": 1, "timeout": 20}}
_NUMEL = (PART_BYTES + (1 << 20)) // 4  # float32 per rank: a data file of two parts


def _url(server, name: str = "") -> str:
    return f"s3://{server.bucket}/{uuid.uuid4().hex[:10]}{name}"


def _state(rank: int, world: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.randn(_NUMEL, generator=gen), (0, rank, world)),
        "o": ShardedObject("o", {"rank": rank, "seed": seed}, (world,), (rank,)),
        "step": seed,
    }


def _location(url: str, options):
    """The checkpoint location a rank passes: the URL, or its storage with ``options``."""
    return url if options is None else S3Storage(url, options)


def _save(rank, world, env, url, seed, options=_FAST):
    os.environ.update(env)
    dc.save(_state(rank, world, seed), _location(url, options))
    return True


def _load_matches(rank, world, env, url, seed, options=_FAST):
    """Whether ``url`` loads bit-exactly as saved with ``seed``."""
    os.environ.update(env)
    expected = _state(rank, world, seed)
    request = _state(rank, world, seed + 1)
    loaded = dc.load(request, _location(url, options))
    return (torch.equal(loaded["w"], expected["w"].data) and loaded["o"] == {"rank": rank, "seed": seed}
            and loaded["step"] == seed)


def _load(rank, world, env, url, options=_FAST):
    os.environ.update(env)
    dc.load(_state(rank, world, 0), _location(url, options))


def _proxied(server, proxy) -> dict:
    return {**server.env(), "AWS_ENDPOINT_URL": proxy.endpoint_url}


def _fail_first(k: int, outcome: str, method: str, fragment: str):
    """A proxy rule: answer the first ``k`` ``method`` requests whose target holds ``fragment``
    with ``outcome``."""
    seen = []

    def rule(m, target, n):
        if m == method and fragment in target and len(seen) < k:
            seen.append(n)
            return outcome
        return None

    return rule


# ----------------------------------------------------------------------------- bad locations


@pytest.mark.parametrize("world", [1, 2])
def test_unknown_scheme_missing_bucket_and_wrong_credentials(world, s3_server, s3_env):
    pool, env = get_pool(world), s3_server.env()
    excs = pool.run_expect_error(_save, env, "foo://x/ckpt", 1, None, timeout=_TIMEOUT)
    assert_all_raise(excs, world, "foo://")
    excs = pool.run_expect_error(_load, env, "foo://x/ckpt", None, timeout=_TIMEOUT)
    assert_all_raise(excs, world, "foo://")

    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ckpt"
    excs = pool.run_expect_error(_save, env, missing, 1, timeout=_TIMEOUT)
    assert_all_raise(excs, world, missing)
    excs = pool.run_expect_error(_load, env, missing, timeout=_TIMEOUT)
    assert_all_raise(excs, world, missing)

    url = _url(s3_server)
    wrong = {**env, "AWS_SECRET_ACCESS_KEY": "0" * 40}
    excs = pool.run_expect_error(_save, wrong, url, 1, timeout=_TIMEOUT)
    assert_all_raise(excs, world, url)
    excs = pool.run_expect_error(_load, wrong, url, timeout=_TIMEOUT)
    assert_all_raise(excs, world, url)
    assert S3Storage(url).list() == []  # nothing was written with the wrong key


def test_a_prefix_holding_objects_is_refused(s3_server, s3_env):
    pool, env, base = get_pool(2), s3_server.env(), _url(s3_server)
    pool.run(_save, env, base + "/iter_10", 1, timeout=_TIMEOUT)
    S3Storage(base + "/stray").write_atomic("notes.txt", b"not a checkpoint")
    # the parent prefix holds objects (under iter_10/), and so does stray/: both refused, untouched
    for occupied in (base, base + "/stray", base + "/iter_10"):
        before = S3Storage(occupied).list()
        excs = pool.run_expect_error(_save, env, occupied, 2, timeout=_TIMEOUT)
        assert_all_raise(excs, 2, occupied, "not empty")
        assert S3Storage(occupied).list() == before
    # iter_1 is empty although iter_10/... exists: the save goes through
    assert pool.run(_save, env, base + "/iter_1", 3, timeout=_TIMEOUT) == [True, True]
    assert pool.run(_load_matches, env, base + "/iter_1", 3, timeout=_TIMEOUT) == [True, True]
    assert pool.run(_load_matches, env, base + "/iter_10", 1, timeout=_TIMEOUT) == [True, True]


# ----------------------------------------------------------------------------- damage after the save


@pytest.mark.parametrize("world", [1, 2])
def test_deleted_truncated_or_damaged_object(world, s3_server, s3_env):
    pool, env, url = get_pool(world), s3_server.env(), _url(s3_server)
    pool.run(_save, env, url, 5, timeout=_TIMEOUT)
    source = S3Storage(url)
    target = f"__{world - 1}_0.distcp"  # the last rank's tensor data (two parts)
    original = source.read_bytes(target)
    damages = {
        "deleted": None,
        "truncated": original[:len(original) // 2],
        "damaged byte": original[:PART_BYTES + 12345] + bytes([original[PART_BYTES + 12345] ^ 0x5A])
        + original[PART_BYTES + 12346:],
    }
    for what, content in damages.items():
        copy = S3Storage(_url(s3_server))
        for name in source.list():
            if name != target or content is not None:
                copy.write_atomic(name, content if name == target else source.read_bytes(name))
        excs = pool.run_expect_error(_load, env, copy.describe(), timeout=_TIMEOUT)
        assert_all_raise(excs, world, copy.describe(target))
        if what == "damaged byte":
            assert_all_raise(excs, world, "Checksum mismatch")
    assert pool.run(_load_matches, env, url, 5, timeout=_TIMEOUT) == [True] * world  # the original is intact


# ----------------------------------------------------------------------------- a failing server


@pytest.mark.parametrize("world", [1, 2])
def test_failed_requests_are_retried(world, s3_server, s3_env):
    """Parts answered 503 SlowDown, 429 and 500, a dropped connection, a failed completion and
    a conditional create whose answer is lost: all retried, the save and load are exact."""
    rules = [_fail_first(2, "503", "PUT", "partNumber="), _fail_first(1, "429", "PUT", "partNumber="),
             _fail_first(1, "drop", "PUT", "partNumber="), _fail_first(1, "500", "POST", "uploadId="),
             _fail_first(1, "lose", "PUT", ".save_claim"), _fail_first(2, "503", "GET", ".distcp")]

    def fault(method, target, n):
        return next((o for o in (rule(method, target, n) for rule in rules) if o), None)

    url = _url(s3_server)
    with FaultProxy(s3_server.ports["s3"], fault) as proxy:
        env = _proxied(s3_server, proxy)
        assert get_pool(world).run(_save, env, url, 7, timeout=_TIMEOUT) == [True] * world
        assert get_pool(world).run(_load_matches, env, url, 7, timeout=_TIMEOUT) == [True] * world
    faults = {o: proxy.count(o) for o in ("503", "429", "drop", "500", "lose")}
    assert faults == {"503": 4, "429": 1, "drop": 1, "500": 1, "lose": 1}, faults


def test_timed_out_puts_are_retried(s3_server, s3_env):
    """A PUT, conditional or not, that gets no answer within the client's timeout is sent again
    (obstore does not retry a timed-out conditional PUT: S3Storage does)."""
    stalled = [_fail_first(1, "stall", "PUT", "/claim"), _fail_first(1, "stall", "PUT", "/small")]
    with FaultProxy(s3_server.ports["s3"], lambda m, t, n: stalled[0](m, t, n) or stalled[1](m, t, n),
                    stall_seconds=3) as proxy:
        # client_options without allow_http: AWS_ALLOW_HTTP still holds
        options = {**_FAST, "endpoint": proxy.endpoint_url, "client_options": {"timeout": 1}}
        storage = S3Storage(_url(s3_server), options)
        storage.create_exclusive("claim", b"save id 1")
        storage.write_atomic("small", b"abc")
        assert storage.read_bytes("claim") == b"save id 1" and storage.read_bytes("small") == b"abc"
    assert [o for m, t, o in proxy.log if m == "PUT"] == ["stall", "forwarded", "stall", "forwarded"], proxy.log


_OVER_BUDGET = {  # every such request answered with the fault
    "parts": (lambda m, t, n: "503" if "partNumber=" in t else None, "503"),
    "completions": (lambda m, t, n: "500" if m == "POST" and "uploadId=" in t else None, "500"),
}


@pytest.mark.parametrize("world, failing", [(1, "parts"), (2, "parts"), (2, "completions")])
def test_failures_beyond_the_retry_budget(world, failing, s3_server, s3_env):
    """Every part upload (or every completion of one) fails: each rank raises naming its
    object, nothing loads, and the multipart uploads are aborted."""
    url, (rule, code) = _url(s3_server), _OVER_BUDGET[failing]
    with FaultProxy(s3_server.ports["s3"], rule) as proxy:
        excs = get_pool(world).run_expect_error(_save, _proxied(s3_server, proxy), url, 1, timeout=_TIMEOUT)
    assert_all_raise(excs, world, url)
    assert any(f"{url}/__{r}_0.distcp" in str(e) and code in str(e) for r in range(world) for e in excs), excs
    assert proxy.count(code) >= 4  # the first attempt and max_retries=3 retries
    assert not dc.check_is_distributed_checkpoint(url)
    with pytest.raises(CheckpointingException):
        dc.load(_state(0, 1, 1), S3Storage(url, _FAST))
    assert _wait_for(lambda: _unfinished_uploads(s3_server) == []), _unfinished_uploads(s3_server)


@pytest.fixture
def own_server():
    """A SeaweedFS of this test's own (it gets killed)."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS is not installed")
    server = SeaweedFS().start()
    try:
        yield server
    finally:
        server.stop()


def test_server_killed_in_the_middle_of_a_save(own_server, monkeypatch):
    """The server dies at the first part upload of the second save: every rank raises (no hang),
    nothing loads; restarted on the same data, the first checkpoint loads and a new save works."""
    server, pool = own_server, get_pool(2)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    first, second, third = _url(server), _url(server), _url(server)
    armed = []

    def kill_at_first_part(method, target, n):
        if armed and not armed[1:] and "partNumber=" in target:
            armed.append(True)
            server.kill()
        return None

    with FaultProxy(server.ports["s3"], kill_at_first_part) as proxy:
        env = _proxied(server, proxy)
        assert pool.run(_save, env, first, 1, timeout=_TIMEOUT) == [True, True]
        armed.append(True)
        excs = pool.run_expect_error(_save, env, second, 2, timeout=_TIMEOUT)
        assert len(armed) == 2 and server.proc is None, "the server was not killed during the save"
        assert_all_raise(excs, 2, second)
        server.restart()
        assert not dc.check_is_distributed_checkpoint(S3Storage(second, _FAST))
        excs = pool.run_expect_error(_load, env, second, timeout=_TIMEOUT)
        assert_all_raise(excs, 2, second)
        assert pool.run(_load_matches, env, first, 1, timeout=_TIMEOUT) == [True, True]
        assert pool.run(_save, env, third, 3, timeout=_TIMEOUT) == [True, True]
        assert pool.run(_load_matches, env, third, 3, timeout=_TIMEOUT) == [True, True]
