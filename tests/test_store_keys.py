"""Object names the store does not keep as written (issue 29, item 4), against the real
SeaweedFS (``tests/s3_server.py``) and ``memory://``.

1. The rule (:func:`object_key_problem`) matches the server: what it refuses, SeaweedFS
   rewrites (a backslash becomes ``/``) or rejects (a segment over 255 bytes, a key over
   1024), or obstore cannot send (control characters, empty / ``.`` / ``..`` segments);
   what it allows is stored and listed under its own name.
2. ``save`` (world 1 and 2), the manager, ``convert``, ``export`` and ``import`` refuse such
   a location or file name (the checkpoint URL, a ``separation_hint`` prefix) up front on
   every rank, naming the key; nothing is written (no ``.save_claim`` left), and nothing
   looks like a checkpoint. Tensor and object keys, which live only inside ``.metadata``,
   are not refused.
3. The commit lists the prefix and fails the save (dropping its claim) when the store did
   not keep a file written: one stored under another name, one replaced by another size.
"""

from __future__ import annotations

import uuid

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, CheckpointManager, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.tools.convert import convert_checkpoint
from dist_checkpointing.storage import object_key_problem, storage_for
from dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from dist_checkpointing.tools import export_checkpoint, import_checkpoint

from .conftest import get_pool
from .helpers import assert_all_raise
from .locations import _export_env

pytest.importorskip("obstore")

KEPT = ["space in it", "uni\u00e9", "emoji\U0001F600", "...", "dots.in.name", "plus+percent%41", "q?x#y&z",
        "colon:semi;", "tilde~", "quote\"apos'", "a" * 255, "/".join(["s" * 200] * 5)]
UNKEPT = {"back\\slash": "backslash", "tab\there": "control", "nl\nx": "control", "nul\x00x": "control",
          "del\x7fx": "control", "c1\x85x": "control", "a//b": "empty", "a/./b": "'.'", "a/../b": "'..'",
          "trail/": "empty", "/lead": "empty", "a" * 256: "255 bytes", "\u00e9" * 128: "255 bytes",
          "/".join(["k" * 250] * 5): "1024", "lone\ud800": "Unicode"}


@pytest.fixture
def s3(s3_server):
    _export_env(s3_server.env())
    return s3_server


def _fresh(s3_server) -> str:
    return f"s3://{s3_server.bucket}/{uuid.uuid4().hex[:10]}"


def test_the_rule():
    for key in KEPT:
        assert object_key_problem(key) is None, key
    for key, why in UNKEPT.items():
        problem = object_key_problem(key)
        assert problem is not None and why in problem, (key, problem)


def test_the_rule_matches_the_server(s3):
    """What the rule keeps round-trips; what it refuses the server rewrites or rejects."""
    import obstore
    from obstore.store import S3Store

    base = _fresh(s3)
    storage = storage_for(base)
    for key in KEPT:
        storage.write_atomic(key, b"kept")
        assert storage.read_bytes(key) == b"kept"
        assert key.split("/")[0] in storage.list(), key
        if "/" not in key:
            assert storage.listed_sizes()[key] == 4
        storage.delete_many([key])
    for key in UNKEPT:  # our storage refuses the others before sending them
        with pytest.raises(OSError, match="not an object key the store keeps"):
            storage.write_atomic(key, b"x")
    assert storage.listed_sizes() == {}  # (SeaweedFS may still list the emptied sub-prefix)
    raw = S3Store(s3.bucket, prefix=base.split("/", 3)[3])
    obstore.put(raw, "a\\b", b"mangled")  # SeaweedFS: stored as a/b, listed as no object a\b
    assert [o["path"] for chunk in obstore.list(raw) for o in chunk] == ["a/b"]
    for key in ("x" * 256, "/".join(["k" * 250] * 5)):
        with pytest.raises(Exception):
            obstore.put(raw, key, b"refused")


# ----------------------------------------------------------------------------- refused up front


def _state(rank: int = 0, world: int = 1, key: str = "w") -> dict:
    return {"w": ShardedTensor.from_rank_offsets(key, torch.arange(4.0) + 4 * rank, (0, rank, world)),
            "opt": ShardedTensor.from_rank_offsets(f"opt.{key}", torch.ones(2) * rank, (0, rank, world)),
            "o": ShardedObject("obj", {"rank": rank}, (world,), (rank,)), "step": 3}


def _save(rank: int, world: int, url: str, hint) -> None:
    strategy = TorchDistSaveShardedStrategy(separation_hint=hint) if hint is not None else None
    dc.save(_state(rank, world), url, sharded_strategy=strategy)


# name -> (fresh base) -> (checkpoint URL, separation_hint, the key named in the error)
BAD_SAVES = {
    "backslash_in_url": lambda b: (f"{b}/run\\1", None, "run\\\\1"),
    "backslash_in_url_parent": lambda b: (f"{b}\\sub/ckpt", None, "\\\\sub"),
    "long_segment_in_url": lambda b: (f"{b}/{'s' * 256}", None, "s" * 40),
    "key_too_long_with_file_names": lambda b: (f"{b}/{'/'.join(['p' * 200] * 5)}", None, "1024"),
    "backslash_hint": lambda b: (f"{b}/ckpt", "opt\\", "opt\\\\__"),
    "control_char_hint": lambda b: (f"{b}/ckpt", "opt\t", "opt\\t__"),
    "long_hint": lambda b: (f"{b}/ckpt", "opt" + "h" * 250, "opt" + "h" * 30),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(BAD_SAVES))
def test_save_refuses_unkept_names_on_every_rank(case, world, s3):
    base = _fresh(s3)
    url, hint, named = BAD_SAVES[case](base)
    errors = get_pool(world).run_expect_error(_save, url, hint)
    assert_all_raise(errors, world, "is not a name the store keeps as written", named)
    assert storage_for(base).list() == [], "something was written"
    assert not dc.check_is_distributed_checkpoint(url.replace("\\", "/"))


def test_save_refuses_unkept_names_on_memory():
    base = f"memory://{uuid.uuid4().hex[:10]}"
    for case, make in BAD_SAVES.items():
        url, hint, named = make(base)
        with pytest.raises(CheckpointingException, match="not a name the store keeps") as info:
            _save(0, 1, url, hint)
        assert named in str(info.value), info.value
        assert storage_for(base).list() == [], case


def _save_and_load_odd_keys(rank: int, world: int, url: str) -> None:
    key = "layer\\0.w\tx//y/../z"
    dc.save(_state(rank, world, key), url, sharded_strategy=TorchDistSaveShardedStrategy(separation_hint="opt."))
    request = {"w": ShardedTensor.from_rank_offsets(key, torch.zeros(4), (0, rank, world)),
               "opt": ShardedTensor.from_rank_offsets(f"opt.{key}", torch.zeros(2), (0, rank, world)),
               "o": ShardedObject("obj", None, (world,), (rank,))}
    loaded = dc.load(request, url)
    assert torch.equal(loaded["w"], torch.arange(4.0) + 4 * rank) and torch.equal(loaded["opt"], torch.ones(2) * rank)
    assert loaded["o"] == {"rank": rank} and loaded["step"] == 3


@pytest.mark.parametrize("world", [1, 2])
def test_keys_inside_the_metadata_are_not_refused(world, s3):
    """Tensor and object keys are no object names: any characters save and load."""
    url = f"{_fresh(s3)}/ckpt"
    get_pool(world).run(_save_and_load_odd_keys, url)
    assert any(name.startswith("opt.__") for name in storage_for(url).list())


def test_tools_and_manager_refuse_unkept_output_names(s3, tmp_path, capsys):
    base = _fresh(s3)
    src = tmp_path / "src"
    dc.save(_state(), src)
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    bad = f"{base}/out\\put"
    for call in (lambda: convert_checkpoint(src, bad, force=True), lambda: export_checkpoint(src, bad, force=True),
                 lambda: export_checkpoint(src, f"{base}/x\\y.pt", format="torch", force=True),
                 lambda: export_checkpoint(src, f"{base}/{'e' * 256}.pt", format="torch"),
                 lambda: import_checkpoint(tmp_path / "model.pt", bad, force=True),
                 lambda: CheckpointManager(f"{base}/root\\x")):
        with pytest.raises(CheckpointingException, match="not a name the store keeps"):
            call()
    for argv in (["convert", str(src), bad], ["export", str(src), bad, "--force"], ["import", str(tmp_path / "model.pt"), bad]):
        assert main(argv) == 1
        stderr = capsys.readouterr().err
        assert stderr.startswith("error: ") and "not a name the store keeps" in stderr, stderr
    assert storage_for(base).list() == []
    assert dc.load_plain_tensors(src)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


# ----------------------------------------------------------------------------- the commit's check


class _Unchecked:
    """An S3 storage with the up-front check switched off, so that the store itself rewrites
    the names (the commit's check is the last line of defence)."""

    @staticmethod
    def make(url: str):
        from dist_checkpointing.storage.s3 import S3Storage

        class Unchecked(S3Storage):
            def name_problem(self, name: str = ""):
                return None

            def _refuse_unkept(self, name: str) -> None:
                return None

        return Unchecked(url)


def _save_unchecked(rank: int, world: int, url: str) -> None:
    state = _state(rank, world)
    state["opt"] = ShardedTensor.from_rank_offsets("opt\\w", torch.ones(2), (0, rank, world))
    dc.save(state, _Unchecked.make(url), sharded_strategy=TorchDistSaveShardedStrategy(separation_hint="opt\\"))


@pytest.mark.parametrize("world", [1, 2])
def test_commit_fails_when_the_store_renamed_a_file(world, s3):
    url = f"{_fresh(s3)}/ckpt"
    errors = get_pool(world).run_expect_error(_save_unchecked, url)
    assert_all_raise(errors, world, "the store did not keep what was written", "opt\\__0_0.distcp is not there")
    names = storage_for(url).list()
    assert "metadata.json" not in names and ".save_claim" not in names, names
    assert not dc.check_is_distributed_checkpoint(url)


def _async_save_with_a_clobbered_file(rank: int, world: int, url: str) -> None:
    queue = AsyncCallsQueue()
    try:
        request = dc.save(_state(rank, world), url, async_sharded_save=True)

        def clobber() -> None:  # another writer replaces a data file before the commit
            if rank == 0:
                storage_for(url).write_atomic("__1_0.distcp" if world > 1 else "__0_0.distcp", b"short")

        request.add_pre_finalize_fn(clobber)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close(abort=True)


@pytest.mark.parametrize("world", [1, 2])
def test_commit_fails_when_a_file_has_another_size(world, s3):
    url = f"{_fresh(s3)}/ckpt"
    errors = get_pool(world).run_expect_error(_async_save_with_a_clobbered_file, url)
    assert_all_raise(errors, world, "holds 5 bytes, not the")
    names = storage_for(url).list()
    assert "metadata.json" not in names and ".save_claim" not in names, names


def test_a_sound_save_passes_the_commit_check(s3):
    url = f"{_fresh(s3)}/ckpt"
    _save(0, 1, url, "opt.")
    assert dc.check_is_distributed_checkpoint(url)
    assert dc.load_plain_tensors(url)["opt.w"].tolist() == [0.0, 0.0]
