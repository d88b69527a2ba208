"""Hostile pickles, damaged checkpoints and crash safety, on real gloo process groups.

Every multi-rank case runs at world sizes 2 and 4: each rank must raise
``CheckpointingException`` naming the culprit file or key (never a hang: DistPool's
timeout fails the test), and nothing pickled inside a checkpoint may execute during a
default (safe) load.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shlex
import shutil
import signal
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

from .conftest import get_pool
from .helpers import assert_all_raise, slack
from .launch import Launched

_ROOT = Path(__file__).resolve().parents[1]
_TIMEOUT = 60.0  # per pool call: a hang fails the test instead of blocking the suite
WORLDS = pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"world{w}")
READERS = ("load", "load_common_state_dict", "load_plain_tensors", "load_sharded_metadata")


# ----------------------------------------------------------------------------- payload classes


class Evil:
    """Unpickling this runs ``touch <marker>`` (a stand-in for arbitrary code)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


@dataclass
class Benign:
    """A harmless custom class: outside the safe allow-list, loadable only with the opt-in."""

    value: int


# ----------------------------------------------------------------------------- state and helpers


def _global(key: str, shape) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape) * 0.25 + len(key)


def _state(rank: int, world: int, fill: bool = True) -> dict:
    """TP-split tensors (along axis 0 and 1), a replicated tensor, one ShardedObject per
    rank and common state."""

    def chunk(key, shape, axis):
        full = _global(key, shape)
        n = full.shape[axis] // world
        local = full.narrow(axis, rank * n, n).clone()
        return local if fill else torch.zeros_like(local)

    return {
        # large enough that rank 0's largest item, alone in __0_0.distcp, is this tensor
        "w": ShardedTensor.from_rank_offsets("layer.w", chunk("layer.w", (128, 32), 0), (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("layer.b", chunk("layer.b", (4, 16), 1), (1, rank, world)),
        "norm": ShardedTensor.from_rank_offsets(
            "norm", _global("norm", (8,)) if fill else torch.zeros(8), replica_id=rank),
        "obj": ShardedObject("rank_state", {"rank": rank, "seed": 3 + rank} if fill else None, (world,), (rank,)),
        "iteration": 5,
        "args": {"lr": 0.1},
    }


def _check_loaded(loaded: dict, rank: int, world: int) -> None:
    expected = _state(rank, world, fill=True)
    for k in ("w", "b", "norm"):
        assert torch.equal(loaded[k], expected[k].data), k
    assert loaded["obj"] == {"rank": rank, "seed": 3 + rank}
    assert loaded["iteration"] == 5 and loaded["args"] == {"lr": 0.1}


def _save_state(rank, world, ckpt):
    dc.save(_state(rank, world), ckpt)
    return True


def _load_and_check(rank, world, ckpt):
    _check_loaded(dc.load(_state(rank, world, fill=False), ckpt), rank, world)
    return True


def _read(rank, world, ckpt, reader):
    """Run one entry point on this rank; return a small picklable summary."""
    if reader == "load":
        loaded = dc.load(_state(rank, world, fill=False), ckpt)
        _check_loaded(loaded, rank, world)
        return sorted(loaded)
    result = getattr(dc, reader)(ckpt)
    return sorted(result)


def _read_tolerant(rank, world, ckpt, reader):
    """Like ``_read``, but a CheckpointingException is an acceptable outcome too (for
    readers that need not touch the damaged file). Any other exception propagates."""
    try:
        return ("ok", _read(rank, world, ckpt, reader))
    except CheckpointingException as e:
        return ("raised", str(e))


def _dir_digest(path: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(path).iterdir())}


# ----------------------------------------------------------------------------- 1. hostile pickles


def test_hostile_payload_is_live(tmp_path):
    """Sanity check of the test payload itself: plain unpickling does run it."""
    marker = tmp_path / "sanity_marker"
    pickle.loads(pickle.dumps(Evil(str(marker))))
    assert marker.exists()


def _check_hostile(pool, world, ckpt, marker: Path, must_raise, fragment):
    """Every reader in ``must_raise`` raises a CheckpointingException containing ``fragment``
    on every rank; the others either work or raise CheckpointingException; nothing runs."""
    for reader in READERS:
        if reader in must_raise:
            excs = pool.run_expect_error(_read, str(ckpt), reader, timeout=_TIMEOUT)
            assert_all_raise(excs, world, fragment)
        else:
            outcomes = pool.run(_read_tolerant, str(ckpt), reader, timeout=_TIMEOUT)
            assert len(outcomes) == world
        assert not marker.exists(), f"{reader} executed the hostile payload"
    # and in this (single, group-less) process too
    for reader in READERS[1:]:
        if reader in must_raise:
            with pytest.raises(CheckpointingException) as info:
                getattr(dc, reader)(ckpt)
            assert fragment in str(info.value)
        else:
            try:
                getattr(dc, reader)(ckpt)
            except CheckpointingException:
                pass
        assert not marker.exists(), f"offline {reader} executed the hostile payload"


@WORLDS
@pytest.mark.parametrize("how", ["torch_save", "torch_save_nested", "raw_pickle"])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_hostile_common_pt(world, how, tmp_path):
    pool = get_pool(world)
    ckpt = tmp_path / "ckpt"
    marker = tmp_path / "pwned"
    pool.run(_save_state, str(ckpt), timeout=_TIMEOUT)
    path = ckpt / "common.pt"
    assert path.is_file()
    if how == "torch_save":
        torch.save(Evil(str(marker)), path)
    elif how == "torch_save_nested":  # looks like a normal common state, one hostile value
        torch.save({"iteration": 5, "args": {"lr": Evil(str(marker))}}, path)
    else:
        path.write_bytes(pickle.dumps(Evil(str(marker))))
    _check_hostile(pool, world, ckpt, marker, ("load", "load_common_state_dict"), "common.pt")
    assert not marker.exists()


def _save_with_evil_object(rank, world, ckpt, marker):
    sd = _state(rank, world)
    data = Evil(marker) if rank == world - 1 else {"ok": rank}
    sd["evil"] = ShardedObject("evil", data, (world,), (rank,))
    dc.save(sd, ckpt)
    return True


def _load_with_evil_object(rank, world, ckpt):
    sd = _state(rank, world, fill=False)
    sd["evil"] = ShardedObject("evil", None, (world,), (rank,))
    dc.load(sd, ckpt)


@WORLDS
def test_hostile_sharded_object(world, tmp_path):
    pool = get_pool(world)
    ckpt = tmp_path / "ckpt"
    marker = tmp_path / "pwned"
    pool.run(_save_with_evil_object, str(ckpt), str(marker), timeout=_TIMEOUT)
    assert not marker.exists(), "save executed the payload"  # pickling only calls __reduce__
    culprit = f"evil/shard_{world - 1}_{world}"
    excs = pool.run_expect_error(_load_with_evil_object, str(ckpt), timeout=_TIMEOUT)
    assert_all_raise(excs, world, culprit)
    assert not marker.exists()
    # Readers that do not need the object may work; none may run it.
    _check_hostile(pool, world, ckpt, marker, (), culprit)
    assert not marker.exists()


def _evil_metadata_bytes(ckpt: Path, marker: Path, how: str) -> bytes:
    if how == "raw":
        return pickle.dumps(Evil(str(marker)))
    # otherwise valid DCP metadata with one hostile attribute hidden inside
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own, trusted file
    metadata.planner_data = {"x": Evil(str(marker))}
    return pickle.dumps(metadata)


@WORLDS
@pytest.mark.parametrize("how", ["raw", "nested"])
def test_hostile_dcp_metadata(world, how, tmp_path):
    pool = get_pool(world)
    ckpt = tmp_path / "ckpt"
    marker = tmp_path / "pwned"
    pool.run(_save_state, str(ckpt), timeout=_TIMEOUT)
    (ckpt / ".metadata").write_bytes(_evil_metadata_bytes(ckpt, marker, how))
    # an attacker also drops the checksum sidecar: the safe unpickler alone must refuse
    (ckpt / ".metadata.checksum").unlink(missing_ok=True)
    _check_hostile(pool, world, ckpt, marker, ("load", "load_plain_tensors", "load_sharded_metadata"),
                   ".metadata")
    assert not marker.exists()


@WORLDS
def test_hostile_tensor_blob(world, tmp_path):
    """A tensor chunk whose blob is a hostile pickle (not a plain tensor) is refused."""
    pool = get_pool(world)
    ckpt = tmp_path / "ckpt"
    marker = tmp_path / "pwned"
    pool.run(_save_state, str(ckpt), timeout=_TIMEOUT)
    evil_file = ckpt / "__evil.distcp"
    torch.save(Evil(str(marker)), evil_file)
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own, trusted file
    index = MetadataIndex("layer.w", torch.Size([0, 0]))
    assert index in metadata.storage_data
    metadata.storage_data[index] = _StorageInfo("__evil.distcp", 0, evil_file.stat().st_size)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    (ckpt / ".metadata.checksum").unlink(missing_ok=True)  # a consistent attacker drops it
    excs = pool.run_expect_error(_read, str(ckpt), "load", timeout=_TIMEOUT)
    assert_all_raise(excs, world, "__evil.distcp", "layer.w")
    assert not marker.exists()
    with pytest.raises(CheckpointingException, match="__evil.distcp"):
        dc.load_plain_tensors(ckpt)
    assert not marker.exists()


def _save_benign(rank, world, ckpt):
    sd = _state(rank, world)
    sd["custom"] = ShardedObject("custom", Benign(rank), (world,), (rank,))
    sd["cfg"] = Benign(-1)
    dc.save(sd, ckpt)
    return True


def _load_benign(rank, world, ckpt, allow_sharded, allow_common):
    sd = _state(rank, world, fill=False)
    sd["custom"] = ShardedObject("custom", None, (world,), (rank,))
    loaded = dc.load(sd, ckpt,
                     sharded_strategy=TorchDistLoadShardedStrategy(allow_pickle=True) if allow_sharded else None,
                     common_strategy=TorchCommonLoadStrategy(allow_pickle=True) if allow_common else None)
    _check_loaded(loaded, rank, world)
    assert loaded["custom"] == Benign(rank) and loaded["cfg"] == Benign(-1)
    return True


@WORLDS
def test_allow_pickle_is_an_explicit_opt_in(world, tmp_path):
    pool = get_pool(world)
    ckpt = tmp_path / "ckpt"
    pool.run(_save_benign, str(ckpt), timeout=_TIMEOUT)
    # default: both the common state and the object are refused, naming the class
    excs = pool.run_expect_error(_load_benign, str(ckpt), False, False, timeout=_TIMEOUT)
    assert_all_raise(excs, world, "common.pt", "Benign")
    excs = pool.run_expect_error(_load_benign, str(ckpt), False, True, timeout=_TIMEOUT)
    assert_all_raise(excs, world, "custom/shard_", "Benign")
    excs = pool.run_expect_error(_load_benign, str(ckpt), True, False, timeout=_TIMEOUT)
    assert_all_raise(excs, world, "common.pt", "Benign")
    # explicit opt-in on both strategies: loads
    assert pool.run(_load_benign, str(ckpt), True, True, timeout=_TIMEOUT) == [True] * world
    with pytest.raises(CheckpointingException, match="allow_pickle"):
        dc.load_common_state_dict(ckpt)
    assert TorchCommonLoadStrategy(allow_pickle=True).load_common(ckpt)["cfg"] == Benign(-1)


# ----------------------------------------------------------------------------- 2. damaged checkpoints


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    assert len(raw) > 1
    path.write_bytes(raw[: len(raw) // 2])


def _unknown_backend(ckpt: Path) -> None:
    cfg = json.loads((ckpt / CONFIG_FNAME).read_text())
    cfg["sharded_backend"] = "zarr_from_the_future"
    (ckpt / CONFIG_FNAME).write_text(json.dumps(cfg))


# name -> (tamper, fragment the message must contain, offline readers that must raise too)
_DAMAGE = {
    "metadata_truncated": (lambda d: _truncate(d / ".metadata"), ".metadata",
                           ("load_plain_tensors", "load_sharded_metadata")),
    "metadata_deleted": (lambda d: (d / ".metadata").unlink(), ".metadata",
                         ("load_plain_tensors", "load_sharded_metadata")),
    "distcp_truncated": (lambda d: _truncate(d / "__0_0.distcp"), "__0_0.distcp", ("load_plain_tensors",)),
    "distcp_deleted": (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp", ("load_plain_tensors",)),
    # rank 0's second file ends with the ShardedObject: the cut lands in it
    "distcp_object_truncated": (lambda d: _truncate(d / "__0_1.distcp"), "__0_1.distcp", ()),
    "common_truncated": (lambda d: _truncate(d / "common.pt"), "common.pt", ("load_common_state_dict",)),
    "common_deleted": (lambda d: (d / "common.pt").unlink(), "common.pt", ("load_common_state_dict",)),
    "unknown_backend": (_unknown_backend, "zarr_from_the_future", READERS[1:]),
    "config_garbage": (lambda d: (d / CONFIG_FNAME).write_text('{"sharded_backend": '), CONFIG_FNAME, READERS[1:]),
}


@WORLDS
def test_damaged_checkpoints_raise_on_every_rank(world, tmp_path):
    pool = get_pool(world)
    base = tmp_path / "base"
    pool.run(_save_state, str(base), timeout=_TIMEOUT)
    assert pool.run(_load_and_check, str(base), timeout=_TIMEOUT) == [True] * world
    with open(base / ".metadata", "rb") as f:
        files = {(i.fqn, tuple(i.offset or ())): si.relative_path for i, si in pickle.load(f).storage_data.items()}
    assert files[("layer.w", (0, 0))] == "__0_0.distcp", files
    assert files[(f"rank_state/shard_0_{world}", ())] == "__0_1.distcp", files
    failures = []
    for name, (tamper, fragment, offline) in _DAMAGE.items():
        ckpt = tmp_path / name
        shutil.copytree(base, ckpt)
        tamper(ckpt)
        try:
            excs = pool.run_expect_error(_read, str(ckpt), "load", timeout=_TIMEOUT)
            assert_all_raise(excs, world, fragment)
            for reader in offline:
                excs = pool.run_expect_error(_read, str(ckpt), reader, timeout=_TIMEOUT)
                assert_all_raise(excs, world, fragment)
                with pytest.raises(CheckpointingException) as info:
                    getattr(dc, reader)(ckpt)
                assert fragment in str(info.value), (reader, str(info.value))
        except AssertionError as e:  # report every damaged case, not only the first
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)
    # the pristine copy is unaffected by all of this
    assert pool.run(_load_and_check, str(base), timeout=_TIMEOUT) == [True] * world


# ----------------------------------------------------------------------------- 3. crash safety

_SAVER = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(1)
    import dist_checkpointing as dc
    from dist_checkpointing import ShardedTensor

    ckpt, n_tensors, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    numel = mib * (1 << 20) // 4
    sd = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((numel,), float(i)))
          for i in range(n_tensors)}
    sd["step"] = 1
    dc.save(sd, ckpt)
    """
)


def _distcp_bytes(path: Path) -> int:
    total = 0
    try:
        for p in path.iterdir():
            if p.name.endswith(".distcp"):
                try:
                    total += p.stat().st_size
                except FileNotFoundError:
                    pass
    except FileNotFoundError:
        pass
    return total


def _kill_save_midway(script: Path, ckpt: Path, n_tensors: int, mib: int) -> bool:
    """Start a save of ``n_tensors x mib`` MiB into ``ckpt`` and SIGKILL it as soon as
    data bytes appear. False if the save finished before it could be killed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(_ROOT))
    proc = Launched([str(script), str(ckpt), str(n_tensors), str(mib)], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if _distcp_bytes(ckpt) > 0:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=slack(30))
                return True
            time.sleep(0.002)
        else:
            pytest.fail("the saver subprocess wrote no data within 60 s")
        err = proc.output()[1]
        assert proc.returncode == 0, f"saver failed on its own (rc {proc.returncode}):\n{err}"
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=slack(30))


def test_killed_save_is_not_a_checkpoint_and_earlier_one_survives(tmp_path):
    a = tmp_path / "A"
    state_a = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.arange(1000.0) + i) for i in range(3)}
    state_a["obj"] = ShardedObject("obj", {"k": [1, 2]}, (1,), (0,))
    state_a["step"] = 7
    dc.save(state_a, a)
    digest_a = _dir_digest(a)

    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    b = tmp_path / "B"
    killed = False
    try:
        for n_tensors, mib in [(4, 64), (4, 128), (8, 128)]:
            if b.exists():
                shutil.rmtree(b)
            if _kill_save_midway(script, b, n_tensors, mib):
                killed = True
                break
        assert killed, "every save finished before it could be killed"

        assert _distcp_bytes(b) > 0  # really killed midway: partial data is there
        assert not (b / CONFIG_FNAME).exists()
        assert not dc.check_is_distributed_checkpoint(b)

        def incomplete(msg: str) -> bool:
            return "metadata.json" in msg or "incomplete" in msg.lower()

        request = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(4)) for i in range(4)}
        for call in (lambda: dc.load(request, b), lambda: dc.load_common_state_dict(b),
                     lambda: dc.load_plain_tensors(b), lambda: dc.load_sharded_metadata(b)):
            with pytest.raises(CheckpointingException) as info:
                call()
            assert incomplete(str(info.value)), str(info.value)
        # the debris is not silently reused by a new save either
        with pytest.raises(CheckpointingException, match="not empty"):
            dc.save({"t": ShardedTensor.from_rank_offsets("t", torch.ones(2))}, b)
    finally:
        shutil.rmtree(b, ignore_errors=True)

    assert _dir_digest(a) == digest_a
    request_a = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(1000)) for i in range(3)}
    request_a["obj"] = ShardedObject("obj", None, (1,), (0,))
    loaded = dc.load(request_a, a)
    for i in range(3):
        assert torch.equal(loaded[f"t{i}"], torch.arange(1000.0) + i)
    assert loaded["obj"] == {"k": [1, 2]} and loaded["step"] == 7
    assert _dir_digest(a) == digest_a


@WORLDS
def test_save_into_complete_checkpoint_refused_untouched(world, tmp_path):
    pool = get_pool(world)
    ckpt = tmp_path / "ckpt"
    pool.run(_save_state, str(ckpt), timeout=_TIMEOUT)
    digest = _dir_digest(ckpt)
    excs = pool.run_expect_error(_save_state, str(ckpt), timeout=_TIMEOUT)
    assert_all_raise(excs, world, "not empty", str(ckpt))
    assert _dir_digest(ckpt) == digest
    assert pool.run(_load_and_check, str(ckpt), timeout=_TIMEOUT) == [True] * world
    assert _dir_digest(ckpt) == digest
