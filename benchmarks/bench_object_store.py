"""Save/load to object storage: dist_checkpointing vs torch DCP's fsspec writer/reader (s3fs)
vs the raw obstore client, against a local SeaweedFS (``tests/s3_server.py: SeaweedFS``,
``weed server -s3`` on 127.0.0.1, its data in a temporary directory).

Every rank holds its part of the GPT-like state of ``bench_save_load.py`` (``--sizes`` MiB in
all, bf16 and fp32 tensors, split over the ranks). Methods, each round in a rotated order,
every save to a fresh prefix, loads into preallocated tensors:

* ``ours``: ``dist_checkpointing.save``/``load`` of ``s3://bucket/prefix`` (checksums on);
* ``dcp``: ``torch.distributed.checkpoint.save``/``load`` with
  ``FsspecWriter``/``FsspecReader`` over s3fs (DCP's defaults: one writer thread, one file per
  rank); every rank's tensors under rank-unique keys, so that each rank writes its own;
* ``raw``: the obstore client alone, the floor: each rank puts its tensors' bytes as one
  object (multipart, the same part size and parts in flight as ``ours``) and gets it back with
  ranged GETs of one part each, as many in flight, into a preallocated buffer.

The ratios include ``dcp / raw``: below 2, ``dcp / ours >= 2`` needs ours faster than the raw client.
Time: wall clock between two barriers, max over ranks; peak extra RSS per rank (VmHWM reset
before the call). Before the timed rounds every method saves and loads a tiny state once
(untimed), so that no method is charged the clients' first-use costs. Round 0 checks every
loaded byte. ``--rounds`` interleaved rounds, medians.
s3fs is a benchmark-only dependency (``pip install s3fs``).

    python benchmarks/bench_object_store.py --sizes 256,1024 --rounds 3 --world-sizes 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import dist_checkpointing  # noqa: E402
from _common import (add_scratch_and_output_flags, build_params, closing_lines, gather_floats,  # noqa: E402
                     nbytes, run_world_sizes, spawn_ranks, timed_collective)
from dist_checkpointing.storage.s3 import PART_BYTES, PARTS_IN_FLIGHT  # noqa: E402
from tests.s3_server import SeaweedFS  # noqa: E402

METHODS = ("ours", "dcp", "raw")
MiB = 1 << 20
RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_object_store.json"
TARGETS = {"dcp / ours >=": 2.0, "ours / raw <=": 1.3}


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class Methods:
    """Save/load of every method for one rank, against the server named by the AWS_* env."""

    def __init__(self, params, dest: List[torch.Tensor], rank: int, world: int, bucket: str):
        import obstore
        from obstore.store import S3Store

        self.params, self.dest, self.rank, self.world, self.bucket = params, dest, rank, world, bucket
        self.obstore, self.store = obstore, S3Store(bucket)
        self.raw_buf = torch.zeros(nbytes([p.tensor for p in params]), dtype=torch.uint8)
        env = os.environ
        self.fsspec_options = {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"],
                               "client_kwargs": {"endpoint_url": env["AWS_ENDPOINT_URL"],
                                                 "region_name": env["AWS_REGION"]}}

    def _sharded(self, tensors):
        return {p.key: p.sharded(t, self.rank, self.world) for p, t in zip(self.params, tensors)}

    def _local(self, tensors):
        return {f"{p.key}.rank{self.rank}": t for p, t in zip(self.params, tensors)}

    def ours_save(self, prefix: str) -> None:
        dist_checkpointing.save(self._sharded([p.tensor for p in self.params]), f"s3://{self.bucket}/{prefix}")

    def ours_load(self, prefix: str) -> None:
        dist_checkpointing.load(self._sharded(self.dest), f"s3://{self.bucket}/{prefix}")

    def dcp_save(self, prefix: str) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(f"s3://{self.bucket}/{prefix}", **self.fsspec_options)
        dcp.save(self._local([p.tensor for p in self.params]), storage_writer=writer)

    def dcp_load(self, prefix: str) -> None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(self._local(self.dest), storage_reader=FsspecReader(f"s3://{self.bucket}/{prefix}",
                                                                      **self.fsspec_options))

    def raw_save(self, prefix: str) -> None:
        self.obstore.put(self.store, f"{prefix}/rank{self.rank}", (_bytes_of(p.tensor) for p in self.params),
                         chunk_size=PART_BYTES, max_concurrency=PARTS_IN_FLIGHT)

    def raw_load(self, prefix: str) -> None:
        key, out = f"{prefix}/rank{self.rank}", _bytes_of(self.raw_buf)

        def get(start: int) -> None:
            n = min(PART_BYTES, len(out) - start)
            out[start:start + n] = memoryview(self.obstore.get_range(self.store, key, start=start, length=n))

        with ThreadPoolExecutor(PARTS_IN_FLIGHT) as pool:
            list(pool.map(get, range(0, len(out), PART_BYTES)))

    def verify(self, method: str) -> bool:
        """Whether the last load of ``method`` gave back every byte."""
        if method == "raw":
            return torch.equal(self.raw_buf, torch.cat([p.tensor.view(-1).view(torch.uint8) for p in self.params]))
        return all(torch.equal(p.tensor, d) for p, d in zip(self.params, self.dest))

    def delete(self, prefix: str) -> None:
        """Remove what a save wrote under ``prefix``."""
        for chunk in self.obstore.list(self.store, prefix + "/"):
            self.obstore.delete(self.store, [o["path"] for o in chunk])


def warm_up(rank: int, world: int, args: argparse.Namespace) -> None:
    """Every method saves and loads a tiny state once, untimed: the clients' first-use costs
    (obstore's runtime and connection pool, s3fs's session, modules imported on first use:
    ~4 MiB of RSS, measured) are not charged to whichever method the first round runs first."""
    params = build_params(0, rank, world)  # the smallest state (h = 64: ~1 MiB)
    methods = Methods(params, [torch.zeros_like(p.tensor) for p in params], rank, world, args.bucket)
    for m in METHODS:
        prefix = f"{args.run_id}/w{world}-warm-up-{m}"
        getattr(methods, f"{m}_save")(prefix)
        getattr(methods, f"{m}_load")(prefix)
        dist.barrier()
        if rank == 0:
            methods.delete(prefix)


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    """One rank: every size, every round, every method; rank 0 writes the raw results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **args.s3_env)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        warm_up(rank, world, args)
        results = []
        for size_mib in args.size_list:
            params = build_params(size_mib / 1024, rank, world)
            dest = [torch.zeros_like(p.tensor) for p in params]
            methods = Methods(params, dest, rank, world, args.bucket)
            rounds = []
            for rnd in range(args.rounds):
                order = METHODS[rnd % len(METHODS):] + METHODS[:rnd % len(METHODS)]
                res = {}
                for m in order:
                    prefix = f"{args.run_id}/w{world}-{size_mib}mib-r{rnd}-{m}"
                    for t in dest:
                        t.zero_()
                    save_s, save_mem = timed_collective(lambda: getattr(methods, f"{m}_save")(prefix))
                    load_s, load_mem = timed_collective(lambda: getattr(methods, f"{m}_load")(prefix))
                    ok = all(gather_floats(float(methods.verify(m)))) if rnd == 0 else None
                    dist.barrier()
                    if rank == 0:
                        methods.delete(prefix)
                    res[m] = {"save_s": save_s, "load_s": load_s, "verified": ok,
                              "save_extra_mib": gather_floats(save_mem), "load_extra_mib": gather_floats(load_mem)}
                rounds.append({"order": list(order), **res})
                if rank == 0:
                    line = "  ".join(f"{m} {res[m]['save_s']:.2f}/{res[m]['load_s']:.2f}" for m in METHODS)
                    print(f"[world {world}, {size_mib} MiB] round {rnd + 1}/{args.rounds} save/load s: {line}",
                          flush=True)
            results.append({"size_mib": size_mib, "local_bytes_per_rank": gather_floats(float(methods.raw_buf.numel())),
                            "rounds": rounds})
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"world_size": world, "sizes": results}, f)
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> Dict[str, object]:
    """Spawn ``world`` ranks against the server and return their raw results."""
    return spawn_ranks(worker, world, args)


def summarize(raw: Dict[str, object]) -> Dict[str, object]:
    """Medians, throughputs, memory peaks, ratios and targets per size."""
    world, per_size, met = raw["world_size"], [], {}
    for entry in raw["sizes"]:
        rounds, total = entry["rounds"], sum(entry["local_bytes_per_rank"])
        methods = {}
        for m in METHODS:
            med = {op: statistics.median(r[m][f"{op}_s"] for r in rounds) for op in ("save", "load")}
            methods[m] = {
                **{f"{op}_s": [r[m][f"{op}_s"] for r in rounds] for op in ("save", "load")},
                **{f"{op}_median_s": med[op] for op in ("save", "load")},
                **{f"{op}_GBps": total / 1e9 / med[op] for op in ("save", "load")},
                **{f"{op}_peak_extra_mib_per_rank": [max(r[m][f"{op}_extra_mib"][k] for r in rounds)
                                                     for k in range(world)] for op in ("save", "load")},
                "verified": rounds[0][m]["verified"],
            }
        ratios = {f"{a}_{op} / {b}_{op}": methods[a][f"{op}_median_s"] / methods[b][f"{op}_median_s"]
                  for op in ("save", "load") for a, b in (("dcp", "ours"), ("ours", "raw"), ("dcp", "raw"))}
        size = entry["size_mib"]
        for op in ("save", "load"):
            met[f"{size} MiB dcp/ours {op} >= 2"] = ratios[f"dcp_{op} / ours_{op}"] >= TARGETS["dcp / ours >="]
            met[f"{size} MiB ours/raw {op} <= 1.3"] = ratios[f"ours_{op} / raw_{op}"] <= TARGETS["ours / raw <="]
        per_size.append({"size_mib": size, "state_bytes_total": total,
                         "local_bytes_per_rank": entry["local_bytes_per_rank"], "rounds": rounds,
                         "methods": methods, "ratios": ratios})
    return {"world_size": world, "sizes": per_size, "targets_met": met}


def format_table(s: Dict[str, object]) -> str:
    """A plain-text table of one world size's summary."""
    lines = []
    for entry in s["sizes"]:
        lines += [f"world size {s['world_size']}, {entry['size_mib']} MiB in all "
                  f"({entry['state_bytes_total'] / s['world_size'] / MiB:.0f} MiB per rank), "
                  f"{len(entry['rounds'])} rounds, medians; GB = 1e9 bytes",
                  f"{'method':<8}{'save s':>8}{'save GB/s':>11}{'load s':>8}{'load GB/s':>11}"
                  f"{'save +MiB':>11}{'load +MiB':>11}  verified"]
        for m in METHODS:
            r = entry["methods"][m]
            mem = ["/".join(f"{x:.0f}" for x in r[f"{op}_peak_extra_mib_per_rank"]) for op in ("save", "load")]
            lines.append(f"{m:<8}{r['save_median_s']:>8.2f}{r['save_GBps']:>11.3f}{r['load_median_s']:>8.2f}"
                         f"{r['load_GBps']:>11.3f}{mem[0]:>11}{mem[1]:>11}  {r['verified']}")
        lines.append("ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in entry["ratios"].items()))
    lines.extend(closing_lines(s))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,1024", help="comma-separated state sizes (all ranks), MiB")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians over them)")
    ap.add_argument("--world-sizes", default="1,2", help="comma-separated world sizes")
    add_scratch_and_output_flags(ap, REPO_ROOT.parent / "bench_tmp", RESULTS_PATH)
    return ap.parse_args()


def main() -> None:
    """Start the server, run every world size, print the tables and write the JSON."""
    args = parse_args()
    args.size_list = [int(x) for x in args.sizes.split(",") if x.strip()]
    args.run_id = uuid.uuid4().hex[:8]
    with SeaweedFS() as server:  # its data in a temporary dir (on the disk here; not tmpfs)
        args.s3_env, args.bucket = server.env(), server.bucket
        run_world_sizes("bench_object_store", args, run_world, summarize, format_table,
                        {"sizes_mib": args.size_list, "rounds": args.rounds, "server": "SeaweedFS (weed server -s3)"})


if __name__ == "__main__":
    main()
