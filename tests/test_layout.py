"""The package root shows the architecture, and module paths of earlier versions still import."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dist_checkpointing
from dist_checkpointing.compat.moved import MOVED

from .helpers import slack

ROOT = Path(dist_checkpointing.__file__).resolve().parent

# Megatron-Core 0.15's modules, this library's entry points, and its packages (one concept each)
MEGATRON_CORE = {"core", "dict_utils", "exchange_utils", "mapping", "optimizer", "serialization", "state_dict_utils",
                 "tensor_aware_state_dict", "utils", "validation", "strategies"}
ENTRY_POINTS = {"__init__", "__main__", "cli", "megatron", "readers", "phases"}
PACKAGES = {"storage", "exchange", "transport", "manager", "integrity", "tensors", "tools", "compat", "pickling",
            "runtime"}


def test_the_root_holds_megatron_cores_modules_entry_points_and_packages():
    found = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert found == MEGATRON_CORE | ENTRY_POINTS | PACKAGES, sorted(found ^ (MEGATRON_CORE | ENTRY_POINTS | PACKAGES))


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_module_itself(old):
    module = importlib.import_module(f"dist_checkpointing.{old}")
    assert module is importlib.import_module(f"dist_checkpointing.{MOVED[old]}")
    assert not (ROOT / f"{old}.py").exists()


def test_old_paths_in_a_fresh_interpreter():
    """``from dist_checkpointing.X import name`` as code written for an earlier version does."""
    code = ("from dist_checkpointing.convert import convert_checkpoint\n"
            "from dist_checkpointing.integrity import checksum\n"
            "from dist_checkpointing.fp8 import is_float8tensor\n"
            "import dist_checkpointing.save_claim as claim, dist_checkpointing.integrity.save_claim as new\n"
            "assert claim is new and convert_checkpoint.__module__ == 'dist_checkpointing.tools.convert'\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=slack(120),
                          cwd=ROOT.parent)
    assert proc.stdout.strip() == "ok", proc.stderr
