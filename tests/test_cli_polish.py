"""The command line as a newcomer meets it: quiet on a closed pipe, the umask's modes,
one wording for a missing path, help without arguments, one-line errors naming the CLI's flags (the API's
arguments in the API), one way of printing sizes, positive shard sizes."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_checkpointing as dc
from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing.cli import main
from dist_checkpointing.tools import export_checkpoint, human_size, inspect_checkpoint

from . import launch
from .helpers import slack

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    dc.save({f"layer{i}.weight": ShardedTensor.from_rank_offsets(f"layer{i}.weight", torch.full((4,), float(i)))
             for i in range(600)}, path)
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m dist_checkpointing ARGS``, forked from the preloaded server (``launch.py``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return launch.run(["-m", "dist_checkpointing", *args], env=env, timeout=slack(120))


def test_closed_pipe_exits_quietly(ckpt):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(f"{sys.executable} -m dist_checkpointing inspect --json {ckpt} | head -c 100 >/dev/null; "
                          "echo status=${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                          text=True, env=env, timeout=slack(120))
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert "status=141" in proc.stdout, proc.stdout  # the output really was cut short


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_export_directory_gets_the_umask_mode(ckpt, tmp_path, umask):
    old = os.umask(umask)
    try:
        export_checkpoint(ckpt, tmp_path / "out", key_prefix="layer1.")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask


@pytest.mark.parametrize("command", ["inspect", "validate", "export", "convert"])
def test_a_missing_path_is_worded_alike_by_every_subcommand(tmp_path, capsys, command):
    outputs = [str(tmp_path / "out")] if command in ("export", "convert") else []
    assert main([command, str(tmp_path / "nope"), *outputs]) == 1
    out, err = capsys.readouterr()
    assert err.strip() == f"error: Checkpoint directory {tmp_path / 'nope'} does not exist" and "DAMAGED" not in out


def test_no_arguments_prints_help_and_version_is_known(capsys):
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: dist-ckpt") and "inspect" in out and err == ""
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("dist-ckpt ")


@pytest.mark.parametrize("command", ["inspect", "validate", "export", "import", "convert", "convert-local"])
def test_every_positional_argument_has_help(capsys, command):
    from dist_checkpointing.cli import _parser

    sub = next(a for a in _parser()._actions if a.dest == "command").choices[command]
    positionals = [a for a in sub._actions if not a.option_strings]
    assert positionals and all(a.help for a in positionals), [a.dest for a in positionals if not a.help]


# fixed bytes (a seeded generator): every pytest-xdist worker must collect the same parameters
_NOISE = random.Random(33).randbytes(400)


@pytest.mark.parametrize("content", [b"hello, world\n", _NOISE[:300], b"PK\x03\x04" + _NOISE[300:]],
                         ids=["text", "random_bytes", "zip_magic"])
def test_import_of_something_else_is_one_line(tmp_path, content):
    source = tmp_path / "thing.pt"
    source.write_bytes(content)
    proc = _cli("import", str(source), str(tmp_path / "out"))
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: Cannot import"), proc.stderr
    assert "mmap" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_existing_output_names_the_flag_in_the_cli_and_the_argument_in_the_api(ckpt, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "--force" in err and "force=True" not in err
    with pytest.raises(CheckpointingException, match="force=True") as info:
        export_checkpoint(ckpt, tmp_path / "out")
    assert "--force" not in str(info.value)


@pytest.mark.parametrize("size", ["0", "nan", "abc"])
def test_max_shard_size_must_be_positive(ckpt, tmp_path, size):
    proc = _cli("export", str(ckpt), str(tmp_path / "out"), "--max-shard-size", size)
    assert proc.returncode == 2 and "--max-shard-size" in proc.stderr and "Traceback" not in proc.stderr
    with pytest.raises(CheckpointingException, match="max_shard_bytes"):
        export_checkpoint(ckpt, tmp_path / "out2", max_shard_bytes=0)


def test_inspect_and_validate_print_sizes_alike(ckpt, capsys):
    assert main(["validate", str(ckpt)]) == 0
    out = capsys.readouterr().out
    size = human_size(inspect_checkpoint(ckpt).tensor_bytes)
    assert f"({size})" in out
    assert main(["inspect", str(ckpt)]) == 0
    assert size in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_logs_its_final_output_not_the_temporary_folder(ckpt, tmp_path, caplog, fmt):
    out = tmp_path / ("hf" if fmt == "safetensors" else "all.pt")
    with caplog.at_level("INFO", logger="dist_checkpointing"):
        export_checkpoint(ckpt, out, format=fmt, key_prefix="layer1")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Exported")]
    assert len(lines) == 1 and lines[0].split(" to ")[-1].startswith(f"{out} in "), lines
