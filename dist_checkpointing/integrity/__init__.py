"""What guards a checkpoint's integrity: checksums of stored bytes (:mod:`.checksums`, whose
names this package re-exports), Megatron-Core's SHA-256 manifest (:mod:`.manifest`), the
claim that makes one save the owner of its directory (:mod:`.save_claim`, with
:mod:`.liveness` telling whether its process still runs), outputs that never overlap their
source (:mod:`.overlap`), object names a store keeps as written (:mod:`.stored_names`) and
the common state every rank holds alike (:mod:`.common_state`).
"""

from .checksums import (
    ALGORITHM, SCOPE_DATA, SCOPE_RECORD, SIDECAR_SUFFIX, RecordVerifier, checksum, item_checksum_scope,
    item_checksum_table, mismatch_error, new_hasher, read_file_verified, sidecar_name, sidecar_record,
    write_file_with_checksum,
)

__all__ = [
    "ALGORITHM", "SCOPE_DATA", "SCOPE_RECORD", "SIDECAR_SUFFIX", "RecordVerifier", "checksum", "item_checksum_scope",
    "item_checksum_table", "mismatch_error", "new_hasher", "read_file_verified", "sidecar_name", "sidecar_record",
    "write_file_with_checksum",
]
