"""Shard distribution and exchange inside a parallelization group (the algorithms behind
the fully parallel wrappers; :mod:`dist_checkpointing.exchange_utils` re-exports them
under Megatron-Core's name):

* :mod:`.distribution` — shard ids and summaries, the deterministic greedy assignment of
  shards to ranks, and the distribution computed from every rank's summary;
* :mod:`.plan` — the same assignment planned at a per-rank cost flat in the group size;
* :mod:`.tensors` — how loaded tensors travel: the collective algorithms and the
  point-to-point exchange of a plan;
* :mod:`.objects` — how loaded ShardedObjects travel.
"""
