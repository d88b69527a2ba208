"""Modules whose public names are imported on first use (PEP 562).

Owns: ``lazy_exports``: a package's public names imported on first use (PEP 562), for the
package itself in the ``dist-ckpt`` and persistent writer processes, ``tools/`` and
``strategies/torch_dist/``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable, Dict, List, Tuple


def lazy_exports(module: str, exports: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``module``: each name of ``exports`` is imported from
    its module (relative to ``module``'s package) on first use, then kept as a global."""
    namespace = import_module(module).__dict__

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(import_module(exports[name], module), name)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
