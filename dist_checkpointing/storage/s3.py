"""The S3 implementation of the storage protocol: ``s3://bucket/prefix`` through obstore.

The client is obstore (``pip install dist_checkpointing[s3]``; benchmarks/README.md says
why), imported when the first :class:`S3Storage` is made. It is configured from the
standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ALLOW_HTTP``, …); ``storage_options``
override it (obstore ``S3Store`` keyword arguments).

Retries: obstore retries every request (HEAD, GET and its body, LIST, PUT, each part of a
multipart upload, its initiation and completion, DELETE) on 5xx, 429/503 throttling,
refused, dropped or timed-out connections, with exponential backoff and jitter, up to
``retry_config`` (default: 10 retries, 100 ms doubling to at most 15 s, none started after
180 s) and ``client_options`` timeouts (default: 5 s to connect, 30 s a request). Both are
storage options; their durations may be given as seconds. Two gaps are filled here: a
single PUT that failed in transit without a retry (obstore does not retry a timed-out
conditional PUT) is sent again, within the same retry count; and a conditional create whose
answer was lost, so that its retry finds the object, reads the object back. A multipart
upload that fails is aborted (by obstore when a part or the completion fails, by
:meth:`S3WriteStream.abort` otherwise); only a killed process or an unreachable server
leaves one behind (a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` removes
those).

The prefix is a directory: ``iter_1`` holds the objects ``iter_1/…`` only, never
``iter_10/…``. A streamed file is a multipart upload of :data:`PART_BYTES` parts, with
:data:`PARTS_IN_FLIGHT` parts uploading. A large write (a tensor's storage, which
``torch.save`` writes in one call) is sent from the caller's memory up to its last part
boundary, without a copy (obstore joins the part being filled with its head), and returns
once obstore has dropped it; other bytes are copied once into parts of their own, at most
``BUFFERS_PER_FILE`` (3) per stream: the one being filled, the others queued or uploading
(as many as the write buffers of a file on disk). It is durable once
:meth:`S3WriteStream.close` returns (CompleteMultipartUpload), and
:meth:`S3WriteStream.abort` aborts the upload. That a streamed file does not exist yet is
checked with a HEAD (not atomic: the checkpoint's directory claim is). Small files are
single PUTs (atomic on S3); :meth:`S3Storage.create_exclusive` is a conditional PUT
(``If-None-Match: *``).

obstore's runtime does not survive a fork: :class:`S3Storage` is not ``fork_safe`` (an
async save writes it from a thread), and in a process forked after obstore was used every
call raises an OSError instead of hanging.

Chosen by measurement (``benchmarks/bench_s3_clients.py``, local SeaweedFS): of obstore,
boto3 and s3fs only obstore uploads multipart straight from our buffers (2-3 MiB extra for
a 1 GiB put, against ~230 MiB for boto3 and 1.3 GiB for s3fs), with the fastest puts and
random ranged reads, 6 ms to import and build, retries built in. Reads (:mod:`.s3_reader`):
a load announces the runs of adjacent small records of each file
(``RangeReader.will_read_ranges``), read through shared 16 MiB blocks fetched 4 ahead (8
held at most); a large record is announced by its reading thread (``RangeReader.will_read``)
and fetched in 16 MiB pieces 4 ahead; other reads come from aligned 16 MiB blocks (256 KiB
for small reads). Object stores cannot rename and nothing needs to: the save claims the
prefix (a conditional create after finding it empty), streams its files, and rank 0 writes
``metadata.json`` last (one atomic PUT), so an interrupted save leaves nothing that loads.
``tests/test_s3_faults.py`` checks retries and aborts against a real server, killed and
restarted, and through a fault-injecting proxy.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .base import FileInfo, RangeReader, Storage, WriteStream, byte_view
from .buffers import BUFFERS_PER_FILE
from .locations import object_key_problem
from .s3_client import DEFAULT_MAX_RETRIES, PART_BYTES, PARTS_IN_FLIGHT, _obstore, _os_errors, _store_options
from .s3_reader import S3Reader

__all__ = ["PART_BYTES", "PARTS_IN_FLIGHT", "S3Reader", "S3Storage", "S3WriteStream"]

_DELETE_BATCH = 100  # keys per delete request of delete_many (its pause runs between them)
_ABORT = object()  # queued by abort(): makes the upload fail, so that obstore aborts it


class S3WriteStream(WriteStream):
    """A new object written front to back as a multipart upload from a background thread."""

    def __init__(self, store: Any, key: str, url: str):
        super().__init__()
        self._url = url
        self._free_parts = threading.Semaphore(BUFFERS_PER_FILE)
        self._part = self._take_part()
        self._fill = 0
        self._flushed = 0
        self._parts: "queue.Queue[Any]" = queue.Queue(maxsize=1)
        self._io_error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._upload, args=(store, key), name="dist-ckpt-s3-writer",
                                        daemon=True)
        self._thread.start()

    def _next_parts(self) -> Iterator[memoryview]:
        while True:
            item = self._parts.get()
            if item is None:
                return
            if item is _ABORT:
                raise OSError(errno.ECANCELED, f"upload of {self._url} aborted")
            box = [item]
            del item  # not kept while suspended: a direct slice is released once it is sent
            yield box.pop()

    def _upload(self, store: Any, key: str) -> None:
        try:
            with _os_errors(f"multipart upload of {self._url}"):
                _obstore().put(store, key, self._next_parts(), use_multipart=True, chunk_size=PART_BYTES,
                               max_concurrency=PARTS_IN_FLIGHT)
        except BaseException as e:  # noqa: BLE001 - re-raised in the writing thread
            self._io_error = e

    def tell(self) -> int:
        return self._flushed + self._fill

    def write(self, data) -> int:  # type: ignore[override]
        """Append ``data``. A write that reaches at least :data:`PART_BYTES` past the
        stream's position into the next parts is sent from ``data``'s own memory up to its
        last part boundary (returning once that is sent); the rest is copied into a part."""
        src = byte_view(data)
        n = src.nbytes
        if self._hasher is not None:
            self._hasher.update(src)
        start = self.tell()
        direct = (start + n) // PART_BYTES * PART_BYTES - start
        if direct >= PART_BYTES:
            self._send_direct(src[:direct])
            src = src[direct:]
        self._copy(src)
        return n

    def _copy(self, src: memoryview) -> None:
        """Copy ``src`` into the current part, handing over each part that fills."""
        n, pos = src.nbytes, 0
        while pos < n:
            k = min(PART_BYTES - self._fill, n - pos)
            self._part[self._fill:self._fill + k] = src[pos:pos + k]
            self._fill += k
            pos += k
            if self._fill == PART_BYTES:
                self._hand_over()

    def _send_direct(self, src: memoryview) -> None:
        """Upload ``src`` (ending on a part boundary) from the caller's memory, without a
        copy: the part being filled is handed over as it is (obstore joins it with the head
        of ``src`` into one part), then ``src`` in slices of at most a part, queued one by
        one so that no more than :data:`PARTS_IN_FLIGHT` parts upload at once. Returns once
        obstore has dropped every slice (sent, or the upload failed): the caller may then
        reuse or free the memory."""
        import numpy

        if self._fill:
            self._hand_over()
        sent = threading.Event()
        whole = numpy.frombuffer(src, dtype=numpy.uint8)
        weakref.finalize(whole, sent.set)  # once no slice of it is left
        slices = [whole[i:i + PART_BYTES] for i in range(0, src.nbytes, PART_BYTES)]
        del whole
        self._flushed += src.nbytes
        try:
            while slices:
                self._queue(slices.pop(0))
        finally:
            del slices
            self._wait_released(sent)

    def _wait_released(self, sent: threading.Event) -> None:
        """Wait for ``sent``; if the uploader stops first, drop what it left queued."""
        while not sent.wait(0.2):
            self._check_uploader()
        if self._io_error is not None:
            self.error = self._io_error
            raise self._io_error

    def _drain(self) -> None:
        """Drop the items queued for a stopped uploader."""
        try:
            while True:
                self._parts.get_nowait()
        except queue.Empty:
            pass

    def _hand_over(self) -> None:
        """Queue the current part for upload (obstore keeps a reference to it until it is
        uploaded) and start the next."""
        part = memoryview(self._part)[:self._fill]
        self._flushed += self._fill
        self._part, self._fill = None, 0
        self._queue(part)
        del part
        self._part = self._take_part()

    def _take_part(self) -> mmap.mmap:
        """A new part buffer, once fewer than :data:`BUFFERS_PER_FILE` parts of this stream
        exist (being filled, queued or uploading), as the write buffers of a file; a
        mapping of its own, unmapped as soon as obstore drops it (a 16 MiB ``bytearray``
        would stay in malloc's arenas)."""
        while not self._free_parts.acquire(timeout=0.2):
            self._check_uploader()
        part = mmap.mmap(-1, PART_BYTES)
        weakref.finalize(part, self._free_parts.release)
        return part

    def _check_uploader(self) -> None:
        """Drop what a stopped uploader left queued (and so the parts it holds)."""
        if not self._thread.is_alive():
            self._drain()

    def _queue(self, item: Any) -> None:
        while True:
            if self._io_error is not None:
                self.error = self._io_error
                raise self._io_error
            try:
                self._parts.put(item, timeout=0.2)
                return
            except queue.Full:
                pass

    def flush(self) -> None:
        """Parts are uploaded as they fill; :meth:`close` uploads the rest."""

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._fill:
                self._hand_over()
            self._queue(None)
            self._thread.join()
            if self._io_error is not None:
                raise self._io_error
        except BaseException:
            self._stop(_ABORT)
            raise
        finally:
            self._part = bytearray()
            super().close()

    def _stop(self, item: Any) -> None:
        """Hand ``item`` to the uploader unless it has stopped; wait for it."""
        while self._thread.is_alive():
            try:
                self._parts.put(item, timeout=0.2)
                break
            except queue.Full:
                pass
        self._thread.join()

    def abort(self) -> None:
        """Abort the multipart upload: no object is created."""
        if not self.closed:
            self._stop(_ABORT)
            self._part = bytearray()
            super().close()


def _open_with_aws_env(location: str, storage_options: Optional[Dict[str, Any]],
                       aws_env: Dict[str, str]) -> "S3Storage":
    """In a worker process: ``S3Storage(location, storage_options)`` with exactly ``aws_env``
    as its ``AWS_*`` environment (the worker runs one call at a time)."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        del os.environ[key]
    os.environ.update(aws_env)
    return S3Storage(location, storage_options)


class S3Storage(Storage):
    """The objects under ``s3://bucket/prefix``; names are the keys below the prefix."""

    fork_safe = False

    def __init__(self, location: str, storage_options: Optional[Dict[str, Any]] = None):
        scheme, _, rest = location.partition("://")
        if scheme.lower() != "s3" or not rest.split("/", 1)[0]:
            raise ValueError(f"Not an s3://bucket/prefix location: {location!r}")
        self.bucket, _, prefix = rest.partition("/")
        self.prefix = prefix.strip("/")
        _obstore()
        from obstore.store import S3Store

        self._location, self._options = location, storage_options
        options = _store_options(storage_options or {})
        self._max_retries = int(options.get("retry_config", {}).get("max_retries", DEFAULT_MAX_RETRIES))
        self._store = S3Store(self.bucket, prefix=self.prefix or None, **options)

    def process_spec(self) -> Tuple[Callable[..., Storage], Tuple[Any, ...]]:
        """Opened in the other process with this process's ``AWS_*`` environment of now (the
        other process may have started under other credentials, endpoint or region)."""
        aws_env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        return _open_with_aws_env, (self._location, self._options, aws_env)

    def __repr__(self) -> str:
        return f"S3Storage({self.describe()!r})"

    def describe(self, name: str = "") -> str:
        path = "/".join(p for p in (self.prefix, name) if p)
        return f"s3://{self.bucket}/{path}"

    def subdirectory(self, name: str) -> "S3Storage":
        return S3Storage(self.describe(name), self._options)

    def name_problem(self, name: str = "") -> Optional[str]:
        return object_key_problem("/".join(p for p in (self.prefix, name) if p))

    def _refuse_unkept(self, name: str) -> None:
        """An ``OSError`` for a key the store would not keep as written (a write is refused)."""
        problem = self.name_problem(name)
        if problem is not None:
            raise OSError(errno.EINVAL, f"{self.describe(name)}: not an object key the store keeps: {problem}")

    def create_stream(self, name: str) -> WriteStream:
        self._refuse_unkept(name)
        if self.info(name) is not None:
            raise FileExistsError(errno.EEXIST, f"{self.describe(name)} exists")
        return S3WriteStream(self._store, name, self.describe(name))

    def _put(self, name: str, data, mode: str) -> None:
        """One PUT; retried here, within the retry budget, when it failed in transit and obstore
        did not retry it (a timed-out conditional PUT: obstore retries only idempotent requests)."""
        self._refuse_unkept(name)
        for attempt in range(self._max_retries + 1):
            try:
                with _os_errors(f"write of {self.describe(name)}"):
                    _obstore().put(self._store, name, memoryview(data), mode=mode, use_multipart=False)
                return
            except OSError as e:
                from obstore.exceptions import GenericError

                cause = e.__cause__
                text = str(cause)  # "... in 1.5s - HTTP error: ...", or "... after 3 retries, ..."
                unretried = (isinstance(cause, GenericError) and "non-2xx" not in text
                             and "retries" not in text.split(" - ", 1)[0])
                if not unretried or attempt == self._max_retries:
                    raise
                time.sleep(min(0.1 * 2 ** attempt, 2.0))

    def write_atomic(self, name: str, data) -> None:
        self._put(name, data, "overwrite")

    def create_exclusive(self, name: str, data) -> None:
        try:
            self._put(name, data, "create")
        except FileExistsError:
            # a retry after a lost answer finds the object the first attempt created: ours if
            # it holds exactly ``data`` (callers write unique content, e.g. a fresh save id)
            if self.read_bytes(name) != bytes(data):
                raise

    def delete(self, name: str) -> None:
        try:
            with _os_errors(f"delete of {self.describe(name)}"):
                _obstore().delete(self._store, name)
        except FileNotFoundError:
            pass

    def delete_many(self, names, pause: Optional[Callable[[], None]] = None) -> None:
        """Delete the objects ``names`` (exactly these keys), 100 per request, ``pause``
        called before each request."""
        names = list(names)
        with _os_errors(f"delete of objects under {self.describe()}"):
            for start in range(0, len(names), _DELETE_BATCH):
                if pause is not None:
                    pause()
                _obstore().delete(self._store, names[start:start + _DELETE_BATCH])

    def make_root(self) -> None:
        """A prefix needs no creating; one listing checks the bucket and the credentials."""
        self.list()

    def read_bytes(self, name: str, max_bytes: Optional[int] = None) -> bytes:
        with _os_errors(f"read of {self.describe(name)}"):
            result = _obstore().get(self._store, name)
            if max_bytes is None:
                return bytes(result.bytes())
            chunks, got = [], 0
            for chunk in result.stream(min_chunk_size=1 << 20):
                chunks.append(bytes(chunk))
                got += len(chunks[-1])
                if got > max_bytes:
                    break
            return b"".join(chunks)[:max_bytes + 1]

    def open_reader(self, name: str) -> RangeReader:
        info = self.info(name)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.describe(name)} does not exist")
        return S3Reader(self._store, name, info.size, self.describe(name))

    def info(self, name: str) -> Optional[FileInfo]:
        if not name:
            return None
        try:
            with _os_errors(f"stat of {self.describe(name)}"):
                meta = _obstore().head(self._store, name)
        except FileNotFoundError:
            return None
        return FileInfo(meta["size"], (meta["e_tag"], meta["size"], meta["last_modified"]))

    def _has_children(self, name: str) -> bool:
        with _os_errors(f"list of {self.describe(name)}"):
            for chunk in _obstore().list(self._store, name or None, chunk_size=1):
                return len(chunk) > 0
        return False

    def kind(self, name: str = "") -> Optional[str]:
        if self.info(name) is not None:
            return "file"
        return "dir" if self._has_children(name) else None

    def _list(self) -> Dict[str, Any]:
        with _os_errors(f"list of {self.describe()}"):
            return _obstore().list_with_delimiter(self._store, None)

    def _listing(self) -> Dict[str, str]:
        """The entries under the prefix from one listing: objects ``"file"``, prefixes ``"dir"``."""
        result = self._list()
        found = {}
        for kind, names in (("file", [o["path"] for o in result["objects"]]), ("dir", result["common_prefixes"])):
            for name in names:
                name = name.rstrip("/").rsplit("/", 1)[-1]
                if name:  # (SeaweedFS lists a prefix whose objects were all deleted as an empty-named object)
                    found[name] = kind
        return found

    def list(self) -> List[str]:
        return sorted(self._listing())

    def entries(self) -> Dict[str, Optional[str]]:
        return dict(sorted(self._listing().items()))

    def listed_sizes(self) -> Optional[Dict[str, int]]:
        return {name: o["size"] for o in self._list()["objects"] if (name := o["path"].rsplit("/", 1)[-1])}
