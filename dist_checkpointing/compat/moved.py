"""Module paths of earlier versions that moved into packages keep importing: the old name is
the new module itself (the same object, so setting an attribute through either name sets
it for both)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Dict, Optional, Sequence

#: old module name (under ``dist_checkpointing``) -> its module now
MOVED: Dict[str, str] = {
    "integrity": "integrity",  # (now the package: it re-exports the checksum functions)
    "manifest": "integrity.manifest",
    "save_claim": "integrity.save_claim",
    "liveness": "integrity.liveness",
    "path_overlap": "integrity.overlap",
    "stored_names": "integrity.stored_names",
    "sharded_tensor": "tensors.sharded",
    "fp8": "tensors.fp8",
    "dtensor": "tensors.dtensor",
    "bytes_view": "tensors.bytes_view",
    "collectives": "runtime.collectives",
    "exchange.collectives": "runtime.collectives",
    **{f"strategies.{m}": f"runtime.{m}" for m in ("async_request", "async_callers", "forked_call", "memory_maps",
                                                   "persistent_worker", "process_qos", "progress")},
    "strategies.staging": "runtime.arenas",
    "manager.worker": "manager.bookkeeping",
    **{f"strategies.{m}": f"strategies.torch_dist.{m}"
       for m in ("records", "blob_template", "torch_blob", "metadata_checks", "coverage")},
    "strategies.dcp_types": "pickling.dcp_types",
    "strategies.torch_dist.dcp_types": "pickling.dcp_types",
    "convert": "tools.convert",
    "safetensors_stream": "strategies.safetensors",
    "tools.safetensors_stream": "strategies.safetensors",
    "whole_tensors": "tools.whole_tensors",
    **{f"manager.local_{m}": f"manager.local.{m}"
       for m in ("tier", "snapshot", "files", "format", "marker", "restore", "convert")},
    "strategies.safe_pickle": "pickling.safe_load",
    "strategies.safe_globals": "pickling.safe_globals",
    "strategies.stand_ins": "pickling.stand_ins",
    "strategies.dcp_async_writer": "strategies.dcp.async_writer",
    "strategies.state_dict_saver": "strategies.dcp.async_save",
    "strategies.cached_metadata_filesystem_reader": "strategies.dcp.cached_reader",
    "strategies.checkpointable": "strategies.dcp.checkpointable",
    "strategies.torch_dist.dcp_interop": "strategies.dcp",  # (split: the package re-exports both halves)
    "transport.staging": "transport.host_bounce",
}
_PKG = __name__.split(".")[0]
_OLD = {f"{_PKG}.{old}": f"{_PKG}.{new}" for old, new in MOVED.items() if old != new}


class SameModuleLoader(importlib.abc.Loader):
    """Gives the import system the module ``target`` itself for another name (an alias)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # (the import system set the alias's spec on it)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves the old name of a moved module to the module."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        new = _OLD.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, SameModuleLoader(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
