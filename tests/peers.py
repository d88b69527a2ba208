"""Test-time peers: Megatron-Core 0.15.3 and 0.19.2, installed by the test session itself.

Some tests check that Megatron-Core reads what this library writes (and the reverse). The
library never imports it: each version is installed with ``pip --target`` into a private
directory (default ``.ci/mcore_site`` and ``.ci/mcore19_site``; ``MCORE_SITE`` /
``MCORE19_SITE`` name another) the first time a test session starts, and the tests put that
directory on a subprocess's ``PYTHONPATH`` (or on ``sys.path`` of a spawned rank).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[1]

# env var -> (requirements, extra pip flags, default directory); each requirement's top-level
# package must be in the directory for the peer to count as installed
PEERS = {
    "MCORE_SITE": (["megatron-core==0.15.3"], [], ROOT / ".ci" / "mcore_site"),
    # its wheels declare Requires-Python >= 3.12; the cp311 wheel works for what the tests use.
    # megatron/core/__init__.py of 0.19 imports triton (its models too), which torch's CPU wheel lacks
    "MCORE19_SITE": (["megatron-core==0.19.2", "triton==3.9.0"], ["--ignore-requires-python"],
                     ROOT / ".ci" / "mcore19_site"),
}
_PACKAGE_DIRS = {"megatron-core": Path("megatron", "core"), "triton": Path("triton")}
_ERRORS: Dict[str, str] = {}


def peer_site(env: str) -> Path:
    """The directory the peer ``env`` is (or would be) installed in."""
    return Path(os.environ.get(env) or PEERS[env][2])


def installed(env: str) -> bool:
    return all((peer_site(env) / _PACKAGE_DIRS[r.split("==")[0]]).is_dir() for r in PEERS[env][0])


def ensure_peers() -> None:
    """Install every missing peer (once per machine; concurrent sessions wait for each other)
    and export its directory in the environment for the tests and their subprocesses."""
    for env, (requirements, flags, _) in PEERS.items():
        site = peer_site(env)
        os.environ[env] = str(site)
        if installed(env):
            continue
        site.parent.mkdir(parents=True, exist_ok=True)
        with open(site.parent / f".{site.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if installed(env):
                continue
            tmp = site.with_name(site.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *flags,
                                   "--target", str(tmp), *requirements, "packaging", "psutil"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                _ERRORS[env] = (f"`pip install {' '.join(requirements)}` into {site} failed: "
                                f"{proc.stderr.strip()[-600:]}")
                continue
            shutil.rmtree(site, ignore_errors=True)
            tmp.rename(site)


def require(env: str) -> str:
    """The peer's directory; fails the calling test (never skips it) when it is missing."""
    if not installed(env):
        import pytest

        pytest.fail(_ERRORS.get(env) or f"{' '.join(PEERS[env][0])} is not installed in {peer_site(env)}")
    return str(peer_site(env))
