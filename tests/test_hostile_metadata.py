"""Crafted ``.metadata`` and ``metadata.json`` (wrong types, impossible sizes) are answered
with a ``CheckpointingException`` naming the file and field by every reader, quickly and
without allocating what they claim; ``validate`` reports them as damaged and never says OK
for what ``load`` refuses (issue 18, classes 3 and 7). Sharded items hidden in other
containers than dicts and lists are refused on save and load with their path (class 4)."""

from __future__ import annotations

import collections
import json
import pickle
import types
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, LocalNonpersistentObject, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main as cli_main
from dist_checkpointing.core import CONFIG_FNAME
from dist_checkpointing.tools import validate_checkpoint

from .conftest import get_pool

_TIMEOUT = 60.0


def _save(ckpt: Path) -> None:
    dc.save(dict(_request(1.0), o=ShardedObject("o", {"a": 1}, (1,), (0,)), step=3), ckpt)


def _rewrite_metadata(ckpt: Path, change) -> None:
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own, trusted file
    change(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    (ckpt / ".metadata.checksum").unlink()  # a consistent attacker drops the sidecar


def _w(metadata):
    return metadata.state_dict_metadata["w"]


def _w_storage(metadata):
    return MetadataIndex("w", torch.Size([0, 0]))


def _set_storage(**fields):
    def change(metadata):
        info = metadata.storage_data[_w_storage(metadata)]
        values = {"relative_path": info.relative_path, "offset": info.offset, "length": info.length, **fields}
        metadata.storage_data[_w_storage(metadata)] = _StorageInfo(**values)
    return change


METADATA_CASES = {
    "state_dict_metadata is a string": (lambda m: setattr(m, "state_dict_metadata", "w"), "state_dict_metadata"),
    "state_dict_metadata is a list": (lambda m: setattr(m, "state_dict_metadata", [1]), "state_dict_metadata"),
    "key is not a string": (lambda m: m.state_dict_metadata.update({7: m.state_dict_metadata["w"]}), "7"),
    "storage_data is a list": (lambda m: setattr(m, "storage_data", [1, 2]), "storage_data"),
    "file name is an int": (_set_storage(relative_path=5), "relative_path"),
    "file name leaves the directory": (_set_storage(relative_path="../x.distcp"), "relative_path"),
    "negative offset": (_set_storage(offset=-8), "offset"),
    "offset is a string": (_set_storage(offset="0"), "offset"),
    "length is a bool": (_set_storage(length=True), "length"),
    "huge length": (_set_storage(length=2**61), "storage"),
    "huge global shape": (lambda m: setattr(_w(m), "size", torch.Size([2**40, 4])), "'w'"),
    "huge chunk": (lambda m: setattr(_w(m), "chunks", [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2**40]))]), "'w'"),
    "shape is a string": (lambda m: setattr(_w(m), "size", "4x4"), "size"),
    "dtype is a string": (lambda m: setattr(_w(m).properties, "dtype", "float32"), "properties"),
    "chunks is a dict": (lambda m: setattr(_w(m), "chunks", {"a": 1}), "chunks"),
    "checksum table is a string": (lambda m: setattr(m, "checksums", "xxh3"), "checksums"),
    "checksum items is a list": (lambda m: m.checksums.update(items=[1]), "checksums"),
    "checksum is negative": (lambda m: m.checksums["items"].update({k: -1 for k in m.checksums["items"]}), "checksums"),
    "mcore_data is a list": (lambda m: setattr(m, "mcore_data", [1]), "mcore_data"),
    "original shape is huge": (lambda m: m.mcore_data.update(w={"nd_reformulated_orig_global_shape": (2**20, 2**20, 2**20)}), "mcore_data"),
    "original shape is a string": (lambda m: m.mcore_data.update(w={"nd_reformulated_orig_global_shape": "x"}), "mcore_data"),
}


SIZE_CASES = ("huge length", "huge global shape")


def _request(fill: float = 0.0) -> dict:
    """'w' whole, 'v' as two chunks (written or read by one process)."""
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), fill)),
            "v": [ShardedTensor.from_rank_offsets("v", torch.full((2, 4), fill + i), (0, i, 2)) for i in range(2)]}


def _readers(ckpt: Path):
    return {
        "load": lambda: dc.load(_request(), ckpt),
        "load_tensors_metadata": lambda: dc.load_tensors_metadata(ckpt),
        "load_sharded_metadata": lambda: dc.load_sharded_metadata(ckpt),
        "load_plain_tensors": lambda: dc.load_plain_tensors(ckpt),
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("hostile") / "pristine"
    _save(ckpt)
    return ckpt


def _copy(pristine: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(pristine, dst)
    return dst


@pytest.mark.parametrize("case", list(METADATA_CASES))
def test_crafted_dcp_metadata_is_refused_by_every_reader(case, pristine, tmp_path, capsys):
    change, field = METADATA_CASES[case]
    ckpt = _copy(pristine, tmp_path / "ckpt")
    _rewrite_metadata(ckpt, change)
    readers = _readers(ckpt)
    if case in SIZE_CASES:  # well-formed, only impossible: the readers of metadata alone allocate nothing
        readers = {k: v for k, v in readers.items() if k in ("load", "load_plain_tensors")}
    for name, read in readers.items():
        with pytest.raises(CheckpointingException) as info:
            read()
        message = str(info.value)
        assert "w" in message or field in message, f"{name}: {message}"
        assert ".metadata" in message or ".distcp" in message or str(ckpt) in message, f"{name}: {message}"
    report = validate_checkpoint(ckpt)
    assert not report.ok and report.problems
    assert cli_main(["validate", str(ckpt)]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def _load_on_ranks(rank, world, ckpt):
    dc.load(_request(), ckpt)
    return True


@pytest.mark.parametrize("case", ["storage_data is a list", "huge length", "huge global shape", "negative offset"])
def test_crafted_dcp_metadata_is_refused_on_every_rank(case, pristine, tmp_path):
    ckpt = _copy(pristine, tmp_path / "ckpt")
    _rewrite_metadata(ckpt, METADATA_CASES[case][0])
    excs = get_pool(2).run_expect_error(_load_on_ranks, str(ckpt), timeout=_TIMEOUT)
    for e in excs:
        assert isinstance(e, CheckpointingException), f"{type(e).__name__}: {e}"


CONFIG_CASES = {
    "a list": [1, 2],
    "backend is an int": {"sharded_backend": 5, "sharded_backend_version": 1},
    "version is a string": {"sharded_backend": "torch_dist", "sharded_backend_version": "1"},
    "version is huge": {"sharded_backend": "torch_dist", "sharded_backend_version": 2**80},
    "version is a bool": {"sharded_backend": "torch_dist", "sharded_backend_version": True},
    "version is negative": {"sharded_backend": "torch_dist", "sharded_backend_version": -1},
    "common backend is a list": {"sharded_backend": "torch_dist", "common_backend": ["torch"]},
    "backend is missing": {"sharded_backend_version": 1},
    "unknown version": {"sharded_backend": "torch_dist", "sharded_backend_version": 2,
                        "common_backend": "torch", "common_backend_version": 1},
    "unknown common backend": {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                               "common_backend": "zarr", "common_backend_version": 1},
}


@pytest.mark.parametrize("case", list(CONFIG_CASES) + ["deeply nested", "not JSON", "huge"])
def test_crafted_metadata_json_is_refused_by_every_reader(case, pristine, tmp_path, capsys):
    ckpt = _copy(pristine, tmp_path / "ckpt")
    if case == "deeply nested":
        text = "[" * 100000 + "]" * 100000
    elif case == "not JSON":
        text = "{sharded_backend: torch_dist"
    elif case == "huge":
        text = json.dumps({"sharded_backend": "torch_dist", "pad": "x" * (1 << 20)})
    else:
        text = json.dumps(CONFIG_CASES[case])
    (ckpt / CONFIG_FNAME).write_text(text)
    readers = dict(_readers(ckpt), load_common_state_dict=lambda: dc.load_common_state_dict(ckpt))
    if case == "unknown common backend":  # only the readers of the common state need it
        readers = {k: v for k, v in readers.items() if k in ("load", "load_common_state_dict")}
    for name, read in readers.items():
        with pytest.raises(CheckpointingException) as info:
            read()
        assert "metadata.json" in str(info.value) or "zarr" in str(info.value) or "version" in str(info.value), \
            f"{name}: {info.value}"
    report = validate_checkpoint(ckpt)
    assert not report.ok, "validate says OK for a checkpoint that load refuses"
    assert cli_main(["validate", str(ckpt)]) == 1
    capsys.readouterr()


# ----------------------------------------------------------------------------- class 4

NT = collections.namedtuple("NT", "a b")


class _Holder:
    def __init__(self, value):
        self.value = value


def _hidden(rank: int, world: int, where: str, fill: bool = True):
    sh = ShardedTensor.from_rank_offsets("w", torch.full((2,), float(rank)) if fill else torch.zeros(2), (0, rank, world))
    build = {
        "tuple": lambda: {"a": (1, sh)},
        "namedtuple": lambda: {"a": [NT(1, sh)]},
        "mapping proxy": lambda: {"m": types.MappingProxyType({"x": LocalNonpersistentObject(3)})},
        "deque": lambda: {"d": collections.deque([ShardedObject("o", 1, (world,), (rank,))])},
        "object attribute": lambda: {"h": _Holder(sh)},
        "tuple in a dict in a list": lambda: {"l": [{"t": (sh,)}]},
    }
    return build[where]()


HIDDEN = ["tuple", "namedtuple", "mapping proxy", "deque", "object attribute", "tuple in a dict in a list"]


def _save_hidden(rank, world, ckpt, where):
    dc.save(_hidden(rank, world, where), ckpt)


def _load_hidden(rank, world, ckpt, where):
    dc.load(_hidden(rank, world, where, fill=False), ckpt)


@pytest.mark.parametrize("where", HIDDEN)
def test_sharded_items_outside_dicts_and_lists_are_refused(where, tmp_path):
    pool = get_pool(2)
    ckpt = tmp_path / "ckpt"
    excs = pool.run_expect_error(_save_hidden, str(ckpt), where, timeout=_TIMEOUT)
    for e in excs:
        assert isinstance(e, CheckpointingException) and "state_dict[" in str(e) and "dicts and lists" in str(e), e
    assert not ckpt.exists() or not any(ckpt.iterdir())  # refused before anything was written
    _save(ckpt)
    excs = pool.run_expect_error(_load_hidden, str(ckpt), where, timeout=_TIMEOUT)
    for e in excs:
        assert isinstance(e, CheckpointingException) and "dicts and lists" in str(e), e


def test_hidden_path_names_the_container():
    sh = ShardedTensor.from_rank_offsets("w", torch.ones(2))
    with pytest.raises(CheckpointingException, match=r"'w' at state_dict\['a'\]\[0\]\['b'\]\[1\] is inside a NT"):
        dc.save({"a": [{"b": NT(0, sh)}]}, "/nonexistent/never/written")


# ----------------------------------------------------------------------------- any field, any junk

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=5),
    st.lists(st.integers(-3, 2**41), max_size=3), st.tuples(st.integers(-3, 10)),
    st.dictionaries(st.text(max_size=3), st.integers(-1, 3), max_size=2),
    st.lists(st.integers(-2, 2**41), max_size=3).map(torch.Size),
)


def _set_index(m, value, field):
    index = _w_storage(m)
    info = m.storage_data.pop(index)
    new = MetadataIndex("w", torch.Size([0, 0]))
    object.__setattr__(new, field, value)
    try:
        hash(new)
    except TypeError:
        assume(False)  # a dict key must hash: such a .metadata cannot be pickled
    m.storage_data[new] = info


_SITES = {
    "state_dict_metadata": lambda m, v: setattr(m, "state_dict_metadata", v),
    "storage_data": lambda m, v: setattr(m, "storage_data", v),
    "entry of w": lambda m, v: m.state_dict_metadata.update(w=v),
    "storage of w": lambda m, v: m.storage_data.update({_w_storage(m): v}),
    "w.size": lambda m, v: setattr(_w(m), "size", v),
    "w.chunks": lambda m, v: setattr(_w(m), "chunks", v),
    "w.dtype": lambda m, v: setattr(_w(m).properties, "dtype", v),
    "w.chunks[0].offsets": lambda m, v: object.__setattr__(_w(m).chunks[0], "offsets", v),
    "w.chunks[0].sizes": lambda m, v: object.__setattr__(_w(m).chunks[0], "sizes", v),
    "relative_path": lambda m, v: _set_storage(relative_path=v)(m),
    "offset": lambda m, v: _set_storage(offset=v)(m),
    "length": lambda m, v: _set_storage(length=v)(m),
    "index.fqn": lambda m, v: _set_index(m, v, "fqn"),
    "index.offset": lambda m, v: _set_index(m, v, "offset"),
    "mcore_data": lambda m, v: setattr(m, "mcore_data", v),
    "original shape": lambda m, v: m.mcore_data.update(w={"nd_reformulated_orig_global_shape": v}),
    "checksums": lambda m, v: setattr(m, "checksums", v),
    "checksum algorithm": lambda m, v: m.checksums.update(algorithm=v),
    "checksum scope": lambda m, v: m.checksums.update(scope=v),
    "checksum items": lambda m, v: m.checksums.update(items=v),
    "one checksum": lambda m, v: m.checksums["items"].update({next(iter(m.checksums["items"])): v}),
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(site=st.sampled_from(sorted(_SITES)), junk=_JUNK)
def test_any_field_with_any_junk_is_refused_or_harmless(site, junk, pristine, tmp_path_factory):
    """Whatever value any field of ``.metadata`` holds, every reader either works or raises
    ``CheckpointingException``; ``validate`` never raises and never says OK when ``load`` refuses."""
    ckpt = _copy(pristine, tmp_path_factory.mktemp("junk") / "ckpt")
    _rewrite_metadata(ckpt, lambda m: _SITES[site](m, junk))
    refused = False
    for name, read in _readers(ckpt).items():
        try:
            read()
        except CheckpointingException:
            refused = refused or name == "load"
    report = validate_checkpoint(ckpt)
    assert not (refused and report.ok), f"{site}={junk!r}: load refuses, validate says OK"
