"""Hang detection in the tests tells a hang from a slow machine (``helpers.wait_with_progress``)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from . import helpers
from .helpers import slack, timeout_scale, wait_with_progress


@pytest.fixture
def unscaled(monkeypatch):
    monkeypatch.setenv("DIST_CKPT_TEST_TIMEOUT_SCALE", "1")


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_scale_setting(monkeypatch) -> None:
    monkeypatch.setenv("DIST_CKPT_TEST_TIMEOUT_SCALE", "3")
    assert timeout_scale() == 3.0 and slack(10) == 30.0
    monkeypatch.delenv("DIST_CKPT_TEST_TIMEOUT_SCALE")
    assert 1.0 <= timeout_scale() <= 8.0


def test_idle_processes_past_the_timeout_are_a_hang(unscaled) -> None:
    proc = _child("import time; time.sleep(60)")
    try:
        start = time.monotonic()
        assert not wait_with_progress(lambda t: time.sleep(t) or False, lambda: [proc.pid], 1.0, quiet=2.0)
        assert 2.5 <= time.monotonic() - start < 15
    finally:
        proc.kill()


# works 20 ms of CPU in every ~220 ms (a process making progress; ~10% of a core, not 100%)
_WORKING = """
import time
while True:
    t = time.process_time()
    while time.process_time() - t < 0.02:
        pass
    time.sleep(0.2)
"""


def test_working_processes_are_not_a_hang_until_the_hard_cap(unscaled) -> None:
    proc = _child(_WORKING)
    try:
        start = time.monotonic()
        assert not wait_with_progress(lambda t: time.sleep(t) or False, lambda: [proc.pid], 1.0, quiet=2.0)
        assert time.monotonic() - start >= helpers._HARD_CAP * 1.0 - 0.5
    finally:
        proc.kill()


def test_ready_returns_at_once(unscaled) -> None:
    start = time.monotonic()
    assert wait_with_progress(lambda t: True, lambda: [], 100.0)
    assert time.monotonic() - start < 1
