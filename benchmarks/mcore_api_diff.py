"""Compare the public names of Megatron-Core's ``megatron.core.dist_checkpointing`` with ours.

A developer script (not part of the package): it imports Megatron-Core (0.15.3 by default,
from ``MCORE_SITE``) next to this checkout's ``dist_checkpointing``, walks every module of
Megatron-Core's package and prints, per module, the public names missing here and the
names whose signature differs. Names that code outside the package imports ("user"
names) are marked ``[user]``: Megatron-Core's own layers, optimizer and models (found by
reading their sources) and Megatron-LM's trainer (listed in ``MEGATRON_LM_IMPORTS``).

    PYTHONPATH=$PWD python benchmarks/mcore_api_diff.py [--mcore-site DIR] [--user-only] [--check]

``--check`` exits 1 when a user name is missing or differs in signature.

A name is public when it is defined in the module (a ``def``, ``class`` or module-level
assignment whose name does not start with ``_``, or a member of ``__all__``); names a module
only imports from a sibling are re-exports, compared only where user code imports them from
there. A signature differs when one of Megatron-Core's parameters is missing here, has
another kind or position or another default, or when we require a parameter it does not
have; extra parameters with defaults are allowed. For classes the constructor and every
public member (methods, properties, class attributes, enum members) are compared.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import pkgutil
import sys
import types
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

PKG = "megatron.core.dist_checkpointing"
OURS = "dist_checkpointing"
DEFAULT_SITE = Path(__file__).resolve().parents[1] / ".ci" / "mcore_site"

# What Megatron-LM's trainer (megatron/training/, not part of the megatron-core wheel)
# imports from the package: checkpointing.py and async_utils.py, core_v0.15.x era and later.
MEGATRON_LM_IMPORTS: Dict[str, Set[str]] = {
    PKG: {"save", "load", "load_common_state_dict", "load_content_metadata", "check_is_distributed_checkpoint",
          "load_tensors_metadata", "ShardedTensor", "ShardedObject"},
    f"{PKG}.mapping": {"ShardedObject", "ShardedTensor", "ShardedStateDict"},
    f"{PKG}.serialization": {"get_default_save_sharded_strategy", "get_default_load_sharded_strategy"},
    f"{PKG}.strategies.async_utils": {"AsyncCallsQueue", "AsyncRequest", "_disable_gc"},
    f"{PKG}.strategies.filesystem_async": {"_results_queue", "FileSystemWriterAsync"},
    f"{PKG}.strategies.fully_parallel": {"FullyParallelLoadStrategyWrapper", "FullyParallelSaveStrategyWrapper"},
    f"{PKG}.strategies.torch": {"TorchDistLoadShardedStrategy", "TorchDistSaveShardedStrategy"},
    f"{PKG}.strategies.state_dict_saver": {"save_state_dict_async_plan", "save_state_dict_async_finalize"},
    f"{PKG}.tensor_aware_state_dict": {"MCoreTensorAwareStateDict"},
    f"{PKG}.utils": {"_clean_metadata_for_serialization"},
    f"{PKG}.validation": {"StrictHandling"},
}


# User names deliberately not provided or differing, with the reason (docs/coming_from_megatron.md lists
# them too): reported as "not provided", not counted as problems.
NOT_PROVIDED: Dict[str, str] = {
    f"{PKG}.strategies.fully_parallel.FullyParallelLoadStrategyWrapper.apply_loading_parallelization":
        "an internal step of Megatron-Core's wrapper; ours splits a load into own reads and an exchange its own way",
    f"{PKG}.strategies.fully_parallel.FullyParallelLoadStrategyWrapper.fill_in_deferred_sharded_tensors":
        "the same internal step",
    f"{PKG}.strategies.fully_parallel.FullyParallelLoadStrategyWrapper.fill_in_deferred_sharded_objects":
        "the same internal step",
    f"{PKG}.strategies.fully_parallel.FullyParallelLoadStrategyWrapper.check_backend_compatibility":
        "the parameter is named loaded_backend (Megatron-Core names it loaded_version and passes the backend "
        "positionally)",
    f"{PKG}.strategies.torch.TorchDistLoadShardedStrategy.check_backend_compatibility": "the same parameter name",
    f"{PKG}.strategies.torch.TorchDistLoadShardedStrategy.load_tensors_metadata":
        "no metadata argument: the strategy reads .metadata itself (checked field by field, cached)",
    **{f"{PKG}.strategies.filesystem_async.FileSystemWriterAsync.{name}":
       "an internal step of Megatron-Core's writer (its write buckets and worker processes); ours writes with "
       "the function get_save_function_and_args returns"
       for name in ("preload_tensors", "write_preloaded_data", "write_preloaded_data_multithread",
                    "write_preloaded_data_multiproc",
                    "prepare_decentralized_global_plan")},
}

# Differences by design against a Megatron-Core newer than the reference (0.15), by its minor version.
NOT_PROVIDED_SINCE: Dict[Tuple[int, int], Dict[str, str]] = {
    (0, 16): {
        **{f"{PKG}{mod}.{fn}": "Megatron-Core 0.16 dropped common_strategy (the 4th parameter in 0.15, the "
                               "reference, kept here): later parameters differ in position only; Megatron-LM "
                               "passes them by keyword"
           for mod in ("", ".serialization") for fn in ("save", "load")},
        f"{PKG}.strategies.torch.TorchDistSaveShardedStrategy":
            "thread_count defaults to 2, as in Megatron-Core 0.15 (the reference); Megatron-LM sets it",
    },
}


def megatron_core_version(site: Path) -> Tuple[int, int]:
    """``(major, minor)`` of the Megatron-Core installed in ``site`` (its dist-info)."""
    for info in site.glob("megatron_core-*.dist-info"):
        major, minor = info.name.split("-")[1].split(".")[:2]
        return int(major), int(minor)
    return 0, 15


def by_design(site: Path) -> Dict[str, str]:
    """Every difference by design for the Megatron-Core in ``site``."""
    found = dict(NOT_PROVIDED)
    for since, entries in NOT_PROVIDED_SINCE.items():
        if megatron_core_version(site) >= since:
            found.update(entries)
    return found


@dataclass
class ModuleReport:
    """The comparison of one of Megatron-Core's modules with ours."""

    theirs: str
    ours: str
    ours_exists: bool
    missing: List[str] = field(default_factory=list)
    signatures: List[Tuple[str, str]] = field(default_factory=list)  # (name, explanation)
    user: Set[str] = field(default_factory=set)
    design: Dict[str, str] = field(default_factory=dict)  # differences by design (by_design), by full name
    megatron_own: bool = False  # not provided: the switch imports Megatron-Core's own module

    def user_problems(self) -> List[str]:
        """The user names of this module that are missing or differ (not those by design)."""
        if self.megatron_own:
            return []
        bad = [n for n in self.missing if n.split(".")[0] in self.user]
        bad += [n for n, _ in self.signatures if n.split(".")[0] in self.user]
        return [n for n in bad if f"{self.theirs}.{n}" not in self.design]


def put_mcore_on_path(site: Path) -> None:
    """Make Megatron-Core's package importable from ``site`` without running
    ``megatron/core/__init__.py`` (0.19's imports all of Megatron-Core, triton included)."""
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    for name in ("megatron", "megatron.core"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(site.joinpath(*name.split(".")))]
            sys.modules[name] = module
    for name in ("megatron.core.tensor_parallel", "megatron.core.utils", "megatron.core.parallel_state"):
        importlib.import_module(name)  # in this order, as megatron/core/__init__.py would


def _source_tree(module) -> Optional[ast.Module]:
    try:
        return ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return None


def defined_names(module) -> Set[str]:
    """Public names a module defines itself (or lists in ``__all__``)."""
    names: Set[str] = set(getattr(module, "__all__", ()) or ())
    tree = _source_tree(module)
    if tree is None:
        return names
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") and n != "logger" and hasattr(module, n)}


def _resolve(importer: str, is_pkg: bool, level: int, module: Optional[str]) -> str:
    if not level:
        return module or ""
    base = importer.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def user_imports(site: Path) -> Dict[str, Set[str]]:
    """Names imported from the package by Megatron-Core's code outside it, and Megatron-LM's.

    ``from PKG.mod import a, b`` gives ``mod: {a, b}``; ``from PKG import mod`` then
    ``mod.x`` gives ``mod: {x}``.
    """
    found: Dict[str, Set[str]] = {k: set(v) for k, v in MEGATRON_LM_IMPORTS.items()}
    root = site / "megatron"
    for path in root.rglob("*.py"):
        rel = path.relative_to(site).with_suffix("")
        if "dist_checkpointing" in rel.parts[:3] and rel.parts[:3] == ("megatron", "core", "dist_checkpointing"):
            continue
        name = ".".join(rel.parts)
        is_pkg = path.name == "__init__.py"
        if is_pkg:
            name = name.rsplit(".", 1)[0]
        try:
            text = path.read_text(encoding="utf-8")
            if PKG.rsplit(".", 1)[-1] not in text:  # an import of the package names it: skip parsing
                continue
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        aliases: Dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = _resolve(name, is_pkg, node.level, node.module)
                for a in node.names:
                    full = f"{src}.{a.name}"
                    if full == PKG or full.startswith(PKG + ".") and _is_module(full):
                        aliases[a.asname or a.name] = full
                    elif src == PKG or src.startswith(PKG + "."):
                        found.setdefault(src, set()).add(a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(PKG) and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                mod = aliases[node.value.id]
                if not _is_module(f"{mod}.{node.attr}"):
                    found.setdefault(mod, set()).add(node.attr)
        for mod in aliases.values():
            found.setdefault(mod, set())
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _default_repr(value) -> str:
    if value is inspect.Parameter.empty:
        return "<required>"
    if isinstance(value, Enum):
        return f"{type(value).__name__}.{value.name}"
    if inspect.isclass(value) or callable(value):
        return getattr(value, "__qualname__", repr(value))
    return repr(value)


def _same_default(theirs, ours) -> bool:
    if ours is inspect.Parameter.empty:
        return False
    if repr(ours) == "<factory>":  # a dataclass default_factory: an empty container there
        return theirs in ({}, [], ())
    return _default_repr(theirs) == _default_repr(ours)


def signature_difference(theirs, ours) -> Optional[str]:
    """Why ``ours`` cannot be called the way ``theirs`` is, or None when it can."""
    try:
        s_t, s_o = inspect.signature(theirs), inspect.signature(ours)
    except (TypeError, ValueError):
        return None
    p_t, p_o = list(s_t.parameters.values()), list(s_o.parameters.values())
    by_name = {p.name: p for p in p_o}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in p_o)
    problems = []
    for i, p in enumerate(p_t):
        q = by_name.get(p.name)
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if not any(x.kind is p.kind for x in p_o):
                problems.append(f"no {'*' if p.kind is p.VAR_POSITIONAL else '**'}{p.name}")
            continue
        if q is None:
            if not (var_kw and p.kind is p.KEYWORD_ONLY):
                problems.append(f"missing parameter {p.name!r}")
            continue
        positional = (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        if p.kind in positional and (q.kind not in positional or p_o.index(q) != i):
            problems.append(f"{p.name!r} not at position {i}")
        elif p.kind is p.POSITIONAL_OR_KEYWORD and q.kind is q.POSITIONAL_ONLY:
            problems.append(f"{p.name!r} is positional-only")
        if p.default is not p.empty and not _same_default(p.default, q.default):
            problems.append(f"{p.name!r} default {_default_repr(q.default)} (theirs {_default_repr(p.default)})")
    names_t = {p.name for p in p_t}
    for q in p_o:
        if q.name not in names_t and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            problems.append(f"extra required parameter {q.name!r}")
    return "; ".join(problems) or None


def _class_members(cls) -> Dict[str, object]:
    members = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ in ("builtins", "abc", "typing", "enum") or klass.__module__.startswith("torch"):
            continue
        for k, v in vars(klass).items():
            if not k.startswith("_") or k == "__init__":
                members[k] = v
    if isinstance(cls, type) and issubclass(cls, Enum):
        members.update({m: m for m in cls.__members__})
    for f in getattr(cls, "__dataclass_fields__", {}):
        if not f.startswith("_"):
            members.setdefault(f, None)
    members.update({f: None for f in getattr(cls, "_fields", ()) if not f.startswith("_")})  # NamedTuple
    return members


def compare_object(name: str, theirs, ours, out: ModuleReport) -> None:
    """Add to ``out`` how ``ours`` differs from ``theirs`` (a function or class)."""
    if inspect.isclass(theirs):
        if not inspect.isclass(ours):
            out.signatures.append((name, f"a class there, {type(ours).__name__} here"))
            return
        why = signature_difference(theirs, ours)
        if why:
            out.signatures.append((name, why))
        ours_members = _class_members(ours)
        for member, value in _class_members(theirs).items():
            if member == "__init__":
                continue
            if member not in ours_members and not hasattr(ours, member):
                out.missing.append(f"{name}.{member}")
                continue
            mine = getattr(ours, member, None)
            if inspect.isfunction(value) and callable(mine):
                why = signature_difference(getattr(theirs, member), mine)
                if why:
                    out.signatures.append((f"{name}.{member}", why))
    elif callable(theirs) and not isinstance(theirs, type):
        why = signature_difference(theirs, ours)
        if why:
            out.signatures.append((name, why))


def compare(site: Path = DEFAULT_SITE) -> List[ModuleReport]:
    """One ``ModuleReport`` per module of Megatron-Core's package, in import-name order."""
    from dist_checkpointing.megatron import MEGATRON_OWN

    put_mcore_on_path(site)
    theirs_pkg = importlib.import_module(PKG)
    users = user_imports(site)
    design = by_design(site)
    names = [PKG] + sorted(m.name for m in pkgutil.walk_packages(theirs_pkg.__path__, PKG + "."))
    reports = []
    for mod_name in names:
        theirs = importlib.import_module(mod_name)
        ours_name = OURS + mod_name[len(PKG):]
        try:
            ours = importlib.import_module(ours_name)
        except ImportError:
            ours = None
        rep = ModuleReport(mod_name, ours_name, ours is not None, user=users.get(mod_name, set()), design=design,
                           megatron_own=ours is None and mod_name[len(PKG) + 1:] in MEGATRON_OWN)
        wanted = defined_names(theirs) | (rep.user & set(vars(theirs)))
        if mod_name == PKG or mod_name.endswith(".strategies"):
            wanted |= {n for n, v in vars(theirs).items() if not n.startswith("_") and not inspect.ismodule(v)}
        for name in sorted(wanted):
            if ours is None or not hasattr(ours, name):
                rep.missing.append(name)
            else:
                compare_object(name, getattr(theirs, name), getattr(ours, name), rep)
        reports.append(rep)
    return reports


def format_report(reports: List[ModuleReport], user_only: bool = False) -> str:
    """The per-module text the script prints."""
    lines = []
    for rep in reports:
        missing = [n for n in rep.missing if not user_only or n.split(".")[0] in rep.user]
        sigs = [(n, w) for n, w in rep.signatures if not user_only or n.split(".")[0] in rep.user]
        head = f"{rep.theirs} -> {rep.ours}" + ("" if rep.ours_exists else "  (module missing here)")
        if rep.megatron_own:
            lines.append(f"{rep.theirs}: Megatron-Core's own module, imported by the switch")
            continue
        if not missing and not sigs:
            lines.append(f"{head}: ok")
            continue
        lines.append(head)
        for n in missing:
            reason = rep.design.get(f"{rep.theirs}.{n}")
            tag = "  [user]" if n.split(".")[0] in rep.user else ""
            lines.append(f"  not provided {n}{tag}: {reason}" if reason else f"  missing    {n}{tag}")
        for n, why in sigs:
            reason = rep.design.get(f"{rep.theirs}.{n}")
            tag = "  [user]" if n.split(".")[0] in rep.user else ""
            lines.append(f"  differs by design {n}{tag}: {reason}" if reason else f"  signature  {n}{tag}: {why}")
    problems = sum(len(r.user_problems()) for r in reports)
    lines.append(f"user-imported names missing or differing: {problems}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mcore-site", type=Path, default=Path(os.environ.get("MCORE_SITE", DEFAULT_SITE)),
                        help="directory holding Megatron-Core's 'megatron' package (default: $MCORE_SITE or .ci/mcore_site)")
    parser.add_argument("--user-only", action="store_true", help="print only the names user code imports")
    parser.add_argument("--check", action="store_true", help="exit 1 when a user name is missing or differs")
    args = parser.parse_args(argv)
    reports = compare(args.mcore_site)
    print(format_report(reports, args.user_only))
    return 1 if args.check and any(r.user_problems() for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
