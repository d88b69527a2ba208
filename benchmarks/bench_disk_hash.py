"""Machine ceilings behind the save/load targets: disk write speed and checksum speed.

Measures, interleaved over rounds (medians), on the disk under test:
* writing 1 GiB with ``O_DIRECT`` from a page-aligned buffer by 1, 2, 4 and 8 threads
  (each ``pwrite``s its own 16 MiB pieces), then ``fsync`` — the most the disk gives;
* writing the same bytes buffered (one ``write`` stream) then ``fsync`` — the raw baseline
  of ``bench_save_load.py``;
* reading them back from the page cache with ``preadv`` into a touched buffer (a warm load);
* hashing them with xxh3-64 (the library's checksum): in one pass over memory, and fused
  with the ``preadv`` reads in 1 MiB pieces as the loader does.

Run: ``python benchmarks/bench_disk_hash.py`` (about a minute; needs 1 GiB of disk).
"""

from __future__ import annotations

import argparse
import datetime
import mmap
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List

import xxhash
from _common import add_scratch_and_output_flags, write_report

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_disk_hash.json"
PIECE = 16 << 20
HASH_PIECE = 1 << 20


def direct_write(path: Path, src: mmap.mmap, size: int, threads: int) -> None:
    """Write ``size`` bytes (``src`` repeated) with O_DIRECT from ``threads`` threads, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    offsets = list(range(0, size, PIECE))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not offsets:
                    return
                off = offsets.pop()
            os.pwrite(fd, src, off)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    os.fsync(fd)
    os.close(fd)


def buffered_write(path: Path, src: mmap.mmap, size: int) -> None:
    """Write ``size`` bytes through the page cache, then fsync."""
    with open(path, "wb") as f:
        for _ in range(0, size, PIECE):
            f.write(src)
        f.flush()
        os.fsync(f.fileno())


def cached_read(path: Path, dest: memoryview, fused_hash: bool) -> None:
    """preadv the file into ``dest``; optionally hash each 1 MiB piece right after reading it."""
    fd = os.open(path, os.O_RDONLY)
    hasher = xxhash.xxh3_64() if fused_hash else None
    piece = HASH_PIECE if fused_hash else len(dest)
    done = 0
    while done < len(dest):
        n = os.preadv(fd, [dest[done:done + piece]], done)
        if hasher is not None:
            hasher.update(dest[done:done + n])
        done += n
    os.close(fd)


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="bytes written per measurement, GiB")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    add_scratch_and_output_flags(ap, REPO_ROOT.parent / "bench_tmp", RESULTS_PATH)
    args = ap.parse_args()
    size = int(args.size_gib * (1 << 30)) // PIECE * PIECE
    scratch = Path(args.dir) / f"bench_disk_hash_{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / "data.bin"
    src = mmap.mmap(-1, PIECE)
    src.write(os.urandom(PIECE))
    dest_buf = mmap.mmap(-1, size)
    dest = memoryview(dest_buf)
    started = datetime.datetime.now().astimezone()
    methods: Dict[str, Callable[[], None]] = {
        f"write O_DIRECT, {n} thread{'s' if n > 1 else ''}": (lambda n=n: direct_write(path, src, size, n))
        for n in (1, 2, 4, 8)
    }
    methods["write buffered + fsync"] = lambda: buffered_write(path, src, size)
    times: Dict[str, List[float]] = {name: [] for name in methods}
    read_times: Dict[str, List[float]] = {"read page cache (preadv)": [], "read + fused xxh3 (1 MiB pieces)": [],
                                          "xxh3 over memory (one pass)": []}
    names = list(methods)
    try:
        for rnd in range(args.rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                os.sync()
                times[name].append(timed(methods[name]))
            cached_read(path, dest, False)  # warm the page cache and touch dest
            read_times["read page cache (preadv)"].append(timed(lambda: cached_read(path, dest, False)))
            read_times["read + fused xxh3 (1 MiB pieces)"].append(timed(lambda: cached_read(path, dest, True)))
            read_times["xxh3 over memory (one pass)"].append(timed(lambda: xxhash.xxh3_64_intdigest(dest)))
    finally:
        path.unlink(missing_ok=True)
        scratch.rmdir()
    load_avg = os.getloadavg()
    results = {}
    lines = [f"{size / 2**30:.2f} GiB per measurement, {args.rounds} rounds, medians; GB = 1e9 bytes; "
             f"load average {load_avg[0]:.1f}",
             f"{'measurement':<36}{'median s':>10}{'GB/s':>8}"]
    for name, ts in {**times, **read_times}.items():
        med = statistics.median(ts)
        results[name] = {"times_s": ts, "median_s": med, "GBps": size / med / 1e9}
        lines.append(f"{name:<36}{med:>10.3f}{size / med / 1e9:>8.2f}")
    out = write_report(args.output, started, {"size_bytes": size, "rounds": args.rounds, "dir": str(scratch)},
                       "result", results)
    print("\n".join(lines))
    print(f"JSON results: {out}")


if __name__ == "__main__":
    main()
