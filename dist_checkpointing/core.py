"""Core types: the library's exception and the checkpoint config (``metadata.json``, read and
written through the storage layer).

Owns: ``CheckpointingException``, ``malformed`` (any error while reading a damaged
checkpoint as one naming what was read), ``open_storage`` (``storage_for``, an unknown
scheme as a ``CheckpointingException``), ``CheckpointingConfig`` (``metadata.json``, read
and written through the storage; the complete/incomplete checkpoint rule: which files count
as a started save is asked of the checks strategies register with
``register_checkpoint_files``).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

from .storage import Storage, StorageOptions, storage_for, url_scheme

Location = Union[str, "os.PathLike[str]", Storage]

CONFIG_FNAME = "metadata.json"
_MAX_CONFIG_BYTES = 1 << 16
# Tell whether a file name is one a strategy writes into a checkpoint directory: registered
# by the strategy registry (``strategies/registry.py``), which knows the formats' file names.
_checkpoint_file_checks: List[Callable[[str], bool]] = []
_implicit_configs: List[Callable[[List[str]], Optional["CheckpointingConfig"]]] = []


# PyTorch DCP's exception, a base of ours whenever DCP is imported: always, except in the dist-ckpt
# command's read-only subcommands, which do not import it (see dist_checkpointing/__init__.py)
_DCP_API = sys.modules.get("torch.distributed.checkpoint.api")


class CheckpointingException(Exception, *((_DCP_API.CheckpointException,) if _DCP_API else ())):
    """Raised for any user-facing checkpointing error (bad input, bad checkpoint, I/O).

    Also a ``torch.distributed.checkpoint.api.CheckpointException``, which Megatron-Core
    lets propagate from PyTorch's reader and writer: code catching either catches it (in
    every process that imports DCP; the ``dist-ckpt`` command's read-only subcommands do not).
    Constructed as ``CheckpointingException(msg)`` (``failures``, the per-rank
    ``(exception, traceback)`` pairs PyTorch's class carries, defaults to none); ``str()``
    is the message, and it is an ``Exception`` (PyTorch's class is only a
    ``BaseException``).
    """

    def __init__(self, msg: Any = "", failures: Optional[Dict[int, Any]] = None):
        Exception.__init__(self, msg)
        self._failures = dict(failures or {})

    __str__ = Exception.__str__


def error_message(e: BaseException) -> str:
    """The message of ``e`` as it is reported to the other ranks (or by another process)."""
    if isinstance(e, CheckpointingException):
        return str(e)
    return f"{type(e).__name__}: {e}"


_gc_lock = threading.Lock()
_gc_pauses = 0  # blocks inside gc_paused now, over all threads
_gc_was_enabled = False  # the collector's state when the first of them began


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off within the block: building or unpickling
    millions of small objects (a large ``.metadata``) otherwise spends much of its time in
    collections that find nothing (measured: rank 0's metadata assembly in the 8,192-rank
    simulation, 13.6 s -> 8.4 s CPU). The pauses of several threads overlap as one: the
    collector's state is taken when the first begins and restored when the last ends."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def key_problem(key: Any) -> Optional[str]:
    """Why ``key`` cannot be a key of a checkpoint (``None`` if it can): the one rule for
    every key on every surface (save, load, ``.metadata`` and its index, the tools, the
    transport). A key is a string of strict UTF-8 text: a lone surrogate (what
    ``os.fsdecode`` makes of a name that is not UTF-8, e.g. ``'w\\udcff'``) cannot be
    written to UTF-8 files (JSON indexes, safetensors headers) nor read back as written."""
    if not isinstance(key, str):
        return f"key {key!r:.100} is a {type(key).__name__}, not a string"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"key {key!r:.200} is not valid UTF-8 text (a lone surrogate {key[e.start]!r} at position "
                f"{e.start}, e.g. from os.fsdecode of a name that is not UTF-8); keys must be UTF-8 text")
    return None


def check_key(key: Any, where: str = "") -> str:
    """``key`` if it passes :func:`key_problem`; otherwise raise :class:`CheckpointingException`
    naming it (after ``where``, e.g. ``"ShardedTensor"`` or a file)."""
    problem = key_problem(key)
    if problem is not None:
        raise CheckpointingException(f"{where}: {problem}" if where else problem[0].upper() + problem[1:])
    return key


@contextmanager
def malformed(what: str) -> Iterator[None]:
    """Turn any error but a CheckpointingException into one naming ``what``: a damaged or
    hostile checkpoint can make reading it fail in any way (wrong types, absurd sizes)."""
    try:
        yield
    except CheckpointingException:
        raise
    except Exception as e:  # noqa: BLE001 - MemoryError, TypeError, OSError, ... all mean "unusable"
        raise CheckpointingException(f"{what}: {type(e).__name__}: {e}") from e


@dataclass
class CheckpointingConfig:
    """The content of ``metadata.json``: which strategies wrote the checkpoint.

    ``common_backend`` is ``None`` for checkpoints that keep the common state inside the
    sharded backend (Megatron-Core >= 0.19 stores it as the ShardedObject ``common_state``).
    """

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: Optional[str] = "torch"
    common_backend_version: Optional[int] = 1


def read_small_json(storage: Storage, name: str, max_bytes: int, what: str) -> Any:
    """The JSON value in the file ``name`` of ``storage``, which must hold at most
    ``max_bytes``; anything else (unreadable, too large, not JSON, nested too deep) is a
    :class:`CheckpointingException` starting with ``what``."""
    try:
        text = storage.read_bytes(name, max_bytes)
        if len(text) > max_bytes:
            raise ValueError(f"larger than {max_bytes} bytes")
        return json.loads(text)
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointingException(f"{what} {storage.describe(name)}: {e}") from e


def open_storage(checkpoint_dir: Location, storage_options: StorageOptions = None) -> Storage:
    """The storage of a checkpoint location (:func:`~.storage.storage_for`, with
    ``storage_options`` for a URL's client); a location that cannot be opened (an unknown
    URL scheme, bad options, a missing client package) is a :class:`CheckpointingException`."""
    try:
        return storage_for(checkpoint_dir, storage_options)
    except Exception as e:  # noqa: BLE001 - ValueError, ImportError, the client's own errors
        raise CheckpointingException(f"Cannot open checkpoint location {checkpoint_dir!r}: {e}") from e


def checkpoint_location(checkpoint_dir: Location, storage_options: StorageOptions = None) -> Union[Path, Storage]:
    """A checkpoint location as strategies receive it: a local directory as a ``Path``
    (Megatron-Core's strategies expect one), a :class:`~.storage.Storage` as is, a URL as
    its :class:`~.storage.Storage` (its client made once, with ``storage_options``). A
    relative directory is made absolute here, once: a working directory changed later (or
    another process's) never moves the checkpoint."""
    if isinstance(checkpoint_dir, Storage) or url_scheme(checkpoint_dir) or storage_options:
        return open_storage(checkpoint_dir, storage_options)
    return Path(os.path.abspath(os.fspath(checkpoint_dir)))


def maybe_load_config(checkpoint_dir: Location) -> Optional[CheckpointingConfig]:
    """Return the config of ``checkpoint_dir``, or ``None`` if it is not a complete checkpoint."""
    storage = open_storage(checkpoint_dir)
    try:
        if storage.info(CONFIG_FNAME) is None:
            return None
    except OSError as e:  # e.g. an object store refusing the credentials
        raise CheckpointingException(f"Cannot read checkpoint config file {storage.describe(CONFIG_FNAME)}: {e}") from e
    config_path = storage.describe(CONFIG_FNAME)
    raw = read_small_json(storage, CONFIG_FNAME, _MAX_CONFIG_BYTES, "Invalid checkpoint config file")
    if not isinstance(raw, dict):
        raise CheckpointingException(f"Invalid checkpoint config file {config_path}: a JSON object is expected, "
                                     f"not {type(raw).__name__}")
    return CheckpointingConfig(
        sharded_backend=_config_field(raw, "sharded_backend", str, config_path),
        sharded_backend_version=_config_field(raw, "sharded_backend_version", int, config_path, 1),
        common_backend=_config_field(raw, "common_backend", str, config_path, None),
        common_backend_version=_config_field(raw, "common_backend_version", int, config_path, None),
    )


_MISSING = object()


def _config_field(raw: dict, name: str, kind: type, path: str, default: Any = _MISSING) -> Any:
    """``raw[name]`` checked to be a ``kind`` (a version: an int in 0..2**31), or ``default``."""
    value = raw.get(name, default)
    if value is _MISSING:
        raise CheckpointingException(f"Invalid checkpoint config file {path}: field {name!r} is missing")
    if value is None and default is None:
        return None
    valid = isinstance(value, str) and len(value) <= 256 if kind is str else (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31)
    if not valid:
        expected = "a string" if kind is str else "an integer version"
        raise CheckpointingException(
            f"Invalid checkpoint config file {path}: field {name!r} must be {expected}, not {value!r:.100}")
    return value


def check_is_distributed_checkpoint(checkpoint_dir: Location, storage_options: StorageOptions = None) -> bool:
    """True if ``checkpoint_dir`` holds a complete distributed checkpoint (False also when
    its ``metadata.json`` cannot be read); a location that cannot be opened (an unknown URL
    scheme, bad ``storage_options``) raises :class:`CheckpointingException`."""
    storage = open_storage(checkpoint_dir, storage_options)
    try:
        return maybe_load_config(storage) is not None
    except CheckpointingException:
        return False  # an unreadable metadata.json


def register_checkpoint_files(is_checkpoint_file: Callable[[str], bool]) -> None:
    """Declare the files a strategy writes (``is_checkpoint_file(name)``): a directory that
    holds one but no ``metadata.json`` is an incomplete checkpoint (:func:`load_config`)."""
    _checkpoint_file_checks.append(is_checkpoint_file)


def register_implicit_checkpoint(config_of: Callable[[List[str]], Optional[CheckpointingConfig]]) -> None:
    """Declare a kind of checkpoint known by its files alone, without ``metadata.json``
    (e.g. a directory of Hugging Face safetensors files): ``config_of(names)`` gives the
    config of a directory holding the files ``names``, or ``None`` (:func:`load_config`)."""
    _implicit_configs.append(config_of)


def load_config(checkpoint_dir: Location) -> CheckpointingConfig:
    """Like :func:`maybe_load_config` but raises a clear error for a missing or partial checkpoint."""
    storage = open_storage(checkpoint_dir)
    checkpoint_dir = storage.describe()
    try:
        kind = storage.kind()
    except OSError as e:
        raise CheckpointingException(f"Cannot read checkpoint location {checkpoint_dir}: {e}") from e
    if kind is None:
        raise CheckpointingException(f"Checkpoint directory {checkpoint_dir} does not exist")
    if kind != "dir":
        raise CheckpointingException(f"Checkpoint path {checkpoint_dir} is not a directory")
    config = maybe_load_config(storage)
    if config is None:
        names = storage.list()
        partial = any(check(name) for name in names for check in _checkpoint_file_checks)
        if partial:
            raise CheckpointingException(
                f"{checkpoint_dir} is an incomplete checkpoint: it has data files but no "
                f"{CONFIG_FNAME}, so its save did not complete (it failed or was killed)"
            )
        for config_of in _implicit_configs:
            config = config_of(names)
            if config is not None:
                return config
        raise CheckpointingException(
            f"{checkpoint_dir} is not a distributed checkpoint: {CONFIG_FNAME} is missing"
        )
    return config


def config_bytes(config: CheckpointingConfig) -> bytes:
    """The bytes of ``metadata.json`` for ``config``."""
    return json.dumps({k: v for k, v in asdict(config).items() if v is not None}).encode()


def save_config(config: CheckpointingConfig, checkpoint_dir: Location) -> None:
    """Write ``metadata.json`` atomically; its presence marks a complete checkpoint."""
    storage = open_storage(checkpoint_dir)
    try:
        storage.write_atomic(CONFIG_FNAME, config_bytes(config))
    except OSError as e:
        raise CheckpointingException(f"Cannot write {storage.describe(CONFIG_FNAME)}: {e}") from e
