"""The offline tools and their command line: inspect, validate, export, import, progress
reporting, and the per-phase timing of ``save``/``load``.

Most cases run in this process with no process group: checkpoints are built with
``dist_checkpointing.save`` and the CLI is driven through ``cli.main([...])``. One
checkpoint is saved by two gloo ranks (TP-split tensors and flattened distributed-optimizer
slices) to test consolidation; a few cases run the real ``python -m dist_checkpointing``
in a subprocess (stderr is then not a terminal, so progress comes as log lines).

Expected tensor values are computed here from a formula, never read back through the code
under test, so an export or import that returns wrong bytes fails.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.strategies.torch import read_metadata
from dist_checkpointing.tools import (
    export_checkpoint,
    format_info,
    human_size,
    import_checkpoint,
    inspect_checkpoint,
    validate_checkpoint,
)

from .conftest import FIXTURES, get_pool
from . import launch
from .helpers import flip_byte, slack

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402

_ROOT = Path(__file__).resolve().parents[1]
_TIMEOUT = 120.0
SER_LOGGER = "dist_checkpointing.serialization"


# ----------------------------------------------------------------------------- values


def _values(shape, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """A deterministic global tensor (distinct per key through ``salt``)."""
    n = math.prod(shape)
    base = torch.arange(n, dtype=torch.float64).reshape(shape)
    if dtype == torch.bool:
        return ((base + salt) % 3 == 0)
    if dtype in (torch.uint8, torch.int16, torch.int64):
        return ((base * 7 + salt) % 127).to(dtype)
    if dtype == torch.float8_e4m3fn:
        return ((base - n / 2) * 0.25 + salt * 0.125).to(dtype)
    return (base * 0.5 + salt + 0.25).to(dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Comparable form (float8 has no CPU ``equal``): its bytes."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert isinstance(got, torch.Tensor), what
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (what, tuple(got.shape), tuple(want.shape))
    assert torch.equal(_raw(got), _raw(want)), f"{what}: values differ\n{got}\n{want}"


# The single-process checkpoint: key -> (shape, dtype). "optimizer.exp_avg.weight" is saved
# as two flattened slices [0, 10) and [10, 24) of its (4, 6) chunk.
SPECS = {
    "model.embedding.weight": ((8, 4), torch.float32),
    "model.layer.bias": ((6,), torch.bfloat16),
    "model.layer.half": ((2, 3), torch.float16),
    "model.ints16": ((5,), torch.int16),
    "model.ids": ((7,), torch.int64),
    "model.mask": ((3, 2), torch.bool),
    "model.bytes": ((9,), torch.uint8),
    "model.fp8": ((4, 2), torch.float8_e4m3fn),
    "model.scalar": ((), torch.float32),
    "model.empty": ((0, 3), torch.float32),
    "optimizer.exp_avg.weight": ((4, 6), torch.float32),
}
FLAT_KEY = "optimizer.exp_avg.weight"
EXPECTED = {k: _values(shape, dtype, i) for i, (k, (shape, dtype)) in enumerate(sorted(SPECS.items()))}
COMMON = {"iteration": 11, "args": {"lr": 0.5, "name": "gpt"}}


def _nbytes(key: str) -> int:
    shape, dtype = SPECS[key]
    return math.prod(shape) * dtype.itemsize


TOTAL_BYTES = sum(_nbytes(k) for k in SPECS)


def _single_state() -> dict:
    sd: dict = {"model": {}}
    for key in SPECS:
        if key == FLAT_KEY:
            continue
        sd["model"][key] = ShardedTensor.from_rank_offsets(key, EXPECTED[key].clone())
    flat = EXPECTED[FLAT_KEY].reshape(-1)
    sd["optimizer"] = [
        ShardedTensor.from_rank_offsets_flat(FLAT_KEY, flat[a:b].clone(), (4, 6), flattened_range=slice(a, b))
        for a, b in ((0, 10), (10, 24))
    ]
    sd["rng"] = ShardedObject("rng", {"seed": 3, "state": [1, 2, 3]}, (1,), (0,))
    sd.update(json.loads(json.dumps(COMMON)))
    return sd


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """The single-process checkpoint (shared: tests that damage it work on a copy)."""
    get_pool(2)  # only starts the two ranks: they boot while the single-process tests run
    path = tmp_path_factory.mktemp("tools") / "ckpt"
    dc.save(_single_state(), path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)  # the fixtures are read-only
    return dst


def _run_cli(capsys, *argv) -> tuple:
    """``cli.main(argv)`` in this process: (exit code, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _subprocess(*argv, exe=None) -> subprocess.CompletedProcess:
    """The installed ``exe`` as a subprocess, or ``python -m dist_checkpointing`` forked from
    the preloaded server (``launch.py``)."""
    env = dict(os.environ, PYTHONPATH=str(_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if exe is None:
        return launch.run(["-m", "dist_checkpointing", *map(str, argv)], env=env, cwd=_ROOT, timeout=slack(120))
    return subprocess.run([exe] + [str(a) for a in argv], capture_output=True, text=True, timeout=slack(120),
                          env=env, cwd=str(_ROOT))


def _read_safetensors_dir(out: Path) -> Dict[str, torch.Tensor]:
    tensors: Dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                assert k not in tensors, f"{k} in two files"
                tensors[k] = fh.get_tensor(k)
    return tensors


# ----------------------------------------------------------------------------- 1. inspect

_ROW = re.compile(r"^  (\S+)\s+\(([^)]*)\)\s+(\S+)\s+(\d+)\s+(.+?)\s+(yes|no)$")


def test_inspect_table(ckpt, capsys):
    rc, out, err = _run_cli(capsys, "inspect", ckpt)
    assert rc == 0, err
    assert "backend      torch_dist v1 (common state: torch)" in out
    assert "common state args, iteration" in out
    assert f"tensors      {len(SPECS)}," in out
    rows = {m.group(1): m.groups()[1:] for m in map(_ROW.match, out.splitlines()) if m}
    assert set(rows) == set(SPECS), out
    for key, (shape, dtype) in SPECS.items():
        shape_s, dtype_s, chunks, _, flat = rows[key]
        assert shape_s == ", ".join(map(str, shape)), (key, shape_s)
        assert dtype_s == str(dtype).replace("torch.", ""), key
        assert int(chunks) == (2 if key == FLAT_KEY else 1), key
        assert flat == ("yes" if key == FLAT_KEY else "no"), key
    assert "objects      1" in out and "rng/shard_0_1" in out
    files = [p for p in ckpt.iterdir() if p.is_file()]
    assert f"files        {len(files)}," in out


def test_inspect_json(ckpt, capsys):
    rc, out, err = _run_cli(capsys, "inspect", ckpt, "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["sharded_backend"] == "torch_dist" and info["sharded_backend_version"] == 1
    assert info["common_backend"] == "torch" and info["common_error"] is None
    assert info["common_keys"] == ["args", "iteration"]
    tensors = {t["key"]: t for t in info["tensors"]}
    assert set(tensors) == set(SPECS)
    for key, (shape, dtype) in SPECS.items():
        t = tensors[key]
        assert t["shape"] == list(shape), key
        assert t["dtype"] == str(dtype), key
        assert t["nbytes"] == _nbytes(key), key
        assert t["chunks"] == (2 if key == FLAT_KEY else 1), key
        assert t["flattened"] is (key == FLAT_KEY), key
    assert list(info["objects"]) == ["rng/shard_0_1"]
    assert 0 < info["objects"]["rng/shard_0_1"] < 4096
    assert info["tensor_bytes"] == TOTAL_BYTES
    on_disk = {p.name: p.stat().st_size for p in ckpt.iterdir() if p.is_file()}
    assert info["files"] == on_disk
    assert info["disk_bytes"] == sum(on_disk.values())
    assert {"metadata.json", ".metadata", "common.pt"} <= set(on_disk)


def test_inspect_errors(tmp_path, capsys):
    rc, out, err = _run_cli(capsys, "inspect", tmp_path / "nope")
    assert rc == 1 and out == "" and "does not exist" in err
    (tmp_path / "notes.txt").write_text("hi")
    rc, out, err = _run_cli(capsys, "inspect", tmp_path)
    assert rc == 1 and "not a distributed checkpoint" in err


FIXTURE_NAMES = [
    "mcore_v0_15/gpt_tp2_dp2", "mcore_v0_15/gpt_tp2_dp2_fpsave", "mcore_v0_15/tp1_single",
    "mcore_v0_15/distopt_flat", "mcore_v0_19/gpt_tp2_dp2", "mcore_v0_19/gpt_tp2_dp2_fpsave",
    "mcore_v0_19/tp1_single",
]
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason="tests/fixtures not present")


@needs_fixtures
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_inspect_and_validate_fixture(name, capsys):
    exp = torch.load(FIXTURES / name / "expected.pt", weights_only=True)
    ckpt = FIXTURES / name / "checkpoint"
    info = inspect_checkpoint(ckpt)
    assert info.sharded_backend == "torch_dist"
    assert info.common_backend == ("torch" if "v0_15" in name else None)  # 0.19: common state inside
    assert info.common_error is None
    assert info.common_keys == sorted(exp["common"])
    assert {t.key: (t.shape, t.dtype) for t in info.tensors} == {
        k: (tuple(v.shape), str(v.dtype)) for k, v in exp["tensors"].items()}
    for t in info.tensors:
        assert t.flattened is ("distopt_flat" in name), t
        assert t.nbytes == exp["tensors"][t.key].numel() * exp["tensors"][t.key].element_size()
    assert set(exp["objects"]) <= set(info.objects)
    text = format_info(info)
    assert "common state inside" in text if "v0_19" in name else "common state: torch" in text
    rc, out, err = _run_cli(capsys, "inspect", ckpt, "--json")
    assert rc == 0 and json.loads(out)["tensor_bytes"] == info.tensor_bytes
    rc, out, err = _run_cli(capsys, "validate", ckpt)
    assert rc == 0, out
    assert ": OK" in out and f"{len(exp['tensors'])} tensors" in out


@needs_fixtures
@pytest.mark.parametrize("name", ["mcore_v0_15/distopt_flat", "mcore_v0_19/gpt_tp2_dp2"])
def test_export_fixture_equals_expected(name, tmp_path):
    """Consolidation of Megatron-Core's own shards (TP, prepended layers, flattened slices)."""
    exp = torch.load(FIXTURES / name / "expected.pt", weights_only=True)
    export_checkpoint(FIXTURES / name / "checkpoint", tmp_path / "out")
    got = _read_safetensors_dir(tmp_path / "out")
    assert set(got) == set(exp["tensors"])
    for k, v in exp["tensors"].items():
        _assert_same(got[k], v, k)


# ----------------------------------------------------------------------------- 2. validate


def test_validate_ok(ckpt, capsys):
    rc, out, err = _run_cli(capsys, "validate", ckpt)
    assert rc == 0, out
    assert out.startswith(f"{ckpt}: OK")
    assert f"{len(SPECS)} tensors ({human_size(TOTAL_BYTES)}) and 1 objects checked" in out
    assert "problem" not in out
    rc, out, err = _run_cli(capsys, "validate", ckpt, "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"] is True and report["problems"] == []
    assert report["checked_tensors"] == len(SPECS) and report["checked_objects"] == 1
    assert report["checked_bytes"] == TOTAL_BYTES
    calls = []
    assert validate_checkpoint(ckpt, progress=lambda d, t, w: calls.append((d, t, w))).ok
    assert [w for _, _, w in calls] == sorted(SPECS)
    assert calls[-1][:2] == (TOTAL_BYTES, TOTAL_BYTES)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _storage(ckpt: Path, key: str):
    [(index, info)] = [(i, s) for i, s in read_metadata(ckpt).storage_data.items() if i.fqn == key]
    return index, info


def _tensor_data_offset(ckpt: Path, key: str):
    """(file, absolute offset of the middle of ``key``'s values): found by searching the
    expected bytes inside the item's stored range, not through the reader."""
    _, info = _storage(ckpt, key)
    path = ckpt / info.relative_path
    blob = path.read_bytes()[info.offset:info.offset + info.length]
    values = EXPECTED[key].numpy().tobytes()
    at = blob.find(values)
    assert at >= 0 and blob.find(values, at + 1) < 0, "the tensor's bytes must be unique in its blob"
    return path, info.offset + at + len(values) // 2


def _flip_tensor(d: Path) -> None:
    path, offset = _tensor_data_offset(d, "model.embedding.weight")
    flip_byte(path, offset)


def _flip_object(d: Path) -> None:
    _, info = _storage(d, "rng/shard_0_1")
    flip_byte(d / info.relative_path, info.offset + info.length // 2)


def _truncate_tensor_file(d: Path) -> None:
    _, info = _storage(d, "model.embedding.weight")
    _truncate(d / info.relative_path, info.offset + info.length - 1)


def _file_of(key: str):
    def fragment(d: Path) -> str:
        return _storage(d, key)[1].relative_path
    return fragment


# name -> (tamper, fragments every message must contain: strings or f(dir) -> string)
_DAMAGE = {
    "partial_no_metadata_json": (lambda d: (d / "metadata.json").unlink(), ["incomplete checkpoint"]),
    "flipped_tensor_byte": (_flip_tensor, ["model.embedding.weight", "Checksum mismatch",
                                           _file_of("model.embedding.weight")]),
    "flipped_object_byte": (_flip_object, ["rng/shard_0_1", "Checksum mismatch"]),
    "truncated_distcp": (_truncate_tensor_file, ["model.embedding.weight", _file_of("model.embedding.weight")]),
    "deleted_distcp": (lambda d: (d / _storage(d, "model.embedding.weight")[1].relative_path).unlink(),
                       ["missing", _file_of("model.embedding.weight")]),
    "corrupted_common": (lambda d: flip_byte(d / "common.pt", 200), ["common.pt"]),
    "truncated_common": (lambda d: _truncate(d / "common.pt", 100), ["common.pt"]),
    "corrupted_dot_metadata": (lambda d: flip_byte(d / ".metadata", 300), [".metadata"]),
    "corrupted_dot_metadata_no_checksum": (
        lambda d: (_truncate(d / ".metadata", 200), (d / ".metadata.checksum").unlink()), [".metadata"]),
}


@pytest.mark.parametrize("name", list(_DAMAGE))
def test_validate_reports_damage(name, ckpt, tmp_path, capsys):
    tamper, fragments = _DAMAGE[name]
    d = _copy(ckpt, tmp_path / "ckpt")
    fragments = [f(d) if callable(f) else f for f in fragments]  # resolved before tampering
    tamper(d)
    rc, out, err = _run_cli(capsys, "validate", d, "--json")
    assert rc == 1, out
    report = json.loads(out)
    assert report["ok"] is False and report["problems"], report
    text = "\n".join(report["problems"])
    for frag in fragments:
        assert frag in text, f"{frag!r} not in {text!r}"
    rc, out, err = _run_cli(capsys, "validate", d)
    assert rc == 1
    assert f"{d}: DAMAGED" in out and "  problem: " in out
    # the library function never raises for damage
    assert not validate_checkpoint(d).ok


def test_validate_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "readme.txt").write_text("not a checkpoint")
    rc, out, err = _run_cli(capsys, "validate", tmp_path)
    assert rc == 1 and "DAMAGED" in out and "metadata.json" in out and "not a distributed checkpoint" in out
    rc, out, err = _run_cli(capsys, "validate", tmp_path / "missing", "--json")
    assert rc == 1 and "does not exist" in json.loads(out)["problems"][0]


@dataclass
class Custom:
    """Outside the safe unpickling allow-list: loadable only with allow_pickle=True."""

    value: int


def test_validate_custom_class_object_is_a_note(tmp_path, capsys):
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0)),
          "tok": ShardedObject("tokenizer", Custom(5), (1,), (0,)),
          "cfg": Custom(-1)}
    dc.save(sd, tmp_path / "ckpt")
    rc, out, err = _run_cli(capsys, "validate", tmp_path / "ckpt", "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"] is True and report["problems"] == [], report
    assert report["checked_objects"] == 1 and report["checked_tensors"] == 1
    assert len(report["notes"]) == 2, report["notes"]
    assert report["notes"][0].startswith("common state: ") and "common.pt" in report["notes"][0]
    assert "tokenizer/shard_0_1" in report["notes"][1]
    assert all("allow_pickle" in n for n in report["notes"])
    # inspect still describes it, with the unreadable common state named
    info = inspect_checkpoint(tmp_path / "ckpt")
    assert info.common_keys == [] and "allow_pickle" in info.common_error
    assert "(unreadable: " in format_info(info) and list(info.objects) == ["tokenizer/shard_0_1"]
    rc, out, err = _run_cli(capsys, "validate", tmp_path / "ckpt")
    assert rc == 0 and ": OK" in out and "  note: " in out
    # ... but a damaged custom object is a problem, not a note (its checksum is checked first)
    d = _copy(tmp_path / "ckpt", tmp_path / "damaged")
    _, info = _storage(d, "tokenizer/shard_0_1")
    flip_byte(d / info.relative_path, info.offset + info.length // 2)
    report = validate_checkpoint(d)
    assert not report.ok and "tokenizer/shard_0_1" in report.problems[0]


@needs_fixtures
def test_catalog_of_a_megatron_checkpoint_records_no_checksums():
    from dist_checkpointing.serialization import get_default_load_sharded_strategy

    path = FIXTURES / "mcore_v0_15/tp1_single/checkpoint"
    items = get_default_load_sharded_strategy(path).stored_items(path)
    assert items.located and not items.checksums_recorded and items.tensors and items.object_locations
    locations = [c.location for t in items.tensors for c in t.chunks] + list(items.object_locations.values())
    assert all(at.checksum is None and items.range_problem("item", at) is None for at in locations)
    assert sorted(items.files) == sorted(p.name for p in path.glob("*.distcp"))


@needs_fixtures
@pytest.mark.parametrize("what", ["common.pt", "sharded_object"])
def test_validate_detects_zeroed_items_without_checksums(what, tmp_path):
    """Megatron-Core writes no checksum files. A common.pt or a ShardedObject whose bytes
    were zeroed (a typical storage failure) is damage: validate must not call it OK.

    BUG (fails): safe_pickle.safe_torch_load turns every pickle.UnpicklingError, including
    torch's "weights only load failed" for garbage bytes, into "Refusing to unpickle ...
    (unknown) ... allow_pickle=True", and tools.validate_checkpoint files every message
    containing "allow_pickle" under notes, so the checkpoint is reported OK."""
    d = _copy(FIXTURES / "mcore_v0_15/tp1_single/checkpoint", tmp_path / "ckpt")
    assert not list(d.glob("*.checksum"))
    if what == "common.pt":
        path = d / "common.pt"
        path.write_bytes(b"\0" * path.stat().st_size)
        culprit = "common.pt"
    else:
        [(index, info)] = [(i, s) for i, s in read_metadata(d).storage_data.items() if i.offset is None]
        raw = bytearray((d / info.relative_path).read_bytes())
        raw[info.offset:info.offset + info.length] = b"\0" * info.length
        (d / info.relative_path).write_bytes(bytes(raw))
        culprit = index.fqn
    report = validate_checkpoint(d)
    assert not report.ok, f"zeroed {culprit} reported OK; notes: {report.notes}"
    assert any(culprit in p for p in report.problems), report.problems


# ----------------------------------------------------------------------------- 3. export


def test_export_safetensors_single_file(ckpt, tmp_path, capsys):
    out = tmp_path / "hf"
    rc, stdout, err = _run_cli(capsys, "export", ckpt, out, "--format", "safetensors")
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert stdout.split() == [str(out / "model.safetensors")]
    plain = dc.load_plain_tensors(ckpt, original_shape=True)  # the export keeps the N-D view
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        assert sorted(fh.keys()) == sorted(SPECS)
        assert fh.metadata() == {"format": "pt"}
        for key in SPECS:
            got = fh.get_tensor(key)
            _assert_same(got, EXPECTED[key], key)  # flattened key: original (4, 6)
            _assert_same(got, plain[key], key)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary output left behind"


def test_export_safetensors_sharded_index(ckpt, tmp_path, capsys):
    out = tmp_path / "hf"
    limit = 40  # bytes
    rc, stdout, err = _run_cli(capsys, "export", ckpt, out, "--max-shard-size", repr(limit / 2**30))
    assert rc == 0, err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"]["total_size"] == TOTAL_BYTES
    assert set(index["weight_map"]) == set(SPECS)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(files)
    assert sorted(stdout.split()) == sorted(str(p) for p in out.iterdir())
    for name in files:
        with safe_open(str(out / name), framework="pt") as fh:
            keys = set(fh.keys())
            assert keys == {k for k, f in index["weight_map"].items() if f == name}
            held = sum(_nbytes(k) for k in keys)
            assert held <= limit or len(keys) == 1, (name, keys, held)
    got = _read_safetensors_dir(out)
    assert set(got) == set(SPECS)
    for key in SPECS:
        _assert_same(got[key], EXPECTED[key], key)


def test_export_torch_format_and_key_filter(ckpt, tmp_path, capsys):
    out = tmp_path / "full.pt"
    rc, stdout, err = _run_cli(capsys, "export", ckpt, out, "--format", "torch")
    assert rc == 0, err
    assert stdout.split() == [str(out)] and out.is_file()
    state = torch.load(out, weights_only=True)
    plain = dc.load_plain_tensors(ckpt, original_shape=True)
    assert set(state) == set(SPECS)
    for key in SPECS:
        _assert_same(state[key], EXPECTED[key], key)
        _assert_same(state[key], plain[key], key)
    # --keys: only the tensors whose key starts with the prefix
    out2 = tmp_path / "opt"
    rc, stdout, err = _run_cli(capsys, "export", ckpt, out2, "--keys", "optimizer.")
    assert rc == 0, err
    got = _read_safetensors_dir(out2)
    assert list(got) == [FLAT_KEY]
    _assert_same(got[FLAT_KEY], EXPECTED[FLAT_KEY])
    rc, _, err = _run_cli(capsys, "export", ckpt, tmp_path / "layer.pt", "--format", "torch", "--keys", "model.layer")
    assert rc == 0, err
    assert sorted(torch.load(tmp_path / "layer.pt", weights_only=True)) == ["model.layer.bias", "model.layer.half"]


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_refuses_existing_output_unless_forced(fmt, ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    if fmt == "safetensors":
        out.mkdir()
        (out / "keep.txt").write_text("precious")
    else:
        out.write_bytes(b"precious")
    before = sorted(tmp_path.rglob("*"))
    rc, stdout, err = _run_cli(capsys, "export", ckpt, out, "--format", fmt)
    assert rc == 1 and stdout == ""
    assert "already exists" in err and "--force" in err and str(out) in err
    assert sorted(tmp_path.rglob("*")) == before
    assert ((out / "keep.txt").read_text() if fmt == "safetensors" else out.read_bytes().decode()) == "precious"
    rc, stdout, err = _run_cli(capsys, "export", ckpt, out, "--format", fmt, "--force")
    assert rc == 0, err
    if fmt == "safetensors":
        assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
        got = _read_safetensors_dir(out)
    else:
        got = torch.load(out, weights_only=True)
    _assert_same(got["model.embedding.weight"], EXPECTED["model.embedding.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "temporary output left behind"


def test_export_bad_inputs(ckpt, tmp_path, capsys):
    # unknown format: a usage error (exit 2), nothing written
    with pytest.raises(SystemExit) as info:
        main(["export", str(ckpt), str(tmp_path / "x"), "--format", "npz"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(CheckpointingException, match="npz"):
        export_checkpoint(ckpt, tmp_path / "x", format="npz")
    # a key filter that matches nothing
    rc, stdout, err = _run_cli(capsys, "export", ckpt, tmp_path / "x", "--keys", "decoder.")
    assert rc == 1 and stdout == ""
    assert "decoder." in err and "No tensor key" in err
    # a non-checkpoint and a partial checkpoint
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text("x")
    rc, _, err = _run_cli(capsys, "export", tmp_path / "plain", tmp_path / "x")
    assert rc == 1 and "not a distributed checkpoint" in err
    partial = _copy(ckpt, tmp_path / "partial")
    (partial / "metadata.json").unlink()
    rc, _, err = _run_cli(capsys, "export", partial, tmp_path / "x", "--format", "torch")
    assert rc == 1 and "incomplete checkpoint" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["partial", "plain"], "something was written"


def test_export_unsupported_dtype(tmp_path, capsys):
    dc.save({"c": ShardedTensor.from_rank_offsets("c", torch.ones(3, dtype=torch.complex128)),
             "f": ShardedTensor.from_rank_offsets("f", torch.arange(3.0))}, tmp_path / "ckpt")
    rc, _, err = _run_cli(capsys, "export", tmp_path / "ckpt", tmp_path / "out")
    assert rc == 1 and "'c'" in err and "complex128" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "something was written"
    rc, _, err = _run_cli(capsys, "export", tmp_path / "ckpt", tmp_path / "out.pt", "--format", "torch")
    assert rc == 0, err
    _assert_same(torch.load(tmp_path / "out.pt", weights_only=True)["c"], torch.ones(3, dtype=torch.complex128))


def test_export_of_damaged_data_fails_and_leaves_nothing(ckpt, tmp_path, capsys):
    d = _copy(ckpt, tmp_path / "ckpt")
    _flip_tensor(d)
    rc, stdout, err = _run_cli(capsys, "export", d, tmp_path / "out")
    assert rc == 1 and "model.embedding.weight" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ----------------------------------------------------------------------------- 4. import


def _plain_source() -> dict:
    return {
        "model": {
            "layers": [{"w": _values((4, 6), torch.float32, 20 + i), "b": _values((6,), torch.bfloat16, 30 + i)}
                       for i in range(2)],
            "emb": _values((8, 4), torch.float16, 40),
        },
        "step": torch.tensor(7),
        "iteration": 3,
        "config": {"lr": 0.1, "name": "tiny", "sizes": [1, 2]},
    }


def test_import_torch_save_and_load_under_another_layout(tmp_path, capsys, ckpt_location):
    src = _plain_source()
    torch.save(src, tmp_path / "model.pt")
    out = ckpt_location("ckpt")
    rc, stdout, err = _run_cli(capsys, "import", tmp_path / "model.pt", out)
    assert rc == 0, err
    assert stdout.strip() == f"{out}: 6 tensors imported"
    keys = {"model.layers.0.w", "model.layers.0.b", "model.layers.1.w", "model.layers.1.b", "model.emb", "step"}
    assert set(dc.load_tensors_metadata(out)) == keys
    assert validate_checkpoint(out).ok
    # a TP slice of one tensor (rows 2..4 of 4), a column split of another, and the common state
    request = {
        "w": ShardedTensor.from_rank_offsets("model.layers.1.w", torch.zeros(2, 6), (0, 1, 2)),
        "emb": ShardedTensor.from_rank_offsets("model.emb", torch.zeros(8, 2, dtype=torch.float16), (1, 0, 2)),
    }
    loaded = dc.load(request, out)
    _assert_same(loaded["w"], src["model"]["layers"][1]["w"][2:4])
    _assert_same(loaded["emb"], src["model"]["emb"][:, 0:2])
    assert loaded["iteration"] == 3
    assert loaded["config"] == {"lr": 0.1, "name": "tiny", "sizes": [1, 2]}
    common = dc.load_common_state_dict(out)
    assert common["iteration"] == 3 and common["config"] == src["config"]
    plain = dc.load_plain_tensors(out)
    for i in range(2):
        _assert_same(plain[f"model.layers.{i}.w"], src["model"]["layers"][i]["w"])
        _assert_same(plain[f"model.layers.{i}.b"], src["model"]["layers"][i]["b"])
    _assert_same(plain["step"], torch.tensor(7))


def test_import_safetensors_round_trip(ckpt, tmp_path, capsys):
    """export -> import -> export gives the same safetensors tensors (single file, sharded
    directory and index file as sources)."""
    rc, _, err = _run_cli(capsys, "export", ckpt, tmp_path / "hf1")
    assert rc == 0, err
    first = _read_safetensors_dir(tmp_path / "hf1")
    rc, _, err = _run_cli(capsys, "export", ckpt, tmp_path / "hf_sharded", "--max-shard-size", repr(64 / 2**30))
    assert rc == 0, err
    assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").is_file()
    sources = {
        "file": tmp_path / "hf1" / "model.safetensors",
        "dir": tmp_path / "hf_sharded",
        "index": tmp_path / "hf_sharded" / "model.safetensors.index.json",
    }
    for name, source in sources.items():
        rc, stdout, err = _run_cli(capsys, "import", source, tmp_path / f"ck_{name}")
        assert rc == 0, (name, err)
        assert f"{len(SPECS)} tensors imported" in stdout
        rc, _, err = _run_cli(capsys, "export", tmp_path / f"ck_{name}", tmp_path / f"hf2_{name}")
        assert rc == 0, (name, err)
        second = _read_safetensors_dir(tmp_path / f"hf2_{name}")
        assert set(second) == set(first) == set(SPECS), name
        for key in SPECS:
            _assert_same(second[key], first[key], f"{name}: {key}")
            _assert_same(second[key], EXPECTED[key], f"{name}: {key}")
    # the imported checkpoint loads with resharding too
    loaded = dc.load({"x": ShardedTensor.from_rank_offsets(FLAT_KEY, torch.zeros(4, 3), (1, 1, 2))},
                     tmp_path / "ck_dir")
    _assert_same(loaded["x"], EXPECTED[FLAT_KEY][:, 3:])


class _ImportedTokenizerConfig:
    """A user class in a torch.save file: refused until the user allows it."""

    def __init__(self, vocab: int):
        self.vocab = vocab


def test_import_opens_the_file_under_the_one_pickle_policy(tmp_path, capsys, monkeypatch):
    """``import`` reads the file as every stored pickle is read: the stand-ins apply (Megatron-LM's
    ``args`` without Megatron), and the user's ``register_safe_globals`` classes are allowed."""
    import argparse

    from dist_checkpointing.pickling import safe_globals

    monkeypatch.setattr(safe_globals, "_REGISTERED", [])  # restored after the test
    src = {"w": torch.arange(4.0), "args": argparse.Namespace(lr=0.1), "tok": _ImportedTokenizerConfig(7)}
    torch.save(src, tmp_path / "model.pt")
    rc, _, err = _run_cli(capsys, "import", tmp_path / "model.pt", tmp_path / "refused")
    assert rc == 1 and "outside the safe allow-list" in err, err
    dc.register_safe_globals(_ImportedTokenizerConfig)
    out = tmp_path / "ckpt"
    rc, _, err = _run_cli(capsys, "import", tmp_path / "model.pt", out)
    assert rc == 0, err
    common = dc.load_common_state_dict(out)
    assert common["args"].lr == 0.1 and common["tok"].vocab == 7
    _assert_same(dc.load_plain_tensors(out)["w"], torch.arange(4.0))


def test_import_refuses_occupied_output(tmp_path, capsys):
    torch.save({"w": torch.arange(4.0)}, tmp_path / "src.pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    rc, stdout, err = _run_cli(capsys, "import", tmp_path / "src.pt", out)
    assert rc == 1 and "already exists" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    rc, stdout, err = _run_cli(capsys, "import", tmp_path / "src.pt", out, "--force")
    assert rc == 0, err
    assert not (out / "keep.txt").exists()
    _assert_same(dc.load_plain_tensors(out)["w"], torch.arange(4.0))
    # an existing empty directory is fine without --force
    (tmp_path / "empty").mkdir()
    rc, _, err = _run_cli(capsys, "import", tmp_path / "src.pt", tmp_path / "empty")
    assert rc == 0, err
    assert dc.check_is_distributed_checkpoint(tmp_path / "empty")


def test_import_bad_sources(tmp_path, capsys):
    torch.save([torch.ones(2), 3], tmp_path / "list.pt")
    (tmp_path / "text.pt").write_text("definitely not a torch file")
    (tmp_path / "nothing").mkdir()
    torch.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(3)}}, tmp_path / "clash.pt")
    cases = {
        "list.pt": "holds a list, not a state dict",
        "text.pt": "is not a torch.save file of a state dict",
        "missing.pt": "does not exist",
        "nothing": "holds no .safetensors files",
        "clash.pt": "a.b",  # two paths flatten to the same key
    }
    for name, fragment in cases.items():
        out = tmp_path / f"out_{name}"
        rc, stdout, err = _run_cli(capsys, "import", tmp_path / name, out)
        assert rc == 1, name
        assert err.startswith("error: ") and fragment in err, (name, err)
        assert not out.exists() or not any(out.iterdir()), f"{name}: output written"
    with pytest.raises(CheckpointingException, match="not a state dict"):
        import_checkpoint(tmp_path / "list.pt", tmp_path / "lib_out")
    assert not (tmp_path / "lib_out").exists()


# ----------------------------------------------------------------------------- 5. the real command line


def test_subprocess_export_logs_progress(ckpt, tmp_path):
    """``python -m dist_checkpointing`` (``__main__``): stderr is a pipe, so progress is
    logged as lines, ending at 100%."""
    out = tmp_path / "hf"
    proc = _subprocess("export", ckpt, out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(out / "model.safetensors")]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("export: ")]
    assert lines, proc.stderr
    size = re.escape(human_size(TOTAL_BYTES))
    assert re.match(rf"export: 100% \({size} of {size}, ", lines[-1]), lines[-1]
    percents = [int(re.match(r"export:\s+(\d+)%", ln).group(1)) for ln in lines]
    assert percents == sorted(percents)
    assert f"Exported {len(SPECS)} tensors" in proc.stderr
    assert "\r" not in proc.stderr, "no progress bar when stderr is not a terminal"
    assert set(_read_safetensors_dir(out)) == set(SPECS)


def test_console_script_validate_damaged(ckpt, tmp_path):
    """The installed ``dist-ckpt`` script (``python -m`` where it is not on PATH): exit 1
    and a report naming the damaged key; progress still logged."""
    d = _copy(ckpt, tmp_path / "ckpt")
    _flip_tensor(d)
    exe = shutil.which("dist-ckpt")
    proc = _subprocess("validate", d, exe=exe)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"{d}: DAMAGED")
    assert "problem: Checksum mismatch for tensor 'model.embedding.weight'" in proc.stdout
    assert "validate: 100%" in proc.stderr


# ----------------------------------------------------------------------------- 6. save/load timing


def _check_events(events, phases, nbytes):
    # the byte reports during the write / read (tests/test_progress.py): their own keys, in order
    reports = [e for e in events if "bytes_done" in e]
    assert all(set(e) == {"phase", "bytes_done", "bytes_total", "elapsed"} for e in reports), reports
    assert [e["bytes_done"] for e in reports] == sorted(e["bytes_done"] for e in reports)
    events = [e for e in events if "bytes_done" not in e]
    assert [e["phase"] for e in events] == phases, events
    for e in events:
        assert set(e) == {"phase", "seconds", "bytes", "elapsed"}
        assert e["bytes"] == nbytes and e["seconds"] >= 0
    elapsed = [e["elapsed"] for e in events]
    assert elapsed == sorted(elapsed)
    assert sum(e["seconds"] for e in events) == pytest.approx(elapsed[-1], rel=1e-6, abs=1e-6)


def _one_record(caplog, prefix):
    records = [r for r in caplog.records if r.name == SER_LOGGER and r.getMessage().startswith(prefix)]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert records[0].levelno == logging.DEBUG  # silent at INFO, as Megatron-Core's save/load
    return records[0].getMessage()


def test_save_and_load_report_phases(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger=SER_LOGGER)
    events = []
    path = tmp_path / "ckpt"
    assert dc.save(_single_state(), path, progress_callback=events.append) is None
    _check_events(events, ["plan", "write", "finalize"], TOTAL_BYTES)
    msg = _one_record(caplog, f"Saved {path}: ")
    assert re.search(rf"{TOTAL_BYTES / 2**20:.1f} MiB on this rank in [\d.]+ s \([\d.]+ GB/s; "
                     r"plan [\d.]+ s, write [\d.]+ s, finalize [\d.]+ s\)$", msg), msg
    caplog.clear()
    events = []
    request = {"w": ShardedTensor.from_rank_offsets("model.embedding.weight", torch.zeros(4, 4), (0, 1, 2)),
               "o": ShardedObject("rng", None, (1,), (0,))}
    loaded = dc.load(request, path, progress_callback=events.append)
    _assert_same(loaded["w"], EXPECTED["model.embedding.weight"][4:])
    assert loaded["o"] == {"seed": 3, "state": [1, 2, 3]} and loaded["iteration"] == 11
    _check_events(events, ["plan", "read", "finalize"], 4 * 4 * 4)  # this rank's requested bytes
    msg = _one_record(caplog, f"Loaded {path}: ")
    assert re.search(r"on this rank in [\d.]+ s \([\d.]+ GB/s; plan [\d.]+ s, read [\d.]+ s, finalize [\d.]+ s\)$",
                     msg), msg


def test_async_save_reports_plan_and_snapshot(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger=SER_LOGGER)
    events = []
    path = tmp_path / "ckpt"
    request = dc.save(_single_state(), path, async_sharded_save=True, progress_callback=events.append)
    _check_events(events, ["plan", "snapshot"], TOTAL_BYTES)
    msg = _one_record(caplog, f"Started async save of {path}: ")
    assert "plan" in msg and "snapshot" in msg
    assert not dc.check_is_distributed_checkpoint(path)
    request.execute_sync()
    assert dc.check_is_distributed_checkpoint(path)
    _assert_same(dc.load_plain_tensors(path, original_shape=True)[FLAT_KEY], EXPECTED[FLAT_KEY])


def test_save_and_load_are_silent_without_logging_config(tmp_path, capsys):
    """With no logging configured (no root handler), save/load print nothing."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = []
    try:
        capsys.readouterr()
        events = []
        dc.save(_single_state(), tmp_path / "ckpt", progress_callback=events.append)
        dc.load({"w": ShardedTensor.from_rank_offsets("model.ids", torch.zeros(7, dtype=torch.int64))},
                tmp_path / "ckpt")
        out, err = capsys.readouterr()
    finally:
        root.handlers = saved
    assert len([e for e in events if "seconds" in e]) == 3
    assert out == "" and err == ""


# ----------------------------------------------------------------------------- world 2: TP + flattened slices

W2 = {  # key -> (global shape, dtype, salt)
    "model.w": ((4, 6), torch.float32, 50),  # TP split along axis 0
    "model.b": ((6,), torch.bfloat16, 51),  # replicated (replica_id = rank)
    "optimizer.exp_avg.w": ((4, 6), torch.float32, 52),  # TP split along axis 1, each rank its whole flat chunk
    "optimizer.exp_avg_sq.w": ((4, 6), torch.float32, 53),  # DP=2 flattened slices [0, 10) and [10, 24)
}
W2_SLICES = [(0, 10), (10, 24)]


def _w2_global(key):
    shape, dtype, salt = W2[key]
    return _values(shape, dtype, salt)


def _w2_state(rank, world):
    w, b = _w2_global("model.w"), _w2_global("model.b")
    ea, eas = _w2_global("optimizer.exp_avg.w"), _w2_global("optimizer.exp_avg_sq.w")
    a, z = W2_SLICES[rank]
    return {
        "model": {
            "w": ShardedTensor.from_rank_offsets("model.w", w[2 * rank:2 * rank + 2].clone(), (0, rank, 2)),
            "b": ShardedTensor.from_rank_offsets("model.b", b.clone(), replica_id=rank),
        },
        "optimizer": {
            "exp_avg": ShardedTensor.from_rank_offsets_flat(
                "optimizer.exp_avg.w", ea[:, 3 * rank:3 * rank + 3].reshape(-1).clone(), (4, 3), (1, rank, 2),
                flattened_range=slice(0, 12)),
            "exp_avg_sq": ShardedTensor.from_rank_offsets_flat(
                "optimizer.exp_avg_sq.w", eas.reshape(-1)[a:z].clone(), (4, 6), flattened_range=slice(a, z)),
        },
        "rng": ShardedObject("rng", {"rank": rank}, (world,), (rank,)),
        "iteration": 9,
    }


def _w2_save(rank, world, path):
    events = []
    dc.save(_w2_state(rank, world), path, progress_callback=events.append)
    return events


def _w2_fully_parallel_load(rank, world, path):
    from dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger(SER_LOGGER)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        events = []
        request = {  # every rank wants all of both model tensors: the shards are read once and exchanged
            "w": ShardedTensor.from_rank_offsets("model.w", torch.zeros(4, 6), replica_id=rank),
            "b": ShardedTensor.from_rank_offsets("model.b", torch.zeros(6, dtype=torch.bfloat16), replica_id=rank),
        }
        loaded = dc.load(request, path, sharded_strategy=FullyParallelLoadStrategyWrapper(
            TorchDistLoadShardedStrategy()), progress_callback=events.append)
        _assert_same(loaded["w"], _w2_global("model.w"))
        _assert_same(loaded["b"], _w2_global("model.b"))
        assert loaded["iteration"] == 9
        return events, records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    """(checkpoint saved by 2 ranks, each rank's save progress events)."""
    path = tmp_path_factory.mktemp("tools_w2") / "ckpt"
    events = get_pool(2).run(_w2_save, str(path), timeout=_TIMEOUT)
    return path, events


def test_world2_inspect_validate_export(w2, tmp_path, capsys):
    path, _ = w2
    info = {t.key: t for t in inspect_checkpoint(path).tensors}
    assert {k: (t.shape, t.dtype, t.chunks, t.flattened) for k, t in info.items()} == {
        "model.w": ((4, 6), "torch.float32", 2, False),
        "model.b": ((6,), "torch.bfloat16", 1, False),
        "optimizer.exp_avg.w": ((4, 6), "torch.float32", 2, True),
        "optimizer.exp_avg_sq.w": ((4, 6), "torch.float32", 2, True),
    }
    assert sorted(inspect_checkpoint(path).objects) == ["rng/shard_0_2", "rng/shard_1_2"]
    rc, out, _ = _run_cli(capsys, "validate", path)
    assert rc == 0 and "4 tensors" in out and "2 objects" in out, out
    rc, _, err = _run_cli(capsys, "export", path, tmp_path / "hf")
    assert rc == 0, err
    got = _read_safetensors_dir(tmp_path / "hf")
    plain = dc.load_plain_tensors(path, original_shape=True)
    assert set(got) == set(W2)
    for key in W2:
        _assert_same(got[key], _w2_global(key), key)
        _assert_same(got[key], plain[key], key)
    rc, _, err = _run_cli(capsys, "export", path, tmp_path / "opt.pt", "--format", "torch", "--keys", "optimizer")
    assert rc == 0, err
    state = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert sorted(state) == ["optimizer.exp_avg.w", "optimizer.exp_avg_sq.w"]
    for key in state:
        _assert_same(state[key], _w2_global(key), key)


def test_world2_save_reports_each_ranks_bytes(w2):
    _, events = w2
    # main replicas: w rows (48 B each), b only on rank 0 (12 B), exp_avg chunk (48 B), exp_avg_sq slice
    expected = [48 + 12 + 48 + 10 * 4, 48 + 48 + 14 * 4]
    for rank, evs in enumerate(events):
        _check_events(evs, ["plan", "write", "finalize"], expected[rank])


def test_world2_catalog_locates_every_chunk(w2):
    """The strategy-level catalog the tools read names, for every chunk and object, the
    data file, byte range and checksum that ``.metadata`` records, and the size of every
    data file; it is the same whatever load strategy reads the checkpoint."""
    from dist_checkpointing.serialization import get_default_load_sharded_strategy
    from dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    path, _ = w2
    items = TorchDistLoadShardedStrategy().stored_items(path)
    assert items.located and items.checksums_recorded
    metadata = read_metadata(path)
    table = metadata.checksums["items"]
    recorded = {(i.fqn, None if i.offset is None else tuple(i.offset)):
                (s.relative_path, s.offset, s.length, table[(s.relative_path, s.offset)])
                for i, s in metadata.storage_data.items()}
    located = {(t.key, c.offsets): dataclasses.astuple(c.location) for t in items.tensors for c in t.chunks}
    located.update({(k, None): dataclasses.astuple(at) for k, at in items.object_locations.items()})
    assert located == recorded
    assert items.files == {f: (path / f).stat().st_size for f, *_ in recorded.values()}
    w = {t.key: t for t in items.tensors}
    # each rank's rows of model.w are in that rank's data files
    assert [(c.offsets, c.location.file.split("_")[2]) for c in w["model.w"].chunks] == [((0, 0), "0"), ((2, 0), "1")]
    for t in items.tensors:  # the chunks tile the stored shape (flattened keys: the reformulated one)
        assert (t.stored_shape != t.shape) == t.flattened, t
        assert sum(math.prod(c.sizes) for c in t.chunks) == math.prod(t.stored_shape)
    assert items.objects == {k: at.length for k, at in items.object_locations.items()}
    for strategy in (FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()),
                     TorchDistLoadShardedStrategy(thread_count=1, verify_checksums=False),
                     get_default_load_sharded_strategy(path)):
        assert strategy.stored_items(path) == items, strategy


def test_world2_fully_parallel_load_reports_exchange(w2):
    path, _ = w2
    results = get_pool(2).run(_w2_fully_parallel_load, str(path), timeout=_TIMEOUT)
    for rank, (events, records) in enumerate(results):
        _check_events(events, ["plan", "read", "finalize"], 4 * 6 * 4 + 6 * 2)  # requested bytes
        loaded = [m for m in records if m.startswith(f"Loaded {path}: ")]
        assert len(loaded) == 1, records
        assert re.search(r"\(([\d.]+) GB/s; plan [\d.]+ s, read [\d.]+ s, exchange [\d.]+ s, finalize [\d.]+ s\)$",
                         loaded[0]), loaded[0]


def _fp_save(rank, world, path):
    from dist_checkpointing.serialization import get_default_save_sharded_strategy
    from dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    sd = {f"r{i}": ShardedTensor.from_rank_offsets(f"r{i}", torch.full((256,), float(i)), replica_id=rank)
          for i in range(4)}
    events = []
    dc.save(sd, path, sharded_strategy=FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy()),
            progress_callback=events.append)
    return events


def test_world2_fully_parallel_save_reports_bytes_this_rank_writes(tmp_path):
    """``save`` documents its log/callback bytes as "bytes this rank writes". With the fully
    parallel save wrapper the writing of replicated tensors is spread over the ranks.

    BUG (fails): serialization.save computes the bytes from the main replicas *before* the
    wrapper redistributes them (``_local_bytes(sharded, main_only=True)``), so rank 0 reports
    every replicated tensor (4096 B) and rank 1 reports 0 B although each writes 2 of the 4."""
    path = tmp_path / "ckpt"
    events = get_pool(2).run(_fp_save, str(path), timeout=_TIMEOUT)
    written = [0, 0]
    for index, info in read_metadata(path).storage_data.items():
        rank = int(re.match(r"__(\d+)_", info.relative_path).group(1))
        written[rank] += 256 * 4
    assert sum(written) == 4 * 256 * 4 and all(written), written  # the wrapper did spread the work
    reported = [evs[-1]["bytes"] for evs in events]
    assert reported == written, f"reported {reported}, written {written}"
