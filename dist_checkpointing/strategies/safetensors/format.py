"""The safetensors format, as this library reads and writes it: file and index names, the
dtype names, and the checks of a header and of ``model.safetensors.index.json``.

A safetensors file is an 8-byte little-endian header length, a JSON header giving every
tensor's dtype, shape and byte range (``data_offsets``, relative to the end of the header),
then the tensors' bytes, row-major. The header is parsed as safetensors' own reader parses
it, and a little stricter: strict UTF-8 (no lone surrogates, even as ``\\u`` escapes), no
duplicate keys, a dtype safetensors defines and torch has, offsets that tile the data
exactly (no gap, no overlap, nothing after the last tensor), each range the size of its
shape. Anything else is a :class:`~...core.CheckpointingException` naming the file and the
entry, raised before anything is allocated for the file's tensors.
"""

from __future__ import annotations

import json
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ...core import CheckpointingException, key_problem, read_small_json
from ...storage import RangeReader, Storage

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.complex64: "C64",
}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
INDEX_FNAME = "model.safetensors.index.json"
SUFFIX = ".safetensors"
METADATA_KEY = "__metadata__"  # the header's entry of free-form strings, not a tensor
MAX_HEADER_BYTES = 100_000_000  # what safetensors' reader accepts
MAX_INDEX_BYTES = 256 << 20


class Entry(NamedTuple):
    """One tensor of a safetensors file: its dtype, shape, and bytes ``[begin, end)`` of the file."""

    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int
    end: int


def key_refusal(key: str) -> Optional[str]:
    """Why a tensor of the key ``key`` cannot be stored in a safetensors file (``None``: it can)."""
    if key == METADATA_KEY:
        return f"tensor key {key!r} is the name safetensors reserves for its header's metadata"
    return key_problem(key)


def dtype_name(key: str, dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``; raises for a dtype the format cannot hold."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise CheckpointingException(f"Tensor {key!r}: safetensors cannot store dtype {dtype}") from None


def _strict_text(value: object) -> bool:
    return isinstance(value, str) and key_problem(value) is None


def _no_duplicates(pairs: List[Tuple[str, object]]) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def header_entries(encoded: bytes, bad: Callable[[str], CheckpointingException]) -> Dict[str, Entry]:
    """The tensor entries of the JSON header ``encoded`` (offsets relative to the data),
    checked as the module says; raises ``bad(problem)`` otherwise."""
    if len(encoded) > MAX_HEADER_BYTES:
        raise bad(f"it is {len(encoded)} bytes long, readers accept at most {MAX_HEADER_BYTES}")
    try:
        header = json.loads(encoded.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"it is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("it is not a JSON object")
    entries: Dict[str, Entry] = {}
    for key, entry in header.items():
        if not _strict_text(key):
            raise bad(key_refusal(key) or f"key {key!r} is not text")
        if key == METADATA_KEY:
            if not (isinstance(entry, dict) and all(_strict_text(k) and _strict_text(v) for k, v in entry.items())):
                raise bad(f"{METADATA_KEY} must map strings to strings")
            continue
        fields = entry if isinstance(entry, dict) else {}
        dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"the entry of {key!r} is not a tensor entry (dtype, shape, data_offsets)")
        if dtype not in DTYPES:
            raise bad(f"the entry of {key!r} has dtype {dtype!r}, which is not one of {sorted(DTYPES)}")
        nbytes = DTYPES[dtype].itemsize
        for d in shape:
            nbytes *= d
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"the entry of {key!r} claims {offsets[1] - offsets[0]} bytes for a {dtype} tensor "
                      f"of shape {shape} ({nbytes} bytes)")
        entries[key] = Entry(DTYPES[dtype], tuple(shape), offsets[0], offsets[1])
    end = 0
    for key, entry in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != end:
            raise bad(f"the data of {key!r} starts at byte {entry.begin} of the data, not at {end} where "
                      f"the tensor before it ends ({'an overlap' if entry.begin < end else 'a gap'})")
        end = entry.end
    return entries


def check_header(encoded: bytes, where: str) -> None:
    """Check the JSON header ``encoded`` of a file about to be written (:func:`header_entries`),
    naming ``where``."""
    header_entries(encoded, lambda problem: CheckpointingException(
        f"{where}: the safetensors header would not be readable: {problem}"))


def read_header(reader: RangeReader, where: str) -> Tuple[int, Dict[str, Entry]]:
    """The header of the safetensors file open in ``reader``: the offset where its data
    starts and its tensor entries (offsets within the file). The header length is checked
    against the file's size before it is read, and the entries to fill the rest of the file."""
    def bad(problem: str) -> CheckpointingException:
        return CheckpointingException(f"{where} is not a valid safetensors file: {problem}")

    try:
        if reader.size < 8:
            raise bad(f"it holds {reader.size} bytes, less than the 8 of a header length")
        length = int.from_bytes(reader.read(0, 8), "little")
        if length > MAX_HEADER_BYTES or length > reader.size - 8:
            raise bad(f"its header length {length} exceeds "
                      f"{'the file' if length <= MAX_HEADER_BYTES else f'the {MAX_HEADER_BYTES} bytes readers accept'} "
                      f"({reader.size} bytes)")
        encoded = reader.read(8, length)
    except OSError as e:
        raise CheckpointingException(f"Cannot read the header of {where}: {e}") from e
    if len(encoded) != length:
        raise bad("it ends inside its header")
    entries = header_entries(encoded, bad)
    start = 8 + length
    end = max((e.end for e in entries.values()), default=0)
    if start + end != reader.size:
        raise bad(f"its tensors end at byte {start + end} but the file holds {reader.size} bytes")
    return start, {k: Entry(e.dtype, e.shape, start + e.begin, start + e.end) for k, e in entries.items()}


def shard_names(count: int) -> List[str]:
    """File names of a model split into ``count`` files (the Hugging Face convention)."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(storage: Storage, weight_map: Dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json`` in ``storage`` (atomically): which file holds each tensor."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    storage.write_atomic(INDEX_FNAME, (json.dumps(index, indent=2) + "\n").encode())


def file_name_problem(name: object) -> Optional[str]:
    """Why ``name`` cannot be a data file of a safetensors checkpoint (``None``: it can): a
    plain file name in the checkpoint's directory ending in ``.safetensors``."""
    if not isinstance(name, str) or not name.endswith(SUFFIX) or name in (SUFFIX,):
        return f"{name!r} is not a .safetensors file name"
    if "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        return f"{name!r} is not a file of the checkpoint's own directory"
    return key_problem(name)


def read_index(storage: Storage) -> Dict[str, str]:
    """The ``weight_map`` of ``model.safetensors.index.json`` (tensor key -> file name),
    checked: a JSON object whose ``weight_map`` maps text keys to the names of
    ``.safetensors`` files of the same directory."""
    where = storage.describe(INDEX_FNAME)
    raw = read_small_json(storage, INDEX_FNAME, MAX_INDEX_BYTES, "Cannot read the safetensors index")
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointingException(f"{where} is not a safetensors index: it has no \"weight_map\" object")
    for key, name in weight_map.items():
        problem = key_refusal(key) or file_name_problem(name)
        if problem is not None:
            raise CheckpointingException(f"{where}: the weight_map entry of {key!r} is refused: {problem}")
    return dict(weight_map)


def file_groups(keys: List[str], sizes: Dict[str, int], max_file_bytes: int, files_at_least: int = 1) -> List[List[str]]:
    """``keys`` (in order) cut into files of consecutive keys: a new file starts where the
    next key would take the current one over ``max_file_bytes``, or over an even share of
    the bytes among ``files_at_least`` files (so that that many writers have work)."""
    total = sum(sizes[k] for k in keys)
    target = max(1, min(max_file_bytes, -(-total // max(1, files_at_least))))
    groups: List[List[str]] = [[]]
    size = 0
    for key in keys:
        if groups[-1] and size + sizes[key] > target:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += sizes[key]
    return groups if groups[0] else []
