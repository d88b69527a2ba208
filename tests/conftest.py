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
    # pytest-xdist's --dist loadfile hands out files largest-first by test count unless told
    # otherwise; the order of pytest_collection_modifyitems (longest-running first) is better
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_sessionstart(session):
    """Print the random order's seed (pytest-randomly, from the ``[test]`` extra) even under
    ``-q``, so a failing order can be replayed."""
    config = session.config
    seed = getattr(config.option, "randomly_seed", None)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if seed is not None and reporter is not None and not hasattr(config, "workerinput"):
        reporter.write_line(f"random test order, seed {seed} (replay it: add "
                            f"-p randomly --randomly-seed={seed})")


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
    from .launch import kill_all

    kill_all()  # scripts a failed test left running
    for p in _POOLS.values():  # every rank of every pool leaves at once, then each pool is reaped
        p.shutdown()
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()


# The longest files (per-file wall time of a parallel run, measured with the README's command),
# run first: pytest-xdist hands out whole files (``--dist loadfile``) in collection order, and
# a long file started last would leave one worker running it alone at the end.
_LONGEST_FIRST = ["test_async_save.py", "test_s3_storage.py", "test_s3_faults.py", "test_docs.py",
                  "test_fully_parallel.py", "test_mcore_names.py", "test_mcore_models.py", "test_cli_imports.py",
                  "test_megatron_interop.py", "test_persistent_worker.py", "test_two_tier_hostile.py",
                  "test_manager_hostile.py", "test_tools_hostile.py", "test_mcore_behaviour.py",
                  "test_output_overlap.py", "test_convert.py", "test_s3_server.py", "test_demo.py",
                  "test_manager_crash.py", "test_pool_timeouts.py", "test_two_tier.py", "test_manager.py",
                  "test_serialization.py", "test_two_tier_torchrun.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
