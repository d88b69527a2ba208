"""Simulated ranks of an 8,192-rank GPT job: what one ordinary rank and rank 0 cost in a save.

The job (:class:`GPTConfig`): TP8 x PP16 x DP64 (Megatron-Core rank order: TP fastest, then
DP, then PP), 96 layers of GPT-3 175B shapes (6 per pipeline stage), bf16 parameters with
Adam state in fp32, Megatron-Core's keys and shardings: column-parallel weights and biases
split along axis 0, row-parallel weights along axis 1, layernorms and the remaining biases
replicated across TP (``replica_id (0, tp, dp)``), the word embeddings (and the learned
position embeddings) on the first stage, the final layernorm and the output layer on the
last, every model item DP-replicated (``replica_id (0, 0|tp, dp)``), and the RNG state as a
``(pp, tp)`` grid of ShardedObject pieces (``replica_id dp``). Two variants:

* ``non-flat``: the optimizer state as whole TP chunks under ``optimizer.state.{fp32_param,
  exp_avg,exp_avg_sq}.<param key>`` (DP-replicated like the parameters);
* ``distopt``: the distributed optimizer: ``optimizer.state.{param,exp_avg,exp_avg_sq}.<param
  key>`` as ``flattened_range`` slices of the TP chunks, split over the DP ranks as Megatron-
  Core's grad buffer splits them (parameters in reverse order in buckets of at least
  ``max(40M, 1M x dp)`` elements, each bucket cut into ``dp`` equal ranges; ``dp_split="even"``
  cuts every parameter over all DP ranks instead), ``replica_id (0, 0|tp, 0)``.

Layer parameters have one key per layer (``decoder.layers.<layer>.<name>``, Megatron-Core's
``non_homogeneous_layers`` layout, ~288 items and keys per rank); ``--stacked`` adds runs of
Megatron-Core's default homogeneous layout (``decoder.layers.<name>``, the layer axis
prepended: every layer key is held by every rank). The job model is ``_gpt_job.py``.

The simulated rank runs the library's own code unchanged — ``validate_sharding_integrity``
and ``TorchDistSaveShardedStrategy._plan_files`` / ``_publish`` — with ``torch.distributed``
replaced, inside ``dist_checkpointing.runtime.collectives`` only, by :class:`SimulatedNetwork`, which
delivers what the other ranks send, computed with the library's own code on their own state:
each holder's ``_summaries`` of the keys the simulated rank judges (``_judge_of``), pickled as
``exchange_objects`` pickles them, and each writer's item locations (``collect_save_items``,
``assign_files``; the file writes are faked: lengths = bytes + a fixed blob header, checksums
a hash of file and offset), as columns (``encode_locations``) pickled as ``gather_object`` pickles them. Only the keys the rank
judges are built on their holders, so the simulation never builds the 2.4M items of the job.
The success path is simulated (every ``all_reduce`` returns this rank's own flags: every rank
agrees). Each measurement runs in a fresh child process (RSS high-water mark reset through
``/proc/self/clear_refs``). Measured: the simulated rank 4321 and the rank that judges the
most bytes (CPU seconds: medians of 5; RSS and ``tracemalloc`` peaks; bytes delivered to it);
rank 0's ``_publish`` (CPU and wall seconds, RSS peak); and ``read_metadata`` of the ``.metadata`` it wrote
(what every rank does first in a ``load`` without the per-key index), and with the index one
ordinary rank's load metadata cost (:func:`measure_index_load`). Rank 0's 3 s target is judged on CPU seconds
(this machine is shared: wall time counts other processes' load).

    python benchmarks/_scale_sim.py                 # both variants, rank 4321 and the worst judge
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import hashlib
import io
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._gpt_job import (  # noqa: E402
    GPTConfig, coords, judge_loads, rank_items, stage_names, stage_ranks,
)
from dist_checkpointing import collectives, validation  # noqa: E402
from dist_checkpointing.exchange import distribution, plan, tensors  # noqa: E402
from dist_checkpointing.core import CheckpointingException  # noqa: E402
from dist_checkpointing.storage import storage_for  # noqa: E402
from dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy  # noqa: E402
from dist_checkpointing.strategies.torch_dist.location_table import encode_locations, in_file_order  # noqa: E402
from dist_checkpointing.strategies.torch_dist.save_plan import assign_files, collect_save_items  # noqa: E402
from dist_checkpointing.validation import (  # noqa: E402
    _aggregator_of, _judge_of, _summaries, _to_aggregators, _to_judges, validate_sharding_integrity,
)

RESULTS_PATH = REPO_ROOT / "benchmarks" / "results" / "bench_scale_sim.json"
VARIANTS = ("non-flat", "distopt")
TARGETS = {"rank_cpu_s": 0.5, "rank_extra_mib": 100.0, "rank_received_bytes": 1_000_000,
           "rank0_s": 3.0, "rank0_mib": 512.0}
THREADS = 2  # writer threads (files) per rank: TorchDistSaveShardedStrategy's default


def config_for(variant: str, **overrides: Any) -> GPTConfig:
    """The 8,192-rank job of ``variant`` (``non-flat`` or ``distopt``), with ``overrides``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {variant!r}")
    return GPTConfig(distributed_optimizer=variant == "distopt", **overrides)


# ----------------------------------------------------------------------------- what the other ranks send


def _block(cfg: GPTConfig) -> int:
    """Ranks per aggregation block of ``validate_sharding_integrity`` (``_aggregator_of``)."""
    return math.isqrt(cfg.world - 1) + 1


def _sent_to(cfg: GPTConfig, sender: int, names: Set[str], dst: int) -> Optional[Dict[str, Any]]:
    """The summaries of ``names`` that ``sender`` sends ``dst`` in the first exchange."""
    return _to_aggregators(_summaries(rank_items(cfg, sender, only=names)), sender, cfg.world)[dst]


def validation_inbox(cfg: GPTConfig, rank: int) -> List[List[bytes]]:
    """What each rank sends ``rank`` in ``validate_sharding_integrity``'s two exchanges (as
    ``exchange_objects`` pickles it; ``b""`` for nothing): the summaries ``rank`` combines
    for the blocks it aggregates, then, from their aggregators, the combinations of the keys
    ``rank`` judges — each built with the library's own code from the holders' own items."""
    world, block = cfg.world, _block(cfg)
    first, second = [b""] * world, [b""] * world
    judged: Dict[int, Dict[int, Set[str]]] = {}  # aggregator -> sender -> names ``rank`` judges
    for pp in range(cfg.pp):
        ranks = stage_ranks(cfg, pp)
        blocks = sorted({r // block for r in ranks})
        aggregated: Dict[int, Set[str]] = {}  # sender -> names whose aggregator for its block is ``rank``
        for name, _ in stage_names(cfg, pp):
            mine = _judge_of(name, world) == rank
            for b in blocks:
                aggregator = _aggregator_of(name, b * block, world)
                senders = [s for s in ranks if s // block == b]
                if aggregator == rank:
                    for s in senders:
                        aggregated.setdefault(s, set()).add(name)
                if mine:
                    for s in senders:
                        judged.setdefault(aggregator, {}).setdefault(s, set()).add(name)
        for sender, names in aggregated.items():
            out = _sent_to(cfg, sender, names, rank)
            if out:
                first[sender] = pickle.dumps(out)
    for aggregator, senders in judged.items():
        received: List[Optional[Dict[str, Any]]] = [None] * world
        for sender, names in senders.items():  # as the aggregator unpickles it
            received[sender] = pickle.loads(pickle.dumps(_sent_to(cfg, sender, names, aggregator)))
        out = _to_judges(received, world)[rank]
        if out:
            second[aggregator] = pickle.dumps(out)
    return [first, second]


@functools.lru_cache(maxsize=None)
def _blob_header() -> int:
    """Bytes that ``torch.save`` adds around a tensor's data (a small tensor measured once)."""
    buf = io.BytesIO()
    torch.save(torch.zeros(16, dtype=torch.float32), buf)
    return len(buf.getvalue()) - 64


def fake_locations(files: Dict[str, List[Any]]) -> List[Tuple]:
    """The item locations ``_write_files`` would return for ``files`` (``assign_files``'
    output), without writing: tensors take their bytes + a ``torch.save`` header, objects their
    payload; checksums are a 64-bit hash of file and offset."""
    locations = []
    for fname, bucket in files.items():
        offset = 0
        for it in bucket:
            length = it.nbytes + (_blob_header() if it.tensor_meta is not None else 0)
            cs = int.from_bytes(hashlib.blake2b(f"{fname}:{offset}".encode(), digest_size=8).digest(), "little")
            locations.append((it.key, it.tensor_meta, fname, offset, length, cs))
            offset += length
    return locations


def sender_locations(cfg: GPTConfig, rank: int) -> List[Tuple]:
    """The item locations ``rank`` sends to rank 0 after writing (its main replicas)."""
    items = collect_save_items(rank_items(cfg, rank, main_only=True))
    return fake_locations(assign_files(items, rank, THREADS, None))


def sender_payload(cfg: GPTConfig, rank: int) -> bytes:
    """What ``rank`` sends rank 0 after writing, pickled as ``gather_object`` pickles it: its
    item locations as columns (``encode_locations``, in file order as ``_publish`` sends them)."""
    return pickle.dumps(encode_locations(in_file_order(sender_locations(cfg, rank))))


def _locations_chunk(args: Tuple[GPTConfig, int, int]) -> List[bytes]:
    cfg, start, stop = args
    return [sender_payload(cfg, r) for r in range(start, stop)]


def gathered_payloads(cfg: GPTConfig, workers: int = 2) -> List[bytes]:
    """What every rank sends rank 0 after writing (:func:`sender_payload`; rank 0's slot empty)."""
    import multiprocessing as mp

    step = -(-cfg.world // (8 * workers))
    chunks = [(cfg, max(1, s), min(cfg.world, s + step)) for s in range(0, cfg.world, step)]
    with mp.get_context("fork").Pool(workers) as pool:
        parts = pool.map(_locations_chunk, chunks)
    return [b""] + [p for part in parts for p in part]


# ----------------------------------------------------------------------------- the simulated network


class _Done:
    def wait(self) -> bool:
        return True


class SimulatedNetwork:
    """``torch.distributed`` as one rank of a simulated world sees it, for the collectives of
    ``dist_checkpointing.runtime.collectives`` on the success path: ``all_to_all_single`` delivers
    ``inboxes`` (one per ``exchange_objects``: rank r's payload for this rank), ``gather`` / ``irecv`` on rank 0 deliver
    ``gathered``, ``all_reduce`` returns this rank's flags (every rank agrees), the first
    rank's broadcast is ``None``. Counts calls and the bytes delivered to this rank as
    ``tests/collective_counter.py`` does."""

    ReduceOp = dist.ReduceOp

    def __init__(self, rank: int, world: int, inboxes: Optional[Sequence[Sequence[bytes]]] = None,
                 gathered: Optional[Sequence[bytes]] = None, reductions: Optional[Sequence[Sequence[int]]] = None):
        self.rank, self.world, self.inboxes, self.gathered = rank, world, list(inboxes or []), gathered
        self.reductions = list(reductions or [])  # results of the next all_reduce/reduce calls, when given
        self.received, self.calls, self.self_payload_ok = 0, {}, None

    def _count(self, name: str, nbytes: int) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.received += nbytes

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group: Any = None) -> int:
        return self.rank

    def get_world_size(self, group: Any = None) -> int:
        return self.world

    def get_backend(self, group: Any = None) -> str:
        return "gloo"

    def all_reduce(self, t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        if self.reductions:
            t.copy_(torch.tensor(self.reductions.pop(0), dtype=t.dtype))
        self._count("all_reduce", t.numel() * t.element_size())

    def reduce(self, t: torch.Tensor, dst: int = 0, op: Any = None, group: Any = None) -> None:
        if self.rank == dst and self.reductions:
            t.copy_(torch.tensor(self.reductions.pop(0), dtype=t.dtype))
        self._count("reduce", t.numel() * t.element_size() if self.rank == dst else 0)

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, group: Any = None) -> None:
        inbox = self.inboxes[0]
        if output_split_sizes is None:  # the byte counts
            out.copy_(torch.tensor([len(p) for p in inbox], dtype=out.dtype))
        else:
            start = sum(input_split_sizes[:self.rank])  # this rank's payload to itself, as the real code made it
            own = inp[start:start + input_split_sizes[self.rank]].numpy().tobytes()
            self.self_payload_ok = (self.self_payload_ok is not False) and own == inbox[self.rank]
            if out.numel():
                out.copy_(torch.frombuffer(bytearray(b"".join(inbox)), dtype=torch.uint8))
            self.inboxes.pop(0)  # the next exchange's
        self._count("all_to_all_single", out.numel() * out.element_size())

    def gather(self, t: torch.Tensor, gather_list: Optional[List[torch.Tensor]] = None, dst: int = 0,
               group: Any = None) -> None:
        for r, slot in enumerate(gather_list or []):
            slot.copy_(t if r == self.rank else torch.tensor([len(self.gathered[r])], dtype=t.dtype))
        self._count("gather", sum(x.numel() * x.element_size() for x in gather_list or []))

    def send(self, t: torch.Tensor, dst: int, group: Any = None) -> None:
        self._count("send", 0)

    def irecv(self, buf: torch.Tensor, src: int, group: Any = None) -> _Done:
        buf.copy_(torch.frombuffer(bytearray(self.gathered[src]), dtype=torch.uint8))
        self._count("irecv", buf.numel())
        return _Done()

    def broadcast_object_list(self, box: List[Any], src: int = 0, group: Any = None) -> None:
        if self.rank != src:
            box[0] = None
        self._count("broadcast_object_list", len(pickle.dumps(box[0])))

    def __getattr__(self, name: str) -> Any:
        raise CheckpointingException(f"the simulated network has no {name!r} (only the success path is simulated)")


@contextlib.contextmanager
def simulated(net: SimulatedNetwork) -> Iterator[SimulatedNetwork]:
    """Route ``dist_checkpointing.runtime.collectives`` (and ``exchange``) through ``net`` within the block."""
    real = collectives.dist
    collectives.dist = distribution.dist = plan.dist = tensors.dist = net
    try:
        yield net
    finally:
        collectives.dist = distribution.dist = plan.dist = tensors.dist = real


# ----------------------------------------------------------------------------- measurements (child processes)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


@contextlib.contextmanager
def _rss_peak() -> Iterator[Dict[str, float]]:
    """The RSS high-water mark above the RSS at entry (MiB), in ``out['extra_rss_mib']``."""
    out: Dict[str, float] = {}
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    yield out
    out["extra_rss_mib"] = (_status_kib("VmHWM") - before) / 1024


def measure_rank(cfg: GPTConfig, rank: int, repeats: int = 5) -> Dict[str, Any]:
    """One ordinary rank (not rank 0): sharding validation and save planning + publishing,
    with every other rank's messages simulated. CPU seconds are medians over ``repeats``."""
    assert rank != 0, "rank 0 is measured by measure_rank0"
    t0 = time.perf_counter()
    inbox = validation_inbox(cfg, rank)
    state = rank_items(cfg, rank)
    build_s = time.perf_counter() - t0
    strategy = TorchDistSaveShardedStrategy(thread_count=THREADS)
    ckpt = Path(tempfile.gettempdir())  # never written by a rank other than 0

    def run() -> Tuple[float, float, SimulatedNetwork, int]:
        net = SimulatedNetwork(rank, cfg.world, inbox)
        validation._LAST_VALID.clear()  # a first save's validation (a repeated one skips the exchanges)
        with simulated(net):
            c0 = time.process_time()
            validate_sharding_integrity(state)
            c1 = time.process_time()
            locations = fake_locations(strategy._plan_files(state))
            strategy._publish(locations, None, storage_for(ckpt))
            c2 = time.process_time()
        return c1 - c0, c2 - c1, net, len(locations)

    with _rss_peak() as rss:
        run()
    times = [run() for _ in range(repeats)]
    tracemalloc.start()
    _, _, net, n_locations = run()
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    validation_s = statistics.median(t[0] for t in times)
    save_s = statistics.median(t[1] for t in times)
    judged = [n for pp in range(cfg.pp) for n, _ in stage_names(cfg, pp) if _judge_of(n, cfg.world) == rank]
    return {
        "rank": rank, "coords_tp_dp_pp": coords(cfg, rank), "items": len(state),
        "keys": len(_summaries(state)), "judged_keys": len(set(judged)),
        "senders_with_summaries": sum(bool(p) for p in inbox[0]),
        "validation_cpu_s": validation_s, "save_plan_publish_cpu_s": save_s, "cpu_s": validation_s + save_s,
        "received_bytes": net.received, "validation_payload_bytes": sum(len(p) for box in inbox for p in box),
        "extra_rss_mib": rss["extra_rss_mib"], "tracemalloc_peak_mib": traced_peak / 2 ** 20,
        "locations_sent": n_locations, "calls": net.calls, "own_payload_matches": net.self_payload_ok,
        "inputs_build_s": build_s,
    }


def measure_rank0(cfg: GPTConfig, payload_file: str, ckpt_dir: str) -> Dict[str, Any]:
    """Rank 0's ``_publish``: gather every rank's item locations (read from ``payload_file``,
    as :func:`gathered_payloads` made them), build the global metadata and write ``.metadata``
    into ``ckpt_dir`` (the library pauses the cyclic garbage collector for this itself)."""
    with open(payload_file, "rb") as f:
        gathered = pickle.load(f)
    own = sender_locations(cfg, 0)
    strategy = TorchDistSaveShardedStrategy(thread_count=THREADS)
    net = SimulatedNetwork(0, cfg.world, gathered=gathered)
    with _rss_peak() as rss, simulated(net):
        c0, w0 = time.process_time(), time.perf_counter()
        strategy._publish(own, None, storage_for(ckpt_dir))
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    counts = [len(pickle.loads(p)[1]) for p in gathered[1:]]
    return {"cpu_s": cpu, "wall_s": wall, "extra_rss_mib": rss["extra_rss_mib"], "received_bytes": net.received,
            "writers": sum(n > 0 for n in counts) + bool(own), "locations": len(own) + sum(counts),
            "metadata_bytes": os.path.getsize(Path(ckpt_dir) / ".metadata")}


def measure_read_metadata(ckpt_dir: str) -> Dict[str, Any]:
    """What every rank does first in a ``load``: ``read_metadata`` (checksum, safe unpickling,
    checks) of the ``.metadata`` that rank 0 wrote."""
    from dist_checkpointing.strategies.torch import read_metadata

    with _rss_peak() as rss:
        c0, w0 = time.process_time(), time.perf_counter()
        read_metadata(ckpt_dir)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {"cpu_s": cpu, "wall_s": wall, "extra_rss_mib": rss["extra_rss_mib"]}


def index_answers(cfg: GPTConfig, ckpt_dir: str, rank: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``rank``'s requests to the readers of the index in ``ckpt_dir`` and their answers (the
    records of its keys cut to its regions), as :func:`~...index_view.indexed_view` gets them."""
    from dist_checkpointing.strategies.torch_dist import key_index
    from dist_checkpointing.strategies.torch_dist.format import INDEX_FNAME
    from dist_checkpointing.strategies.torch_dist.load import requested_regions

    requests = requested_regions(rank_items(cfg, rank))
    reader = storage_for(ckpt_dir).open_reader(INDEX_FNAME)
    try:
        header = key_index.read_header(reader, "index")
        everything = key_index.read_buckets(reader, header, range(header.n_buckets), "index")
    finally:
        reader.close()
    return requests, {k: key_index.select_chunks(everything[k], boxes) for k, boxes in requests.items()
                      if k in everything}


def measure_index_load(cfg: GPTConfig, ckpt_dir: str, rank: int) -> Dict[str, Any]:
    """An ordinary rank's metadata cost at load with the per-key index that rank 0 wrote:
    its share as a reader (the buckets :func:`~...key_index.reader_buckets` gives it, every
    key's record cut for one requester), and its own view: the answers for the keys it
    requests (cut by the readers, as :func:`~...index_view.indexed_view` does; computed
    outside the measurement, it is the other ranks' work) turned into the partial
    ``Metadata`` and checked. Bytes read: the header, the ``.metadata`` sidecar, its table
    slice and buckets (counted on the storage reader)."""
    from dist_checkpointing.integrity.checksums import recorded_checksum
    from dist_checkpointing.strategies.torch_dist.metadata_checks import check_dcp_metadata
    from dist_checkpointing.strategies.torch_dist import key_index
    from dist_checkpointing.strategies.torch_dist.format import INDEX_FNAME

    storage = storage_for(ckpt_dir)
    requests, answers = index_answers(cfg, ckpt_dir, rank)
    reader = storage.open_reader(INDEX_FNAME)
    counted = {"bytes": 0}
    inner = reader.read

    def read(offset: int, n: int) -> bytes:
        data = inner(offset, n)
        counted["bytes"] += len(data)
        return data

    reader.read = read
    with _rss_peak() as rss:
        c0 = time.process_time()
        header = key_index.read_header(reader, "index")
        recorded_checksum(storage, ".metadata")
        mine = key_index.read_buckets(reader, header, key_index.reader_buckets(rank, cfg.world, header.n_buckets), "index")
        served = [key_index.select_chunks(rec, None) for rec in mine.values()]
        c1 = time.process_time()
        view = key_index.partial_metadata(answers, header, "index")
        check_dcp_metadata(view, "index")
        cpu = time.process_time() - c0
    sidecar = os.path.getsize(Path(ckpt_dir) / ".metadata.checksum")
    index_bytes = os.path.getsize(Path(ckpt_dir) / INDEX_FNAME)
    received = len(pickle.dumps(answers))
    del served
    return {"rank": rank, "cpu_s": cpu, "reader_cpu_s": c1 - c0, "extra_rss_mib": rss["extra_rss_mib"],
            "bytes_read": counted["bytes"] + sidecar, "requested_keys": len(requests),
            "chunks_received": sum(len(r[4]) for r in answers.values() if r[0] == "t"),
            "answers_pickled_bytes": received, "index_bytes": index_bytes,
            "all_ranks_bytes_read": index_bytes + cfg.world * (key_index.HEADER_BYTES + sidecar)}


def profile_rank0(cfg: GPTConfig, payload_file: str, ckpt_dir: str, top: int = 14) -> str:
    """cProfile of :func:`measure_rank0` (the heaviest functions, cumulative time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    measure_rank0(cfg, payload_file, ckpt_dir)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def _child(kind: str, cfg: GPTConfig, *args: Any) -> Any:
    """Run one measurement in a fresh interpreter; return its JSON result."""
    spec = json.dumps({"kind": kind, "cfg": asdict(cfg), "args": list(args)})
    proc = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {kind} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_child(spec: str) -> None:
    job = json.loads(spec)
    cfg = GPTConfig(**job["cfg"])
    if job["kind"] == "read_metadata":
        print(json.dumps(measure_read_metadata(*job["args"])))
        return
    if job["kind"] == "index_load":
        print(json.dumps(measure_index_load(cfg, *job["args"])))
        return
    fn = {"rank": measure_rank, "rank0": measure_rank0, "profile0": profile_rank0}[job["kind"]]
    print(json.dumps(fn(cfg, *job["args"])))


# ----------------------------------------------------------------------------- the benchmark


def simulate(variant: str, rank: int = 4321, profile: bool = False, **overrides: Any) -> Dict[str, Any]:
    """Measure one variant (``non-flat`` or ``distopt``; ``overrides`` change the job, e.g.
    ``stacked_layers=True``): ``rank``, the worst judge of the job (most estimated bytes to
    receive, :func:`judge_loads`), rank 0's metadata assembly (as is, and with the garbage
    collector paused), and one rank's ``read_metadata`` at load. Returns a JSON-able dict."""
    cfg = config_for(variant, **overrides)
    loads = judge_loads(cfg)
    worst = max((r for r in loads if r != 0), key=lambda r: loads[r][1])
    items = {f"stage {pp}": len(rank_items(cfg, stage_ranks(cfg, pp)[0])) for pp in (0, 1, cfg.pp - 1)}
    result: Dict[str, Any] = {"variant": variant + (" stacked" if cfg.stacked_layers else ""), "config": asdict(cfg),
                              "world": cfg.world, "items_per_rank_dp0_tp0": items, "loadavg_before": os.getloadavg()}
    result["ordinary_rank"] = _child("rank", cfg, rank)
    result["worst_judge"] = _child("rank", cfg, worst) if worst != rank else dict(result["ordinary_rank"])
    result["worst_judge"]["estimated_bytes"] = loads[worst][1]
    t0 = time.perf_counter()
    payloads = gathered_payloads(cfg)
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        pickle.dump(payloads, f, protocol=pickle.HIGHEST_PROTOCOL)
    build_s = time.perf_counter() - t0
    del payloads
    try:
        with tempfile.TemporaryDirectory() as ckpt:
            r0 = result["rank0"] = _child("rank0", cfg, f.name, ckpt)
            r0["inputs_build_s"] = build_s
            result["read_metadata"] = _child("read_metadata", cfg, ckpt)
            result["index_load"] = _child("index_load", cfg, ckpt, rank)
            if profile or r0["cpu_s"] > TARGETS["rank0_s"] or r0["extra_rss_mib"] > TARGETS["rank0_mib"]:
                result["rank0_profile"] = _child("profile0", cfg, f.name, ckpt)
    finally:
        os.unlink(f.name)
    ranks = [result["ordinary_rank"], result["worst_judge"]]
    result["targets_met"] = {
        "rank CPU <= 0.5 s": all(r["cpu_s"] <= TARGETS["rank_cpu_s"] for r in ranks),
        "rank extra memory <= 100 MiB": all(max(r["extra_rss_mib"], r["tracemalloc_peak_mib"])
                                            <= TARGETS["rank_extra_mib"] for r in ranks),
        "rank received <= 1 MB": all(r["received_bytes"] <= TARGETS["rank_received_bytes"] for r in ranks),
        "rank 0 assembly <= 3 s CPU": r0["cpu_s"] <= TARGETS["rank0_s"],
        "rank 0 assembly <= 0.5 GiB": r0["extra_rss_mib"] <= TARGETS["rank0_mib"],
        "load: rank metadata CPU <= 0.3 s": result["index_load"]["cpu_s"] <= 0.3,
        "load: rank extra memory <= 64 MiB": result["index_load"]["extra_rss_mib"] <= 64,
        "load: rank metadata bytes read <= 4 MB": result["index_load"]["bytes_read"] <= 4e6,
        "load: all ranks' bytes read <= 2x index": result["index_load"]["all_ranks_bytes_read"]
        <= 2 * result["index_load"]["index_bytes"],
    }
    result["loadavg_after"] = os.getloadavg()
    return result


def print_table(res: Dict[str, Any]) -> None:
    """One variant's figures as a table."""
    print(f"\n{res['variant']}: world {res['world']}, items per rank (tp 0, dp 0) {res['items_per_rank_dp0_tp0']}")
    print(f"  {'rank':<20}{'items':>6}{'keys':>6}{'judged':>7}{'CPU s (valid.+save)':>22}{'recv kB':>9}"
          f"{'RSS+ MiB':>9}{'traced MiB':>11}")
    for label in ("ordinary_rank", "worst_judge"):
        r = res[label]
        print(f"  {label.replace('_', ' ') + ' ' + str(r['rank']):<20}{r['items']:>6}{r['keys']:>6}"
              f"{r['judged_keys']:>7}{r['cpu_s']:>9.3f} ({r['validation_cpu_s']:.3f}+{r['save_plan_publish_cpu_s']:.3f})"
              f"{r['received_bytes'] / 1e3:>9.1f}{r['extra_rss_mib']:>9.1f}{r['tracemalloc_peak_mib']:>11.1f}")
    r0 = res["rank0"]
    print(f"  rank 0 metadata: {r0['locations']} locations from {r0['writers']} writers, received "
          f"{r0['received_bytes'] / 1e6:.1f} MB, .metadata {r0['metadata_bytes'] / 1e6:.1f} MB: "
          f"{r0['wall_s']:.2f} s wall ({r0['cpu_s']:.2f} s CPU), RSS +{r0['extra_rss_mib']:.0f} MiB "
          f"(inputs built in {r0['inputs_build_s']:.0f} s)")
    rm = res["read_metadata"]
    print(f"  every rank at load, read_metadata: {rm['wall_s']:.2f} s wall ({rm['cpu_s']:.2f} s CPU), "
          f"RSS +{rm['extra_rss_mib']:.0f} MiB")
    il = res["index_load"]
    print(f"  rank {il['rank']} at load with the index ({il['index_bytes'] / 1e6:.1f} MB): {il['cpu_s']:.3f} s CPU "
          f"(reader share {il['reader_cpu_s']:.3f}), RSS +{il['extra_rss_mib']:.1f} MiB, read {il['bytes_read'] / 1e3:.1f} kB, "
          f"{il['requested_keys']} keys / {il['chunks_received']} chunks received ({il['answers_pickled_bytes'] / 1e3:.0f} kB); "
          f"all ranks read {il['all_ranks_bytes_read'] / 1e6:.1f} MB")
    print("  targets: " + ", ".join(f"{k}: {'MET' if ok else 'NOT met'}" for k, ok in res["targets_met"].items()))
    print(f"  load average (1 min) before/after: {res['loadavg_before'][0]:.1f} / {res['loadavg_after'][0]:.1f}")
    if "rank0_profile" in res:
        print("\n".join("    " + line for line in res["rank0_profile"].splitlines() if line.strip()))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _run_child(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rank", type=int, default=4321, help="the ordinary rank to simulate (default 4321)")
    ap.add_argument("--dp-split", default="buckets", choices=("buckets", "even"))
    ap.add_argument("--stacked", action="store_true",
                    help="also Megatron-Core's homogeneous layout (layer parameters stacked into one key each)")
    ap.add_argument("--profile", action="store_true", help="profile rank 0 even when its targets are met")
    ap.add_argument("--output", default=str(RESULTS_PATH))
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = []
    for stacked in (False, True) if args.stacked else (False,):
        for variant in args.variants.split(","):
            res = simulate(variant, args.rank, args.profile, dp_split=args.dp_split, stacked_layers=stacked)
            print_table(res)
            results.append(res)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results, "total_s": time.perf_counter() - t0}, indent=1, default=str))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; JSON results: {out}")


if __name__ == "__main__":
    main()
