"""End-to-end demo: save a GPT-like model state at one parallel layout, reload it at others.

The model state is a *sharded state dict* as a Megatron-style trainer builds it:

* ``embedding.word_embeddings.weight`` and ``output_layer.weight`` split along the vocab
  axis by tensor parallelism (TP);
* per-layer weights stacked along a new leading layer axis (``prepend_axis_num=1``, one
  ShardedTensor per layer): ``linear_qkv`` / ``linear_fc1`` split on the output axis,
  ``linear_proj`` / ``linear_fc2`` split on the input axis;
* layernorm weights replicated on every rank (``replica_id`` = rank, so exactly one main
  replica); TP-split tensors replicated across data parallelism (``replica_id`` = DP rank);
* an RNG ``ShardedObject`` with one piece per rank;
* common state: the iteration number and an args dict.

Every value is a deterministic function of its global index, so whatever layout a rank
loads with, it knows what it must get. The demo saves at TP=2 x DP=N/2 (TP=1 if N is
odd), reloads at TP=N x DP=1 and at TP=1 x DP=N, verifies every value, the RNG pieces,
the common state and the content metadata, and prints a timing table on rank 0.

Usage::

    python examples/gpt_demo.py [--nproc 4]             # spawns local gloo ranks
    torchrun --nproc-per-node 4 examples/gpt_demo.py    # uses torchrun's ranks

Under torchrun (possibly across nodes) pass ``--dir`` on a file system every rank sees.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dist_checkpointing
from dist_checkpointing import ShardedObject, ShardedTensor, serialization

ITERATION = 1000
BASE_SEED = 1234
DTYPE = torch.float32
PG_TIMEOUT = datetime.timedelta(minutes=5)

StateDict = Dict[str, Any]


class DemoVerificationError(Exception):
    """Loaded state differs from what was saved (the message lists every difference)."""


class DemoConfigError(ValueError):
    """The model sizes do not fit the parallel layouts of the demo."""


# ----------------------------------------------------------------------------- model and layout


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the GPT-like model."""

    hidden: int
    layers: int
    vocab: int

    @property
    def ffn(self) -> int:
        """MLP inner size (4 x hidden, as in GPT)."""
        return 4 * self.hidden

    def as_dict(self) -> Dict[str, int]:
        """The sizes as a plain dict (stored in the common state)."""
        return {"hidden": self.hidden, "layers": self.layers, "vocab": self.vocab, "ffn": self.ffn}


@dataclass(frozen=True)
class Layout:
    """A (TP, DP) layout of the world and this rank's place in it (TP varies fastest)."""

    tp: int
    dp: int
    rank: int

    @classmethod
    def of_world(cls, tp: int, world_size: int, rank: int) -> "Layout":
        """TP=``tp`` and DP=``world_size / tp`` for ``rank``."""
        if world_size % tp:
            raise ValueError(f"TP={tp} does not divide the world size {world_size}")
        return cls(tp, world_size // tp, rank)

    @property
    def tp_rank(self) -> int:
        """Position in the tensor-parallel group."""
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        """Position in the data-parallel group."""
        return self.rank // self.tp

    @property
    def name(self) -> str:
        """E.g. ``tp2dp2``."""
        return f"tp{self.tp}dp{self.dp}"


@dataclass(frozen=True)
class ParamSpec:
    """One model parameter: its global shape (without the layer axis) and TP split axis."""

    key: str
    shape: Tuple[int, ...]
    tp_axis: Optional[int]  # None: replicated on every rank
    per_layer: bool


def param_specs(cfg: ModelConfig) -> List[ParamSpec]:
    """The parameters of the GPT-like model (Megatron-Core names)."""
    h, f, v = cfg.hidden, cfg.ffn, cfg.vocab
    attn, mlp = "decoder.layers.self_attention", "decoder.layers.mlp"
    return [
        ParamSpec("embedding.word_embeddings.weight", (v, h), 0, False),
        ParamSpec("decoder.layers.input_layernorm.weight", (h,), None, True),
        ParamSpec(f"{attn}.linear_qkv.weight", (3 * h, h), 0, True),
        ParamSpec(f"{attn}.linear_qkv.bias", (3 * h,), 0, True),
        ParamSpec(f"{attn}.linear_proj.weight", (h, h), 1, True),
        ParamSpec("decoder.layers.pre_mlp_layernorm.weight", (h,), None, True),
        ParamSpec(f"{mlp}.linear_fc1.weight", (f, h), 0, True),
        ParamSpec(f"{mlp}.linear_fc2.weight", (h, f), 1, True),
        ParamSpec("decoder.final_layernorm.weight", (h,), None, False),
        ParamSpec("output_layer.weight", (v, h), 0, False),
    ]


def demo_tps(world_size: int) -> Tuple[int, int, int]:
    """TP sizes of the save layout and of the two load layouts for ``world_size`` ranks."""
    return (2 if world_size % 2 == 0 else 1), world_size, 1


def check_config(cfg: ModelConfig, world_size: int) -> None:
    """Raise DemoConfigError if a TP-split axis cannot be split evenly by a demo TP size."""
    for tp in demo_tps(world_size):
        for spec in param_specs(cfg):
            if spec.tp_axis is not None and spec.shape[spec.tp_axis] % tp:
                raise DemoConfigError(
                    f"{spec.key}: axis {spec.tp_axis} of size {spec.shape[spec.tp_axis]} cannot be "
                    f"split by TP={tp}; choose --hidden/--vocab divisible by {tp}"
                )


# ----------------------------------------------------------------------------- deterministic values


def _hash_to_float(index: torch.Tensor, seed: int) -> torch.Tensor:
    """Map int64 indices to float32 values in [-1, 1) exactly (integer hash, 16-bit result)."""
    mask = 0xFFFFFFFF
    h = (index ^ seed) & mask
    h = (h * 0x45D9F3B) & mask
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & mask
    h = h ^ (h >> 16)
    return ((h & 0xFFFF) - 32768).to(DTYPE) / 32768.0


def global_values(key: str, global_shape: Sequence[int], offset: Sequence[int],
                  size: Sequence[int]) -> torch.Tensor:
    """The region ``[offset, offset + size)`` of the global tensor ``key`` (shape ``size``).

    Each element is a hash of its flat index in the global tensor and of the key, so any
    chunk of any layout can be computed (and checked) without building the whole tensor.
    """
    ndim = len(global_shape)
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for axis in reversed(range(ndim)):
        coords = torch.arange(offset[axis], offset[axis] + size[axis], dtype=torch.int64) * stride
        index = index + coords.view([-1] + [1] * (ndim - 1 - axis))
        stride *= global_shape[axis]
    return _hash_to_float(index, zlib.crc32(key.encode()))


@dataclass(frozen=True)
class Chunk:
    """Where a rank's local tensor lies in a global tensor (computed by the demo itself)."""

    global_shape: Tuple[int, ...]
    offset: Tuple[int, ...]
    size: Tuple[int, ...]  # size 1 on the layer axis
    local_shape: Tuple[int, ...]  # shape of the local tensor (no layer axis)
    replica_id: int
    rank_offsets: Tuple[Tuple[int, int, int], ...]


def chunk_of(spec: ParamSpec, cfg: ModelConfig, layout: Layout, layer: Optional[int]) -> Chunk:
    """The chunk of ``spec`` (layer ``layer``) that ``layout``'s rank holds."""
    local, offset = list(spec.shape), [0] * len(spec.shape)
    rank_offsets: List[Tuple[int, int, int]] = []
    pre = 1 if layer is not None else 0
    if spec.tp_axis is None:
        replica_id = layout.rank
    else:
        local[spec.tp_axis] //= layout.tp
        offset[spec.tp_axis] = layout.tp_rank * local[spec.tp_axis]
        rank_offsets.append((spec.tp_axis + pre, layout.tp_rank, layout.tp))
        replica_id = layout.dp_rank
    global_shape, size = tuple(spec.shape), tuple(local)
    if layer is not None:
        global_shape, offset, size = (cfg.layers,) + global_shape, [layer] + offset, (1,) + size
        rank_offsets.insert(0, (0, layer, cfg.layers))
    return Chunk(global_shape, tuple(offset), size, tuple(local), replica_id, tuple(rank_offsets))


def expected_tensor(key: str, chunk: Chunk) -> torch.Tensor:
    """The values a rank holding ``chunk`` of ``key`` must have."""
    return global_values(key, chunk.global_shape, chunk.offset, chunk.size).reshape(chunk.local_shape)


def rng_piece(rank: int) -> Dict[str, Any]:
    """The RNG state saved by ``rank``: a seed and the torch generator state it gives."""
    seed = BASE_SEED + rank
    return {"seed": seed, "torch_rng_state": torch.Generator().manual_seed(seed).get_state()}


def common_state(cfg: ModelConfig, save_layout: Layout, world_size: int) -> StateDict:
    """The non-sharded state: iteration number and training args."""
    args = dict(cfg.as_dict(), tp=save_layout.tp, dp=save_layout.dp, world_size=world_size, seed=BASE_SEED)
    return {"iteration": ITERATION, "args": args}


def content_metadata(save_layout: Layout, world_size: int) -> Dict[str, Any]:
    """Metadata describing the checkpoint's content (readable without loading it)."""
    return {"model": "gpt_demo", "iteration": ITERATION, "tp": save_layout.tp,
            "dp": save_layout.dp, "world_size": world_size}


# ----------------------------------------------------------------------------- sharded state dict


def sharded_param(spec: ParamSpec, cfg: ModelConfig, layout: Layout, layer: Optional[int],
                  for_save: bool) -> ShardedTensor:
    """The ShardedTensor of ``spec`` for this rank: expected values to save, NaNs to load into."""
    chunk = chunk_of(spec, cfg, layout, layer)
    if for_save:
        data = expected_tensor(spec.key, chunk)
    else:
        data = torch.full(chunk.local_shape, float("nan"), dtype=DTYPE)
    return ShardedTensor.from_rank_offsets(
        spec.key, data, *chunk.rank_offsets, replica_id=chunk.replica_id,
        prepend_axis_num=1 if layer is not None else 0,
    )


def model_sharded_state_dict(cfg: ModelConfig, layout: Layout, for_save: bool) -> StateDict:
    """``{key: ShardedTensor}``, or ``{key: [ShardedTensor per layer]}`` for layer weights."""
    model: StateDict = {}
    for spec in param_specs(cfg):
        if spec.per_layer:
            model[spec.key] = [sharded_param(spec, cfg, layout, i, for_save) for i in range(cfg.layers)]
        else:
            model[spec.key] = sharded_param(spec, cfg, layout, None, for_save)
    return model


def rng_sharded_object(rank: int, world_size: int, for_save: bool) -> ShardedObject:
    """This rank's piece of the RNG state grid (shape ``(1, world)``)."""
    data = rng_piece(rank) if for_save else None
    return ShardedObject("rng_state", data, (1, world_size), (0, rank), replica_id=0)


def build_state_dict(cfg: ModelConfig, layout: Layout, world_size: int, save_layout: Layout,
                     for_save: bool) -> StateDict:
    """The full sharded state dict (model, RNG, and common state when saving)."""
    sd: StateDict = {
        "model": model_sharded_state_dict(cfg, layout, for_save),
        "rng_state": rng_sharded_object(layout.rank, world_size, for_save),
    }
    if for_save:
        sd.update(common_state(cfg, save_layout, world_size))
    return sd


def local_bytes(model: StateDict, main_replicas_only: bool) -> int:
    """Bytes of this rank's model tensors (only the main replicas: what a save writes)."""
    total = 0
    for value in model.values():
        for sh in value if isinstance(value, list) else [value]:
            if not main_replicas_only or dist_checkpointing.is_main_replica(sh.replica_id):
                total += sh.data.numel() * sh.data.element_size()
    return total


# ----------------------------------------------------------------------------- verification


def verify_model(loaded: StateDict, cfg: ModelConfig, layout: Layout) -> List[str]:
    """Differences between the loaded model tensors and their expected values."""
    errors: List[str] = []
    for spec in param_specs(cfg):
        layers: List[Optional[int]] = list(range(cfg.layers)) if spec.per_layer else [None]
        values = loaded.get(spec.key)
        got_list = values if spec.per_layer else [values]
        if not isinstance(got_list, list) or len(got_list) != len(layers):
            errors.append(f"{spec.key}: unexpected loaded structure {type(values).__name__}")
            continue
        for layer, got in zip(layers, got_list):
            where = spec.key if layer is None else f"{spec.key}[layer {layer}]"
            expected = expected_tensor(spec.key, chunk_of(spec, cfg, layout, layer))
            if not isinstance(got, torch.Tensor):
                errors.append(f"{where}: loaded a {type(got).__name__}, not a tensor")
            elif got.shape != expected.shape or got.dtype != expected.dtype:
                errors.append(f"{where}: loaded {got.dtype}{tuple(got.shape)}, "
                              f"expected {expected.dtype}{tuple(expected.shape)}")
            elif not torch.equal(got, expected):
                bad = (got != expected).sum().item()
                errors.append(f"{where}: {bad} of {got.numel()} values differ")
    return errors


def verify_rng(loaded: Any, rank: int) -> List[str]:
    """Differences between the loaded RNG piece and the one ``rank`` saved."""
    expected = rng_piece(rank)
    if not isinstance(loaded, dict) or set(loaded) != set(expected):
        return [f"rng_state: loaded {loaded!r:.200}, expected keys {sorted(expected)}"]
    if loaded["seed"] != expected["seed"] or not torch.equal(loaded["torch_rng_state"], expected["torch_rng_state"]):
        return [f"rng_state: loaded the piece with seed {loaded['seed']}, expected {expected['seed']}"]
    return []


def verify_common(loaded: StateDict, expected: StateDict) -> List[str]:
    """Differences between the loaded and the saved common state."""
    return [f"common state {key!r}: loaded {loaded.get(key)!r}, expected {value!r}"
            for key, value in expected.items() if loaded.get(key) != value]


def verify_content_metadata(ckpt_dir: Path, expected: Dict[str, Any]) -> List[str]:
    """Differences between ``load_content_metadata`` and what was given to ``save``."""
    got = dist_checkpointing.load_content_metadata(ckpt_dir)
    return [] if got == expected else [f"content metadata: loaded {got!r}, expected {expected!r}"]


def raise_if_any_rank_failed(errors: List[str], what: str) -> None:
    """Gather every rank's errors; raise DemoVerificationError on every rank if there are any."""
    gathered: List[Optional[List[str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    lines = [f"rank {rank}: {e}" for rank, errs in enumerate(gathered) for e in (errs or [])]
    if lines:
        shown = "\n  ".join(lines[:20]) + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else "")
        raise DemoVerificationError(f"{what}: {len(lines)} problem(s):\n  {shown}")


# ----------------------------------------------------------------------------- phases


@dataclass
class PhaseResult:
    """One row of the report: bytes summed over ranks, seconds maxed over ranks."""

    phase: str
    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def timed_phase(phase: str, fn: Callable[[], Any], my_bytes: int) -> Tuple[Any, PhaseResult]:
    """Run ``fn`` between barriers; reduce bytes (sum) and seconds (max) over ranks."""
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    elapsed = time.perf_counter() - start
    stats = torch.tensor([float(my_bytes)], dtype=torch.float64)
    secs = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)
    return out, PhaseResult(phase, int(stats.item()), secs.item())


def save_phase(cfg: ModelConfig, layout: Layout, world_size: int, ckpt_dir: Path) -> PhaseResult:
    """Save the state at ``layout`` with content metadata; check the metadata reads back."""
    sd = build_state_dict(cfg, layout, world_size, layout, for_save=True)
    meta = content_metadata(layout, world_size)
    _, result = timed_phase(
        f"save {layout.name}",
        lambda: dist_checkpointing.save(sd, ckpt_dir, content_metadata=meta),
        local_bytes(sd["model"], main_replicas_only=True),
    )
    errors = verify_content_metadata(ckpt_dir, meta)
    if not dist_checkpointing.check_is_distributed_checkpoint(ckpt_dir):
        errors.append(f"{ckpt_dir} is not recognised as a complete checkpoint")
    raise_if_any_rank_failed(errors, f"after save {layout.name}")
    return result


def load_phase(cfg: ModelConfig, layout: Layout, world_size: int, save_layout: Layout,
               ckpt_dir: Path) -> PhaseResult:
    """Load the checkpoint at ``layout`` and verify every value, RNG piece and common entry."""
    request = build_state_dict(cfg, layout, world_size, save_layout, for_save=False)
    loaded, result = timed_phase(
        f"load tp{layout.tp}",
        lambda: dist_checkpointing.load(request, ckpt_dir),
        local_bytes(request["model"], main_replicas_only=False),
    )
    errors = verify_model(loaded.get("model", {}), cfg, layout)
    errors += verify_rng(loaded.get("rng_state"), layout.rank)
    errors += verify_common(loaded, common_state(cfg, save_layout, world_size))
    errors += verify_content_metadata(ckpt_dir, content_metadata(save_layout, world_size))
    raise_if_any_rank_failed(errors, f"load tp{layout.tp}dp{layout.dp}")
    return result


def format_table(cfg: ModelConfig, world_size: int, rows: Sequence[PhaseResult]) -> str:
    """The report printed by rank 0."""
    lines = [
        f"gpt_demo: world={world_size} hidden={cfg.hidden} layers={cfg.layers} vocab={cfg.vocab}",
        f"{'phase':<14} {'bytes':>14} {'seconds':>9} {'GB/s':>8}",
    ]
    lines += [f"{r.phase:<14} {r.nbytes:>14,} {r.seconds:>9.3f} {r.gb_per_s:>8.3f}" for r in rows]
    return "\n".join(lines)


def warm_up() -> None:
    """Resolve the default strategies once, so that the timings measure I/O and not the
    first import of ``torch.distributed.checkpoint`` (seconds on a small machine)."""
    serialization.get_default_save_sharded_strategy()
    serialization.get_default_save_common_strategy()


def run_demo(cfg: ModelConfig, root: Path, keep: bool) -> None:
    """Save at TP=2 (1 if the world is odd), reload at TP=world and TP=1; verify; report."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    save_tp, *load_tps = demo_tps(world_size)
    check_config(cfg, world_size)
    save_layout = Layout.of_world(save_tp, world_size, rank)
    ckpt_dir = root / f"gpt_demo_{save_layout.name}"
    if rank == 0 and dist_checkpointing.check_is_distributed_checkpoint(ckpt_dir):
        print(f"replacing the checkpoint an earlier run kept in {ckpt_dir}")
        shutil.rmtree(ckpt_dir)  # the demo's own, complete checkpoint: run it again with --keep
    dist.barrier()
    warm_up()
    rows = [save_phase(cfg, save_layout, world_size, ckpt_dir)]
    for tp in load_tps:
        rows.append(load_phase(cfg, Layout.of_world(tp, world_size, rank), world_size, save_layout, ckpt_dir))
    dist.barrier()
    if rank == 0:
        if keep:
            print(f"checkpoint kept in {ckpt_dir}")
        else:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        print(format_table(cfg, world_size, rows))
        print("demo OK", flush=True)


# ----------------------------------------------------------------------------- process setup


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line of the demo."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to spawn locally (default 4; ignored under torchrun)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="checkpoint root (default: a fresh temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (and temp root)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    parser.add_argument("--layers", type=int, default=8, help="number of layers (default 8)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    parser.add_argument("--start-method", choices=("fork", "spawn"), default=None,
                        help="how local ranks are started (default: fork on Linux, else spawn)")
    args = parser.parse_args(argv)
    for name in ("hidden", "layers", "vocab"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be positive")
    return args


def launched_by_torchrun() -> bool:
    """True when the environment already names this process's rank (torchrun, SLURM wrappers)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_start_method() -> str:
    """``fork`` on Linux (the ranks inherit the parent's imports: seconds saved per rank on a
    small machine; the parent runs no torch op before forking), ``spawn`` elsewhere."""
    return "fork" if sys.platform.startswith("linux") else "spawn"


def set_threads(local_world_size: int) -> None:
    """Share the CPU cores between the local ranks."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def rank_main(cfg: ModelConfig, root: Optional[Path], keep: bool) -> int:
    """Body of every rank once the process group is up; returns the exit code."""
    rank = dist.get_rank()
    try:
        made_root = root is None
        if made_root:  # rank 0 picks the temp dir; on several nodes pass --dir instead
            box = [tempfile.mkdtemp(prefix="gpt_demo_") if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            root = Path(box[0])
        try:
            run_demo(cfg, root, keep)
        finally:
            if made_root and not keep and rank == 0:
                shutil.rmtree(root, ignore_errors=True)
        return 0
    except (DemoVerificationError, DemoConfigError) as e:  # raised alike on every rank
        if rank == 0:
            print(f"demo FAILED: {e}", file=sys.stderr, flush=True)
        dist.barrier()  # no rank exits (and gets its peers killed) before rank 0 has reported
        return 1
    except Exception as e:  # noqa: BLE001 - reported with the rank, then a non-zero exit
        print(f"[rank {rank}] demo FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        dist.destroy_process_group()


def spawned_worker(rank: int, world_size: int, port: int, cfg: ModelConfig,
                   root: Optional[Path], keep: bool) -> None:
    """Entry point of a rank started by ``torch.multiprocessing.start_processes``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    set_threads(world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
    code = rank_main(cfg, root, keep)
    if code:
        sys.exit(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo on torchrun's ranks, or spawn ``--nproc`` local ranks; the exit code."""
    args = parse_args(argv)
    cfg = ModelConfig(args.hidden, args.layers, args.vocab)
    if launched_by_torchrun():
        set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
        return rank_main(cfg, args.dir, args.keep)
    nproc = args.nproc or 4
    try:
        check_config(cfg, nproc)
    except DemoConfigError as e:
        print(f"demo FAILED: {e}", file=sys.stderr)
        return 2
    start_method = args.start_method or default_start_method()
    if start_method == "fork":
        warm_up()  # the forked ranks inherit the imported strategy modules
    try:
        mp.start_processes(spawned_worker, args=(nproc, free_port(), cfg, args.dir, args.keep),
                           nprocs=nproc, start_method=start_method)
    except mp.ProcessExitedException as e:
        print(f"demo FAILED: rank {e.error_index} exited with code {e.exit_code}", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as e:
        print(f"demo FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
