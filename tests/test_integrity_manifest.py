"""Megatron-Core's integrity manifest ``integrity.json``: written on request by ``save``,
verified by ``load`` (by default when present) and reported by ``validate``; the format is
checked against Megatron-Core 0.19's own functions when the peer is installed (.ci/run)."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor
from dist_checkpointing.core import CheckpointingException
from dist_checkpointing.integrity.manifest import MANIFEST_FNAME, manifest_bytes
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.tools import validate_checkpoint

from .conftest import get_pool
from .peers import require

_TIMEOUT = 60.0


def _full(world: int) -> torch.Tensor:
    return torch.arange(2 * world * 6.0).reshape(2 * world, 6)


def _state(rank: int, world: int, zeros: bool = False) -> dict:
    rows = _full(world)[2 * rank:2 * rank + 2].clone()
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(rows) if zeros else rows, (0, rank, world)),
        "o": ShardedObject("o", None if zeros else {"rank": rank}, (world,), (rank,)),
        "step": 7,
    }


def _save(rank, world, ckpt, async_save=False):
    if not async_save:
        dc.save(_state(rank, world), ckpt, verify_integrity=True)
        return
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(dc.save(_state(rank, world), ckpt, async_sharded_save=True, verify_integrity=True))
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()


def _load(rank, world, ckpt, verify_integrity=None):
    out = dc.load(_state(rank, world, zeros=True), ckpt, verify_integrity=verify_integrity)
    assert torch.equal(out["w"], _full(world)[2 * rank:2 * rank + 2])
    assert out["o"] == {"rank": rank} and out["step"] == 7


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("world,async_save", [(1, False), (2, False), (2, True)])
def test_round_trip(world, async_save, tmp_path):
    ckpt = tmp_path / "ckpt"
    pool = get_pool(world)
    pool.run(_save, str(ckpt), async_save, timeout=_TIMEOUT)
    # every regular file but the manifest itself, metadata.json included, as Megatron-Core lists them
    expected = {p.name: _sha256(p) for p in ckpt.iterdir() if p.is_file() and p.name != MANIFEST_FNAME}
    assert "metadata.json" in expected and f"__{world - 1}_0.distcp" in expected
    assert (ckpt / MANIFEST_FNAME).read_bytes() == manifest_bytes(expected)
    pool.run(_load, str(ckpt), timeout=_TIMEOUT)
    pool.run(_load, str(ckpt), True, timeout=_TIMEOUT)
    assert validate_checkpoint(ckpt).ok


def test_without_a_manifest(tmp_path):
    ckpt = tmp_path / "ckpt"
    pool = get_pool(2)
    pool.run(_save_plain, str(ckpt), timeout=_TIMEOUT)
    assert not (ckpt / MANIFEST_FNAME).exists()
    pool.run(_load, str(ckpt), timeout=_TIMEOUT)  # verified only when present
    excs = pool.run_expect_error(_load, str(ckpt), True, timeout=_TIMEOUT)
    for e in excs:  # Megatron-Core's verify_integrity=True needs a manifest too
        assert isinstance(e, CheckpointingException) and MANIFEST_FNAME in str(e), e


def _save_plain(rank, world, ckpt):
    dc.save(_state(rank, world), ckpt)


def _drop_sidecar(ckpt: Path) -> str:
    (ckpt / ".metadata.checksum").unlink()  # loads fine without a manifest: only it notices
    return ".metadata.checksum"


def _wrong_hash(ckpt: Path) -> str:
    raw = json.loads((ckpt / MANIFEST_FNAME).read_text())
    raw["files"]["__1_0.distcp"] = "0" * 64
    (ckpt / MANIFEST_FNAME).write_text(json.dumps(raw, indent=2))
    return "__1_0.distcp"


def _changed_file(ckpt: Path) -> str:
    path = ckpt / "common.pt.checksum"
    path.write_bytes(path.read_bytes().replace(b'"algorithm"', b'"algorithm" '))
    return "common.pt.checksum"


def _extra_file(ckpt: Path) -> str:
    (ckpt / "notes.txt").write_text("added after the save")
    return "notes.txt"


def _uncommitted(ckpt: Path) -> str:
    (ckpt / "metadata.json").unlink()  # killed between the manifest and metadata.json
    return "incomplete checkpoint"


def _malformed(mutate):
    def damage(ckpt: Path) -> str:
        raw = json.loads((ckpt / MANIFEST_FNAME).read_text())
        (ckpt / MANIFEST_FNAME).write_text(mutate(raw))
        return MANIFEST_FNAME
    return damage


_DAMAGE = {
    "missing_listed_file": _drop_sidecar,
    "wrong_hash": _wrong_hash,
    "file_changed": _changed_file,
    "extra_unlisted_file": _extra_file,
    "uncommitted": _uncommitted,
    "not_json": _malformed(lambda raw: '{"algorithm": "sha256", "files": {'),
    "files_a_list": _malformed(lambda raw: json.dumps({"algorithm": "sha256", "files": list(raw["files"])})),
    "digest_an_int": _malformed(lambda raw: json.dumps({"files": {**raw["files"], "common.pt": 12}})),
    "name_escapes": _malformed(lambda raw: json.dumps({"files": {**raw["files"], "../x": "0" * 64}})),
    "other_algorithm": _malformed(lambda raw: json.dumps({"algorithm": "md5", "files": raw["files"]})),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("manifest") / "ckpt"
    get_pool(2).run(_save, str(ckpt), timeout=_TIMEOUT)
    return ckpt


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_bad_input(damage, saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    name = _DAMAGE[damage](ckpt)
    pool = get_pool(2)
    excs = pool.run_expect_error(_load, str(ckpt), timeout=_TIMEOUT)
    for e in excs:
        assert isinstance(e, CheckpointingException) and name in str(e), e
    report = validate_checkpoint(ckpt)
    assert not report.ok and any(name in p for p in report.problems), report.problems
    if damage in ("missing_listed_file", "extra_unlisted_file"):
        pool.run(_load, str(ckpt), False, timeout=_TIMEOUT)  # verify_integrity=False skips the manifest


# ----------------------------------------------------------------------------- Megatron-Core 0.19


def _megatron_manifest_functions():
    """Megatron-Core 0.19's own manifest functions, taken from its installed source
    (importing ``megatron.core`` needs Triton and CUDA): ``save_integrity_manifest`` and
    ``_verify_integrity_manifest_impl`` with their constants and ``maybe_msc``."""
    core = Path(require("MCORE19_SITE")) / "megatron" / "core"
    spec = importlib.util.spec_from_file_location("_mcore19_msc_utils", core / "msc_utils.py")
    msc_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(msc_utils)
    wanted = {"INTEGRITY_FNAME", "_HASH_ALGORITHM", "_READ_CHUNK_SIZE", "_compute_file_hash",
              "save_integrity_manifest", "_verify_integrity_manifest_impl"}
    tree = ast.parse((core / "dist_checkpointing" / "validation.py").read_text())
    body = [node for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name in wanted)
            or (isinstance(node, ast.Assign) and {getattr(t, "id", None) for t in node.targets} & wanted)]
    assert len(body) == len(wanted), "Megatron-Core's manifest functions were not found"
    namespace = {"hashlib": hashlib, "json": json, "os": os, "Dict": dict, "maybe_msc": msc_utils.maybe_msc,
                 "logger": __import__("logging").getLogger("mcore19"), "CheckpointingException": RuntimeError}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(core / "dist_checkpointing" / "validation.py"), "exec"),
         namespace)
    return namespace


def test_megatron_core_019_manifest_format(saved, tmp_path):
    mcore = _megatron_manifest_functions()
    assert mcore["INTEGRITY_FNAME"] == MANIFEST_FNAME
    mcore["_verify_integrity_manifest_impl"](str(saved))  # Megatron-Core's verifier accepts ours
    theirs = tmp_path / "ckpt"
    shutil.copytree(saved, theirs)
    (theirs / MANIFEST_FNAME).unlink()
    mcore["save_integrity_manifest"](str(theirs))
    assert (theirs / MANIFEST_FNAME).read_bytes() == (saved / MANIFEST_FNAME).read_bytes()
    get_pool(2).run(_load, str(theirs), True, timeout=_TIMEOUT)  # and we verify Megatron-Core's
    _wrong_hash(theirs)
    with pytest.raises(RuntimeError, match="__1_0.distcp"):
        mcore["_verify_integrity_manifest_impl"](str(theirs))


def test_remove_sharded_tensors_keeps_the_manifest_matching(tmp_path):
    ckpt = tmp_path / "ckpt"
    dc.save({"keep": ShardedTensor.from_rank_offsets("keep", torch.arange(6.0)),
             "optimizer.m": ShardedTensor.from_rank_offsets("optimizer.m", torch.ones(3))}, ckpt,
            verify_integrity=True)
    dc.remove_sharded_tensors(ckpt, "optimizer.")
    assert validate_checkpoint(ckpt).ok
    loaded = dc.load({"keep": ShardedTensor.from_rank_offsets("keep", torch.zeros(6))}, ckpt, verify_integrity=True)
    assert torch.equal(loaded["keep"], torch.arange(6.0))
