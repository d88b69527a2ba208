"""Writing a rank's data files as records: where every byte of a data file is written.

A data file is a sequence of records: a tensor's ``torch.save`` blob (:class:`TensorRecord`:
the fixed prefix and suffix of :mod:`.blob_template` around the tensor's bytes) or a
``ShardedObject``'s bytes as they are. :func:`write_records` writes one file through one
:meth:`~..storage.Storage.create_stream` (the staged ``O_DIRECT`` writer, its buffer pool and
the fsync rules live in :mod:`..storage`); :func:`write_record_files` writes several, each
on its own thread (files of small records one after another on one). This module imports no torch: the persistent writer
(:mod:`.persistent_worker`) runs :func:`write_from_arena` with it alone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ...core import CheckpointingException
from ...integrity.checksums import new_hasher
from ...storage import Storage, WriteStream
from ...runtime.persistent_worker import arena_bytes, report_progress
from ...runtime.progress import byte_meter, reporting_bytes

#: where a record lies in its file: ``(offset, length, checksum or None)``
Span = Tuple[int, int, Optional[int]]
#: how a record travels to the persistent writer: a ShardedObject's bytes, or a tensor's
#: ``(offset in the arena, nbytes, index of its (prefix, suffix) template)``
ArenaRecord = Union[bytes, Tuple[int, int, int]]


@dataclass(frozen=True)
class TensorRecord:
    """A tensor's ``torch.save`` blob: ``prefix``, the tensor's bytes, ``suffix``."""

    prefix: bytes
    data: memoryview
    suffix: bytes


Record = Union[bytes, TensorRecord]


def _same(record: Record) -> Record:
    return record


def write_records(storage: Storage, name: str, items: Sequence[Any], compute_checksums: bool = True,
                  on_written: Optional[Callable[[int], None]] = None,
                  as_record: Callable[[Any], Record] = _same,
                  nbytes: Callable[[Any], int] = len) -> List[Span]:
    """Write ``items`` as the records of the new file ``name`` of ``storage``, each turned
    into a :data:`Record` by ``as_record`` just before it is written (so at most one host
    copy of a device tensor exists at a time).

    Returns the :data:`Span` of each record; the checksum (``None`` unless
    ``compute_checksums``) covers the record's bytes. It is computed piece by piece right
    after each piece is copied into the stream's write buffer (still in the CPU cache),
    while the stream's I/O thread writes the previous buffer. A storage error is a
    :class:`CheckpointingException` naming the file. ``on_written(nbytes(item))``, if
    given, is called after each record (progress reports)."""
    try:
        stream = storage.create_stream(name)
    except OSError as e:
        raise CheckpointingException(f"Cannot create checkpoint file {storage.describe(name)}: {e}") from e
    try:
        spans = _write(stream, items, compute_checksums, on_written, as_record, nbytes)
        stream.close()
    except Exception as e:  # noqa: BLE001 - named below
        stream.abort()
        cause = stream.error or e
        raise CheckpointingException(
            f"Writing checkpoint file {storage.describe(name)} failed: {type(cause).__name__}: {cause}") from cause
    except BaseException:
        stream.abort()
        raise
    return spans


def _write(stream: WriteStream, items: Sequence[Any], compute_checksums: bool,
           on_written: Optional[Callable[[int], None]], as_record: Callable[[Any], Record],
           nbytes: Callable[[Any], int]) -> List[Span]:
    spans: List[Span] = []
    for item in items:
        record = as_record(item)
        start = stream.tell()
        if compute_checksums:
            stream.start_checksum(new_hasher())
        if isinstance(record, TensorRecord):
            stream.write(record.prefix)
            stream.write(record.data)
            stream.write(record.suffix)
        else:
            stream.write(record)
        spans.append((start, stream.tell() - start, stream.take_checksum() if compute_checksums else None))
        del record  # a device tensor's host copy goes before the next one is made
        if on_written is not None:
            on_written(nbytes(item))
    return spans


#: files whose records average less than this are written one after another by one thread:
#: their writes are mostly Python work, and two threads taking turns for the GIL record by
#: record made 2 files of 16 KiB records 1.8x, of 64 KiB 1.2x slower than one thread (2
#: cores; from 256 KiB on, the same)
SMALL_RECORD_BYTES = 256 << 10


def write_record_files(write_file: Callable[..., List[Span]], files: Dict[str, Sequence[Any]], storage: Storage,
                       checksums: bool, thread_count: int, nbytes: Callable[[Any], int]) -> List[List[Span]]:
    """Write each file of ``files`` with ``write_file(storage, name, items, checksums,
    on_written)`` (files in parallel on ``thread_count`` threads, those of small records
    in sequence on one of them: :data:`SMALL_RECORD_BYTES`); the spans of each file, in
    order. The bytes written (``nbytes`` of each item) are reported to the caller's
    progress sink, if any (:mod:`.progress`)."""
    sizes = {name: sum(nbytes(item) for item in items) for name, items in files.items()}
    meter = byte_meter("write", sum(sizes.values()))
    on_written = meter and meter.add

    def write(names: List[str]) -> List[List[Span]]:
        return [write_file(storage, name, files[name], checksums, on_written) for name in names]

    small = [name for name, items in files.items() if sizes[name] < SMALL_RECORD_BYTES * max(1, len(items))]
    tasks = ([small] if small else []) + [[name] for name in files if name not in small]
    order = {name: i for i, name in enumerate(files)}
    tasks.sort(key=lambda task: order[task[0]])  # a failure is reported as the first failing file's
    if thread_count <= 1 or len(tasks) <= 1:
        tasks = [list(files)]
        done = write(tasks[0])
    else:
        with ThreadPoolExecutor(min(thread_count, len(tasks))) as pool:
            done = [spans for task_spans in pool.map(write, tasks) for spans in task_spans]
    by_name = dict(zip([name for task in tasks for name in task], done))
    if meter is not None:
        meter.finish()
    return [by_name[name] for name in files]


def _arena_nbytes(item: ArenaRecord) -> int:
    return item[1] if isinstance(item, tuple) else len(item)


def write_from_arena(spec: Tuple[Callable[..., Storage], Tuple[Any, ...]], arena_id: int,
                     files: Dict[str, List[ArenaRecord]], templates: List[Tuple[bytes, bytes]],
                     checksums: bool, thread_count: int, progress: bool = False) -> List[List[Span]]:
    """In the persistent writer: write ``files`` (their tensors' bytes read in place from
    arena ``arena_id``, their blobs completed by ``templates``) into the storage ``spec``
    opens; the spans of each file, in order. ``progress``: send the bytes written to the
    caller as they go (:func:`.persistent_worker.report_progress`)."""
    factory, args = spec
    flat = arena_bytes(arena_id)

    def as_record(item: ArenaRecord) -> Record:
        if isinstance(item, tuple):
            offset, n, template = item
            prefix, suffix = templates[template]
            return TensorRecord(prefix, flat[offset:offset + n], suffix)
        return item

    def write_file(storage: Storage, name: str, items: Sequence[ArenaRecord], compute: bool,
                   on_written: Optional[Callable[[int], None]]) -> List[Span]:
        return write_records(storage, name, items, compute, on_written, as_record, _arena_nbytes)

    with reporting_bytes(report_progress if progress else None):
        return write_record_files(write_file, files, factory(*args), checksums, thread_count, _arena_nbytes)
