"""Keys must be UTF-8 text (issue 43, items 4 and 5): a key with a lone surrogate (what
``os.fsdecode`` makes of a name that is not UTF-8) is refused by one rule
(``core.key_problem``) on every surface — save, load, validation, ``.metadata``, the index,
the zarr reader, the tools, the transport — with a ``CheckpointingException`` naming the
key on every rank, also when only one rank holds it (an agreed step, never a hang or a raw
``UnicodeEncodeError``). Exports write only what their reader parses."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import struct
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main as cli_main
from dist_checkpointing.core import key_problem
from dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from dist_checkpointing.strategies.torch_dist import key_index
from dist_checkpointing.tools import export_checkpoint, validate_checkpoint
from dist_checkpointing.strategies.safetensors.format import check_header
from dist_checkpointing.transport import PGTransport
from dist_checkpointing.validation import validate_sharding_integrity

from .conftest import FIXTURES, get_pool
from .helpers import assert_all_raise

BAD = "w\udcff"  # os.fsdecode(b"w\xff")
NAMED = repr(BAD)  # how every message names it
_TIMEOUT = 60.0


def _tensor(key: str, rank: int, world: int) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, torch.arange(4.0) + 4 * rank, (0, rank, world))


def _state(rank: int, world: int, holders: str, kind: str) -> dict:
    sd = {"good": _tensor("good", rank, world)}
    if holders == "all" or (holders == "one" and rank == world - 1):
        if kind == "tensor":
            sd["bad"] = ShardedTensor.from_rank_offsets(BAD, torch.ones(2), replica_id=rank)
        elif kind == "object":
            sd["bad"] = ShardedObject(BAD, {"x": 1}, (1,), (0,), replica_id=rank)
        else:  # flattened
            sd["bad"] = ShardedTensor.from_rank_offsets_flat(BAD, torch.ones(2), (4,), flattened_range=slice(0, 2),
                                                             replica_id=rank)
    return sd


def _save(rank: int, world: int, ckpt: str, holders: str, kind: str, validate: bool) -> None:
    dc.save(_state(rank, world, holders, kind), ckpt, validate_access_integrity=validate)


def _load(rank: int, world: int, ckpt: str, how: str) -> None:
    request = {"good": ShardedTensor.from_rank_offsets("good", torch.zeros(4), (0, rank, world))}
    if rank == world - 1:  # one rank asks for the key
        request["bad"] = ShardedTensor.from_rank_offsets(BAD, torch.zeros(4))
    if how == "strategy":  # the strategy's own load, as Megatron-LM may call it
        TorchDistLoadShardedStrategy().load(request, ckpt)
    else:
        strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()) if how == "fully_parallel" else None
        dc.load(request, ckpt, sharded_strategy=strategy, validate_access_integrity=how != "no_validation")


def _validate(rank: int, world: int) -> None:
    items = [_tensor("good", rank, world)] + ([_tensor(BAD, rank, world)] if rank == 0 else [])
    validate_sharding_integrity(items)


def test_the_rule():
    assert key_problem("decoder.layers.0.weight") is None and key_problem("ünïcødé/✓") is None
    assert NAMED in key_problem(BAD) and "UTF-8" in key_problem(BAD)
    assert "not a string" in key_problem(7)


@pytest.mark.parametrize("world, holders", [(1, "all"), (2, "all"), (2, "one"), (4, "all"), (4, "one")])
@pytest.mark.parametrize("kind", ["tensor", "object", "flattened"])
@pytest.mark.parametrize("validate", [True, False])
def test_save_refuses_on_every_rank_and_writes_nothing(world, holders, kind, validate, tmp_path):
    ckpt = tmp_path / "ckpt"
    errors = get_pool(world).run_expect_error(_save, str(ckpt), holders, kind, validate, timeout=_TIMEOUT)
    assert_all_raise(errors, world, NAMED, "UTF-8")
    assert not ckpt.exists()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("how", ["plain", "no_validation", "fully_parallel", "strategy"])
def test_load_request_refused_on_every_rank(world, how, tmp_path):
    ckpt = tmp_path / "ckpt"
    get_pool(world).run(_save, str(ckpt), "none", "tensor", True, timeout=_TIMEOUT)
    errors = get_pool(world).run_expect_error(_load, str(ckpt), how, timeout=_TIMEOUT)
    assert_all_raise(errors, world, NAMED)


@pytest.mark.parametrize("world", [2, 4])
def test_validation_of_one_ranks_key_is_refused_everywhere(world):
    assert_all_raise(get_pool(world).run_expect_error(_validate, timeout=_TIMEOUT), world, NAMED)


# ----------------------------------------------------------------------------- stored keys


@pytest.fixture
def stored_bad_key(tmp_path: Path) -> Path:
    """A checkpoint whose ``.metadata`` holds the key (as a writer that pickles it may
    write it): its tensor ``good`` renamed, the sidecar and index dropped."""
    ckpt = tmp_path / "stored"
    dc.save({"good": ShardedTensor.from_rank_offsets("good", torch.arange(4.0)), "step": 1}, ckpt)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own, trusted file
    metadata.state_dict_metadata[BAD] = metadata.state_dict_metadata.pop("good")
    metadata.storage_data = {type(i)(BAD, i.offset, i.index): v for i, v in metadata.storage_data.items()}
    metadata.mcore_data = {BAD: {}}
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    for name in (".metadata.checksum", ".metadata.index", ".metadata.index.checksum"):
        (ckpt / name).unlink()
    return ckpt


def test_stored_key_is_refused_by_every_reader(stored_bad_key, tmp_path, capsys):
    for read in (dc.load_plain_tensors, dc.load_tensors_metadata, dc.load_sharded_metadata,
                 lambda c: dc.load({"w": ShardedTensor.from_rank_offsets("other", torch.zeros(4))}, c)):
        with pytest.raises(CheckpointingException, match=r"\.metadata is malformed.*'w\\udcff'.*UTF-8"):
            read(stored_bad_key)
    report = validate_checkpoint(stored_bad_key)
    assert not report.ok and any(NAMED in p for p in report.problems), report.problems
    out = tmp_path / "out"
    for fmt in ("safetensors", "torch"):
        with pytest.raises(CheckpointingException, match=r"'w\\udcff'"):
            export_checkpoint(stored_bad_key, out / fmt, fmt)
        assert not (out / fmt).exists()
    assert cli_main(["inspect", str(stored_bad_key)]) != 0
    assert cli_main(["validate", str(stored_bad_key)]) == 1
    assert cli_main(["export", str(stored_bad_key), str(out / "cli")]) != 0
    captured = capsys.readouterr()
    assert "w\\udcff" in captured.err + captured.out and not (out / "cli").exists()


def test_index_bucket_with_such_a_key_is_malformed(tmp_path, monkeypatch):
    """A crafted index whose bucket names such a key (as JSON's escape ``\\udcff``) is
    refused naming the index, never a raw error."""
    ckpt = tmp_path / "ckpt"
    dc.save({"good": ShardedTensor.from_rank_offsets("good", torch.arange(4.0))}, ckpt)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    record = key_index.index_records(metadata)["good"]
    old = (ckpt / ".metadata.index").read_bytes()
    indexed = key_index.IndexHeader(old, "index", len(old)).metadata_checksum
    monkeypatch.setattr(key_index, "bucket_of", lambda key, n: 0)  # one bucket: no hash needed to craft it
    raw = key_index._index_file({BAD: json.dumps([BAD, record]).encode()}, indexed, "record", True)
    monkeypatch.undo()
    (ckpt / ".metadata.index").write_bytes(raw)
    (ckpt / ".metadata.index.checksum").unlink()
    strategy = TorchDistLoadShardedStrategy()
    monkeypatch.setattr("dist_checkpointing.strategies.torch_dist.index_view.INDEX_ABOVE_BYTES", 0)
    with pytest.raises(CheckpointingException, match=r"\.metadata\.index: bucket 0 is malformed: key 'w\\udcff'"):
        strategy.load_local({"w": ShardedTensor.from_rank_offsets("good", torch.zeros(4))}, ckpt)
    report = validate_checkpoint(ckpt)
    assert any("bucket 0 is malformed" in p and NAMED in p for p in report.problems), report.problems


def test_zarr_directory_name_not_utf8(tmp_path):
    """A zarr checkpoint's key is a directory name: one that is not UTF-8 is refused by
    loads, the offline readers and ``validate``, naming it."""
    ckpt = tmp_path / "zarr"
    shutil.copytree(FIXTURES / "mcore_v0_15" / "zarr_tp2_dp2" / "checkpoint", ckpt)
    array = next(p for p in sorted(ckpt.iterdir()) if (p / ".zarray").is_file())
    os.rename(array, ckpt / BAD)
    assert (ckpt / os.fsdecode(b"w\xff")).is_dir()
    for read in (dc.load_plain_tensors, dc.load_tensors_metadata):
        with pytest.raises(CheckpointingException, match=r"'w\\udcff'.*UTF-8"):
            read(ckpt)
    report = validate_checkpoint(ckpt)
    assert any(NAMED in p for p in report.problems), report.problems


# ----------------------------------------------------------------------------- export


def test_export_refuses_what_safetensors_cannot_hold(tmp_path):
    ckpt = tmp_path / "ckpt"
    dc.save({"m": ShardedTensor.from_rank_offsets("__metadata__", torch.ones(2)),
             "w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, ckpt)
    with pytest.raises(CheckpointingException, match="'__metadata__'.*reserves"):
        export_checkpoint(ckpt, tmp_path / "st", "safetensors")
    assert not (tmp_path / "st").exists()
    export_checkpoint(ckpt, tmp_path / "export.pt", "torch")  # torch.save holds it
    assert set(torch.load(tmp_path / "export.pt")) == {"__metadata__", "w"}
    with pytest.raises(CheckpointingException, match=r"prefix.*'w\\udcff'"):
        export_checkpoint(ckpt, tmp_path / "p", "safetensors", key_prefix=BAD)


def test_exported_files_parse_with_safetensors(tmp_path):
    """Every header the export writes is the one ``safetensors`` reads (several files,
    odd names, an empty tensor), and the header check refuses what it would not parse."""
    safetensors = pytest.importorskip("safetensors.torch")
    ckpt = tmp_path / "ckpt"
    keys = ["ünï.cødé", "a b/c", "e", "q\"uote"]
    dc.save({k: ShardedTensor.from_rank_offsets(k, torch.arange(3.0 + i)) for i, k in enumerate(keys)} |
            {"z": ShardedTensor.from_rank_offsets("z", torch.zeros(0))}, ckpt)
    files = export_checkpoint(ckpt, tmp_path / "st", "safetensors", max_shard_bytes=16)
    loaded = {}
    for f in files:
        if str(f).endswith(".safetensors"):
            loaded.update(safetensors.load_file(f))
    assert sorted(loaded) == sorted(keys + ["z"]) and torch.equal(loaded["e"], torch.arange(5.0))
    for bad in [b'{"w\\udcff":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b'[1]',
                b'{"w":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}',
                b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b'{"__metadata__":{"a":1}}']:
        with pytest.raises(CheckpointingException, match="would not be readable"):
            check_header(bad, "x")
        with pytest.raises(Exception):  # the reader itself refuses them
            safetensors.load(struct.pack("<Q", len(bad)) + bad + b"\0" * 8)


# ----------------------------------------------------------------------------- transport


@contextlib.contextmanager
def _group():
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def _transfer(rank: int, world: int, where: str) -> None:
    state = {"model": {BAD if where == "top" else "w": torch.ones(2)}, "step": 1}
    if where == "nested":
        state["model"]["w"] = [{"x": 1, BAD: torch.zeros(1)}]
    with _group() as g:
        if rank == 0:
            PGTransport(g, timedelta(seconds=5), "cpu").send_checkpoint(list(range(1, world)), state)
        else:
            PGTransport(g, timedelta(seconds=5), "cpu").recv_checkpoint(0)


@pytest.mark.parametrize("where", ["top", "nested"])
def test_transport_refuses_on_sender_and_receivers(where):
    errors = get_pool(2).run_expect_error(_transfer, where, timeout=_TIMEOUT)
    assert_all_raise(errors, 2, NAMED)
