"""``validate`` reads every file a load may read (issue 43, item 6): the per-key index
``.metadata.index`` and its checksum sidecar (bucket by bucket as a load reads them, and
each record against ``.metadata``'s), the integrity manifest, what a save leaves behind.
It never says OK for what ``load`` refuses: each damage is tried on ``validate`` and on
loads at worlds 1 and 2 that use the index (as loads do whenever the ranks together would
read more than ``INDEX_ABOVE_BYTES`` of ``.metadata``)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main as cli_main
from dist_checkpointing.integrity.checksums import checksum
from dist_checkpointing.strategies.torch_dist import index_view, key_index
from dist_checkpointing.tools import validate_checkpoint

from .conftest import get_pool
from .helpers import flip_byte

_KEYS = 40  # several buckets
_TIMEOUT = 60.0


def _save(rank: int, world: int, ckpt: str) -> None:
    sd = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.arange(4.0) + i + 4 * rank, (0, rank, world))
          for i in range(_KEYS)}
    dc.save(dict(sd, o=ShardedObject("o", {"step": 3}, (1,), (0,), replica_id=rank), step=3), ckpt)


def _load_with_index(rank: int, world: int, ckpt: str) -> str:
    """A load that uses the index (its threshold set to 0 here, restored after)."""
    old = index_view.INDEX_ABOVE_BYTES
    index_view.INDEX_ABOVE_BYTES = 0
    try:
        request = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.zeros(8), replica_id=rank)
                   for i in range(_KEYS)}
        loaded = dc.load(dict(request, o=ShardedObject("o", None, (1,), (0,), replica_id=rank)), ckpt)
        assert torch.equal(loaded["w3"], torch.arange(8.0) + 3) and loaded["o"] == {"step": 3}
        return "ok"
    except CheckpointingException as e:
        return f"refused: {e}"
    finally:
        index_view.INDEX_ABOVE_BYTES = old


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    get_pool(2).run(_save, str(ckpt), timeout=_TIMEOUT)
    return ckpt


def _bucket_span(ckpt: Path, bucket: int):
    raw = (ckpt / ".metadata.index").read_bytes()
    header = key_index.IndexHeader(raw, "index", len(raw))
    return key_index._ENTRY.unpack_from(raw, header.table_offset + bucket * key_index._ENTRY.size)


def _flip_bucket(ckpt: Path) -> None:
    offset, length, _ = _bucket_span(ckpt, 7)
    flip_byte(ckpt / ".metadata.index", offset + length // 2)


def _without_sidecar(damage):
    def both(ckpt: Path) -> None:
        damage(ckpt)
        (ckpt / ".metadata.index.checksum").unlink()
    return both


def _rewrite_index(ckpt: Path, change) -> None:
    """An index whose every checksum is right but whose records ``change`` altered (a
    crafted or buggy writer), with a matching sidecar."""
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own, trusted file
    raw = (ckpt / ".metadata.index").read_bytes()
    indexed = key_index.IndexHeader(raw, "index", len(raw)).metadata_checksum
    records = key_index.index_records(metadata)
    change(records)
    encoded = {k: json.dumps([k, r], separators=(",", ":")).encode() for k, r in records.items()}
    data = key_index._index_file(encoded, indexed, "record", True)
    (ckpt / ".metadata.index").write_bytes(data)
    sidecar = json.loads((ckpt / ".metadata.index.checksum").read_text())
    sidecar.update(checksum=f"{checksum(data):016x}", length=len(data))
    (ckpt / ".metadata.index.checksum").write_text(json.dumps(sidecar))


def _moved_chunk(records) -> None:
    records["w5"][4][0][3] += 8  # chunk 0 of w5 claims the bytes 8 further on


def _dropped_key(records) -> None:
    del records["w9"]


def _foreign_index(ckpt: Path) -> None:
    """The index (and sidecar) of another save of the same layout."""
    other = ckpt.parent / "other"
    get_pool(2).run(_save, str(other), timeout=_TIMEOUT)
    for name in (".metadata.index", ".metadata.index.checksum"):
        shutil.copy(other / name, ckpt / name)


# damage -> (what validate's problems say, or None for OK; whether a load through the index is refused)
CASES = {
    "bucket flipped": (_flip_bucket, ".metadata.index", True),
    "bucket flipped, no sidecar": (_without_sidecar(_flip_bucket), "Checksum mismatch for bucket 7", True),
    "bucket table flipped, no sidecar": (_without_sidecar(lambda c: flip_byte(c / ".metadata.index", 70)),
                                         ".metadata.index: bucket 0 claims bytes", True),
    "truncated, no sidecar": (_without_sidecar(lambda c: (c / ".metadata.index").write_bytes(
        (c / ".metadata.index").read_bytes()[:-10])), ".metadata.index", True),
    "sidecar damaged": (lambda c: (c / ".metadata.index.checksum").write_text("{nope"),
                        ".metadata.index.checksum is damaged", False),
    "record moved": (lambda c: _rewrite_index(c, _moved_chunk), "does not match the .metadata it indexes", True),
    "record dropped": (lambda c: _rewrite_index(c, _dropped_key), "'w9'", True),
    "header flipped, no sidecar": (_without_sidecar(lambda c: flip_byte(c / ".metadata.index", 20)), None, False),
    "another save's index": (_foreign_index, None, False),
    "no index": (lambda c: (c / ".metadata.index").unlink(), None, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_has_the_verdict_of_a_load_through_the_index(saved, case, tmp_path):
    damage, problem, refused = CASES[case]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    damage(ckpt)
    report = validate_checkpoint(ckpt)
    if problem is None:
        assert report.ok, report.problems
    else:
        assert not report.ok and any(problem in p for p in report.problems), report.problems
    for world in (1, 2):
        verdicts = get_pool(world).run(_load_with_index, str(ckpt), timeout=_TIMEOUT)
        assert all(v.startswith("refused") == refused for v in verdicts), (world, verdicts)
        if refused:  # what a load refuses, validate never calls OK
            assert not report.ok
    assert cli_main(["validate", str(ckpt)]) == (0 if problem is None else 1)


def test_leftovers_of_a_save_are_noted(saved, tmp_path):
    """A claim left by a save that committed but did not remove it, or an atomic write's
    temporary file: loads ignore them, validate says OK and notes them."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    (ckpt / ".save_claim").write_text('{"save_id": "0f3c", "host": "node7", "pid": 4242, "time": 0}')
    (ckpt / "..metadata.1a2b.tmp").write_bytes(b"partial")
    report = validate_checkpoint(ckpt)
    assert report.ok, report.problems
    assert any(".save_claim" in n and "save 0f3c by pid 4242 on node7" in n for n in report.notes), report.notes
    assert any("..metadata.1a2b.tmp" in n for n in report.notes), report.notes
    assert get_pool(2).run(_load_with_index, str(ckpt), timeout=_TIMEOUT) == ["ok", "ok"]
