"""The snapshot of an async save, for every writer (torch_dist's and plain DCP's): which one a
save takes (:func:`snapshot_mode`) and the host copies of the tensors a fork does not isolate
(:func:`fork_host_copies`, into reused :class:`ForkHostCopies`). Every tensor's values go
through :func:`..tensors.values.plain_values` on the way (in the copies, the arenas and the
writers), so every mode saves what a sync save saves.

Why a fork by default for CPU state, and not a persistent writer fed with copies: a
snapshot the training loop may change right after ``save`` returns needs either a copy or
copy-on-write. A copy is one ``memcpy`` into reused buffers per save (0.07-0.11 s per GiB
here, ~0.8 s per GiB the first time the buffers are touched) and a second resident copy of
the state. A fork costs ~0.03 s per GiB of resident memory (page tables), no memory up
front, and inherits the loaded interpreter; its costs are one page fault per page the
trainer rewrites while the writer runs (+0.9 to +1.0 s per GiB rewritten) and once after
(+0.2 s per GiB). ``"copy"`` trades the later faults for the memcpy at the call. Accelerator
state never forks (a process holding a device context). Figures: ``benchmarks/README.md``.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Sequence, Tuple

import torch

from .memory_maps import needs_host_copy

#: what ``async_snapshot`` may ask for (``"auto"`` resolved by :func:`snapshot_mode`)
SNAPSHOT_MODES = ("auto", "stream", "copy", "fork")


def snapshot_mode(requested: str, tensors: Sequence[torch.Tensor], fork_safe: bool, stream: bool = True) -> str:
    """The snapshot a save of ``tensors`` takes: ``requested``, with ``"auto"`` resolved —
    ``"stream"`` (``"copy"`` for a writer that cannot stream: ``stream=False``) when any
    tensor is on an accelerator (a process holding a device context is never forked), else
    ``"fork"``; a fork into a storage that does not survive one (``fork_safe=False``: S3's
    client) becomes ``"copy"``."""
    mode = requested
    if mode == "auto":
        on_device = any(t.device.type != "cpu" for t in tensors)
        mode = ("stream" if stream else "copy") if on_device else "fork"
    if mode == "fork" and not fork_safe:
        mode = "copy"
    return mode


class ForkHostCopies:
    """Host (CPU) copies of the tensors a fork-mode async save cannot leave to copy-on-write,
    kept for the next save of the same structure: a slot whose tensor keeps its shape and
    dtype reuses its buffer (already touched, so the copy runs at memory speed). Reuse is
    safe while an earlier writer runs: a forked writer has its own copy of the pages."""

    def __init__(self) -> None:
        self._buffers: Dict[Hashable, torch.Tensor] = {}

    def copy(self, tensors: Sequence[Tuple[Hashable, torch.Tensor]]) -> List[torch.Tensor]:
        """Copy each ``(slot, tensor)`` into its slot's buffer; buffers of slots not in this
        call are dropped."""
        buffers: Dict[Hashable, torch.Tensor] = {}
        out = []
        for slot, t in tensors:
            buf = self._buffers.get(slot)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype)
            buf.copy_(t.detach())
            buffers[slot] = buf
            out.append(buf)
        self._buffers = buffers
        return out

    def release(self) -> None:
        """Free every buffer."""
        self._buffers = {}


def fork_host_copies(tensors: Sequence[Tuple[Hashable, torch.Tensor]], fork: bool,
                     copies: "ForkHostCopies") -> Dict[Hashable, torch.Tensor]:
    """The host copies the snapshot needs, by slot: for a fork, of the tensors it does not
    isolate (:func:`.memory_maps.needs_host_copy`: other devices, pinned, shared or
    file-backed memory); without a fork, of every tensor. Into ``copies``' reused buffers."""
    needed = needs_host_copy([t for _, t in tensors]) if fork else [True] * len(tensors)
    chosen = [slot_tensor for slot_tensor, need in zip(tensors, needed) if need]
    return dict(zip([slot for slot, _ in chosen], copies.copy(chosen)))
