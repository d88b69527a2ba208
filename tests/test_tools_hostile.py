"""The offline tools against their own source and against hostile ``.metadata`` (issue 18).

1. ``export``/``import`` refuse an output that is their source, holds it or lies inside
   it, however the path is spelled (``..``, ``.``, relative, symlinks, ``/proc/self/cwd``,
   bind mounts), with and without ``force``; the source and its siblings stay untouched.
2. ``.metadata`` rewritten by an attacker (absurd sizes, offsets outside the files, wrong
   types): ``validate`` reports it as damage and never raises, ``inspect`` and ``export``
   raise only ``CheckpointingException``, the command line prints ``error:`` lines and no
   traceback, and nothing is allocated for the claimed sizes (checked in a subprocess
   under an address-space limit).

Everything runs in this process with no process group, except the two subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.tools import export_checkpoint, import_checkpoint, inspect_checkpoint, validate_checkpoint

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

from .helpers import slack

_ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"w": torch.arange(8, dtype=torch.float32), "v": torch.arange(6, dtype=torch.float32).reshape(3, 2) * 0.5}
HUGE = 2**40
_ENV = dict(os.environ, PYTHONPATH=str(_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # subprocesses


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A small checkpoint (two tensors, one object, common state), and exports of it."""
    root = tmp_path_factory.mktemp("hostile")
    ckpt = root / "ckpt"
    dc.save({"w": ShardedTensor.from_rank_offsets("w", EXPECTED["w"].clone()),
             "v": ShardedTensor.from_rank_offsets("v", EXPECTED["v"].clone()),
             "o": ShardedObject("o", {"seed": 1}, (1,), (0,)), "step": 3}, ckpt)
    export_checkpoint(ckpt, root / "hf")
    export_checkpoint(ckpt, root / "hf_sharded", max_shard_bytes=16)
    torch.save(EXPECTED, root / "model.pt")
    return root


def _tree(root: Path) -> List[Tuple[str, int, int]]:
    """Every entry under ``root`` (symlinks not followed) with its size and mtime: a file
    or directory created, removed or rewritten anywhere changes it."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            entries.append((os.path.relpath(os.path.join(dirpath, name), root), st.st_size, st.st_mtime_ns))
    return sorted(entries)


def _assert_same(got: Dict[str, torch.Tensor]) -> None:
    assert set(got) == set(EXPECTED)
    for key, want in EXPECTED.items():
        assert torch.equal(got[key], want), key


def _refused(fn: Callable[[], object], source, out) -> None:
    """``fn`` raises a CheckpointingException naming both paths (as pathlib spells them)."""
    with pytest.raises(CheckpointingException) as info:
        fn()
    message = str(info.value)
    assert str(Path(source)) in message and str(Path(out)) in message, message


# ----------------------------------------------------------------------------- 1. export onto its source


def _src_layout(base: Path, tmp_path: Path) -> Path:
    """``tmp_path/ckpts/ckpt`` (the checkpoint) between siblings."""
    src = tmp_path / "ckpts" / "ckpt"
    shutil.copytree(base / "ckpt", src)
    (tmp_path / "ckpts" / "sibling.txt").write_text("keep me")
    shutil.copytree(base / "ckpt", tmp_path / "ckpts" / "ckpt_sibling")
    return src


def _link(path: Path, target: Path) -> Path:
    path.symlink_to(target, target_is_directory=target.is_dir())
    return path


def _cd(monkeypatch, cwd: Path, source, out) -> tuple:
    monkeypatch.chdir(cwd)
    return source, out


# case -> (src, tmp_path, monkeypatch) -> (source argument, output argument)
EXPORT_OVERLAPS: Dict[str, Callable] = {
    "same": lambda s, t, m: (s, s),
    "same_as_str_with_dot": lambda s, t, m: (s, f"{s}/."),
    "same_via_dotdot": lambda s, t, m: (s, f"{s}/../{s.name}"),
    "same_relative": lambda s, t, m: _cd(m, t, s, "ckpts/ckpt"),
    "same_as_cwd": lambda s, t, m: _cd(m, s, s, "."),
    "same_via_symlink": lambda s, t, m: (s, _link(t / "alias", s)),
    "source_via_symlink": lambda s, t, m: (_link(t / "alias", s), s),
    "parent": lambda s, t, m: (s, s.parent),
    "parent_via_dotdot": lambda s, t, m: (s, f"{s}/.."),
    "parent_relative": lambda s, t, m: _cd(m, s, ".", ".."),
    "parent_via_symlink": lambda s, t, m: (s, _link(t / "alias", s.parent)),
    "parent_of_symlinked_source": lambda s, t, m: (_link(t / "alias", s), s.parent),
    "grandparent": lambda s, t, m: (s, t),
    "grandparent_relative": lambda s, t, m: _cd(m, s, ".", "../.."),
    "inside": lambda s, t, m: (s, s / "export"),
    "inside_deep": lambda s, t, m: (s, s / "a" / "b" / "out.pt"),
    "inside_via_symlink": lambda s, t, m: (s, _link(t / "alias", s) / "export"),
    "inside_via_parent_symlink": lambda s, t, m: (s, _link(t / "alias", s.parent) / "ckpt" / "x"),
    "inside_via_proc_cwd": lambda s, t, m: _cd(m, s, s, "/proc/self/cwd/export"),
}


@pytest.mark.parametrize("force", [False, True], ids=["no_force", "force"])
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("case", list(EXPORT_OVERLAPS))
def test_export_refuses_output_overlapping_its_checkpoint(case, fmt, force, base, tmp_path, monkeypatch):
    src = _src_layout(base, tmp_path)
    source, out = EXPORT_OVERLAPS[case](src, tmp_path, monkeypatch)
    before = _tree(tmp_path)
    _refused(lambda: export_checkpoint(source, out, format=fmt, force=force), source, out)
    assert _tree(tmp_path) == before, "something was written or deleted"
    _assert_same(dc.load_plain_tensors(src))
    _assert_same(dc.load_plain_tensors(tmp_path / "ckpts" / "ckpt_sibling"))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_next_to_its_checkpoint_is_allowed(fmt, base, tmp_path):
    """Names that share a prefix with the source, and a symlink output (replaced itself,
    its target untouched), are not overlaps."""
    src = _src_layout(base, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep me")
    outs = [Path(f"{src}_export"), src.parent / f"{src.name}.export", _link(tmp_path / "link", elsewhere)]
    for out in outs:
        export_checkpoint(src, out, format=fmt, force=True)
        got = load_file(out / "model.safetensors") if fmt == "safetensors" else torch.load(out, weights_only=True)
        _assert_same(got)
    assert not outs[2].is_symlink() and (elsewhere / "keep.txt").read_text() == "keep me"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]
    _assert_same(dc.load_plain_tensors(src))


# ----------------------------------------------------------------------------- import onto its source


def _import_layout(base: Path, tmp_path: Path) -> Path:
    """``tmp_path/src`` holding a safetensors dir, a sharded one, a torch file, a sibling."""
    root = tmp_path / "src"
    root.mkdir()
    shutil.copytree(base / "hf", root / "hf")
    shutil.copytree(base / "hf_sharded", root / "hf_sharded")
    shutil.copy(base / "model.pt", root / "model.pt")
    (root / "sibling.txt").write_text("keep me")
    return root


# case -> (root, tmp_path, monkeypatch) -> (source argument, output argument)
IMPORT_OVERLAPS: Dict[str, Callable] = {
    "dir_same": lambda r, t, m: (r / "hf", r / "hf"),
    "dir_same_via_dotdot": lambda r, t, m: (r / "hf", f"{r}/hf_sharded/../hf"),
    "dir_same_via_symlink": lambda r, t, m: (r / "hf", _link(t / "alias", r / "hf")),
    "dir_parent": lambda r, t, m: (r / "hf", r),
    "dir_parent_relative": lambda r, t, m: _cd(m, r / "hf", ".", ".."),
    "dir_inside": lambda r, t, m: (r / "hf", r / "hf" / "ckpt"),
    "dir_inside_relative": lambda r, t, m: _cd(m, r / "hf", ".", "ckpt"),
    "dir_inside_via_symlink": lambda r, t, m: (_link(t / "alias", r / "hf"), r / "hf" / "ckpt"),
    "file_same": lambda r, t, m: (r / "model.pt", r / "model.pt"),
    "file_same_via_symlink": lambda r, t, m: (r / "model.pt", _link(t / "alias.pt", r / "model.pt")),
    "file_parent": lambda r, t, m: (r / "model.pt", r),
    "file_grandparent": lambda r, t, m: (r / "model.pt", t),
    "file_inside": lambda r, t, m: (r / "model.pt", r / "model.pt" / "ckpt"),
    "safetensors_file_parent": lambda r, t, m: (r / "hf" / "model.safetensors", r / "hf"),
    "index_its_directory": lambda r, t, m: (r / "hf_sharded" / "model.safetensors.index.json", r / "hf_sharded"),
    "index_inside_its_directory": lambda r, t, m: (r / "hf_sharded" / "model.safetensors.index.json",
                                                   r / "hf_sharded" / "ckpt"),
}


@pytest.mark.parametrize("force", [False, True], ids=["no_force", "force"])
@pytest.mark.parametrize("case", list(IMPORT_OVERLAPS))
def test_import_refuses_output_overlapping_its_source(case, force, base, tmp_path, monkeypatch):
    root = _import_layout(base, tmp_path)
    source, out = IMPORT_OVERLAPS[case](root, tmp_path, monkeypatch)
    before = _tree(tmp_path)
    # an index file is checked as the directory it reads
    read = Path(source).parent if str(source).endswith(".json") else source
    _refused(lambda: import_checkpoint(source, out, force=force), read, out)
    assert _tree(tmp_path) == before, "something was written or deleted"
    for name in ("hf", "hf_sharded"):
        _assert_same({k: v for f in sorted((root / name).glob("*.safetensors")) for k, v in load_file(f).items()})
    _assert_same(torch.load(root / "model.pt", weights_only=True))
    assert (root / "sibling.txt").read_text() == "keep me"


def test_import_next_to_its_source_is_allowed(base, tmp_path):
    root = _import_layout(base, tmp_path)
    for source, out in [(root / "hf", Path(f"{root}/hf_ckpt")), (root / "model.pt", root / "model.pt.ckpt"),
                        (root / "hf_sharded" / "model.safetensors.index.json", root / "hf_sharded_ckpt")]:
        assert import_checkpoint(source, out) == 2
        _assert_same(dc.load_plain_tensors(out))
    # a symlink to an empty directory is written through; one to an occupied directory
    # is replaced itself with force, its target untouched
    (tmp_path / "empty").mkdir()
    assert import_checkpoint(root / "model.pt", _link(tmp_path / "to_empty", tmp_path / "empty")) == 2
    _assert_same(dc.load_plain_tensors(tmp_path / "empty"))
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "keep.txt").write_text("keep me")
    link = _link(tmp_path / "to_occupied", tmp_path / "occupied")
    with pytest.raises(CheckpointingException, match="already exists"):
        import_checkpoint(root / "model.pt", link)
    assert import_checkpoint(root / "model.pt", link, force=True) == 2
    assert not link.is_symlink() and [p.name for p in (tmp_path / "occupied").iterdir()] == ["keep.txt"]
    _assert_same(dc.load_plain_tensors(link))


def test_cli_refuses_overlapping_output(base, tmp_path, capsys):
    src = _src_layout(base, tmp_path)
    root = _import_layout(base, tmp_path)
    before = _tree(tmp_path)
    for argv, source, out in [
        (["export", src, src.parent, "--force"], src, src.parent),
        (["export", src, src / "out.pt", "--format", "torch"], src, src / "out.pt"),
        (["import", root / "hf", root, "--force"], root / "hf", root),
        (["import", root / "hf", root / "hf" / "ckpt"], root / "hf", root / "hf" / "ckpt"),
    ]:
        rc = main([str(a) for a in argv])
        stdout, stderr = capsys.readouterr()
        assert rc == 1 and stdout == "", argv
        assert stderr.startswith("error: ") and str(source) in stderr and str(out) in stderr, stderr
        assert "Traceback" not in stderr
    assert _tree(tmp_path) == before
    _assert_same(dc.load_plain_tensors(src))


_BIND_SCRIPT = textwrap.dedent("""
    import json, sys
    from dist_checkpointing.core import CheckpointingException
    from dist_checkpointing.tools import export_checkpoint, import_checkpoint
    src, parent_alias, src_alias, hf, hf_alias = sys.argv[1:]
    results = {}
    for name, fn in [("export_to_parent_alias", lambda: export_checkpoint(src, parent_alias, force=True)),
                     ("export_to_src_alias", lambda: export_checkpoint(src, src_alias, force=True)),
                     ("export_inside_src_alias", lambda: export_checkpoint(src, src_alias + "/x", force=True)),
                     ("import_to_source_alias", lambda: import_checkpoint(hf, hf_alias, force=True)),
                     ("import_inside_source_alias", lambda: import_checkpoint(hf, hf_alias + "/ck"))]:
        try:
            fn()
            results[name] = "done"
        except CheckpointingException as e:
            results[name] = str(e)
    print(json.dumps(results))
""")


def test_bind_mounted_aliases_are_refused(base, tmp_path):
    """A bind mount shows one directory under two unrelated paths: no string comparison
    (even of resolved paths) sees it; their device and inode numbers do."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("no unprivileged mount namespaces here")
    src = _src_layout(base, tmp_path)
    root = _import_layout(base, tmp_path)
    aliases = [tmp_path / "parent_alias", tmp_path / "src_alias", tmp_path / "hf_alias"]
    for a in aliases:
        a.mkdir()
    before = _tree(tmp_path)
    script = (f"mount --bind {src.parent} {aliases[0]} && mount --bind {src} {aliases[1]} && "
              f"mount --bind {root / 'hf'} {aliases[2]} && exec {sys.executable} -c \"$0\" \"$@\"")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, _BIND_SCRIPT, str(src), str(aliases[0]),
                           str(aliases[1]), str(root / "hf"), str(aliases[2])],
                          capture_output=True, text=True, timeout=slack(120), env=_ENV)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 5
    for name, message in results.items():
        assert "the output" in message and "the source" in message, (name, message)
    assert _tree(tmp_path) == before
    _assert_same(dc.load_plain_tensors(src))


# ----------------------------------------------------------------------------- 2. hostile .metadata


def _storage(md, key: str):
    [(index, info)] = [(i, s) for i, s in md.storage_data.items() if i.fqn == key]
    return index, info


def _set_storage(md, key: str, **fields) -> None:
    index, info = _storage(md, key)
    md.storage_data[index] = dataclasses.replace(info, **fields)


def _past_eof(md, d: Path) -> None:
    _, info = _storage(md, "w")
    _set_storage(md, "w", offset=(d / info.relative_path).stat().st_size + 100)


def _covering_chunk(numel: int):
    def craft(md, d: Path) -> None:
        md.state_dict_metadata["w"].size = torch.Size((numel,))
        md.state_dict_metadata["w"].chunks = [ChunkStorageMetadata(torch.Size((0,)), torch.Size((numel,)))]
    return craft


# variant -> (metadata, checkpoint dir) -> None: rewrites the metadata of tensor "w" (8 float32)
SIZE_ATTACKS: Dict[str, Callable] = {
    "huge_global_shape": lambda md, d: setattr(md.state_dict_metadata["w"], "size", torch.Size((HUGE,))),
    "huge_global_shape_and_chunk": _covering_chunk(HUGE),
    "large_global_shape_and_chunk": _covering_chunk(2**31),  # 8 GiB: allocatable, never backed
    "huge_chunk_size": lambda md, d: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", torch.Size((HUGE,))),
    "huge_storage_length": lambda md, d: _set_storage(md, "w", length=HUGE),
    "negative_offset": lambda md, d: _set_storage(md, "w", offset=-8),
    "offset_past_eof": _past_eof,
    "chunk_without_storage_entry": lambda md, d: md.storage_data.pop(_storage(md, "w")[0]),
}
TYPE_ATTACKS: Dict[str, Callable] = {
    "size_is_a_string": lambda md, d: setattr(md.state_dict_metadata["w"], "size", "abc"),
    "chunks_is_none": lambda md, d: setattr(md.state_dict_metadata["w"], "chunks", None),
    "storage_entry_is_an_int": lambda md, d: md.storage_data.__setitem__(_storage(md, "w")[0], 5),
    "offset_is_a_string": lambda md, d: _set_storage(md, "w", offset="0"),
    "dtype_is_a_string": lambda md, d: setattr(md.state_dict_metadata["w"].properties, "dtype", "float32"),
    "key_is_a_tuple": lambda md, d: md.state_dict_metadata.__setitem__(("w", 1), md.state_dict_metadata.pop("w")),
}
ATTACKS = {**SIZE_ATTACKS, **TYPE_ATTACKS}


def _craft(base: Path, d: Path, attack: str) -> Path:
    """A copy of the checkpoint whose ``.metadata`` an attacker rewrote consistently (the
    checksum sidecar dropped, as it would not match)."""
    shutil.copytree(base / "ckpt", d)
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own, trusted file
    ATTACKS[attack](md, d)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    (d / ".metadata.checksum").unlink()
    return d


def _names_culprit(message: str, attack: str) -> bool:
    return "'w'" in message if attack in SIZE_ATTACKS else ("'w'" in message or ".metadata" in message)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_validate_reports_hostile_metadata(attack, base, tmp_path, capsys):
    d = _craft(base, tmp_path / "ckpt", attack)
    start = time.perf_counter()
    report = validate_checkpoint(d)
    assert time.perf_counter() - start < 5
    assert not report.ok and any(_names_culprit(p, attack) for p in report.problems), report.problems
    rc = main(["validate", str(d)])
    stdout, stderr = capsys.readouterr()
    assert rc == 1 and "DAMAGED" in stdout and "problem: " in stdout and "Traceback" not in stderr
    rc = main(["validate", str(d), "--json"])
    assert rc == 1 and json.loads(capsys.readouterr().out)["ok"] is False


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_inspect_hostile_metadata_raises_only_checkpointing_exception(attack, base, tmp_path, capsys):
    d = _craft(base, tmp_path / "ckpt", attack)
    try:
        inspect_checkpoint(d)  # metadata only: absurd sizes are only described
    except CheckpointingException as e:
        assert _names_culprit(str(e), attack), e
    for argv in (["inspect", str(d)], ["inspect", str(d), "--json"]):
        rc = main(argv)
        stdout, stderr = capsys.readouterr()
        assert rc in (0, 1) and "Traceback" not in stderr
        assert rc == 0 or (stderr.startswith("error: ") and stdout == ""), stderr


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_export_refuses_hostile_metadata(attack, fmt, base, tmp_path, capsys):
    d = _craft(base, tmp_path / "ckpt", attack)
    out = tmp_path / ("out" if fmt == "safetensors" else "out.pt")
    start = time.perf_counter()
    with pytest.raises(CheckpointingException) as info:
        export_checkpoint(d, out, format=fmt)
    assert time.perf_counter() - start < 5
    assert _names_culprit(str(info.value), attack), info.value
    rc = main(["export", str(d), str(out), "--format", fmt])
    stdout, stderr = capsys.readouterr()
    assert rc == 1 and stdout == "" and stderr.startswith("error: ") and "Traceback" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "output or temporary files left"


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, re, resource, sys
    from dist_checkpointing.cli import main
    from dist_checkpointing.core import CheckpointingException
    from dist_checkpointing.tools import export_checkpoint, inspect_checkpoint, validate_checkpoint
    vm = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
    results = {}
    for d in sys.argv[1:]:
        r = {"validate": validate_checkpoint(d).ok}
        try:
            inspect_checkpoint(d)
        except CheckpointingException:
            pass
        for fmt in ("safetensors", "torch"):
            try:
                export_checkpoint(d, d + "_out_" + fmt, format=fmt)
                r[fmt] = "done"
            except CheckpointingException as e:
                r[fmt] = str(e)
        r["cli"] = main(["validate", d])
        results[d] = r
    print(json.dumps(results))
""")


def test_hostile_sizes_allocate_nothing(base, tmp_path):
    """Under an address-space limit of 512 MiB above what the process holds, the size
    attacks are reported (and an intact checkpoint still validates and exports): the
    claimed sizes are checked before any buffer is allocated."""
    dirs = [_craft(base, tmp_path / a, a) for a in SIZE_ATTACKS]
    intact = shutil.copytree(base / "ckpt", tmp_path / "intact")
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(intact)] + [str(d) for d in dirs],
                          capture_output=True, text=True, timeout=slack(120), env=_ENV)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results.pop(str(intact)) == {"validate": True, "safetensors": "done", "torch": "done", "cli": 0}
    for d, r in results.items():
        assert r["validate"] is False and r["cli"] == 1, (d, r)
        for fmt in ("safetensors", "torch"):
            assert "'w'" in r[fmt] and "Allocator" not in r[fmt] and "MemoryError" not in r[fmt], (d, fmt, r[fmt])
