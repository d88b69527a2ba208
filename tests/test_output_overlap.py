"""An output that is its source, holds it or lies inside it is refused for every kind of
location and every tool that writes (issue 29, item 1): ``convert``, ``export`` (both
formats), ``import``, ``convert-local`` and the manager's ``persist_local``, through the API
and the command line, with and without ``force``. URLs (``memory://``, ``s3://`` on the
real SeaweedFS) are compared after normalising them (trailing and repeated slashes, ``.``
and ``..`` segments, scheme and bucket case, a backslash), a ``file://`` URL as the local
path it names. After every refused call the source is as it was and loads."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, CheckpointManager, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.tools.convert import convert_checkpoint
from dist_checkpointing.manager import convert_local_checkpoint
from dist_checkpointing.storage import normalized_location, storage_for
from dist_checkpointing.tools import export_checkpoint, import_checkpoint

from .conftest import get_pool
from .helpers import assert_all_raise
from .locations import _export_env

EXPECTED = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "v": torch.arange(5, dtype=torch.bfloat16)}


def _state() -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", EXPECTED["w"].clone()),
            "v": ShardedTensor.from_rank_offsets("v", EXPECTED["v"].clone()),
            "o": ShardedObject("o", {"seed": 1}, (1,), (0,)), "step": 7}


@pytest.fixture(params=["memory", "s3"])
def base(request) -> str:
    """A fresh URL prefix: ``memory://`` (fsspec), then ``s3://`` on the real SeaweedFS."""
    if request.param == "memory":
        return f"memory://{uuid.uuid4().hex[:10]}"
    pytest.importorskip("obstore")
    server = request.getfixturevalue("s3_server")
    _export_env(server.env())
    return f"s3://{server.bucket}/{uuid.uuid4().hex[:10]}"


def _stored(location: str) -> Dict[str, int]:
    """Every file under ``location`` (one level down too) with its size."""
    storage = storage_for(location)
    found = {}
    for name in storage.list():
        info = storage.info(name)
        if info is not None:
            found[name] = info.size
        else:
            found.update({f"{name}/{k}": v for k, v in _stored(storage.describe(name)).items()})
    return found


def _intact(src: str, before: Dict[str, int], parent: str) -> None:
    assert _stored(parent) == before, "something was written or deleted"
    got = dc.load_plain_tensors(src)
    assert set(got) == set(EXPECTED) and all(torch.equal(got[k], v) for k, v in EXPECTED.items())


def _upper_scheme(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme.upper()}://{rest}"


def _upper_bucket(url: str) -> str:
    scheme, rest = url.split("://", 1)
    bucket, _, key = rest.partition("/")
    return f"{scheme}://{bucket.upper()}/{key}"


# name -> (base, src) -> the output URL
URL_OVERLAPS: Dict[str, Callable[[str, str], str]] = {
    "same": lambda b, s: s,
    "trailing_slash": lambda b, s: s + "/",
    "trailing_slashes": lambda b, s: s + "///",
    "repeated_slash": lambda b, s: f"{b}//src",
    "dot_segment": lambda b, s: f"{b}/./src/.",
    "dotdot_segment": lambda b, s: f"{b}/other/../src",
    "scheme_case": lambda b, s: _upper_scheme(s),
    "bucket_case": lambda b, s: _upper_bucket(s),
    "parent": lambda b, s: b,
    "parent_with_slash": lambda b, s: b + "/",
    "inside": lambda b, s: s + "/out",
    "inside_deep": lambda b, s: s + "//a/./b",
    "file_inside": lambda b, s: s + "/metadata.json",
    "data_file_inside": lambda b, s: s + "/__0_0.distcp",
    "inside_by_backslash": lambda b, s: s + "\\out",
}

TOOLS: Dict[str, Callable[[str, str, bool], object]] = {
    "convert": lambda s, o, f: convert_checkpoint(s, o, force=f),
    "export": lambda s, o, f: export_checkpoint(s, o, force=f),
    "export_torch": lambda s, o, f: export_checkpoint(s, o, format="torch", force=f),
}


def _refused(fn: Callable[[], object], *names: str) -> None:
    with pytest.raises(CheckpointingException) as info:
        fn()
    message = str(info.value)
    assert "source" in message and all(n in message for n in names), message


@pytest.mark.parametrize("force", [True, False], ids=["force", "no_force"])
def test_url_outputs_overlapping_the_source_are_refused(base, force):
    src = f"{base}/src"
    dc.save(_state(), src)
    dc.save(_state(), f"{base}/src_sibling")  # shares a prefix: never touched, never an overlap
    before = _stored(base)
    for case, out_of in URL_OVERLAPS.items():
        out = out_of(base, src)
        for tool, run in TOOLS.items():
            _refused(lambda: run(src, out, force), src, out)
            _intact(src, before, base)
    for tool, run in TOOLS.items():  # the source given with a trailing slash is the same source
        _refused(lambda: run(src + "/", f"{src}/inside", force), f"{src}/inside")
    _intact(src, before, base)


def test_url_outputs_next_to_the_source_are_written(base):
    src = f"{base}/src"
    dc.save(_state(), src)
    convert_checkpoint(src, f"{src}_converted")
    export_checkpoint(src, f"{src}.export")
    export_checkpoint(src, f"{base}/srcx.pt", format="torch")
    got = dc.load_plain_tensors(f"{src}_converted")
    assert all(torch.equal(got[k], v) for k, v in EXPECTED.items())
    assert storage_for(f"{src}.export").list() == ["model.safetensors"]
    assert dc.load_plain_tensors(src).keys() == EXPECTED.keys()


def test_normalized_location():
    same = ["s3://b/x/src", "S3://B/x/src/", "s3://b//x/./src", "s3://b/x/y/../src", "s3://b/x\\src"]
    assert {normalized_location(u) for u in same} == {("s3", "b/x/src")}
    assert normalized_location("memory://a//b/") == ("memory", "a/b")
    assert normalized_location("/tmp/x") == ("", "/tmp/x")
    assert normalized_location("file:///tmp/x/") == ("", "/tmp/x")
    assert normalized_location(storage_for("/tmp/x")) == ("", "/tmp/x")
    assert normalized_location(storage_for("memory://q/r")) == ("memory", "q/r")


# ----------------------------------------------------------------------------- file:// URLs of local paths


def _local_src(tmp_path: Path) -> Path:
    src = tmp_path / "ckpts" / "src"
    dc.save(_state(), src)
    return src


FILE_URL_OVERLAPS: Dict[str, Callable[[Path], str]] = {
    "same": lambda s: f"file://{s}",
    "same_slash": lambda s: f"file://{s}/",
    "same_dot": lambda s: f"file://{s}/.",
    "same_via_symlink": lambda s: f"file://{_alias(s)}",
    "parent": lambda s: f"file://{s.parent}",
    "inside": lambda s: f"file://{s}/out",
    "file_inside": lambda s: f"file://{s}/metadata.json",
}


def _alias(src: Path) -> Path:
    link = src.parent.parent / "alias"
    if not link.is_symlink():
        link.symlink_to(src, target_is_directory=True)
    return link


@pytest.mark.parametrize("force", [True, False], ids=["force", "no_force"])
def test_file_url_of_the_source_is_refused(tmp_path, force):
    pytest.importorskip("fsspec")
    src = _local_src(tmp_path)
    for case, out_of in FILE_URL_OVERLAPS.items():
        out = out_of(src)
        before = _stored(str(tmp_path / "ckpts"))
        for tool, run in TOOLS.items():
            _refused(lambda: run(str(src), out, force), str(src), out)
            _refused(lambda: run(f"file://{src}", str(src / "out"), force), str(src / "out"))
            _intact(str(src), before, str(tmp_path / "ckpts"))


def test_import_to_a_file_url_of_its_source_is_refused(tmp_path):
    pytest.importorskip("fsspec")
    src = tmp_path / "in"
    src.mkdir()
    torch.save(EXPECTED, src / "model.pt")
    before = _stored(str(tmp_path))
    for source, out in [(src, f"file://{src}"), (src, f"file://{src}/ckpt"), (src / "model.pt", f"file://{src}"),
                        (src / "model.pt", f"file://{src}/model.pt/"), (src, f"file://{tmp_path}/./")]:
        for force in (False, True):
            _refused(lambda: import_checkpoint(source, out, force=force), str(source), out)
            assert _stored(str(tmp_path)) == before
    assert import_checkpoint(src / "model.pt", f"file://{tmp_path}/out") == 2
    assert torch.equal(dc.load_plain_tensors(tmp_path / "out")["w"], EXPECTED["w"])


# ----------------------------------------------------------------------------- the command line


def test_cli_refuses_url_outputs_onto_their_source(base, capsys):
    src = f"{base}/src"
    dc.save(_state(), src)
    before = _stored(base)
    for argv, out in [(["convert", src, src + "/", "--force"], src + "/"),
                      (["convert", src, base, "--force"], base),
                      (["export", src, f"{base}/./src", "--force"], f"{base}/./src"),
                      (["export", src, f"{src}/metadata.json", "--format", "torch", "--force"], f"{src}/metadata.json"),
                      (["export", src, f"{src}//inside"], f"{src}//inside")]:
        rc = main(argv)
        stdout, stderr = capsys.readouterr()
        assert rc == 1 and stdout == "", argv
        assert stderr.startswith("error: ") and src in stderr and out in stderr and "Traceback" not in stderr, stderr
        _intact(src, before, base)


# ----------------------------------------------------------------------------- the local tier


def _train_local(rank: int, world: int, root: str, local: str) -> List[int]:
    with CheckpointManager(root, save_interval_steps=100, local_dir=local, local_interval=1,
                           node_of_rank=list(range(world))) as m:
        for step in (1, 2):
            m.save(step, {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(10 * step + rank)),
                                                               (0, rank, world)), "step": step})
        m.wait_until_finished()
        return list(m.local.complete)


def _restore(rank: int, world: int, root: str, local: str, persist: bool) -> tuple:
    with CheckpointManager(root, save_interval_steps=100, local_dir=local, local_interval=1,
                           node_of_rank=list(range(world))) as m:
        loaded = m.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world)), "step": 0},
                        persist_local=persist)
        assert torch.equal(loaded["w"], torch.full((4,), 20.0 + rank))
        return m.restored_from, m.all_steps()


def _tree(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file()
                  and not p.name.startswith((".manager_lock", "latest_", "dist_checkpointing_manager")))


# name -> (tmp_path) -> (root of the restoring manager, local_dir)
PERSIST_OVERLAPS: Dict[str, Callable[[Path], tuple]] = {
    "root_is_the_node_dir": lambda t: (t / "node{node}", t / "node{node}"),
    "target_is_the_node_dir": lambda t: (t / "root", t / "root" / "iter_0000002"),
    "target_holds_the_node_dirs": lambda t: (t / "root", t / "root" / "iter_0000002" / "node{node}"),
    "node_dir_holds_the_root": lambda t: (t / "node{node}" / "root", t / "node{node}"),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(PERSIST_OVERLAPS))
def test_persist_local_onto_the_local_dir_is_refused(case, world, tmp_path):
    root, local = PERSIST_OVERLAPS[case](tmp_path)
    # node 0's root for a root spelled with {node}: rank 1's node dir is not inside it
    root = str(root).format(node=0)
    pool = get_pool(world)
    assert pool.run(_train_local, root, str(local)) == [[1, 2]] * world
    before = _tree(tmp_path)
    errors = pool.run_expect_error(_restore, root, str(local), True)
    assert_all_raise(errors, world, "persist the local-tier step", "source", "iter_0000002")
    assert _tree(tmp_path) == before, "a local copy or a persistent file was written or deleted"
    # the local copies are intact: the step restores from them (without persisting it)
    assert pool.run(_restore, root, str(local), False) == [(("local", 2), [])] * world


def test_persist_local_next_to_the_local_dir_is_written(tmp_path):
    pool = get_pool(2)
    root, local = str(tmp_path / "root"), str(tmp_path / "root_local" / "node{node}")
    pool.run(_train_local, root, local)
    assert pool.run(_restore, root, local, True) == [(("local", 2), [2])] * 2
    assert (tmp_path / "root" / "iter_0000002" / "metadata.json").is_file()


def test_convert_local_onto_a_node_dir_is_refused(tmp_path, capsys):
    get_pool(2).run(_train_local, str(tmp_path / "root"), str(tmp_path / "node{node}"))
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    before = _tree(tmp_path)
    for out in [nodes[0], nodes[1] / "out", f"{nodes[0]}/./out/", tmp_path, f"file://{nodes[1]}/out"]:
        _refused(lambda: convert_local_checkpoint([str(n) for n in nodes], out), str(out))
        rc = main(["convert-local", *map(str, nodes), str(out)])
        stdout, stderr = capsys.readouterr()
        assert rc == 1 and stderr.startswith("error: ") and str(out) in stderr and "source" in stderr, stderr
        assert _tree(tmp_path) == before
    done = convert_local_checkpoint([str(n) for n in nodes], tmp_path / "converted")
    assert done.step == 2
    got = dc.load_plain_tensors(tmp_path / "converted")["w"]
    assert torch.equal(got, torch.tensor([20.0] * 4 + [21.0] * 4))
    shutil.rmtree(tmp_path / "converted")
    assert os.listdir(nodes[0]) and os.listdir(nodes[1])
