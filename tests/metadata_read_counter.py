"""Counts the bytes a process reads from a checkpoint's ``.metadata*`` files (``.metadata``,
its per-key index and their sidecars) through the POSIX storage, within a block."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator

from dist_checkpointing.storage.posix import PosixStorage


@contextlib.contextmanager
def count_metadata_reads() -> Iterator[Dict[str, int]]:
    """``counted["bytes"]``: the bytes read from ``.metadata*`` files within the block."""
    counted = {"bytes": 0}
    real_open, real_read = PosixStorage.open_reader, PosixStorage.read_bytes

    def open_reader(self, name):
        reader = real_open(self, name)
        if name.startswith(".metadata"):
            inner = reader.read

            def read(offset, n):
                data = inner(offset, n)
                counted["bytes"] += len(data)
                return data
            reader.read = read
        return reader

    def read_bytes(self, name, *args, **kwargs):
        data = real_read(self, name, *args, **kwargs)
        if name.startswith(".metadata"):
            counted["bytes"] += len(data)
        return data

    PosixStorage.open_reader, PosixStorage.read_bytes = open_reader, read_bytes
    try:
        yield counted
    finally:
        PosixStorage.open_reader, PosixStorage.read_bytes = real_open, real_read
