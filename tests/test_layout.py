"""The package root shows the architecture, and module paths of earlier versions still import."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Dict, Set

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
    assert not (ROOT / f"{old.replace('.', '/')}.py").exists()


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


def _imports() -> Dict[str, Set[str]]:
    """Every module of the package (dotted, under the package) -> the modules of the package it
    imports (at the top or inside a function)."""
    found: Dict[str, Set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        name = ".".join(p for p in parts if p != "__init__")
        targets: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                targets |= {f"{mod}.{a.name}".strip(".") for a in node.names} | {mod}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                targets |= {n[len("dist_checkpointing."):] for n in names if n.startswith("dist_checkpointing.")}
        found[name] = targets
    return found


# the layers, lowest first: a module imports from its own layer or lower ones only
LOWER = ("core", "mapping", "dict_utils", "tensors", "runtime", "storage", "exchange", "transport", "integrity",
         "pickling", "validation", "exchange_utils")
UPPER = ("strategies", "serialization", "manager", "tools", "cli", "megatron", "readers", "phases", "__main__")


def test_imports_point_down():
    upward = sorted((mod, target) for mod, targets in _imports().items()
                    if mod.split(".")[0] in LOWER for target in targets
                    if target.split(".")[0] in UPPER)
    assert not upward, upward


def test_the_torch_dist_format_does_not_import_plain_dcp_interop():
    """``strategies.dcp`` is built on ``strategies.torch_dist``, not the reverse (its package
    still exports the DCP bridges lazily, where earlier versions had them)."""
    upward = sorted((mod, target) for mod, targets in _imports().items() if mod.startswith("strategies.torch_dist")
                    for target in targets if target.startswith("strategies.dcp"))
    assert not upward, upward


def test_runtime_imports_only_the_layers_below_it():
    """The process services import each other, ``core``, ``tensors`` and the trusted unpickler."""
    allowed = ("runtime", "core", "tensors", "pickling.trusted")
    wrong = sorted((mod, target) for mod, targets in _imports().items() if mod.split(".")[0] == "runtime"
                   for target in targets if not target.startswith(allowed))
    assert not wrong, wrong


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
