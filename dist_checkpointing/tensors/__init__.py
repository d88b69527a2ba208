"""Tensor kinds and views the data model builds on: :class:`~.sharded.ShardedTensor` (re-exported
by :mod:`dist_checkpointing.mapping`), a tensor's bytes (:mod:`.bytes_view`), FP8 tensors
(:mod:`.fp8`) and DTensors (:mod:`.dtensor`)."""
