"""Helpers shared by several test modules (the process pools live in ``conftest.py``)."""

from __future__ import annotations

import contextlib
import socket
import time
from pathlib import Path
from typing import Iterator, List, Sequence, Tuple

from dist_checkpointing import CheckpointingException, ShardedTensor
from dist_checkpointing.dict_utils import nested_values
from dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from dist_checkpointing.strategies.torch_dist import save as torch_dist_save


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_all_raise(excs: Sequence[BaseException], world: int, *fragments: str) -> None:
    """Every one of the ``world`` ranks raised a ``CheckpointingException`` whose message
    holds every fragment."""
    assert len(excs) == world
    for rank, e in enumerate(excs):
        assert isinstance(e, CheckpointingException), f"rank {rank}: {type(e).__name__}: {e}"
        for frag in fragments:
            assert frag in str(e), f"rank {rank}: {frag!r} not in {e}"


def flip_byte(path: Path, position: int) -> None:
    """Damage one byte of a file in place (XOR 0x5A)."""
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x5A]))


@contextlib.contextmanager
def slow_writes(delay: float) -> Iterator[None]:
    """The writer sleeps ``delay`` s before each data file (a forked writer inherits this
    patch), so what a test does right after ``save`` returns happens while it writes."""
    orig = torch_dist_save.write_file

    def slow(*args, **kwargs):
        time.sleep(delay)
        return orig(*args, **kwargs)

    torch_dist_save.write_file = slow
    try:
        yield
    finally:
        torch_dist_save.write_file = orig


class RecordingLoad(TorchDistLoadShardedStrategy):
    """The real load strategy, remembering which shards it was asked to read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: List[Tuple[str, Tuple[int, ...]]] = []

    def load(self, sharded_state_dict, checkpoint_dir):  # type: ignore[no-untyped-def]
        self.reads.extend((sh.key, tuple(sh.global_offset)) for sh in nested_values(sharded_state_dict)
                          if isinstance(sh, ShardedTensor))
        return super().load(sharded_state_dict, checkpoint_dir)
