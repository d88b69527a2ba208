"""Hugging Face safetensors checkpoints as sources and results of this library.

- :mod:`.format`: the file and index formats, parsed and checked.
- :mod:`.file_writer`: safetensors files written one tensor at a time.
- :mod:`.source`: a directory (or prefix) of safetensors files seen as a checkpoint.
- :mod:`.reader`: the byte ranges of a request read from those files.
- :mod:`.load`: :class:`~.load.SafetensorsLoadShardedStrategy`, the load strategy of such a directory.
- :mod:`.save`: :class:`~.save.SafetensorsSaveShardedStrategy`, saving straight to safetensors.

The package re-exports the format and writer names (the old module path
``dist_checkpointing.tools.safetensors_stream`` is this package).
"""

from .file_writer import SafetensorsFileWriter, read_back_header
from .format import (DTYPE_NAMES, DTYPES, INDEX_FNAME, MAX_HEADER_BYTES, Entry, check_header, dtype_name,
                     key_refusal, read_header, read_index, shard_names, write_index)

__all__ = ["SafetensorsFileWriter", "read_back_header", "DTYPE_NAMES", "DTYPES", "INDEX_FNAME", "MAX_HEADER_BYTES",
           "Entry", "check_header", "dtype_name", "key_refusal", "read_header", "read_index", "shard_names",
           "write_index"]
