"""The ShardedTensor: where a rank's local tensor sits in a global tensor (regular and
uneven grids, prepended axes, flattened distributed-optimizer slices), with the types
every sharded item shares (:class:`ShardedBase`, :data:`ReplicaId`, the state-dict
aliases). Imported from :mod:`.mapping`, which re-exports every name here.

Owns: ``ShardedTensor`` (with ``from_rank_offsets_flat`` and ``reformulated_region`` for
flattened distributed-optimizer slices) and what every sharded item shares: ``ShardedBase``,
``ReplicaId``, ``is_main_replica``, ``ShardedStateDict``, ``StateDict``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ..core import CheckpointingException

ReplicaId = Union[int, Tuple[int, ...]]
ShardedStateDict = Dict[str, Any]
StateDict = Dict[str, Any]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the replica that is written on save: ``0`` or a tuple of zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase(ABC):
    """Common base of everything the sharded strategies save and load."""

    key: str
    data: Any
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise :class:`CheckpointingException` if the metadata is inconsistent."""

    @abstractmethod
    def without_data(self) -> "ShardedBase":
        """A copy with ``data=None`` (metadata only)."""


def _as_int_tuple(name: str, key: str, value: Any) -> Tuple[int, ...]:
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError) as e:
        raise CheckpointingException(
            f"ShardedTensor {key!r}: {name} must be a tuple of ints, got {value!r}"
        ) from e


@dataclass
class ShardedTensor(ShardedBase):
    """A local tensor and its place in a global tensor.

    Args:
        key: name of the global tensor in the checkpoint.
        data: the local tensor (``None`` for metadata-only instances).
        dtype: dtype of the global tensor.
        local_shape: shape of ``data`` (without prepended axes).
        global_shape: shape of the global tensor (prepended axes included).
        global_offset: offset of the local chunk in the global tensor.
        axis_fragmentations: number of chunks along each global axis (regular grids),
            or ``None`` (uneven grids are allowed).
        replica_id: which replica of the chunk this is; ``0`` (or all zeros) is written.
        prepend_axis_num: number of leading global axes of size 1 absent from ``data``.
        allow_shape_mismatch: skip the global shape check on load.
        flattened_range: for distributed-optimizer state, the slice of the flattened local
            chunk that ``data`` (1-D) holds; ``local_shape`` is then the chunk's shape.
    """

    key: str
    data: Optional[torch.Tensor]
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        self.local_shape = _as_int_tuple("local_shape", self.key, self.local_shape)
        self.global_shape = _as_int_tuple("global_shape", self.key, self.global_shape)
        self.global_offset = _as_int_tuple("global_offset", self.key, self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = _as_int_tuple(
                "axis_fragmentations", self.key, self.axis_fragmentations
            )
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check that data, shapes, offsets and fragmentations agree with each other."""
        key = self.key
        if not isinstance(key, str) or not key:
            raise CheckpointingException(f"ShardedTensor key must be a non-empty str, got {key!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise CheckpointingException(f"ShardedTensor {key!r}: dtype must be a torch.dtype")
        if self.prepend_axis_num < 0:
            raise CheckpointingException(f"ShardedTensor {key!r}: negative prepend_axis_num")
        if self.data is not None:
            if not isinstance(self.data, torch.Tensor):
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: data must be a torch.Tensor, got {type(self.data)}"
                )
            if self.data.dtype != self.dtype:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: data dtype {self.data.dtype} does not match "
                    f"the declared dtype {self.dtype}"
                )
            if self.flattened_range is None and tuple(self.data.shape) != self.local_shape:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: data shape {tuple(self.data.shape)} does not "
                    f"match local_shape {self.local_shape}"
                )
        ndim = len(self.global_shape)
        if len(self.global_offset) != ndim:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: global_offset {self.global_offset} and global_shape "
                f"{self.global_shape} have different lengths"
            )
        if len(self.local_shape) + self.prepend_axis_num != ndim:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: local_shape {self.local_shape} with "
                f"prepend_axis_num={self.prepend_axis_num} does not match global_shape "
                f"{self.global_shape}"
            )
        if self.axis_fragmentations is not None and len(self.axis_fragmentations) != ndim:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: axis_fragmentations {self.axis_fragmentations} must "
                f"have {ndim} entries"
            )
        for axis, (off, glob) in enumerate(zip(self.global_offset, self.global_shape)):
            loc = 1 if axis < self.prepend_axis_num else self.local_shape[axis - self.prepend_axis_num]
            if off < 0 or loc < 0 or off + loc > glob:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: chunk [{off}, {off + loc}) on axis {axis} lies "
                    f"outside the global shape {self.global_shape} (global_offset "
                    f"{self.global_offset}, local_shape {self.local_shape})"
                )
        if self.flattened_range is not None:
            self._validate_flattened()

    def _validate_flattened(self) -> None:
        key, rng = self.key, self.flattened_range
        if not isinstance(rng, slice) or not isinstance(rng.start, int) or not isinstance(rng.stop, int):
            raise CheckpointingException(f"ShardedTensor {key!r}: flattened_range must be a slice of ints, got {rng!r}")
        if rng.step not in (None, 1):
            raise CheckpointingException(f"ShardedTensor {key!r}: flattened_range {rng} must not have a step")
        numel = math.prod(self.local_shape)
        if not 0 <= rng.start <= rng.stop <= numel:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: flattened_range {rng} lies outside the chunk of {numel} elements "
                f"(local_shape {self.local_shape})"
            )
        if self.data is not None and (self.data.ndim != 1 or self.data.numel() != rng.stop - rng.start):
            raise CheckpointingException(
                f"ShardedTensor {key!r}: flat data must be 1-D with {rng.stop - rng.start} elements "
                f"(flattened_range {rng}), got shape {tuple(self.data.shape)}"
            )
        if self.axis_fragmentations is None:
            raise CheckpointingException(f"ShardedTensor {key!r}: a flattened tensor needs a regular grid "
                                         "(axis_fragmentations)")
        for axis, (glob, fr) in enumerate(zip(self.global_shape, self.axis_fragmentations)):
            size = 1 if axis < self.prepend_axis_num else self.local_shape[axis - self.prepend_axis_num]
            if axis >= self.prepend_axis_num and (size * fr != glob or self.global_offset[axis] % max(size, 1)):
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: a flattened tensor's chunks must form a regular grid, but axis "
                    f"{axis} has global size {glob}, {fr} fragments of {size} and offset {self.global_offset[axis]}"
                )

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs: Any,
    ) -> "ShardedTensor":
        """Build from ``(axis, rank_offset, fragments)`` triples on a regular grid.

        Along each listed ``axis`` (counting prepended axes) the global size is
        ``fragments * local size`` and the offset ``rank_offset * local size``; a prepended
        axis has size ``fragments`` and offset ``rank_offset``.
        """
        if init_kwargs.get("flattened_range") is not None:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: use from_rank_offsets_flat for flattened tensors"
            )
        init_kwargs.pop("flattened_range", None)
        if not isinstance(data, torch.Tensor):
            raise CheckpointingException(f"ShardedTensor {key!r}: data must be a torch.Tensor")
        ndim = data.ndim + prepend_axis_num
        global_offset = [0] * ndim
        axis_fragm = [1] * ndim
        global_shape = [1] * prepend_axis_num + list(data.shape)
        seen_axes = set()
        for entry in rank_offsets:
            try:
                axis, axis_rank_offset, axis_fragm_n = (int(v) for v in entry)
            except (TypeError, ValueError) as e:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: rank offset {entry!r} is not an "
                    "(axis, rank_offset, fragments) triple"
                ) from e
            if not 0 <= axis < ndim:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: rank offset axis {axis} out of range for a "
                    f"{ndim}-D global tensor"
                )
            if axis in seen_axes:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: duplicate rank offset for axis {axis}"
                )
            if axis_fragm_n < 1 or not 0 <= axis_rank_offset < axis_fragm_n:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: invalid rank offset {axis_rank_offset} for "
                    f"{axis_fragm_n} fragments on axis {axis}"
                )
            seen_axes.add(axis)
            axis_fragm[axis] = axis_fragm_n
            if axis < prepend_axis_num:
                global_offset[axis] = axis_rank_offset
                global_shape[axis] = axis_fragm_n
            else:
                local = data.shape[axis - prepend_axis_num]
                global_offset[axis] = axis_rank_offset * local
                global_shape[axis] = axis_fragm_n * local
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(axis_fragm),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        flat_data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *rank_offsets: Tuple[int, int, int],
        flattened_range: Optional[slice] = None,
        **init_kwargs: Any,
    ) -> "ShardedTensor":
        """Like :meth:`from_rank_offsets` for distributed-optimizer slices: ``flat_data`` is
        ``chunk.flatten()[flattened_range]`` of a chunk of shape ``non_flat_local_shape``."""
        if flattened_range is None:
            raise CheckpointingException(f"ShardedTensor {key!r}: from_rank_offsets_flat needs a flattened_range")
        if not isinstance(flat_data, torch.Tensor) or flat_data.ndim != 1:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: flat data must be a 1-D tensor, got "
                f"{tuple(flat_data.shape) if isinstance(flat_data, torch.Tensor) else type(flat_data)}"
            )
        meta = torch.empty(tuple(non_flat_local_shape), dtype=flat_data.dtype, device="meta")
        sh = cls.from_rank_offsets(key, meta, *rank_offsets, **init_kwargs)
        return replace(sh, data=flat_data, flattened_range=flattened_range)

    @property
    def has_regular_grid(self) -> bool:
        """Whether the chunks form a regular grid (``axis_fragmentations`` is set)."""
        return self.axis_fragmentations is not None

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """The chunk size along each global axis of a regular grid (global size divided by
        the axis fragmentation); an axis that does not divide evenly is refused unless
        ``allow_shape_mismatch``."""
        if self.axis_fragmentations is None:
            raise CheckpointingException(f"ShardedTensor {self.key!r} has no regular grid (axis_fragmentations=None)")
        chunks = []
        for size, fragments in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and size % fragments:
                raise CheckpointingException(f"ShardedTensor {self.key!r}: axis shape ({size}) not divisible "
                                             f"by axis fragmentation ({fragments})")
            chunks.append(size // fragments)
        return tuple(chunks)

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Index of the local chunk in the global tensor (ints on prepended axes)."""
        pre = self.prepend_axis_num
        return tuple(self.global_offset[:pre]) + tuple(
            slice(off, off + size) for off, size in zip(self.global_offset[pre:], self.local_shape)
        )

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Position of the chunk in the grid of chunks (regular grids)."""
        pre = self.prepend_axis_num
        chunk = list(self.global_offset[:pre])
        for off, size in zip(self.global_offset[pre:], self.local_shape):
            if size == 0 or off % size:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: offset {off} is not a multiple of the chunk "
                    f"size {size} (uneven grid)"
                )
            chunk.append(off // size)
        return tuple(chunk)

    def is_empty_chunk(self) -> bool:
        """Whether this chunk (or its flattened slice) holds no elements, e.g. a rank's share
        of an unevenly sharded tensor that gives it nothing. Several ranks may hold empty
        chunks at the same offset: they are not replicas of one chunk."""
        rng = self.flattened_range
        return rng.stop == rng.start if rng is not None else math.prod(self.local_shape) == 0

    def global_region(self) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """``(offsets, sizes)`` of the chunk in the global tensor (size 1 on prepended axes)."""
        return self.global_offset, (1,) * self.prepend_axis_num + self.local_shape

    def reformulated_region(self) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
        """For a flattened tensor: ``(shape, offsets, sizes)`` of its slice in the N-D
        reformulated tensor ``axis_fragmentations + (prod(local_shape),)``, where each chunk of
        the grid is one row and the slice a range of the last axis (Megatron-Core 0.15's
        storage layout of flattened tensors)."""
        if self.flattened_range is None:
            raise CheckpointingException(f"ShardedTensor {self.key!r} is not flattened")
        chunk = self.local_chunk_offset_in_global()
        rng = self.flattened_range
        shape = tuple(self.axis_fragmentations) + (math.prod(self.local_shape),)
        return shape, chunk + (rng.start,), (1,) * len(chunk) + (rng.stop - rng.start,)

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    def init_data(self, device: Union[str, torch.device], init_fn: Callable = torch.empty) -> None:
        """Allocate ``data`` (if missing) on ``device`` with ``init_fn(shape, dtype=, device=)``
        (1-D with the slice's length for flattened tensors)."""
        if self.data is not None:
            return
        shape = self.local_shape
        if self.flattened_range is not None:
            shape = (self.flattened_range.stop - self.flattened_range.start,)
        self.data = init_fn(shape, dtype=self.dtype, device=device)

    def local_coordinates(self) -> Tuple[torch.Tensor, ...]:
        """Per element of ``data`` (in order), its index along each axis of the local chunk."""
        if self.flattened_range is None:
            grids = torch.meshgrid(*(torch.arange(s) for s in self.local_shape), indexing="ij")
            return tuple(g.reshape(-1) for g in grids)
        flat = torch.arange(self.flattened_range.start, self.flattened_range.stop)
        return tuple(torch.unravel_index(flat, self.local_shape)) if self.local_shape else ()

    def global_coordinates(self) -> Tuple[torch.Tensor, ...]:
        """Per element of ``data`` (in order), its index along each global axis."""
        local = self.local_coordinates()
        n = local[0].numel() if local else 1
        pre = tuple(torch.full((n,), off, dtype=torch.long) for off in self.global_offset[: self.prepend_axis_num])
        rest = tuple(c + off for c, off in zip(local, self.global_offset[self.prepend_axis_num:]))
        return pre + rest

    def narrow(self, dim: int, start: int, length: int) -> List["ShardedTensor"]:
        """Narrow the local data along ``dim``; the result describes a chunk of a *smaller*
        global tensor whose size along ``dim`` shrinks by ``length / local size`` (used to
        split fused weights into separately saved global tensors)."""
        if self.data is None:
            raise CheckpointingException(f"ShardedTensor {self.key!r}: cannot narrow without data")
        gdim = dim + self.prepend_axis_num
        local_len = self.local_shape[dim]
        glob, off = self.global_shape[gdim], self.global_offset[gdim]
        if local_len == 0 or (glob * length) % local_len or (off * length) % local_len:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: cannot narrow axis {dim} of size {local_len} to "
                f"{length} on a grid with global size {glob} and offset {off}"
            )
        global_shape = list(self.global_shape)
        global_offset = list(self.global_offset)
        global_shape[gdim] = glob * length // local_len
        global_offset[gdim] = off * length // local_len
        local_shape = list(self.local_shape)
        local_shape[dim] = length
        if self.flattened_range is not None:
            if dim != 0:
                raise CheckpointingException(f"ShardedTensor {self.key!r}: a flat tensor can only be narrowed on dim 0")
            row = math.prod(self.local_shape[1:])
            lo = max(self.flattened_range.start, start * row)
            hi = min(self.flattened_range.stop, (start + length) * row)
            if lo >= hi:
                return []
            data = self.data[lo - self.flattened_range.start: hi - self.flattened_range.start]
            new_range = slice(lo - start * row, hi - start * row)
            return [replace(self, data=data, local_shape=tuple(local_shape), global_shape=tuple(global_shape),
                            global_offset=tuple(global_offset), flattened_range=new_range)]
        new_data = self.data.narrow(dim, start, length)
        return [
            replace(
                self,
                data=new_data,
                local_shape=tuple(new_data.shape),
                global_shape=tuple(global_shape),
                global_offset=tuple(global_offset),
            )
        ]

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key='{self.key}')"
