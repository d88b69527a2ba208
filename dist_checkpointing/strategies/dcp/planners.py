"""Megatron-Core's plain-DCP planners, for users who drive ``torch.distributed.checkpoint``
themselves with :func:`.state_dict.mcore_to_pyt_state_dict`'s state dict: ``MCoreSavePlanner``
(metadata carrying ``mcore_data``) and ``MCoreLoadPlanner`` (global shapes checked, objects
unpickled through the safe allow-list)."""

from __future__ import annotations

import io
from typing import Any, Dict, Optional, Tuple

from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...core import CheckpointingException
from ...mapping import ShardedTensor
from ...pickling.safe_load import safe_torch_load


class MCoreSavePlanner(DefaultSavePlanner):
    """A DCP save planner whose metadata carries Megatron-Core's ``mcore_data``.

    For users who drive ``torch.distributed.checkpoint.save`` themselves:
    ``nd_flattened_global_shapes`` maps keys to their original global shape when they are
    stored N-D reformulated (recorded as ``nd_reformulated_orig_global_shape``).
    """

    def __init__(self, *args: Any, nd_flattened_global_shapes: Optional[Dict[str, Tuple[int, ...]]] = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.nd_flattened_global_shapes = dict(nd_flattened_global_shapes or {})

    def transform_object(self, write_item, object: Any):
        """BytesIO values are already serialized (see :func:`.state_dict.mcore_to_pyt_state_dict`)."""
        if isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)

    def create_global_plan(self, all_plans):
        global_plan, metadata = super().create_global_plan(all_plans)
        metadata.mcore_data = {key: {"nd_reformulated_orig_global_shape": tuple(shape)}
                               for key, shape in self.nd_flattened_global_shapes.items()}
        return global_plan, metadata


class MCoreLoadPlanner(DefaultLoadPlanner):
    """A DCP load planner that checks requested global shapes against the checkpoint
    and reads objects safely.

    ``shapes_validation_sharded_tensors`` are the ShardedTensors whose global shapes must
    match; a mismatch raises :class:`CheckpointingException` naming the key (plain DCP
    would fail later with a less helpful error, or silently load a smaller tensor).
    """

    def __init__(self, *args: Any, shapes_validation_sharded_tensors: Tuple[ShardedTensor, ...] = (),
                 allow_pickle: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = tuple(shapes_validation_sharded_tensors)
        self.allow_pickle = allow_pickle

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """Objects are unpickled with the safe allow-list and unwrapped from their list."""
        fqn = read_item.dest_index.fqn
        obj = safe_torch_load(value, f"object {fqn!r}", self.allow_pickle)
        if isinstance(obj, list) and len(obj) == 1:
            obj = obj[0]
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    def create_local_plan(self):
        for sh in self.shapes_validation_sharded_tensors:
            md = self.metadata.state_dict_metadata.get(sh.key)
            if md is None:
                raise CheckpointingException(f"ShardedTensor {sh.key!r} not found in the checkpoint")
            if not isinstance(md, TensorStorageMetadata) or (
                    tuple(md.size) != sh.global_shape and not sh.allow_shape_mismatch):
                raise CheckpointingException(
                    f"Global shape mismatch for key {sh.key!r}: checkpoint has "
                    f"{tuple(getattr(md, 'size', ()))}, the request expects {sh.global_shape}"
                )
        return super().create_local_plan()
