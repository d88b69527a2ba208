"""Which S3 client for the object-store backend: obstore vs boto3 vs s3fs, against a local
SeaweedFS (``tests/s3_server.py: SeaweedFS``, ``weed server -s3`` on 127.0.0.1).

Every measurement runs in a fresh child process (``--child``), so that peak memory and
import time are the client's own. Operations, the same access pattern for every client:

* ``put``: one object of ``--sizes`` MiB from a caller buffer (a numpy array standing for our
  write buffer), multipart with ``--part-mib`` MiB parts, ``--concurrency`` parts in flight
  (obstore ``put(memoryview)``; boto3 ``upload_fileobj`` over a reader of the buffer, which
  copies each part; s3fs ``pipe_file(bytes(buffer))``: it takes no memoryview, so the whole
  object is copied first, then each part again);
* ``get``: the same object into a preallocated buffer, as ``--part-mib`` MiB ranged GETs,
  ``--concurrency`` threads, each part landing in its slice of the buffer;
* ``ranges``: ``--ranges`` ranged GETs of ``--range-kib`` KiB at random offsets of the
  256 MiB object, 16 threads, each into its slice of a preallocated buffer.

A ranged read lands in the caller's buffer through the client's best path: boto3
``StreamingBody.readinto`` (socket -> buffer, no extra copy); obstore ``get_range`` returns a
Rust-owned ``Bytes`` that is copied in (one copy); s3fs ``cat_file`` returns ``bytes``,
copied in (one copy, after aiohttp's own buffering). Time: wall clock of the operation only.
Peak extra RSS: the child's VmHWM during the operation (reset via ``/proc/self/clear_refs``
after the buffers are allocated and touched) minus its RSS then. Import: importing the
client and building it, in the child (numpy already imported). Every get/range result is
checked against the bytes written. ``--rounds`` interleaved rounds (client order rotated
each round); medians. Load average before/after is printed: the machine is shared.

    python benchmarks/bench_s3_clients.py --sizes 256,1024 --rounds 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
CLIENTS = ("obstore", "boto3", "s3fs")
RANGE_OBJECT_MIB = 256


def _pattern(n: int) -> np.ndarray:
    """``n`` bytes (a multiple of 1 MiB): one fixed random MiB repeated."""
    block = np.random.default_rng(0).integers(0, 256, MiB, dtype=np.uint8)
    out = np.empty(n, np.uint8)
    out.reshape(-1, MiB)[:] = block
    return out


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class _BufferReader(io.RawIOBase):
    """A seekable reader over a caller buffer (what boto3's ``upload_fileobj`` needs)."""

    def __init__(self, mv: memoryview) -> None:
        self.mv, self.pos = mv, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: len(self.mv) + pos}[whence]
        return self.pos

    def readinto(self, b) -> int:
        n = min(len(b), len(self.mv) - self.pos)
        b[:n] = self.mv[self.pos:self.pos + n]
        self.pos += n
        return n


def _make_client(name: str, part: int, conc: int):
    """``(put(key, mv), read_into(key, offset, mv))`` for client ``name``, configured from the
    AWS_* environment the parent set."""
    env = os.environ
    if name == "obstore":
        import obstore
        from obstore.store import S3Store

        store = S3Store(env["BENCH_BUCKET"], endpoint=env["AWS_ENDPOINT_URL"], region=env["AWS_REGION"],
                        access_key_id=env["AWS_ACCESS_KEY_ID"], secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                        client_options={"allow_http": True})

        def put(key, mv):
            obstore.put(store, key, mv, chunk_size=part, max_concurrency=conc)

        def read_into(key, off, mv):
            mv[:] = memoryview(obstore.get_range(store, key, start=off, length=len(mv)))
        return put, read_into
    if name == "boto3":
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                              config=Config(max_pool_connections=32, retries={"mode": "standard"}))
        tconf = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc)

        def put(key, mv):
            client.upload_fileobj(_BufferReader(mv), env["BENCH_BUCKET"], key, Config=tconf)

        def read_into(key, off, mv):
            body = client.get_object(Bucket=env["BENCH_BUCKET"], Key=key,
                                     Range=f"bytes={off}-{off + len(mv) - 1}")["Body"]
            got = 0
            while got < len(mv):
                n = body.readinto(mv[got:])
                if n == 0:
                    raise IOError(f"short read of {key} at {off + got}")
                got += n
            body.close()
        return put, read_into
    if name == "s3fs":
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=env["AWS_ENDPOINT_URL"], max_concurrency=conc)
        bucket = env["BENCH_BUCKET"]

        def put(key, mv):
            # botocore accepts bytes/bytearray/file objects, not a memoryview: a full copy
            fs.pipe_file(f"{bucket}/{key}", bytes(mv), chunksize=part, max_concurrency=conc)

        def read_into(key, off, mv):
            mv[:] = fs.cat_file(f"{bucket}/{key}", start=off, end=off + len(mv))
        return put, read_into
    raise ValueError(name)


def _parallel(fn: Callable[[int], None], n: int, threads: int) -> None:
    with ThreadPoolExecutor(threads) as ex:
        for f in [ex.submit(fn, i) for i in range(n)]:
            f.result()


def child(name: str, op: str, size_mib: int, args: argparse.Namespace) -> Dict[str, float]:
    """One measurement in this (fresh) process; returns seconds, extra RSS and import time."""
    part, conc = args.part_mib * MiB, args.concurrency
    t0 = time.perf_counter()
    put, read_into = _make_client(name, part, conc)
    import_s = time.perf_counter() - t0
    size = size_mib * MiB
    if op == "put":
        buf = _pattern(size)
        key = f"put-{name}-{size_mib}"
    elif op == "get":
        buf = np.ones(size, np.uint8)  # touched: resident before the baseline
        key = f"seed-{size_mib}"
    else:
        rng = np.random.default_rng(1)
        length = args.range_kib * 1024
        offsets = rng.integers(0, RANGE_OBJECT_MIB * MiB - length, args.ranges)
        buf = np.ones(args.ranges * length, np.uint8)
        key = f"seed-{RANGE_OBJECT_MIB}"
    mv = memoryview(buf)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status("VmRSS")
    t0 = time.perf_counter()
    if op == "put":
        put(key, mv)
    elif op == "get":
        nparts = -(-size // part)
        _parallel(lambda i: read_into(key, i * part, mv[i * part:min(size, (i + 1) * part)]), nparts, conc)
    else:
        _parallel(lambda i: read_into(key, int(offsets[i]), mv[i * length:(i + 1) * length]), args.ranges, 16)
    seconds = time.perf_counter() - t0
    extra = _status("VmHWM") - base
    if op == "get":
        assert np.array_equal(buf, _pattern(size)), f"{name}: wrong bytes from {key}"
    elif op == "ranges":
        block = _pattern(MiB)
        for i in range(0, args.ranges, 50):  # every 50th range, fully
            want = block[(int(offsets[i]) + np.arange(length)) % MiB]
            assert np.array_equal(buf[i * length:(i + 1) * length], want), f"{name}: wrong range {i}"
    return {"seconds": seconds, "extra_rss_mib": extra / MiB, "import_s": import_s}


def _run_child(name: str, op: str, size_mib: int, env: Dict[str, str], argv: List[str]) -> Dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", name, op, str(size_mib), *argv],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{name} {op} {size_mib} MiB failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,1024", help="object sizes in MiB (multiples of 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--ranges", type=int, default=1000)
    p.add_argument("--range-kib", type=int, default=256)
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        name, op, size = args.child
        print(json.dumps(child(name, op, int(size), args)))
        return
    sys.path.insert(0, str(ROOT))
    from tests.s3_server import SeaweedFS

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server and clean up on kill

    sizes = [int(s) for s in args.sizes.split(",")]
    clients = args.clients.split(",")
    argv = [f"--part-mib={args.part_mib}", f"--concurrency={args.concurrency}",
            f"--ranges={args.ranges}", f"--range-kib={args.range_kib}"]
    load_before = os.getloadavg()
    with SeaweedFS(bucket="bench", volume_growth=7) as server:  # SeaweedFS's default: parallel writes spread
        print(f"SeaweedFS up in {server.start_seconds:.2f} s at {server.endpoint_url}")
        env = {**os.environ, **server.env(), "BENCH_BUCKET": server.bucket}
        os.environ.update(env)
        import obstore
        from obstore.store import S3Store

        store = S3Store(server.bucket, endpoint=server.endpoint_url, region=server.region,
                        access_key_id=server.access_key, secret_access_key=server.secret_key,
                        client_options={"allow_http": True})
        for s in sorted(set(sizes) | {RANGE_OBJECT_MIB}):  # the objects every client reads
            obstore.put(store, f"seed-{s}", memoryview(_pattern(s * MiB)), chunk_size=16 * MiB)
        ops = [(op, s) for s in sizes for op in ("put", "get")] + [("ranges", RANGE_OBJECT_MIB)]
        results: Dict[tuple, List[Dict[str, float]]] = {}
        for r in range(args.rounds):
            order = clients[r % len(clients):] + clients[:r % len(clients)]
            for op, s in ops:
                for name in order:
                    res = _run_child(name, op, s, env, argv)
                    results.setdefault((name, op, s), []).append(res)
                    print(f"round {r} {name:8s} {op:6s} {s:5d} MiB {res['seconds']:7.2f} s "
                          f"peak extra {res['extra_rss_mib']:7.1f} MiB  load {os.getloadavg()[0]:.1f}", flush=True)
                    if op == "put":
                        obstore.delete(store, f"put-{name}-{s}")
    load_after = os.getloadavg()
    print("\n| client | op | MiB | median s | MiB/s | peak extra RSS MiB (median) | rounds |")
    print("|---|---|---:|---:|---:|---:|---:|")
    summary = []
    for (name, op, s), rs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        sec = statistics.median(x["seconds"] for x in rs)
        mem = statistics.median(x["extra_rss_mib"] for x in rs)
        mib = args.ranges * args.range_kib / 1024 if op == "ranges" else s
        print(f"| {name} | {op} | {mib:.0f} | {sec:.2f} | {mib / sec:.0f} | {mem:.0f} | {len(rs)} |")
        summary.append({"client": name, "op": op, "mib": mib, "median_s": sec, "peak_extra_rss_mib": mem,
                        "all_s": [x["seconds"] for x in rs]})
    for name in clients:
        imp = statistics.median(x["import_s"] for (n, _, _), rs in results.items() if n == name for x in rs)
        print(f"import + construct {name}: {imp * 1000:.0f} ms (median over its children)")
    print(f"load average (1 min) before/after: {load_before[0]:.1f} / {load_after[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": summary, "load_before": load_before,
                                               "load_after": load_after}, indent=1))


if __name__ == "__main__":
    main()
