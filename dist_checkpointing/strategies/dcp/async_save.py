"""Megatron-Core's asynchronous save of plain PyTorch DCP checkpoints, in two collective
steps around a background write (Megatron-LM's ``--ckpt-format torch_dcp`` /
``fsdp_dtensor`` with ``--async-save``; this library's own format saves through ``save``).

1. :func:`save_state_dict_async_plan`: DCP's planning (each rank's local plan, the
   coordinator's global plan and metadata) and the writer's snapshot
   (:meth:`~.async_writer.FileSystemWriterAsync.prepare_write_data`).
2. The writer's function writes the files in the background (an ``AsyncRequest``).
3. :func:`save_state_dict_async_finalize`: every rank's write results go to the
   coordinator, which writes ``.metadata``; an error of any rank is raised on every rank.

The plan's result is the tuple the finalization takes (``finalize(*plan(...))``, as
Megatron-LM's trainer calls them). The result is a checkpoint ``torch.distributed.checkpoint.load``
and Megatron-Core read.
"""

from __future__ import annotations

import inspect
from typing import Any, List, Optional, Tuple

import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper

from ...core import CheckpointingException
from .async_writer import FileSystemWriterAsync


def _as_ours(e: CheckpointException, what: str) -> CheckpointingException:
    causes = "; ".join(f"rank {rank}: {type(err).__name__}: {err}" for rank, err in sorted(e.failures.items()))
    return CheckpointingException(f"{what} failed on rank(s) {sorted(e.failures)}: {causes}")


def save_state_dict_async_plan(
    state_dict: Any,
    storage_writer: FileSystemWriterAsync,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    planner: Optional[SavePlanner] = None,
    cached_ckpt_structure: Optional[Tuple[SavePlan, SavePlan, bool]] = None,
    loaded_all_plans: Optional[List[SavePlan]] = None,
    enable_cache: bool = False,
) -> Tuple[FileSystemWriterAsync, Optional[Metadata], _DistWrapper]:
    """Plan the save of ``state_dict`` (collective over ``process_group``) and snapshot it into
    ``storage_writer``: returns ``(storage_writer, global metadata (coordinator only),
    distributed wrapper)`` for :func:`save_state_dict_async_finalize`. An error of the
    planning or of the snapshot on any rank is raised on every rank. Every save plans
    afresh: ``cached_ckpt_structure``, ``loaded_all_plans`` (Megatron-Core's) and
    ``enable_cache`` (NVIDIA Resiliency Extension's, which Megatron-LM passes) are accepted
    and not used."""
    wrapper = _DistWrapper(process_group, dist.is_available() and dist.is_initialized(), coordinator_rank)
    planner = planner if planner is not None else DefaultSavePlanner()
    global_metadata: Optional[Metadata] = None

    def local_step() -> SavePlan:  # (an error here is raised on every rank)
        if not isinstance(storage_writer, FileSystemWriterAsync):
            raise CheckpointingException(f"An async DCP save needs a FileSystemWriterAsync, not {storage_writer!r}")
        if "storage_meta" in inspect.signature(planner.set_up_planner).parameters:
            planner.set_up_planner(state_dict, storage_meta=storage_writer.storage_meta(),
                                   is_coordinator=wrapper.is_coordinator)
        else:
            planner.set_up_planner(state_dict, is_coordinator=wrapper.is_coordinator)
        storage_writer.set_up_storage_writer(wrapper.is_coordinator, rank=wrapper.rank)
        return storage_writer.prepare_local_plan(planner.create_local_plan())

    def global_step(plans: List[SavePlan]) -> List[SavePlan]:
        nonlocal global_metadata
        plans, global_metadata = planner.create_global_plan(plans)
        return storage_writer.prepare_global_plan(plans)

    try:
        plan = planner.finish_plan(wrapper.reduce_scatter("plan", local_step, global_step))
        wrapper.all_gather("snapshot", lambda: storage_writer.prepare_write_data(plan, planner))
    except CheckpointException as e:
        raise _as_ours(e, f"Planning the DCP save to {getattr(storage_writer, 'path', storage_writer)}") from e
    return storage_writer, global_metadata, wrapper


def save_state_dict_async_finalize(storage_writer: FileSystemWriterAsync, global_metadata: Optional[Metadata],
                                   dist_wrapper: _DistWrapper) -> None:
    """Complete the save after the background write (collective): the coordinator writes
    ``.metadata`` from every rank's write results; a failed write on any rank raises on
    every rank and leaves no ``.metadata``."""

    def finish(all_results: List[Any]) -> None:
        storage_writer.finish(global_metadata, all_results)

    try:
        dist_wrapper.all_reduce("write", storage_writer.retrieve_write_results, finish)
    except CheckpointException as e:
        raise _as_ours(e, f"Finalizing the DCP save to {storage_writer.path}") from e
