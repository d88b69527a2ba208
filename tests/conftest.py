"""Shared fixtures: per-world-size process pools and the Megatron-Core fixture paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .dist_pool import DistPool
from .locations import ckpt_location  # noqa: F401  (the local file system / S3 test matrix)
from .s3_server import no_aws_env, s3_env, s3_server  # noqa: F401  (one SeaweedFS S3 server per run; its env)

_POOLS: dict = {}

# Real checkpoints written by Megatron-Core 0.15 and 0.19, kept in the repository (see their README).
FIXTURES = Path(os.environ.get("DIST_CKPT_FIXTURES", Path(__file__).resolve().parent / "fixtures"))


def pytest_configure(config):
    """Megatron-Core peers are installed before the test modules are collected (they read
    ``MCORE_SITE`` / ``MCORE19_SITE`` at import)."""
    from .peers import ensure_peers

    ensure_peers()


def get_pool(world_size: int) -> DistPool:
    """The session's pool of ``world_size`` gloo ranks (started on first use)."""
    if world_size not in _POOLS:
        _POOLS[world_size] = DistPool(world_size)
    return _POOLS[world_size]


@pytest.fixture(params=[1, 2, 4], ids=lambda w: f"world{w}")
def pool(request) -> DistPool:
    """Each test using it runs at world sizes 1, 2 and 4."""
    return get_pool(request.param)


@pytest.fixture
def pool2() -> DistPool:
    return get_pool(2)


@pytest.fixture
def pool4() -> DistPool:
    return get_pool(4)


def pytest_sessionfinish(session, exitstatus):
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()
