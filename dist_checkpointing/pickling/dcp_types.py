"""PyTorch DCP's metadata classes, or light stand-ins with the same names and fields.

A checkpoint's ``.metadata`` is a pickle of DCP's dataclasses (``Metadata``,
``TensorStorageMetadata``, ``_StorageInfo``, …), and importing any of them imports the whole
of ``torch.distributed.checkpoint`` (about 1.2 s of CPU). The names here are **DCP's own
classes** whenever DCP is imported when this module is first imported: always in a program
that imports ``dist_checkpointing`` (the package imports DCP), so everything the library
writes is DCP's classes and DCP and Megatron-Core read it. Only the ``dist-ckpt`` command's
read-only subcommands (``inspect``, ``validate``, ``export``) run without DCP: there the names
are the stand-ins below, which unpickle, compare and hash as DCP's classes do. The choice is
made once per process (:data:`USING_DCP`); every module of the read path takes the classes
from here, so the metadata the unpickler builds and the classes the readers check are the same.

Owns: pyTorch DCP's metadata classes (``Metadata``, ``TensorStorageMetadata``,
``_StorageInfo``, …) as the rest of the package uses them: DCP's own when DCP is imported
when this module is first imported (always with ``import dist_checkpointing``), else light
dataclasses with the same names, fields, pickled state, equality and hashing (the
``dist-ckpt`` command's read-only subcommands, which do not import DCP's ~1.2 s of CPU); the
``.metadata`` unpickler and every reader take them from here.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

#: whether the names below are DCP's classes (else the stand-ins)
USING_DCP = "torch.distributed.checkpoint" in sys.modules


class _StandIn:
    """Marks a stand-in class (for messages and tests)."""


@dataclass
class _ChunkStorageMetadata(_StandIn):
    offsets: torch.Size
    sizes: torch.Size


class _MemFormatEncoding(enum.Enum):
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEMORY_FORMATS = {
    _MemFormatEncoding.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
    _MemFormatEncoding.TORCH_CHANNELS_LAST: torch.channels_last,
    _MemFormatEncoding.TORCH_PRESERVE_FORMAT: torch.preserve_format,
}


@dataclass
class _TensorProperties(_StandIn):
    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False

    def __setstate__(self, state: tuple) -> None:
        # DCP's pickled state: (dtype, layout, requires_grad, memory-format encoding, pin_memory)
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        if encoding not in _MEMORY_FORMATS:
            raise RuntimeError(f"Invalid torch.memory_format encoding: {encoding}")
        self.memory_format = _MEMORY_FORMATS[encoding]


@dataclass
class _TensorStorageMetadata(_StandIn):
    properties: _TensorProperties
    size: torch.Size
    chunks: List[_ChunkStorageMetadata]


@dataclass
class _BytesStorageMetadata(_StandIn):
    pass


@dataclass
class _StorageMeta(_StandIn):
    checkpoint_id: Any = None
    save_id: Optional[str] = None
    load_id: Optional[str] = None
    modules: List[str] = field(default_factory=list)


@dataclass
class _Metadata(_StandIn):
    state_dict_metadata: Dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Optional[_StorageMeta] = None
    version: Optional[str] = None


@dataclass(frozen=True)
class _MetadataIndex(_StandIn):
    fqn: str
    offset: Optional[torch.Size] = None
    index: Optional[int] = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset: Optional[Sequence[int]] = None, index: Optional[int] = None):
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", torch.Size(offset))


@dataclass
class _StorageInfo(_StandIn):
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Optional[Sequence[str]] = None


class _WriteItemType(enum.Enum):
    TENSOR = 1
    SHARD = 2
    BYTE_IO = 3


class _LoadItemType(enum.Enum):
    TENSOR = 1
    BYTE_IO = 2


@dataclass(frozen=True)
class _TensorWriteData(_StandIn):
    chunk: _ChunkStorageMetadata
    properties: _TensorProperties
    size: torch.Size


@dataclass(frozen=True)
class _WriteItem(_StandIn):
    index: _MetadataIndex
    type: _WriteItemType
    bytes_io_data: Any = None
    tensor_data: Optional[_TensorWriteData] = None


@dataclass(frozen=True)
class _ReadItem(_StandIn):
    type: _LoadItemType
    dest_index: _MetadataIndex
    dest_offsets: torch.Size
    storage_index: _MetadataIndex
    storage_offsets: torch.Size
    lengths: torch.Size


@dataclass(frozen=True)
class _SavePlan(_StandIn):
    items: List[_WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


@dataclass
class _LoadPlan(_StandIn):
    items: List[_ReadItem]
    storage_data: Any = None
    planner_data: Any = None


# (DCP module, class name) -> stand-in
_STAND_INS: Dict[tuple, type] = {
    ("metadata", "Metadata"): _Metadata, ("metadata", "TensorStorageMetadata"): _TensorStorageMetadata,
    ("metadata", "BytesStorageMetadata"): _BytesStorageMetadata, ("metadata", "TensorProperties"): _TensorProperties,
    ("metadata", "ChunkStorageMetadata"): _ChunkStorageMetadata, ("metadata", "MetadataIndex"): _MetadataIndex,
    ("metadata", "StorageMeta"): _StorageMeta, ("metadata", "_MEM_FORMAT_ENCODING"): _MemFormatEncoding,
    ("planner", "SavePlan"): _SavePlan, ("planner", "WriteItem"): _WriteItem,
    ("planner", "WriteItemType"): _WriteItemType, ("planner", "TensorWriteData"): _TensorWriteData,
    ("planner", "LoadPlan"): _LoadPlan, ("planner", "ReadItem"): _ReadItem, ("planner", "LoadItemType"): _LoadItemType,
    ("filesystem", "_StorageInfo"): _StorageInfo,
}


def _resolve() -> Dict[tuple, type]:
    """``(module, name) -> class``: DCP's classes if DCP is imported, else the stand-ins."""
    if not USING_DCP:
        return dict(_STAND_INS)
    from torch.distributed.checkpoint import filesystem, metadata, planner

    modules = {"metadata": metadata, "planner": planner, "filesystem": filesystem}
    return {key: getattr(modules[key[0]], key[1]) for key in _STAND_INS}


#: ``("torch.distributed.checkpoint.<module>", name) -> class`` of every class here, for the unpickler
CLASSES: Dict[tuple, type] = {(f"torch.distributed.checkpoint.{m}", n): c for (m, n), c in _resolve().items()}
_by_name = {n: c for (m, n), c in _resolve().items()}

Metadata = _by_name["Metadata"]
TensorStorageMetadata = _by_name["TensorStorageMetadata"]
BytesStorageMetadata = _by_name["BytesStorageMetadata"]
TensorProperties = _by_name["TensorProperties"]
ChunkStorageMetadata = _by_name["ChunkStorageMetadata"]
MetadataIndex = _by_name["MetadataIndex"]
StorageMeta = _by_name["StorageMeta"]
StorageInfo = _by_name["_StorageInfo"]
SavePlan = _by_name["SavePlan"]
LoadPlan = _by_name["LoadPlan"]
del _by_name
