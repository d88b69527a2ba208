"""Tuning settings read and set through a module other than the one whose code reads them.

When a module's code moves into a package, its module-level settings (e.g.
``transport.BUCKET_BYTES``) move with the code that reads them; the old module name keeps
them working: ``old.NAME`` reads and ``old.NAME = value`` (or ``monkeypatch.setattr``)
sets the setting where the code reads it.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Iterable


def forward_settings(module_name: str, target: types.ModuleType, names: Iterable[str]) -> None:
    """Make each of ``names`` on the (imported) module ``module_name`` read from and set on
    ``target``. The module must not bind these names itself."""
    forwarded = frozenset(names)
    module = sys.modules[module_name]
    clash = sorted(n for n in forwarded if n in vars(module))
    if clash:
        raise ValueError(f"{module_name} binds {clash} itself: they would not be forwarded to {target.__name__}")

    class _Forwarding(types.ModuleType):
        def __getattr__(self, name: str) -> Any:  # (only for names the module does not bind)
            if name in forwarded:
                return getattr(target, name)
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

        def __setattr__(self, name: str, value: Any) -> None:
            if name in forwarded:
                setattr(target, name, value)
            else:
                super().__setattr__(name, value)

        def __delattr__(self, name: str) -> None:
            if name in forwarded:
                raise AttributeError(f"{module_name}.{name} is a setting of {target.__name__}: set it, do not delete it")
            super().__delattr__(name)

    module.__class__ = _Forwarding
