"""The command line: ``python -m dist_checkpointing`` (or ``dist-ckpt``) ``inspect``,
``validate``, ``export``, ``import`` and ``convert`` a checkpoint, and ``convert-local`` a
local-tier checkpoint into a normal one, in one process without a process group. A
checkpoint may be a directory or a URL (``s3://bucket/prefix``, …), configured by the
environment and ``--storage-option KEY=VALUE``. Long operations show a progress bar on
a terminal and log lines otherwise.

Each subcommand imports only the tools it runs (inside :func:`main`): ``--help`` and
``--version`` import neither torch nor the library's modules; ``inspect``, ``validate`` and
``export`` import torch but not ``torch.distributed.checkpoint``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

logger = logging.getLogger("dist_checkpointing.cli")


def _progress(desc: str) -> Callable[[int, int, str], None]:
    """A progress callback: a tqdm bar when stderr is a terminal, else a log line per 10%."""
    from .tools.info import human_size

    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)

        def update(done: int, total: int, what: str) -> None:
            bar.total = total
            bar.set_postfix_str(what[-40:], refresh=False)
            bar.update(done - bar.n)
            if done >= total:
                bar.close()

        return update

    state = {"next": 0.0, "start": time.perf_counter()}

    def log(done: int, total: int, what: str) -> None:
        fraction = done / total if total else 1.0
        if fraction >= state["next"] or done >= total:
            elapsed = time.perf_counter() - state["start"]
            logger.info("%s: %3.0f%% (%s of %s, %.1f s) %s", desc, 100 * fraction, human_size(done),
                        human_size(total), elapsed, what)
            state["next"] = min(1.0, fraction + 0.1)

    return log


def _positive_gib(text: str) -> float:
    """``--max-shard-size``: a positive number of GiB (at least one byte)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value * 2**30 >= 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def _storage_option(text: str) -> tuple:
    """``--storage-option KEY=VALUE``: a dotted KEY nests (``client_options.allow_http=true``);
    a VALUE that is JSON (``true``, ``3``, ``{...}``) is taken as such, else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return key, parsed


def _storage_options(pairs: Optional[List[tuple]]) -> Optional[Dict[str, Any]]:
    """The ``storage_options`` dict of the repeated ``--storage-option`` (None without any)."""
    if not pairs:
        return None
    options: Dict[str, Any] = {}
    for key, value in pairs:
        *parents, leaf = key.split(".")
        node = options
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                from .core import CheckpointingException

                raise CheckpointingException(f"--storage-option {key}: {part} is already a value")
        node[leaf] = value
    return options


# the subcommands that only read checkpoints: they run without torch.distributed.checkpoint,
# reading `.metadata` into light stand-ins of its classes (pickling/dcp_types.py)
_READ_ONLY = ("inspect", "validate", "export")

_CKPT = "the checkpoint: a directory or a URL (s3://bucket/prefix, …)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dist-ckpt", description="Inspect, validate, export, import and "
                                     "convert distributed checkpoints (of any registered backend).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("inspect", help="describe a checkpoint: backend, common state, tensors, objects, size")
    p.add_argument("dir", metavar="DIR", help=_CKPT)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = sub.add_parser("validate", help="check a checkpoint completely (exit 0 if intact, 1 if not)")
    p.add_argument("dir", metavar="DIR", help=_CKPT)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = sub.add_parser("export", help="write consolidated full tensors as safetensors or one torch.save file")
    p.add_argument("dir", metavar="DIR", help=_CKPT)
    p.add_argument("out", metavar="OUT", help="a directory (safetensors) or a file (torch); a URL too")
    p.add_argument("--format", choices=("safetensors", "torch"), default="safetensors",
                   help="safetensors files with an index (default), or one torch.save file")
    p.add_argument("--keys", metavar="PREFIX", help="only the tensors whose key starts with PREFIX")
    p.add_argument("--max-shard-size", type=_positive_gib, default=5.0, metavar="GIB",
                   help="safetensors: split into files of at most this many GiB (default 5)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p = sub.add_parser("import", help="turn a torch.save or safetensors state dict into a checkpoint")
    p.add_argument("source", metavar="SOURCE", help="a torch.save file, a .safetensors file or a directory of them")
    p.add_argument("out", metavar="OUT", help="the checkpoint to create: a directory or a URL")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p = sub.add_parser("convert", help="rewrite a checkpoint in Megatron-Core 0.19's layout (flattened keys "
                       "whole, common.pt as the common_state object)")
    p.add_argument("dir", metavar="DIR", help=_CKPT + " to convert")
    p.add_argument("out", metavar="OUT", help="the checkpoint to create: a directory or a URL")
    p.add_argument("--layout", choices=("mcore-0.19",), default="mcore-0.19", help="the layout to write (default and only: mcore-0.19)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p = sub.add_parser("convert-local", help="write a local-tier (two-tier mode) checkpoint as a normal one that "
                       "loads under any layout", description="Write a step of a local-tier checkpoint (the node-local "
                       "directories of CheckpointManager's two-tier mode) as a normal torch_dist checkpoint into OUT. "
                       "Each rank's shards are read from its first intact copy (own or replica) in the order of the "
                       "NODE_DIRs. Put options before the NODE_DIRs or after OUT.")
    p.add_argument("node_dirs", nargs="+", metavar="NODE_DIR", help="a node-local directory (local_dir of a node)")
    p.add_argument("out", metavar="OUT", help="the checkpoint to create: an empty or missing directory, or a URL "
                   "(ROOT/iter_{step:07d} adds it to a CheckpointManager root)")
    p.add_argument("--step", type=int, metavar="N",
                   help="the step to convert (default: the newest step complete in the NODE_DIRs)")
    p.add_argument("--root", metavar="ROOT", help="convert the copies of the job with this persistent root only "
                   "(needed when the NODE_DIRs hold copies of the step from several jobs)")
    for name in ("inspect", "validate", "export", "import", "convert", "convert-local"):
        sub.choices[name].add_argument(
            "--storage-option", dest="storage_options", action="append", type=_storage_option, metavar="KEY=VALUE",
            help="an option of the URL's storage client (repeatable; e.g. endpoint=http://host:port), "
                 "over the AWS_* environment")
    return parser


def _version() -> str:
    """The installed package's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dist_checkpointing")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises nothing more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (tests): nothing to flush
        pass
    finally:
        os.close(devnull)


def _run(args: argparse.Namespace, options: Optional[Dict[str, Any]]) -> int:
    """Run the subcommand ``args.command``, importing only the tools it needs."""
    from .core import CheckpointingException
    from .tools.info import human_size

    if args.command == "inspect":
        from .tools.info import format_info, inspect_checkpoint

        info = inspect_checkpoint(args.dir, options)
        print(json.dumps(info.as_dict(), indent=2) if args.json else format_info(info))
        return 0
    if args.command == "validate":
        from .core import open_storage
        from .tools.validate import validate_checkpoint

        if not args.json and open_storage(args.dir, options).kind() is None:  # (--json reports it as a problem)
            raise CheckpointingException(f"Checkpoint directory {args.dir} does not exist")
        report = validate_checkpoint(args.dir, progress=_progress("validate"), storage_options=options)
        if args.json:
            print(json.dumps(vars(report) | {"ok": report.ok}, indent=2))
        else:
            print(f"{report.path}: {'OK' if report.ok else 'DAMAGED'} — {report.checked_tensors} tensors "
                  f"({human_size(report.checked_bytes)}) and {report.checked_objects} objects checked")
            for problem in report.problems:
                print(f"  problem: {problem}")
            for note in report.notes:
                print(f"  note: {note}")
        return 0 if report.ok else 1
    if args.command == "export":
        from .tools.export import export_checkpoint

        files = export_checkpoint(args.dir, args.out, args.format, args.keys, args.force,
                                  int(args.max_shard_size * 2**30), progress=_progress("export"),
                                  storage_options=options)
        for f in files:
            print(f)
        return 0
    if args.command == "convert":
        from .tools.convert import convert_checkpoint

        result = convert_checkpoint(args.dir, args.out, args.layout, args.force, progress=_progress("convert"),
                                    storage_options=options)
        print(f"{args.out}: {result.tensors} tensors ({result.flattened} were flattened) and "
              f"{result.objects} objects written in layout {args.layout}")
        return 0
    if args.command == "convert-local":
        from .manager import convert_local_checkpoint

        done = convert_local_checkpoint(args.node_dirs, args.out, args.step, storage_options=options,
                                        root=args.root)
        print(f"{args.out}: step {done.step} of {done.world} ranks: {done.tensors} tensor chunks "
              f"({human_size(done.nbytes)}) and {done.objects} objects written")
        return 0
    from .tools.importing import import_checkpoint

    count = import_checkpoint(args.source, args.out, args.force, storage_options=options)
    print(f"{args.out}: {count} tensors imported")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line; returns the exit status (0 success, 1 failure, 2 usage)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `dist-ckpt` alone: what it can do
        parser.print_help()
        return 0
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.command not in _READ_ONLY:
        # what writes a checkpoint writes DCP's own metadata classes: import DCP before the
        # library (pickling/dcp_types.py takes DCP's classes when DCP is already imported)
        import torch.distributed.checkpoint  # noqa: F401
    from .core import CheckpointingException
    from .tools.output import OutputExistsError

    try:
        return _run(args, _storage_options(getattr(args, "storage_options", None)))
    except OutputExistsError as e:
        print(f"error: {e.out} already exists (pass --force to replace it)", file=sys.stderr)
        return 1
    except CheckpointingException as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader of our output went away (`dist-ckpt inspect ... | head`)
        _silence_stdout()
        return 141  # as if killed by SIGPIPE, the shell convention
    except OSError as e:  # storage errors name the location and what failed
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the tools raise CheckpointingException; never a traceback anyway
        logger.debug("unexpected error", exc_info=True)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
