"""The one-line switch: make ``megatron.core.dist_checkpointing`` this package.

::

    import dist_checkpointing.megatron
    dist_checkpointing.megatron.install()   # before Megatron is imported
    import megatron.core.dist_checkpointing as m   # m is dist_checkpointing

or, without changing the trainer, run it through this module (also under ``torchrun``)::

    python -m dist_checkpointing.megatron pretrain_gpt.py --ckpt-format torch_dist ...
    torchrun --nproc-per-node 8 -m dist_checkpointing.megatron pretrain_gpt.py ...
    python -m dist_checkpointing.megatron -m some.module ...

:func:`install` puts a finder first on ``sys.meta_path`` that resolves
``megatron.core.dist_checkpointing`` and every ``megatron.core.dist_checkpointing.X`` to
``dist_checkpointing`` and ``dist_checkpointing.X`` (the same module objects: nothing is
copied), whether Megatron-Core is installed or not and whether it is imported before or
after. Modules of Megatron-Core's package that were imported before :func:`install` are
replaced in ``sys.modules`` (names other modules already bound keep the old objects, so
install first). :func:`install` is idempotent; :func:`uninstall` removes the finder and the
aliases. The few modules of Megatron-Core's package that are model logic rather than
checkpointing (:data:`MEGATRON_OWN`) come from the installed Megatron-Core itself, and run
on this package's types.

Owns: the switch: ``install()`` / ``uninstall()`` of a ``sys.meta_path`` finder aliasing
``megatron.core.dist_checkpointing[.X]`` to this package (the modules of ``MEGATRON_OWN``,
model logic such as 0.19's ``gpt_checkpoint_interop``, come from the installed
Megatron-Core, running on this package); ``python -m dist_checkpointing.megatron SCRIPT``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
from types import ModuleType
from typing import List, Optional, Sequence

from .compat.moved import SameModuleLoader

ALIAS = "megatron.core.dist_checkpointing"
TARGET = "dist_checkpointing"


def _target_name(fullname: str) -> Optional[str]:
    if fullname == ALIAS or fullname.startswith(ALIAS + "."):
        return TARGET + fullname[len(ALIAS):]
    return None


class MegatronAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``megatron.core.dist_checkpointing[.X]`` to ``dist_checkpointing[.X]``."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        name = _target_name(fullname)
        if name is None:
            return None
        if importlib.util.find_spec(name) is None:
            return _megatron_own_spec(fullname)  # else not provided here: the import fails as usual
        ours = importlib.import_module(name)
        return importlib.machinery.ModuleSpec(fullname, SameModuleLoader(name), is_package=hasattr(ours, "__path__"))


#: modules of Megatron-Core's package that hold model logic over the mapping layer and no
#: checkpoint I/O: not provided here; under the switch, Megatron-Core's own file (from the
#: installed Megatron-Core) is imported, running on this package's types
MEGATRON_OWN = {
    "gpt_checkpoint_interop": "Megatron-Core >= 0.19: points a hybrid model's sharded state dict at a GPT "
                              "checkpoint's keys (it needs megatron.core.models)",
}


_OWN = "dist_checkpointing.megatron: Megatron-Core's own module on this package"


def _megatron_own_spec(fullname: str) -> Optional[importlib.machinery.ModuleSpec]:
    """The spec of Megatron-Core's own file for a module of :data:`MEGATRON_OWN`."""
    name = fullname[len(ALIAS) + 1:]
    core = sys.modules.get("megatron.core")
    if name not in MEGATRON_OWN or core is None:
        return None
    for directory in getattr(core, "__path__", ()):
        path = os.path.join(directory, "dist_checkpointing", name + ".py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location(fullname, path)
            spec.loader_state = _OWN  # uninstall() drops the module: it was bound to this package
            return spec
    return None


def _finder() -> Optional[MegatronAliasFinder]:
    return next((f for f in sys.meta_path if isinstance(f, MegatronAliasFinder)), None)


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _finder() is not None


def _aliased_names() -> List[str]:
    return [n for n in sys.modules if _target_name(n) is not None]


def _resolved_here(name: str) -> bool:
    """Whether the module ``name`` in ``sys.modules`` is this package's (or Megatron-Core's
    own file imported by the finder, running on this package)."""
    module = sys.modules[name]
    return module is sys.modules.get(_target_name(name)) or getattr(module.__spec__, "loader_state", None) == _OWN


def install() -> None:
    """Make ``megatron.core.dist_checkpointing`` and its submodules resolve to this package."""
    if not is_installed():
        sys.meta_path.insert(0, MegatronAliasFinder())
    for name in _aliased_names():  # Megatron-Core's own modules imported before: replace them
        if _resolved_here(name):
            continue
        del sys.modules[name]
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a module of theirs we do not provide: gone, as if never imported
    parent = sys.modules.get("megatron.core")
    if parent is not None:
        parent.dist_checkpointing = importlib.import_module(ALIAS)


def uninstall() -> None:
    """Remove the finder and the aliases (a later import finds Megatron-Core's own package)."""
    finder = _finder()
    while finder is not None:
        sys.meta_path.remove(finder)
        finder = _finder()
    for name in _aliased_names():
        if _resolved_here(name):
            del sys.modules[name]
    parent = sys.modules.get("megatron.core")
    if parent is not None and getattr(parent, "dist_checkpointing", None) is sys.modules.get(TARGET):
        del parent.dist_checkpointing


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m dist_checkpointing.megatron SCRIPT [ARGS]`` or ``... -m MODULE [ARGS]``:
    :func:`install`, then run the script or module as ``__main__`` with ``ARGS``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    importlib.import_module(__spec__.name if __spec__ else __name__).install()  # the importable module's finder
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("python -m dist_checkpointing.megatron -m MODULE [ARGS]: MODULE missing")
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as python does for a script
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
