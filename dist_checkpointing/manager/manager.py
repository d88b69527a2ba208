"""``CheckpointManager``: when to save, what to keep, where to resume — crash-safe.

Every rank builds the manager and calls ``save``/``load`` (collective); rank 0 alone
touches the root's own files (lock, index, tracker) and deletes checkpoints, in a
background thread. Every rank decides whether to save from the same state and one small
``all_reduce`` agrees (rank 0's metrics are broadcast when it saves); rank 0 picks the step
to load and broadcasts it; retention is a pure function of state every rank holds alike.
The commit order is what makes a kill at any moment safe (the package docstring):
checkpoint data → ``metadata.json`` (the library's commit) → index → tracker → deletions.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import ExitStack
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .. import serialization
from ..runtime.collectives import broadcast_object, get_rank, run_agreed, run_agreed_with_flags
from ..core import CheckpointingException, open_storage
from ..mapping import ShardedStateDict, StateDict
from ..integrity.overlap import refuse_overlap
from ..storage import Storage, url_scheme
from ..integrity.stored_names import refuse_unkept_names
from ..strategies.async_utils import AsyncCallsQueue
from ..validation import StrictHandling
from .agreement import check_step, decided_on_rank0, same_on_every_rank, step_flags
from .crash import crash_point
from .layout import (
    CONTENT_KEY, INDEX_FNAME, RELEASE, TRACKER_FNAME, Metrics, config_name, recorded_metrics, read_index, scan_root,
    step_dir, write_index, write_tracker,
)
from .local.marker import load_run_id, normalise_root
from .local.restore import restore as restore_local, restored_state
from .local.tier import LocalTier
from .lock import RootLock
from .retention import RetentionPolicy, check_positive, metric_value
from .bookkeeping import Bookkeeper

logger = logging.getLogger(__name__)

PathOrUrl = Union[str, "os.PathLike[str]"]  # a local directory or a URL (no Storage: the manager opens it)


class CheckpointManager:
    """Checkpoints of a training run under ``root`` in Megatron-LM's layout
    (``root/iter_{step:07d}/`` and ``root/latest_checkpointed_iteration.txt``).

    Args:
        root: a local directory or a URL (``s3://bucket/prefix``); created if missing.
        save_interval_steps: :meth:`should_save` is true every that many steps (``None``:
            at every step).
        keep_last, keep_every_n_steps, keep_best: retention policies, combined (a
            checkpoint is kept if any keeps it; the newest is always kept; none set: all
            are kept). ``keep_best`` ranks by ``metrics[best_metric]``, ``best_mode``
            ``'min'`` or ``'max'``.
        async_save: write in the background; a checkpoint counts once every rank has
            finished it (finalized at the next ``save``, ``load``, :meth:`wait_until_finished`
            or :meth:`close`).
        storage_options: options of the object store client (``s3://`` roots).
        local_dir, local_interval, replication_factor, node_of_rank: two-tier mode (both
            ``local_dir`` and ``local_interval`` given): every ``local_interval`` steps each
            rank also writes its own shards to ``local_dir`` (node-local; ``{node}`` and
            ``{rank}`` are replaced) and replicates them to ``replication_factor - 1`` ranks on
            other nodes (``node_of_rank``: each rank's node; default from torchrun's
            ``LOCAL_WORLD_SIZE``); :meth:`load` restores the newest step of either tier
            (:mod:`.local.tier`). ``local_snapshot``: ``"fork"`` (default; CPU tensors: a
            local save blocks for a fork, a child copies the state) or ``"copy"`` (the
            copy on the training thread). Every local copy belongs to this job (the root and
            its run id, kept in the root): a ``local_dir`` holding another job's copies is
            refused, unless ``local_takeover`` (then they are deleted).

    Collective (every rank calls them): the constructor, :meth:`save`, :meth:`load`,
    :meth:`load_from`, :meth:`wait_until_finished`, :meth:`close`. The queries (:meth:`latest_step`,
    :meth:`all_steps`, :meth:`best_step`, :meth:`metrics`, :meth:`should_save`) and
    :meth:`load_common` work on one rank alone. Errors are :class:`CheckpointingException`,
    raised on every rank.
    """

    def __init__(self, root: PathOrUrl, *, save_interval_steps: Optional[int] = None, keep_last: Optional[int] = None,
                 keep_every_n_steps: Optional[int] = None, keep_best: Optional[int] = None,
                 best_metric: Optional[str] = None, best_mode: str = "min", async_save: bool = False,
                 storage_options: Optional[Dict[str, Any]] = None, local_dir: Optional[PathOrUrl] = None,
                 local_interval: Optional[int] = None, replication_factor: int = 1,
                 node_of_rank: Optional[List[int]] = None, local_snapshot: str = "fork", local_takeover: bool = False):
        self.policy = RetentionPolicy(keep_last, keep_every_n_steps, keep_best, best_metric, best_mode)
        check_positive("save_interval_steps", save_interval_steps)
        self.save_interval_steps = save_interval_steps
        self.async_save = async_save
        self._root = os.fspath(root) if not isinstance(root, str) else root
        if not url_scheme(self._root):  # absolute once: a later os.chdir never moves the checkpoints
            self._root = os.path.abspath(self._root)
        self._storage_options = storage_options
        self.storage = self._open(self._root)
        self._rank = get_rank()
        self._lock: Optional[RootLock] = None
        self._bookkeeper: Optional[Bookkeeper] = None  # rank 0: bookkeeping writes and deletions
        self._queue: Optional[AsyncCallsQueue] = AsyncCallsQueue() if async_save else None
        self._pending: Optional[int] = None  # the step being saved (async: until finalized)
        self._closed = False
        self._steps: Dict[int, Metrics]  # complete checkpoints kept: step -> metrics
        self._steps, leftovers = decided_on_rank0(self._open_root,
                                                   f"Opening checkpoint root {self.storage.describe()}")
        if self._rank == 0:
            self._bookkeeper = Bookkeeper(self.storage, self._child)
            for name in leftovers:
                self._bookkeeper.delete(name, committed=False)
        self.local: Optional[LocalTier] = None  # two-tier mode
        self.restored_from: Optional[Tuple[str, Any]] = None  # ("local" | "persistent", step) or ("outside", dir)
        if (local_dir is None) != (local_interval is None):
            raise CheckpointingException("CheckpointManager: two-tier mode needs both local_dir and local_interval")
        if local_dir is not None:
            check_positive("local_interval", local_interval)
            try:
                job = decided_on_rank0(lambda: {"root": normalise_root(self._root), "run": load_run_id(self.storage)},
                                        "Two-tier mode")
                self.local = LocalTier(os.fspath(local_dir), local_interval, replication_factor, node_of_rank,
                                       snapshot=local_snapshot, job=job, takeover=local_takeover)
            except BaseException:
                self.close(abort=True)
                raise

    # -- storage ---------------------------------------------------------------------------
    def _open(self, location: str) -> Storage:
        return open_storage(location, self._storage_options)

    def _location(self, name: str) -> str:
        return f"{self._root.rstrip('/')}/{name}" if url_scheme(self._root) else os.path.join(self._root, name)

    def _child(self, name: str) -> Storage:
        return self._open(self._location(name))

    def _checkpoint_dir(self, step: int) -> Union[str, Storage]:
        """What ``save``/``load`` get for ``step``: the location, or its storage when the
        store needs options."""
        location = self._location(step_dir(step))
        return location if self._storage_options is None else self._open(location)

    def _open_root(self) -> Tuple[Dict[int, Metrics], List[str]]:
        """Rank 0: create the root, take its lock, find its checkpoints (metrics from the
        index, else from the checkpoints themselves) and repair the tracker."""
        refuse_unkept_names(self.storage, [TRACKER_FNAME, INDEX_FNAME], "CheckpointManager")
        if self.storage.kind() == "file":
            raise CheckpointingException(f"Checkpoint root {self.storage.describe()} is a file, not a directory")
        try:
            self.storage.make_root()
        except OSError as e:
            raise CheckpointingException(f"Cannot create checkpoint root {self.storage.describe()}: {e}") from e
        self._lock = RootLock(self.storage)
        self._lock.acquire()
        try:
            scan = scan_root(self.storage, self._child)
            index = read_index(self.storage)
            steps = {s: (index or {}).get(s) for s in scan.complete}
            missing = [s for s in steps if index is None or s not in index]
            for step in missing:
                steps[step] = self._read_recorded_metrics(step)
            if missing:
                write_index(self.storage, steps)
            if steps and scan.tracker not in (str(max(steps)), RELEASE):
                logger.warning("Tracker of %s names %s; the newest complete checkpoint is %d: rewriting it",
                               self.storage.describe(), scan.tracker, max(steps))
                write_tracker(self.storage, max(steps))
            return steps, scan.leftovers
        except BaseException:
            self._lock.release()
            raise

    def _read_recorded_metrics(self, step: int) -> Metrics:
        try:
            return recorded_metrics(serialization.load_content_metadata(self._checkpoint_dir(step)))
        except CheckpointingException as e:
            logger.warning("No metrics for step %d: %s", step, e)
            return None

    # -- queries (one rank alone) -------------------------------------------------------------
    def latest_step(self) -> Optional[int]:
        """The newest complete step (``None`` if there is none)."""
        return max(self._steps) if self._steps else None

    def all_steps(self) -> List[int]:
        """The complete steps kept, ascending."""
        return sorted(self._steps)

    def best_step(self) -> Optional[int]:
        """The best complete step by ``metrics[best_metric]`` (``None`` without ``best_metric``
        or when no step has it)."""
        ranked = self.policy.ranked(self._steps)
        return ranked[0] if ranked else None

    def metrics(self, step: int) -> Optional[dict]:
        """The metrics saved with ``step`` (``None`` if none were, or it is not kept)."""
        metrics = self._steps.get(step)
        return dict(metrics) if metrics is not None else None

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a save step: on the interval and newer than every checkpoint
        (complete or in flight)."""
        step = check_step(step)
        newest = max([*self._steps, *([self._pending] if self._pending is not None else [])], default=-1)
        on_interval = self.save_interval_steps is None or step % self.save_interval_steps == 0
        return on_interval and step > newest

    # -- saving ------------------------------------------------------------------------------
    def _decide_save(self, step: int, metrics: Metrics, force: bool) -> Tuple[bool, Metrics]:
        """Whether to save ``step``: every rank decides the same from the same state; rank 0
        also checks the metrics and clears a leftover of an interrupted save of it out of
        the way."""
        newest = max(self._steps, default=None)
        if newest is not None and step < newest:
            raise CheckpointingException(
                f"CheckpointManager: step {step} is older than the newest checkpoint {newest} of "
                f"{self.storage.describe()}: steps must increase (delete the newer checkpoints or use another root)")
        if step in self._steps:
            if force:
                raise CheckpointingException(
                    f"CheckpointManager: step {step} is already saved ({self.storage.describe(step_dir(step))})")
            return False, None
        if not (force or self.should_save(step)):
            return False, None
        if self._bookkeeper is None:  # not rank 0: rank 0's metrics are recorded
            return True, None
        if metrics is not None:
            try:
                if not isinstance(metrics, dict):
                    raise TypeError(f"a dict is expected, not {type(metrics).__name__}")
                json.dumps(metrics)
            except (TypeError, ValueError) as e:
                raise CheckpointingException(
                    f"CheckpointManager: metrics of step {step} must be a JSON object: {e}") from e
        if self.policy.keep_best is not None and metric_value(metrics, self.policy.best_metric) is None:
            raise CheckpointingException(
                f"CheckpointManager: keep_best needs metrics[{self.policy.best_metric!r}] as a finite number "
                f"for step {step}, got {(metrics or {}).get(self.policy.best_metric)!r}")
        name = step_dir(step)
        if self.storage.kind(name) is not None:
            if self.storage.info(name) is not None or self.storage.info(config_name(step)) is not None:
                raise CheckpointingException(f"CheckpointManager: {self.storage.describe(name)} is in the way")
            self._bookkeeper.remove_now(name)  # the leftover of an interrupted save of this step
            if self.storage.kind(name) is not None:
                raise CheckpointingException(
                    f"CheckpointManager: {self.storage.describe(name)} holds files this library did not write")
        return True, (dict(metrics) if metrics is not None else None)

    def save(self, step: int, sharded_state_dict: ShardedStateDict, metrics: Optional[dict] = None,
             force: bool = False, content_metadata: Optional[dict] = None) -> bool:
        """Save ``step`` if :meth:`should_save` says so (or ``force``); returns whether it
        saved (collective). ``metrics`` (JSON-serializable, rank 0's are used) are stored with
        the checkpoint, also in its ``content_metadata`` under ``"dist_checkpointing_manager"``.

        A step older than the newest checkpoint, or a ``force`` d save of a step already saved,
        is an error. An earlier async save is finalized first (its failure is raised here).
        """
        self._check_open()
        step = check_step(step)
        self._finalize(blocking=True)
        (do_save, metrics), agreed = run_agreed_with_flags(
            lambda: self._decide_save(step, metrics, force), lambda _: step_flags(step), f"Saving step {step}")
        if not same_on_every_rank(agreed):
            raise CheckpointingException(
                f"CheckpointManager: the ranks pass different steps to save (rank {self._rank}: step {step})")
        metrics = broadcast_object(metrics) if do_save else None  # rank 0's (a local-only step records none)
        content = dict(content_metadata or {})
        content[CONTENT_KEY] = {"step": step, "metrics": metrics}
        if self.local is not None:
            self.local.finalize()  # the local save in flight (collective), before any copy is queued
        # a local copy holds what a persistent save stores: a restore from it answers alike
        local_state = {**sharded_state_dict, "content_metadata": content}
        if not do_save:
            return self._save_local(step, local_state)
        commit = self._after_commit_fn(step, metrics)
        self._pending = step
        if self._bookkeeper is not None:
            self._bookkeeper.hold_deletions()  # until the save is committed or failed
        try:
            request = serialization.save(sharded_state_dict, self._checkpoint_dir(step),
                                         async_sharded_save=self.async_save, content_metadata=content)
        except CheckpointingException:
            self._discard(step)
            raise
        if request is None:
            commit()  # the same on every rank, and nothing in it can fail: no collective needed
        else:
            assert self._queue is not None
            request.add_pre_finalize_fn(lambda: crash_point("finalize", step))
            request.add_finalize_fn(commit)
            self._queue.schedule_async_request(request)
            crash_point("save", step)
        # after the persistent save's copies are queued: the local tier agrees over its own
        # (gloo) group, which does not wait for them
        self._save_local(step, local_state)
        return True

    def _save_local(self, step: int, sharded_state_dict: ShardedStateDict) -> bool:
        """Two-tier mode: start ``step``'s local save if it is on the local interval (every
        rank decides alike; the local save in flight is already finalized)."""
        if self.local is None:
            return False
        if not self.local.should_save(step):
            return False
        self.local.save(step, sharded_state_dict)
        return True

    def _after_commit_fn(self, step: int, metrics: Metrics) -> Callable[[], None]:
        """What follows the commit of ``step`` on every rank (no collective): count it and
        apply retention; rank 0's bookkeeper then writes the index, then the tracker, then
        deletes what retention dropped — in that order, in the background."""

        def after_commit() -> None:
            self._end_save()
            self._steps[step] = metrics
            doomed = self.policy.to_delete(self._steps)
            for old in doomed:
                del self._steps[old]
            if self._bookkeeper is None:
                return
            kept = dict(self._steps)

            def record() -> None:
                write_index(self.storage, kept)
                crash_point("tracker", step)
                write_tracker(self.storage, step)

            self._bookkeeper.submit(record)
            for old in doomed:
                self._bookkeeper.delete(step_dir(old), committed=True)

        return after_commit

    def _end_save(self) -> None:
        """The save in progress is over (committed or failed): deletions may go on."""
        if self._pending is not None and self._bookkeeper is not None:
            self._bookkeeper.release_deletions()
        self._pending = None

    def _discard(self, step: int) -> None:
        """After a failed save of ``step``: its directory is a leftover (rank 0 deletes it)."""
        self._end_save()
        if self._bookkeeper is not None:
            self._bookkeeper.delete(step_dir(step), committed=False)

    def _finalize(self, blocking: bool) -> None:
        """Finalize the async save in flight if it is done (every rank agrees), or wait for it."""
        if self._queue is None or self._pending is None:
            return
        pending = self._pending
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointingException as e:
            self._discard(pending)
            raise CheckpointingException(f"Async save of step {pending} failed; no checkpoint was deleted: {e}") from e

    def maybe_finalize(self) -> None:
        """Finalize the async save in flight (and, in two-tier mode, the local save in
        flight) if every rank has finished writing it, without waiting (collective: one
        small ``all_reduce`` per save in flight).
        Call it every step, as Megatron-LM does, so a checkpoint counts as soon as it is done."""
        self._check_open()
        self._finalize(blocking=False)
        if self.local is not None:
            self.local.finalize(blocking=False)

    def wait_for_staging(self) -> None:
        """Block until the snapshots of the saves in flight are taken (their device-to-host
        copies done). Work queued on the stream that was current at :meth:`save` (the
        optimizer step) is ordered after the copies without it; call it before changing
        saved tensors from another stream or another thread's stream. Not collective;
        returns at once for CPU state."""
        if self._queue is not None:
            self._queue.wait_for_staging()
        if self.local is not None:
            self.local.wait_for_staging()

    def wait_until_finished(self) -> None:
        """Finalize the async save in flight (collective); on rank 0 also wait for the
        background deletions."""
        self._check_open()
        self._finalize(blocking=True)
        if self.local is not None:
            self.local.finalize()
        if self._bookkeeper is not None:
            self._bookkeeper.wait()

    # -- loading -----------------------------------------------------------------------------
    def _pick(self, step: Optional[int]) -> int:
        if step is None:
            latest = self.latest_step()
            if latest is None:
                raise CheckpointingException(f"CheckpointManager: no complete checkpoint in {self.storage.describe()}")
            return latest
        step = check_step(step)
        if step not in self._steps:
            raise CheckpointingException(
                f"CheckpointManager: step {step} is not a complete checkpoint of {self.storage.describe()} "
                f"(complete: {self.all_steps()})")
        return step

    def load(self, sharded_state_dict: ShardedStateDict, step: Optional[int] = None,
             strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
             persist_local: bool = False) -> Any:
        """Load ``step`` (default: the newest complete checkpoint) into ``sharded_state_dict``
        (collective; rank 0's choice of step is used on every rank); returns what
        :func:`dist_checkpointing.load` returns. The step is not deleted while it loads.

        Two-tier mode, without ``step``: the newest step complete in either tier; from the
        local tier when it is newer than every persistent checkpoint and every rank's copy
        (own or replica) is found intact, else from the persistent tier (on every rank
        alike). :attr:`restored_from` tells which. With ``persist_local``, a step restored
        from the local tier is then also saved as a persistent checkpoint of that step, by
        :meth:`save` (``force``; async when the manager is), so that a run of another layout
        or world size can load it; no effect when the step came from the persistent tier."""
        self._check_open()
        self._finalize(blocking=True)
        if self.local is not None and step is None:
            self.local.finalize()
            latest = self.latest_step()
            restored = restore_local(self.local, sharded_state_dict, -1 if latest is None else latest)
            if restored is not None:
                self.restored_from = ("local", restored[0])
                if restored[0] not in self.local.complete:  # it is in the local tier: not saved there again
                    self.local.complete.append(restored[0])
                if persist_local:
                    self._refuse_persisting_onto_local(restored[0])
                    self.save(restored[0], restored_state(sharded_state_dict, restored[1]), force=True)
                return restored[1]
        with ExitStack() as held:
            def pick_and_hold() -> int:  # rank 0: the step, kept from deletion until every rank has read it
                chosen = self._pick(step)
                assert self._bookkeeper is not None
                held.enter_context(self._bookkeeper.loading(step_dir(chosen)))
                return chosen

            chosen = decided_on_rank0(pick_and_hold, "Loading")
            result = serialization.load(sharded_state_dict, self._checkpoint_dir(chosen), strict=strict)
            run_agreed(lambda: None, "Loading")  # every rank is done reading
        self.restored_from = ("persistent", chosen)
        return result

    def load_from(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: PathOrUrl, **load_kwargs: Any) -> Any:
        """Load a checkpoint from outside the run, e.g. the Hugging Face model a fine-tuning
        starts from (collective): :func:`dist_checkpointing.load` with ``load_kwargs`` and the
        manager's ``storage_options``; :attr:`restored_from` becomes ``("outside", checkpoint_dir)``."""
        self._check_open()
        self._finalize(blocking=True)
        result = serialization.load(sharded_state_dict, checkpoint_dir, storage_options=self._storage_options, **load_kwargs)
        self.restored_from = ("outside", checkpoint_dir)
        return result

    def _refuse_persisting_onto_local(self, step: int) -> None:
        """``persist_local``: refuse (on every rank) a persistent step directory that is, holds
        or lies inside a rank's node-local directory (saving it would delete or mix copies)."""
        assert self.local is not None
        node_dir, target = self.local.node_dir, self._location(step_dir(step))
        run_agreed(lambda: refuse_overlap(node_dir, target, "persist the local-tier step"),
                   f"Persisting step {step} from the local tier")

    def load_common(self, step: Optional[int] = None) -> StateDict:
        """The common (non-sharded) state of ``step`` (default: the newest complete one);
        one rank alone."""
        self._check_open()
        chosen = self._pick(step)
        if self._bookkeeper is None:
            return serialization.load_common_state_dict(self._checkpoint_dir(chosen))
        with self._bookkeeper.loading(step_dir(chosen)):
            return serialization.load_common_state_dict(self._checkpoint_dir(chosen))

    # -- lifetime ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointingException(f"CheckpointManager of {self.storage.describe()} is closed")

    def close(self, abort: bool = False) -> None:
        """Finalize the async save in flight, finish the deletions and release the root
        (collective). With ``abort`` (not collective, e.g. after an error on this rank) the
        save in flight is dropped — left incomplete, removed by the next manager — and
        queued deletions are left to it too."""
        if self._closed:
            return
        try:
            if not abort:
                self._finalize(blocking=True)
                if self.local is not None:
                    self.local.close()
        finally:
            self._closed = True
            if self._queue is not None:
                self._queue.close(abort=abort)
            self._end_save()  # an aborted save in flight stays incomplete: a leftover
            if self._bookkeeper is not None:
                self._bookkeeper.stop(finish=not abort)
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)
