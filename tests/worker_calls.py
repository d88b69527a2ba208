"""Calls the persistent-worker tests send to a worker. This module imports no torch, so a
worker made with ``tensors=False`` runs them without importing it (as the writer of async
saves does)."""

from __future__ import annotations

import os

import xxhash

from dist_checkpointing.runtime import persistent_worker


def pid_and_args(*args, **kwargs):
    return os.getpid(), args, kwargs


def boom(what):
    raise ValueError(f"boom {what}")


def die():
    os._exit(7)


def arena_digest(arena_id, n):
    return xxhash.xxh3_64_intdigest(persistent_worker.arena_bytes(arena_id)[:n])


def has_torch() -> bool:
    import sys

    return "torch" in sys.modules
