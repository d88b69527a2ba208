"""Megatron-Core's module name for the shard distribution and exchange algorithms: a
re-export of :mod:`dist_checkpointing.exchange`, where the code lives
(:mod:`~dist_checkpointing.exchange.distribution` — which rank writes or reads each shard;
:mod:`~dist_checkpointing.exchange.plan` — the same, planned at a per-rank cost flat in the
group size; :mod:`~dist_checkpointing.exchange.tensors` — how loaded tensors travel;
:mod:`~dist_checkpointing.exchange.objects` — how loaded objects travel), so model code
written for ``megatron.core.dist_checkpointing.exchange_utils`` ports by changing the
import prefix. The exchange buffer sizes (``SMALL_SHARD_BYTES``, ``BUCKET_BYTES``,
``ROUND_BYTES``) live in :mod:`~dist_checkpointing.exchange.tensors`, where they are read.
"""

from .exchange.distribution import (
    ShardDistribution,
    ShardId,
    ShardInfo,
    collect_holders,
    comm_device,
    determine_main_replica_uniform_distribution,
    distribute_shards_to_ranks,
    distribution_from_summaries,
    local_tensor_summary,
    shard_id,
)
from .exchange.objects import exchange_loaded_objects_gather_object, local_object_keys, object_loaders
from .exchange.tensors import (
    EXCHANGE_ALGORITHMS,
    check_exchange_algo,
    empty_tensor_for_exchange,
    exchange_by_distribution,
    exchange_loaded_tensors_broadcast,
    exchange_loaded_tensors_gather_object,
    exchange_loaded_tensors_gather_rounds,
)
from .tensors.fp8 import is_float8tensor

__all__ = [
    "EXCHANGE_ALGORITHMS", "ShardDistribution", "ShardId",
    "ShardInfo", "check_exchange_algo", "collect_holders", "comm_device", "determine_main_replica_uniform_distribution",
    "distribute_shards_to_ranks", "distribution_from_summaries", "empty_tensor_for_exchange", "exchange_by_distribution",
    "exchange_loaded_objects_gather_object", "exchange_loaded_tensors_broadcast", "exchange_loaded_tensors_gather_object",
    "exchange_loaded_tensors_gather_rounds", "is_float8tensor", "local_object_keys", "local_tensor_summary",
    "object_loaders", "shard_id",
]

_get_empty_tensor_for_exchange = empty_tensor_for_exchange  # Megatron-Core's private name, which its tests import
