"""``ckpt_location``: the shared test matrix of checkpoint locations. A test that takes it runs
once on the local file system and once on S3 (the session's SeaweedFS server,
``tests/s3_server.py``; that case is skipped without SeaweedFS or obstore). The fixture is a
:class:`Locations`: ``ckpt_location("name")`` is a fresh location of that kind (a path, or
an ``s3://`` URL under a prefix of the test's own), and ``ckpt_location.list(location)`` the
names stored there. For S3, the server's ``AWS_*`` environment is set in this process and
in every rank of the process pools (pools started later inherit it)."""

from __future__ import annotations

import os
import uuid
from typing import Dict, List

import pytest

from dist_checkpointing.storage import storage_for



class Locations:
    """Fresh checkpoint locations under ``root`` (a directory or an ``s3://`` prefix)."""

    def __init__(self, kind: str, root: str):
        self.kind, self.root = kind, root

    def __call__(self, name: str = "ckpt") -> str:
        return os.path.join(self.root, name) if self.kind == "posix" else f"{self.root}/{name}"

    def list(self, location: str) -> List[str]:
        """The names of the files (and sub-directories) stored at ``location``."""
        return storage_for(location).list()


def _set_env(rank: int, world: int, env: Dict[str, str]) -> None:
    os.environ.update(env)


def _export_env(env: Dict[str, str]) -> None:
    os.environ.update(env)
    from . import conftest  # (here: a rank that unpickles a function of this module imports it first)

    for pool in conftest._POOLS.values():
        pool.run(_set_env, env)


@pytest.fixture(params=["posix", "s3"])
def ckpt_location(request, tmp_path) -> Locations:
    """A :class:`Locations` on the local file system, then on S3."""
    if request.param == "posix":
        return Locations("posix", str(tmp_path))
    pytest.importorskip("obstore")
    server = request.getfixturevalue("s3_server")
    _export_env(server.env())
    return Locations("s3", f"s3://{server.bucket}/{uuid.uuid4().hex[:12]}")
