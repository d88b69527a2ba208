"""obstore for the S3 storage: imported on first use (an ImportError saying how to
install it; an OSError in a process forked after it was used: its runtime does not survive
a fork), its errors as ``OSError``, ``storage_options`` as ``S3Store`` takes them, and the
part size shared by uploads and reads."""

from __future__ import annotations

import errno
import os
import re
import sys
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Dict, Iterator, Optional

from .buffers import WRITE_BUFFER_BYTES

PART_BYTES = WRITE_BUFFER_BYTES
PARTS_IN_FLIGHT = 4
DEFAULT_MAX_RETRIES = 10  # obstore's default


_forked_after_use = False  # set in a forked child of a process that had imported obstore


def _mark_forked() -> None:
    global _forked_after_use
    _forked_after_use = _forked_after_use or "obstore" in sys.modules


os.register_at_fork(after_in_child=_mark_forked)


def _obstore():
    """The obstore module, or an ImportError saying how to install it; an OSError in a forked
    child of a process that used it (its runtime does not survive a fork: every request would
    hang), e.g. the writer of an async save."""
    if _forked_after_use:
        raise OSError(errno.ENOTSUP, "s3:// storage cannot be used in a process forked after obstore was used "
                                     "(its runtime does not survive a fork)")
    try:
        import obstore
    except ImportError as e:
        raise ImportError("s3:// checkpoint locations need obstore: pip install 'dist_checkpointing[s3]' "
                          "(from a clone of the repository: pip install -e '.[s3]')") from e
    return obstore


# What to check when the server refuses a request, by its S3 error code (or HTTP status).
_CREDENTIALS = ("check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or storage_options) "
                "and that they may access this bucket")
_REFUSED_HINTS = {
    "SignatureDoesNotMatch": _CREDENTIALS, "InvalidAccessKeyId": _CREDENTIALS, "AccessDenied": _CREDENTIALS,
    "403": _CREDENTIALS,
    "NoSuchBucket": "the bucket does not exist: check the bucket in the URL and the endpoint (AWS_ENDPOINT_URL)",
    "AuthorizationHeaderMalformed": "check the region (AWS_REGION) and the endpoint (AWS_ENDPOINT_URL)",
    "PermanentRedirect": "check the region (AWS_REGION) and the endpoint (AWS_ENDPOINT_URL)",
    "301": "check the region (AWS_REGION) and the endpoint (AWS_ENDPOINT_URL)",
}
_STATUS = re.compile(r"status code: (\d{3})([^:<]*)")
_CODE = re.compile(r"<Code>([^<]+)</Code>")


def _error(code: int, message: str) -> OSError:
    """An ``OSError`` with ``errno`` ``code`` whose text is ``message`` alone."""
    error = OSError(message)
    error.errno = code
    return error


def refused(what: str, error: BaseException) -> Optional[OSError]:
    """An ``OSError`` saying what the server refused and what to check, for an answer a retry
    cannot change (wrong credentials, no such bucket, wrong region); ``None`` otherwise."""
    text = str(error)
    status = _STATUS.search(text)
    if status is None or not status.group(1).startswith(("3", "4")):
        return None
    code = _CODE.search(text)
    reason = code.group(1) if code else status.group(2).strip()
    hint = _REFUSED_HINTS.get(code.group(1) if code else "", _REFUSED_HINTS.get(status.group(1)))
    if hint is None:
        return None  # a missing key, a failed condition...: the caller's own handling
    return _error(errno.EACCES if status.group(1) == "403" else errno.EIO,
                  f"{what}: the server refused it (HTTP {status.group(1)} {reason}): {hint}")


@contextmanager
def _os_errors(what: str) -> Iterator[None]:
    """obstore's errors as ``OSError`` (``FileExistsError`` for a failed create) naming ``what``;
    a request the server refuses says what was refused and what to check."""
    from obstore.exceptions import AlreadyExistsError, BaseError

    try:
        yield
    except AlreadyExistsError as e:
        raise FileExistsError(errno.EEXIST, f"{what} exists") from e
    except (BaseError, FileNotFoundError, PermissionError) as e:
        denied = refused(what, e)
        if denied is not None:
            raise denied from e
        if not isinstance(e, BaseError):
            raise
        raise _error(errno.EIO, f"{what}: {type(e).__name__}: {str(e).splitlines()[0]}") from e


def _store_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` for obstore's ``S3Store``, with the durations of ``retry_config`` (and its
    ``backoff``) and of ``client_options`` given as seconds turned into what obstore takes;
    ``client_options`` keep ``AWS_ALLOW_HTTP`` unless they set ``allow_http``."""
    out = dict(options)
    retry = dict(out.get("retry_config") or {})
    backoff = dict(retry.get("backoff") or {})
    for config, keys in ((retry, ("retry_timeout",)), (backoff, ("init_backoff", "max_backoff"))):
        for key in keys:
            if isinstance(config.get(key), (int, float)):
                config[key] = timedelta(seconds=config[key])
    if backoff:
        retry["backoff"] = backoff
    if retry:
        out["retry_config"] = retry
    client = dict(out.get("client_options") or {})
    for key in ("connect_timeout", "timeout", "pool_idle_timeout", "http2_keep_alive_timeout"):
        if isinstance(client.get(key), (int, float)) and not isinstance(client[key], bool):
            client[key] = f"{round(client[key] * 1000)}ms"
    if client:
        # obstore takes client_options instead of the environment's AWS_ALLOW_HTTP: keep it
        client.setdefault("allow_http", os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true")
        out["client_options"] = client
    return out
