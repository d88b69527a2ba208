"""The local tier of two-tier checkpointing (:class:`.tier.LocalTier`): frequent per-rank
copies in node-local directories, replicated to partner ranks. One concept a module:
:mod:`.tier` (saving, replicating, finalizing), :mod:`.snapshot` (a rank's state as one flat
buffer), :mod:`.format` (the header), :mod:`.files` (copies and markers on disk),
:mod:`.marker` (which job a copy belongs to), :mod:`.restore` (restoring, from this rank's
copy or a partner's), :mod:`.convert` (a step as a torch_dist checkpoint). Imported on use.
"""
