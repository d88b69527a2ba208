"""Entry points: ``save``, ``load`` and the offline readers.

``save`` and ``load`` are collective over the default process group (or run alone
without one); every error they raise is raised on every rank. The offline readers
(``load_common_state_dict``, ``load_tensors_metadata``, ``load_sharded_metadata``,
``load_plain_tensors``, ``load_content_metadata``, ``check_is_distributed_checkpoint``)
work in a single process with no process group (they live in :mod:`.readers`, the last
in :mod:`.core`).
Every entry point takes a local directory, a URL (``s3://bucket/prefix``, or any scheme
fsspec knows) with optional ``storage_options`` for its client, or a
:class:`~.storage.Storage`.

An async save (``async_sharded_save=True``) runs the same steps up to the common state, which
rank 0 only serializes (``SaveCommonStrategy.stage_common``); the returned request's
``async_fn`` first writes ``common.pt`` and its sidecar on the queue's thread
(``AsyncRequest.add_async_step``), and one more finalize step has rank 0 write
``metadata.json``. The commit and the save/load step orders: ``docs/architecture.md``.

A load's collectives by ``strict`` mode (success path; nothing is gathered unless something
is wrong): the default ``ASSUME_OK_UNEXPECTED`` makes 7 one-byte ``all_reduce`` s
(agreements and the validation verdict) plus validation's four ``all_to_all_single`` (none
for a request validated before); ``LOG_UNEXPECTED`` / ``RETURN_UNEXPECTED`` / ``IGNORE_ALL``
add an agreement on reading the keys, ``RAISE_UNEXPECTED`` also a flag (and a gather of the
unexpected keys only when some rank has them), the ``*_ALL`` modes an ``all_reduce`` of one
byte per checkpoint key. With the per-key index every mode adds its two ``exchange_objects``
and three agreements in the strategy's ``load``, and ``*_ALL`` replaces the per-key bitmap by
a flag (and a gather of the keys no rank asked for only when there are some).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple, Union

from .runtime.collectives import broadcast_object, check_whole_world, error_message, get_rank, run_agreed
from .core import (
    CONFIG_FNAME,
    CheckpointingConfig,
    CheckpointingException,
    check_is_distributed_checkpoint,
    check_key,
    checkpoint_location,
    load_config,
    open_storage,
    save_config,
)
from .readers import (
    CONTENT_METADATA_KEY,
    CkptDir,
    CkptShardedMetadata,  # noqa: F401 - Megatron-Core's name in this module
    get_default_load_sharded_strategy,
    load_common,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    sharded_load_strategy,
)
from .tensors.dtensor import dtensors_to_sharded, is_dtensor, restore_dtensors
from .integrity.checksums import sidecar_name, sidecar_record
from .integrity.manifest import MANIFEST_FNAME, hash_written_files, verify_manifest, write_manifest
from .integrity.save_claim import CLAIM_FNAME, check_claim, claim_save_dir, release_claim
from .integrity.stored_names import refuse_unkept_names, verify_stored
from .storage import StorageOptions
from .dict_utils import (
    copy_structure, dict_list_map_inplace, extract_matching_values, find_anywhere, merge, nested_values,
)
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    KeyMap,
    apply_factories,
    apply_factory_merges,
    apply_key_map,
)
from .phases import Phases, ProgressCallback, local_bytes
from .runtime.async_request import AsyncRequest
from .strategies.async_strategies import check_async_strategy
from .runtime.progress import reporting_bytes
from .strategies.common import COMMON_STATE_FNAME
from .strategies.common_object import COMMON_STATE_OBJECT_NAME as COMMON_STATE_OBJECT_BASE_KEY
from .strategies.torch_dist.format import METADATA_FNAME
from .strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from .validation import (
    StrictHandling,
    check_common_state_consistency,
    determine_missing_and_unexpected_keys,
    handle_mismatched_keys,
    parse_strict_flag,
    validate_sharding_integrity,
)

logger = logging.getLogger(__name__)

__all__ = [
    "save", "load", "check_is_distributed_checkpoint", "load_common_state_dict", "load_tensors_metadata",
    "load_sharded_metadata", "load_plain_tensors", "load_content_metadata", "remove_sharded_tensors",
    "get_default_save_sharded_strategy", "get_default_save_common_strategy", "get_default_load_sharded_strategy",
]


# ----------------------------------------------------------------------------- strategies


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    """The registered sharded save strategy for ``(backend, version)``."""
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> SaveCommonStrategy:
    """The registered common save strategy for ``(backend, version)``."""
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


def _resolve_save_strategy(strategy: Any, action: StrategyAction, default: Tuple[str, int], base: type) -> Any:
    """A save strategy given as ``None`` (the default), ``(backend, version)`` or an instance."""
    if strategy is None:
        strategy = default
    if isinstance(strategy, tuple):
        strategy = get_default_strategy(action, *strategy)
    if not isinstance(strategy, base):
        raise CheckpointingException(f"Not a {base.__name__}: {strategy!r}")
    return strategy


# ----------------------------------------------------------------------------- state dict split


def _split_state_dict(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict, StateDict]:
    """Copy the structure, turn DTensor leaves into ShardedTensors, build factories, and split
    into (sharded, common, non-persistent)."""
    if not isinstance(sharded_state_dict, dict):
        raise CheckpointingException(f"A sharded state dict must be a dict, got {type(sharded_state_dict).__name__}")
    sd = copy_structure(sharded_state_dict)
    dtensors_to_sharded(sd)
    apply_factories(sd)
    nonpersistent, rest = extract_matching_values(sd, lambda v: isinstance(v, LocalNonpersistentObject))
    sharded, common = extract_matching_values(rest, lambda v: isinstance(v, ShardedBase))
    for sh in nested_values(sharded):
        check_key(sh.key, type(sh).__name__)
    hidden = find_anywhere(common, lambda v: isinstance(v, (ShardedBase, LocalNonpersistentObject)) or is_dtensor(v))
    if hidden is not None:
        path, value, container = hidden
        key = getattr(value, "key", None)
        raise CheckpointingException(
            f"{type(value).__name__}{'' if key is None else f' {key!r}'} at {path} is inside a "
            f"{container.__name__}: sharded items, DTensors and LocalNonpersistentObjects may only be nested in dicts "
            "and lists (anywhere else they would be pickled into the common state by rank 0 alone, and the "
            "other ranks' data lost). Use a dict or a list there."
        )
    return sharded, common, nonpersistent


# ----------------------------------------------------------------------------- save

# the names a save writes besides the sharded strategy's data files (checked up front)
SAVED_FILE_NAMES = (CLAIM_FNAME, COMMON_STATE_FNAME, sidecar_name(COMMON_STATE_FNAME), METADATA_FNAME,
                sidecar_name(METADATA_FNAME), MANIFEST_FNAME, CONFIG_FNAME)


def _check_written_by(save_id: str, checkpoint_dir: CkptDir) -> Dict[str, Optional[int]]:
    """Before committing: the directory is still this save's, and the files that record a
    save id (the checksum sidecars of ``common.pt`` and ``.metadata``) name this one;
    returns those files and sidecars with the sizes recorded (``None``: any size)."""
    check_claim(checkpoint_dir, save_id)
    written: Dict[str, Optional[int]] = {}
    for name in (COMMON_STATE_FNAME, METADATA_FNAME):
        record = sidecar_record(checkpoint_dir, name)
        if record is None:
            continue
        recorded = record.get("save_id")
        if recorded is not None and recorded != save_id:
            raise CheckpointingException(
                f"{open_storage(checkpoint_dir).describe(name)} was written by save {recorded}, not by this save ({save_id}): "
                "another save wrote into the directory; not committing it"
            )
        length = record.get("length")
        written.update({name: length if isinstance(length, int) else None, sidecar_name(name): None})
    return written


def _claim_directory(checkpoint_dir: CkptDir) -> str:
    """Rank 0 claims the directory (atomically: of concurrent saves into it, one wins);
    every rank gets the save id, or raises rank 0's reason (collective)."""
    claim: Tuple[Optional[str], Optional[str]] = (None, None)
    if get_rank() == 0:
        try:
            claim = (None, claim_save_dir(checkpoint_dir))
        except Exception as e:  # noqa: BLE001 - broadcast to every rank
            claim = (error_message(e), None)
    dir_error, save_id = broadcast_object(claim)
    if dir_error is not None:
        raise CheckpointingException(dir_error)
    return save_id  # type: ignore[return-value]


def _commit(checkpoint_dir: CkptDir, save_id: str, config: CheckpointingConfig, verify_integrity: bool,
            data_files: Optional[Dict[str, int]]) -> None:
    """The last step of a save: with ``verify_integrity`` every rank hashes the files it
    wrote (collective); rank 0 checks the directory is still this save's and that the
    store kept every file written (``data_files``: the sharded strategy's, with their
    sizes; one listing — if not, the claim is dropped and the save fails), writes
    ``integrity.json`` (if any), then ``metadata.json`` — the commit — and drops the claim."""
    digests = hash_written_files(checkpoint_dir) if verify_integrity else None
    if get_rank() == 0:
        written = _check_written_by(save_id, checkpoint_dir)
        try:
            verify_stored(open_storage(checkpoint_dir), {**written, **(data_files or {})},
                          f"Not committing {open_storage(checkpoint_dir).describe()}")
        except CheckpointingException:
            release_claim(checkpoint_dir, save_id)
            raise
        if digests is not None:  # before metadata.json: a committed checkpoint has all of it
            write_manifest(checkpoint_dir, digests, config)
        save_config(config, checkpoint_dir)
        release_claim(checkpoint_dir, save_id)


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: CkptDir,
    sharded_strategy: Union[None, SaveShardedStrategy, Tuple[str, int]] = None,
    common_strategy: Union[None, SaveCommonStrategy, Tuple[str, int]] = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
    content_metadata: Optional[dict] = None,
    progress_callback: Optional[ProgressCallback] = None,
    verify_integrity: bool = False,
    storage_options: StorageOptions = None,
    progress_bar: Optional[bool] = None,
    async_strategy: Optional[str] = "nvrx",
) -> Optional[AsyncRequest]:
    """Save a sharded state dict into ``checkpoint_dir`` (collective).

    The directory must be empty or missing. ``checkpoint_dir`` may also be a
    :class:`~.storage.Storage` or a URL (``s3://bucket/prefix``, a scheme fsspec knows,
    or one registered with :func:`~.storage.register_storage`; ``storage_options``
    configure its client, over the environment); every byte goes through it (the same
    for :func:`load` and the offline readers). With ``validate_access_integrity`` the main
    replicas are first checked to cover every global tensor exactly once (collectively;
    nothing is written if any rank finds a problem). Ranks whose common state differs from
    rank 0's log the differing keys (after ``preprocess_common_before_consistancy_check``,
    which may drop keys that legitimately differ); rank 0's is saved. ShardedTensors and
    ShardedObjects are written by their main replicas, the common state by rank 0, and
    ``metadata.json`` last, so an interrupted save never looks complete. The caller's dict
    is not modified.

    ``common_strategy=CommonStateObjectSaveStrategy()`` (``dist_checkpointing.strategies``)
    writes Megatron-Core 0.19's layout: no ``common.pt``, the common state stored as the
    ShardedObject ``common_state`` and ``metadata.json`` without a common backend.

    With ``async_sharded_save=True`` (the sharded strategy must be an
    ``AsyncSaveShardedStrategy``) the checks happen now, the common state is serialized
    and the sharded state snapshotted now, both are written in the background, and an
    ``AsyncRequest`` is returned: schedule it on an ``AsyncCallsQueue``; the checkpoint
    is complete (has ``metadata.json``) only once the queue has finalized it. The caller
    may modify its tensors as soon as ``save`` returns.

    With ``verify_integrity=True`` (Megatron-Core's name) the commit also writes
    Megatron-Core's integrity manifest ``integrity.json`` (a SHA-256 of every file; each
    rank hashes the files it wrote), before ``metadata.json``; :func:`load` then verifies it.

    Each call logs one line at INFO (bytes this rank writes, seconds, GB/s, and the
    split into phases: ``plan``, ``write``, ``finalize``); ``progress_callback``, if given,
    is called with ``{"phase", "seconds", "bytes", "elapsed"}`` as each phase ends, and
    while this rank writes its data with ``{"phase": "write", "bytes_done", "bytes_total",
    "elapsed"}`` (at most every 0.5 s, and once at the end; not from the background writer
    of an async save). ``progress_bar``: a tqdm bar of those bytes on rank 0's stderr;
    ``None`` (default): only when stderr is a terminal and the write takes over a second.

    ``async_strategy`` (Megatron-Core >= 0.16: ``"nvrx"`` or ``"mcore"``, whose async
    machinery writes the data) is accepted so that its callers run unchanged; an async
    save here is always this library's own (:mod:`.strategies.async_utils`).
    """
    checkpoint_dir = checkpoint_location(checkpoint_dir, storage_options)
    phases = Phases(progress_callback, progress_bar)
    rank = get_rank()

    def prepare():
        check_async_strategy(async_strategy)
        sharded_strategy_ = _resolve_save_strategy(
            sharded_strategy, StrategyAction.SAVE_SHARDED, ("torch_dist", 1), SaveShardedStrategy)
        common_strategy_ = _resolve_save_strategy(
            common_strategy, StrategyAction.SAVE_COMMON, ("torch", 1), SaveCommonStrategy)
        if async_sharded_save and not isinstance(sharded_strategy_, AsyncSaveShardedStrategy):
            raise CheckpointingException(f"{sharded_strategy_} cannot save asynchronously (async_sharded_save=True)")
        sharded, common, _ = _split_state_dict(sharded_state_dict)
        if content_metadata is not None:
            common[CONTENT_METADATA_KEY] = content_metadata
        common_strategy_.add_to_sharded(sharded, common, rank)  # e.g. Megatron-Core 0.19's common_state object
        for sh in nested_values(sharded):
            sh.validate_metadata_integrity()
            if isinstance(sh, ShardedTensor) and sh.data is None:
                raise CheckpointingException(f"ShardedTensor {sh.key!r} has no data to save")
        phases.nbytes = local_bytes(sharded, main_only=True)
        refuse_unkept_names(open_storage(checkpoint_dir), [*SAVED_FILE_NAMES, *sharded_strategy_.data_file_names(rank)],
                            "Saving the checkpoint")
        return sharded_strategy_, common_strategy_, sharded, common

    sharded_strategy_, common_strategy_, sharded, common = run_agreed(prepare, "Preparing the save")
    if validate_access_integrity:
        validate_sharding_integrity(nested_values(sharded))
    common_view = run_agreed(
        lambda: preprocess_common_before_consistancy_check(common)
        if preprocess_common_before_consistancy_check is not None else common,
        "Preprocessing the common state",
    )
    check_common_state_consistency(common_view)

    save_id = _claim_directory(checkpoint_dir)

    def save_common():
        if rank != 0:
            return None
        if async_sharded_save:  # serialized now, written in the background
            return common_strategy_.stage_common(common, checkpoint_dir)
        common_strategy_.save_common(common, checkpoint_dir)
        return None

    phases.end("plan")
    write_common = run_agreed(save_common, "Saving the common state")

    config = CheckpointingConfig(sharded_strategy_.backend, sharded_strategy_.version,
                                 common_strategy_.backend, common_strategy_.version)

    def commit() -> None:
        _commit(checkpoint_dir, save_id, config, verify_integrity, sharded_strategy_.last_written_files)

    if async_sharded_save:
        with reporting_bytes(phases.background_sink()):  # the write's bytes, reported as it goes
            if sharded_strategy_.async_save_agreed:  # no collective after its queued copies
                request = sharded_strategy_.async_save(sharded, checkpoint_dir)
            else:
                request = run_agreed(lambda: sharded_strategy_.async_save(sharded, checkpoint_dir),
                                     "Starting the async save")
        if write_common is not None:
            request.add_async_step(write_common)
        request.add_finalize_fn(commit)
        phases.nbytes = sharded_strategy_.last_written_bytes or phases.nbytes
        phases.end("snapshot")
        phases.log("Started async save of", checkpoint_dir)
        return request
    with phases.metering():
        run_agreed(lambda: sharded_strategy_.save(sharded, checkpoint_dir), "Saving the sharded state")
    # The strategy knows what this rank wrote (a fully parallel save moves main replicas).
    written = sharded_strategy_.last_written_bytes
    phases.nbytes = written if written is not None else phases.nbytes
    phases.end("write", sharded_strategy_.last_timings)
    run_agreed(commit, "Committing the checkpoint")
    phases.end("finalize")
    phases.log("Saved", checkpoint_dir)
    return None


# ----------------------------------------------------------------------------- load


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: CkptDir,
    sharded_strategy: Union[None, LoadShardedStrategy, Tuple[str, int]] = None,
    common_strategy: Optional[LoadCommonStrategy] = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
    progress_callback: Optional[ProgressCallback] = None,
    verify_integrity: Optional[bool] = None,
    storage_options: StorageOptions = None,
    progress_bar: Optional[bool] = None,
    process_group: Optional[Any] = None,
    key_map: Optional[KeyMap] = None,
) -> Union[StateDict, Tuple[StateDict, set, set]]:
    """Load the request ``sharded_state_dict`` from ``checkpoint_dir`` (collective).

    Returns the request's structure with ShardedTensors replaced by loaded tensors (the
    request's own tensors, filled in place, where it has them), ShardedObjects by their
    objects, factories merged, non-persistent objects unwrapped, and the common state
    merged in.

    ``validate_access_integrity`` checks, collectively, that the ranks agree on each
    requested key's global shape and dtype and do not request a chunk with two main
    replicas (partial requests are fine).

    ``strict`` (:class:`StrictHandling`) decides what happens to *unexpected* keys
    (requested here, absent from the checkpoint) and *missing* keys (in the checkpoint,
    requested by no rank): the default assumes there are none (a requested key that is
    absent is an error); ``LOG_*`` log them, ``RAISE_*`` raise on every rank, ``RETURN_*``
    return ``(state_dict, missing_keys, unexpected_keys)`` and ``IGNORE_ALL`` ignores them.
    Except in the raising modes, unexpected keys are left out of the load and the result.

    Each call logs one line at INFO (bytes this rank requests, seconds, GB/s, phases
    ``plan``, ``read`` — split into ``plan``/``read``/``exchange`` by the fully parallel
    wrapper — and ``finalize``); ``progress_callback`` and ``progress_bar`` work as in
    :func:`save`, the byte reports with ``"phase": "read"`` (the bytes this rank reads).

    A checkpoint with Megatron-Core's integrity manifest ``integrity.json`` is first
    verified against it (every file hashed once, split over the ranks; a listed file
    missing, a wrong hash or an unlisted file is an error naming the file).
    ``verify_integrity``: ``None`` (default) verifies when there is a manifest, ``True``
    requires one (as Megatron-Core's ``verify_integrity=True``), ``False`` skips it.

    ``process_group`` (Megatron-Core >= 0.16: the ranks that together describe one whole
    sharded state dict) may be ``None`` or a group of every rank: a load runs over all of
    them; a group of some ranks only is refused.

    ``key_map`` names each requested item's key in the checkpoint: a dict (keys it does not
    name are kept) or a callable ``key -> stored key``, e.g. from Megatron-style keys to a
    Hugging Face checkpoint's (:func:`~.mapping.apply_key_map`); missing and unexpected keys
    are reported under the stored names.
    """
    check_whole_world(process_group, "load")
    if key_map is not None:
        sharded_state_dict = run_agreed(lambda: apply_key_map(sharded_state_dict, key_map), "Mapping the keys")
    strict = parse_strict_flag(strict)
    checkpoint_dir = checkpoint_location(checkpoint_dir, storage_options)
    phases = Phases(progress_callback, progress_bar)
    if verify_integrity is not False:
        verify_manifest(checkpoint_dir, required=bool(verify_integrity))  # collective

    def prepare():
        config = load_config(checkpoint_dir)
        sharded_strategy_ = sharded_load_strategy(config, sharded_strategy)
        common = load_common(config, checkpoint_dir, common_strategy, sharded_strategy_)
        sharded, _, nonpersistent = _split_state_dict(sharded_state_dict)
        phases.nbytes = local_bytes(sharded, main_only=False)
        return sharded_strategy_, common, sharded, nonpersistent

    sharded_strategy_, common, sharded, nonpersistent = run_agreed(prepare, "Preparing the load")
    if validate_access_integrity:
        validate_sharding_integrity(nested_values(sharded), allow_gaps=True)
    missing: set = set()
    unexpected: set = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        need_missing = StrictHandling.requires_global_app_metadata(strict)
        found = sharded_strategy_.key_mismatch(sharded, checkpoint_dir, need_missing)  # collective

        def checkpoint_and_requested_keys():
            ckpt_keys = {sh.key for sh in sharded_strategy_.load_sharded_metadata(checkpoint_dir).values()}
            ckpt_keys.discard(COMMON_STATE_OBJECT_BASE_KEY)
            return ckpt_keys, {sh.key for sh in nested_values(sharded)}

        if found is not None:  # from the checkpoint's per-key index
            missing, unexpected = found
            missing.discard(COMMON_STATE_OBJECT_BASE_KEY)
        else:
            ckpt_keys, requested = run_agreed(checkpoint_and_requested_keys, "Reading the checkpoint's keys")
            missing, unexpected = determine_missing_and_unexpected_keys(ckpt_keys, requested, need_missing)
        handle_mismatched_keys(strict, missing, unexpected, checkpoint_dir)
        if unexpected:
            sharded, _ = extract_matching_values(sharded, lambda sh: sh.key not in unexpected)
    phases.end("plan")
    with phases.metering():
        loaded = run_agreed(lambda: sharded_strategy_.load(sharded, checkpoint_dir), "Loading the sharded state")
    phases.end("read", sharded_strategy_.last_timings)

    def finish():
        request = sharded_state_dict
        if unexpected:  # unexpected keys were dropped from the load: drop them here too
            request, _ = extract_matching_values(
                copy_structure(sharded_state_dict),
                lambda v: not (isinstance(v, ShardedBase) and not isinstance(v, ShardedTensorFactory)
                               and v.key in unexpected))
        result = apply_factory_merges(loaded, request)
        dict_list_map_inplace(lambda v: v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, nonpersistent)
        merge(result, nonpersistent)
        return restore_dtensors(merge(common, result), sharded_state_dict)

    result = run_agreed(finish, "Merging the loaded state")
    phases.end("finalize")
    phases.log("Loaded", checkpoint_dir)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return result, missing, unexpected
    return result
