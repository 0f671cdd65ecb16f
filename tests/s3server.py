"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks (moto's standalone server, spoken
to over HTTP), and a forwarding proxy in front of it that adds latency, caps bandwidth and injects
faults (503 SlowDown, 403, truncated bodies) — no mocked client anywhere."""

from __future__ import annotations

import http.client
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.fs as pafs

ACCESS_KEY, SECRET_KEY, REGION = "testing-key", "testing-secret", "us-east-1"


def credentials_env(key: str | None = None) -> dict[str, str]:
    """What a pod or shell would export (the spec never holds credentials); ``key``: access key and
    secret both (s3rver's)."""
    return {"AWS_ACCESS_KEY_ID": key or ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": key or SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}


class MotoS3:
    """moto's standalone S3 server bound to 127.0.0.1 on a free port: in a thread of this process
    (ThreadedMotoServer), or with ``process=True`` as its own ``moto_server`` process (benchmarks:
    the server then does not share this interpreter's lock with the reader and the proxy)."""

    def __init__(self, process: bool = False) -> None:
        self._server = self._proc = None
        if process:
            import shutil
            import socket
            import subprocess
            import sys

            with socket.socket() as sk:
                sk.bind(("127.0.0.1", 0))
                port = sk.getsockname()[1]
            exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
            self._proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
            self.endpoint = f"http://127.0.0.1:{port}"
            for _ in range(200):  # up to ~20 s
                try:
                    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                    c.request("GET", "/")
                    c.getresponse().read()
                    c.close()
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                self._proc.kill()
                raise RuntimeError("moto_server did not start")
            return
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def filesystem(self, endpoint: str | None = None) -> pafs.S3FileSystem:
        ep = endpoint or self.endpoint
        return pafs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION, scheme="http",
                                 allow_bucket_creation=True, allow_bucket_deletion=True,
                                 endpoint_override=ep.split("://", 1)[1])

    def upload_dir(self, local_dir: str, bucket: str, prefix: str) -> list[str]:
        fs = self.filesystem()
        if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            fs.create_dir(bucket)
        out = []
        for name in sorted(os.listdir(local_dir)):
            src = os.path.join(local_dir, name)
            if not os.path.isfile(src):
                continue
            dst = f"{bucket}/{prefix}/{name}"
            with open(src, "rb") as f, fs.open_output_stream(dst) as o:
                o.write(f.read())
            out.append(dst)
        return out

    def put_keys(self, bucket: str, keys: list[str], data: bytes = b"x") -> None:
        """Many small objects at once: straight into the in-thread server's store (2,000 PUTs over HTTP take ~20 s
        here; what a test then asks of the server still goes over HTTP), else one PUT each."""
        fs = self.filesystem()
        if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            fs.create_dir(bucket)
        if self._server is not None:
            from moto.core import DEFAULT_ACCOUNT_ID
            from moto.s3.models import s3_backends

            backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
            for key in keys:
                backend.put_object(bucket, key, data)
            return
        for key in keys:
            with fs.open_output_stream(f"{bucket}/{key}") as o:
                o.write(data)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        if self._server is not None:
            self._server.stop()


class _QuietServer(ThreadingHTTPServer):
    """A client that goes away mid-answer (a benchmark worker exiting) is not an error worth a traceback."""

    daemon_threads = True

    def handle_error(self, request, client_address):
        import sys

        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


class Fault:
    """Answer the next ``count`` requests matching ``match(method, path)`` with ``status`` (or cut the
    body short when ``truncate``)."""

    def __init__(self, status: int = 503, count: int = 1, match: Callable[[str, str], bool] | None = None,
                 code: str = "SlowDown", truncate: bool = False):
        self.status, self.count, self.code, self.truncate = status, count, code, truncate
        self.match = match or (lambda method, path: True)
        self.fired = 0


class S3Proxy:
    """HTTP proxy on 127.0.0.1 in front of an S3 endpoint: fixed latency per request, optional bandwidth
    cap, injected faults, and counts of what passed (requests, GET bytes)."""

    def __init__(self, upstream: str, latency_s: float = 0.0, bandwidth_bps: float | None = None):
        self.upstream = upstream.split("://", 1)[1]
        self.latency_s, self.bandwidth_bps = latency_s, bandwidth_bps
        self.faults: list[Fault] = []
        self.requests = 0
        self.get_bytes = 0
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request since reset_counts
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                with proxy._lock:
                    proxy.requests += 1
                    proxy.seen.append((self.command, self.path))
                    fault = next((f for f in proxy.faults if f.fired < f.count and f.match(self.command, self.path)), None)
                    if fault is not None:
                        fault.fired += 1
                if proxy.latency_s:
                    time.sleep(proxy.latency_s)
                if fault is not None and not fault.truncate:
                    msg = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                           f"<Message>injected by the test proxy</Message></Error>").encode()
                    self.send_response(fault.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if self.command == "GET":
                    with proxy._lock:
                        proxy.get_bytes += len(data)
                    if proxy.bandwidth_bps:
                        time.sleep(len(data) / proxy.bandwidth_bps)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                # a HEAD answer carries the object's length, not the (empty) body's
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data[: len(data) // 2] if fault is not None and fault.truncate else data)
                    if fault is not None and fault.truncate:
                        self.close_connection = True

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self._httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()

    def inject(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def reset_counts(self) -> None:
        with self._lock:
            self.requests = 0
            self.get_bytes = 0
            self.seen = []

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class RangeHTTPServer:
    """A static HTTP server on 127.0.0.1 serving a directory: index pages listing its files (links),
    HEAD with Content-Length, and ``Range: bytes=a-b`` GETs answered 206 — what object stores and the
    Hugging Face Hub's resolve URLs offer, enough for fsspec's HTTP filesystem. Counts requests and
    GET bytes; ``fail_next`` answers that many requests with 503."""

    def __init__(self, root: str):
        import functools
        import re
        from http.server import SimpleHTTPRequestHandler

        server = self
        self.requests = 0
        self.get_bytes = 0
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request since reset_counts
        self.fail_next = 0
        self._lock = threading.Lock()
        rng = re.compile(r"bytes=(\d+)-(\d*)$")

        class Handler(SimpleHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _count(self) -> bool:
                with server._lock:
                    server.requests += 1
                    if server.fail_next > 0:
                        server.fail_next -= 1
                        fail = True
                    else:
                        fail = False
                if fail:
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                return fail

            def do_HEAD(self):
                if not self._count():
                    super().do_HEAD()

            def do_GET(self):
                if self._count():
                    return
                path = self.translate_path(self.path)
                m = rng.match(self.headers.get("Range", ""))
                if m is None or not os.path.isfile(path):
                    super().do_GET()
                    return
                size = os.path.getsize(path)
                start = int(m.group(1))
                end = min(size - 1, int(m.group(2))) if m.group(2) else size - 1
                if start >= size or end < start:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read(end - start + 1)
                with server._lock:
                    server.get_bytes += len(data)
                self.send_response(206)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=root))
        self._httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class GcsEmulator:
    """A GCS-compatible server (the JSON API of ``gcp-storage-emulator``) as its own process on 127.0.0.1
    (in this process pyarrow's GCS client would wait on the interpreter lock the server needs)."""

    def __init__(self, bucket: str) -> None:
        import shutil
        import socket
        import subprocess
        import sys

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        exe = shutil.which("gcp-storage-emulator", path=os.path.dirname(sys.executable)) or "gcp-storage-emulator"
        self._proc = subprocess.Popen([exe, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory",
                                       "--default-bucket", bucket], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{port}"
        for _ in range(200):  # up to ~20 s
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                c.request("GET", f"/storage/v1/b/{bucket}")
                c.getresponse().read()
                c.close()
                return
            except OSError:
                time.sleep(0.1)
        self._proc.kill()
        raise RuntimeError("gcp-storage-emulator did not start")

    def filesystem(self, endpoint: str | None = None) -> pafs.GcsFileSystem:
        import datetime

        ep = endpoint or self.endpoint
        return pafs.GcsFileSystem(anonymous=True, endpoint_override=ep.split("://", 1)[1], scheme="http",
                                  retry_time_limit=datetime.timedelta(seconds=1))

    def upload_dir(self, local_dir: str, bucket: str, prefix: str) -> list[str]:
        fs = self.filesystem()
        out = []
        for name in sorted(os.listdir(local_dir)):
            src = os.path.join(local_dir, name)
            if os.path.isfile(src):
                with open(src, "rb") as f, fs.open_output_stream(f"{bucket}/{prefix}/{name}") as o:
                    o.write(f.read())
                out.append(f"{bucket}/{prefix}/{name}")
        return out

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self._proc.kill()
            self._proc.wait(timeout=10)


S3RVER_DIR = os.path.expanduser(os.environ.get("MIXPLANE_S3RVER_DIR", "~/.cache/mixplane/s3rver"))
S3RVER_KEY = "S3RVER"  # the only access key / secret s3rver accepts (others: InvalidAccessKeyId)


class S3rver:
    """s3rver (npm, ``make s3rver``: a Node S3-compatible server keeping objects as files) as its own
    process on 127.0.0.1 — ranged GETs stream from disk, so large objects cost what they should
    (moto copies a whole object's value per ranged GET: ~10 requests/s on 70 MB objects). It checks
    access keys: ``credentials_env(S3RVER_KEY)``. Objects are uploaded with boto3 (s3rver stores the
    aws-chunked bodies of pyarrow's uploads undecoded)."""

    @staticmethod
    def available() -> bool:
        return os.path.exists(os.path.join(S3RVER_DIR, "node_modules", ".bin", "s3rver"))

    def __init__(self, buckets: tuple[str, ...] = ("bench",)) -> None:
        import socket
        import subprocess
        import tempfile

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="mixplane-s3rver-")
        cmd = [os.path.join(S3RVER_DIR, "node_modules", ".bin", "s3rver"), "--address", "127.0.0.1", "--port", str(port),
               "--directory", self._dir, "--silent"]
        for b in buckets:
            cmd += ["--configure-bucket", b]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{port}"
        for _ in range(200):  # up to ~20 s
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                c.request("GET", "/")
                c.getresponse().read()
                c.close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("s3rver did not start")

    def filesystem(self, endpoint: str | None = None) -> pafs.S3FileSystem:
        ep = endpoint or self.endpoint
        return pafs.S3FileSystem(access_key=S3RVER_KEY, secret_key=S3RVER_KEY, region=REGION, scheme="http",
                                 endpoint_override=ep.split("://", 1)[1])

    def upload_dir(self, local_dir: str, bucket: str, prefix: str) -> list[str]:
        import boto3

        c = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=S3RVER_KEY,
                         aws_secret_access_key=S3RVER_KEY, region_name=REGION)
        out = []
        for name in sorted(os.listdir(local_dir)):
            src = os.path.join(local_dir, name)
            if os.path.isfile(src):
                c.upload_file(src, bucket, f"{prefix}/{name}")
                out.append(f"{bucket}/{prefix}/{name}")
        return out

    def stop(self) -> None:
        import shutil

        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self._proc.kill()
            self._proc.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)
