"""What each ``dist-ckpt`` subcommand imports: ``--help`` and ``--version`` neither torch nor the
library, the read-only subcommands (inspect, validate, export) not ``torch.distributed.checkpoint``
(they read ``.metadata`` into light stand-ins of DCP's classes), and their output is the same as
with DCP's own classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Set, Tuple

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import ShardedObject, ShardedTensor

from . import launch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
DCP = "torch.distributed.checkpoint"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("imports") / "ckpt"
    state = {f"layer{i}.weight": ShardedTensor.from_rank_offsets(f"layer{i}.weight", torch.full((8, 4), float(i)))
             for i in range(3)}
    state["opt.exp_avg"] = ShardedTensor.from_rank_offsets_flat(
        "opt.exp_avg", torch.arange(64.0, dtype=torch.bfloat16), (8, 8), flattened_range=slice(0, 64))
    state["rng"] = ShardedObject("rng", {"seed": 1}, (1,), (0,))
    state["iteration"] = 7
    dc.save(state, path)
    return path


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def _command_line(*args: str) -> Tuple[subprocess.CompletedProcess, Set[str]]:
    """``python -m dist_checkpointing ARGS`` as a user runs it, and every module it imported
    (from ``-X importtime``, which lists each import on stderr)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "dist_checkpointing", *args],
                          capture_output=True, text=True, env=_env(), timeout=300)
    modules = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    return proc, modules


def _with_dcp(*args: str) -> subprocess.CompletedProcess:
    """The same command in a process that imported DCP first (DCP's own metadata classes):
    forked from the preloaded server (``launch.py``), which did."""
    code = f"import sys, {DCP}; from dist_checkpointing.cli import main; sys.exit(main(sys.argv[1:]))"
    return launch.run(["-c", code, *args], env=_env(), timeout=300)


@pytest.mark.parametrize("args", [[], ["--help"], ["--version"], ["inspect", "--help"]])
def test_help_and_version_import_neither_torch_nor_the_library(args):
    proc, modules = _command_line(*args)
    assert proc.returncode == 0, proc.stderr
    assert "dist-ckpt" in proc.stdout
    assert "torch" not in modules and "numpy" not in modules
    ours = {m for m in modules if m.startswith("dist_checkpointing.")}
    assert ours <= {"dist_checkpointing.cli", "dist_checkpointing.compat", "dist_checkpointing.compat.moved",
                    "dist_checkpointing.compat.lazy"}, ours


def _heavy(modules) -> List[str]:
    """DCP and what importing it costs most (DTensor, the sharded tensor)."""
    return sorted(m for m in modules if m == DCP or m.startswith(DCP + ".") or m.startswith("torch.distributed._shard")
                  or m == "torch.distributed.tensor")


def test_read_only_subcommands_do_not_import_dcp(light_run):
    """inspect, validate and export, one after another in one command-line process (fresh):
    none imports DCP; torch is imported (common.pt is a torch.save archive)."""
    commands = {args[0] for args, status, _ in light_run["outputs"] if status == 0}
    assert {"inspect", "validate", "export"} <= commands, light_run["outputs"]
    assert light_run["torch_imported"] and light_run["heavy"] == [], light_run["heavy"]


def test_writing_subcommands_write_dcps_own_classes(ckpt, tmp_path):
    """convert imports DCP first, so the .metadata it writes is DCP's classes: DCP reads it."""
    out = tmp_path / "c19"
    proc, modules = _command_line("convert", str(ckpt), str(out))
    assert proc.returncode == 0, proc.stderr
    assert DCP in modules
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(out)).read_metadata()
    assert isinstance(metadata.state_dict_metadata["layer0.weight"], TensorStorageMetadata)


_RUN_ALL = """
import contextlib, io, json, sys
sys.argv[0] = "dist-ckpt"  # the command line's process (the package imports its modules lazily)
if sys.argv[1] == "dcp":
    import torch.distributed.checkpoint
from dist_checkpointing.cli import main
out = []
for args in json.loads(sys.argv[2]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = main(args)
    out.append([args, status, buf.getvalue()])
heavy = sorted(m for m in sys.modules if m.startswith(("torch.distributed.checkpoint", "torch.distributed._shard"))
               or m == "torch.distributed.tensor")
print(json.dumps({"outputs": out, "dcp_imported": "torch.distributed.checkpoint" in sys.modules,
                  "torch_imported": "torch" in sys.modules, "heavy": heavy}))
"""


def _run_all(mode: str, commands: List[List[str]]) -> dict:
    """Run each command with :func:`dist_checkpointing.cli.main` in one process that imports DCP
    first (``mode="dcp"``: forked from the preloaded server, ``launch.py``) or not at all
    (``"light"``: a fresh interpreter): exit statuses and outputs."""
    args = ["-c", _RUN_ALL, mode, json.dumps(commands)]
    proc = launch.run(args, env=_env(), timeout=300) if mode == "dcp" else \
        subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _compared_commands(ckpt: Path) -> List[List[str]]:
    paths = [ckpt] + [FIXTURES / which / "checkpoint" for which in
                      ("mcore_v0_15/tp1_single", "mcore_v0_15/distopt_flat", "mcore_v0_19/gpt_tp2_dp2")]
    return [[*command, str(path)] for path in paths
            for command in (["inspect"], ["inspect", "--json"], ["validate", "--json"], ["validate"])]


@pytest.fixture(scope="module")
def light_run(ckpt, tmp_path_factory) -> dict:
    """The compared commands, then an export, in one fresh command-line process."""
    out = tmp_path_factory.mktemp("light_export") / "out"
    return _run_all("light", _compared_commands(ckpt) + [["export", str(ckpt), str(out)]])


def test_read_only_output_is_the_same_with_and_without_dcp(ckpt, light_run):
    """inspect (table and JSON) and validate of ours and of Megatron-Core 0.15 (its own metadata
    class) and 0.19 checkpoints print the same from the stand-ins as from DCP's classes."""
    commands = _compared_commands(ckpt)
    full = _run_all("dcp", commands)
    assert not light_run["dcp_imported"] and full["dcp_imported"]
    for (args, status, out), (_, full_status, full_out) in zip(light_run["outputs"], full["outputs"]):
        assert (status, out) == (full_status, full_out), args
        assert status == 0 and out.strip(), (args, out)
    assert len(full["outputs"]) == len(commands)


def test_export_writes_the_same_bytes_with_and_without_dcp(ckpt, tmp_path):
    light, modules = _command_line("export", str(ckpt), str(tmp_path / "light"))
    full = _with_dcp("export", str(ckpt), str(tmp_path / "full"))
    assert light.returncode == full.returncode == 0, (light.stderr, full.stderr)
    assert _heavy(modules) == []
    names = sorted(p.name for p in (tmp_path / "light").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "full").iterdir()) and names
    for name in names:
        assert (tmp_path / "light" / name).read_bytes() == (tmp_path / "full" / name).read_bytes(), name


def test_the_library_imports_dcp_with_the_package():
    """Outside the command line the package still imports DCP at once (before any process
    group exists) and its metadata classes are DCP's own."""
    code = (f"import sys, dist_checkpointing; assert '{DCP}' in sys.modules; "
            "from dist_checkpointing.pickling import dcp_types; "
            "from torch.distributed.checkpoint.metadata import Metadata; "
            "assert dcp_types.USING_DCP and dcp_types.Metadata is Metadata; "
            "from torch.distributed.checkpoint.api import CheckpointException; "
            "assert issubclass(dist_checkpointing.CheckpointingException, CheckpointException)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
