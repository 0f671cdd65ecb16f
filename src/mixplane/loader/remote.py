"""Object storage for sources: the filesystem a source uri names (S3-compatible endpoints with an
endpoint override and region from the spec; credentials only from the usual places — environment,
an AWS profile or a credentials file mounted from a Secret, never the spec), ranged reads with
retries, backoff and timeouts, and errors that name the object.

Failure classes: 404 (missing object or bucket) and 403 (credentials refused) are not retried;
throttling (503 SlowDown), other 5xx, cut transfers and timeouts are retried with exponential backoff
and jitter up to ``RemoteIO.attempts``; then :class:`RemoteUnavailableError` names the object and the
last error. The AWS SDK's own retries are off (one attempt per request), so every retry is ours and
counted in :class:`~mixplane.loader.parquet.IOStats`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pyarrow.fs as pafs

from mixplane import settings
from mixplane.errors import MixplaneError


@dataclass
class RemoteIO:
    """Tuning of remote reads (defaults for every remote source of a process)."""

    attempts: int = 6  # tries per request (1 = no retry)
    backoff_s: float = 0.05  # first retry after ~this, doubling, with jitter
    backoff_max_s: float = 2.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 30.0
    # read-ahead (sourcereader / readahead): the next prefetch_pages pages of the read order (page mode:
    # beyond those already in the shuffle buffer; rowgroup mode: prefetch_chunks row-group chunks) are
    # fetched ahead, ranges closer than coalesce_gap bytes merged into one request of at most
    # max_request bytes (at least min_request when a batch is split over the request slots), at most
    # max_inflight requests at once, all within cache_bytes of fetched bytes
    prefetch_pages: int = 64
    prefetch_chunks: int = 2
    coalesce_gap: int = 64 << 10
    max_request: int = 8 << 20
    min_request: int = 1 << 20
    max_inflight: int = 16
    cache_bytes: int = 128 << 20  # recently read / prefetched ranges kept (bytes)
    split_cache_bytes: int = 32 << 20  # page mode: decoded split pages whose other parts are planned (0: off)
    tail_bytes: int = 64 << 10  # one read of a file's last bytes serves its footer and most OffsetIndexes


DEFAULTS = RemoteIO()


class RemoteError(MixplaneError, OSError):
    """A remote object that cannot be read; the message names it."""


class MissingObjectError(RemoteError, FileNotFoundError):
    """404: the object (or its bucket) does not exist — deleted, or never there."""


class AccessDeniedError(RemoteError, PermissionError):
    """403: the storage refused the credentials (or they lack permission for the object)."""


class RemoteUnavailableError(RemoteError):
    """Retries exhausted on throttling, 5xx, cut transfers or timeouts."""


_NOT_FOUND = ("NOT_FOUND:", "NO_SUCH_KEY", "NO_SUCH_BUCKET", "RESOURCE_NOT_FOUND", "Path does not exist", "HTTP response code: 404")
_DENIED = ("PERMISSION_DENIED", "UNAUTHENTICATED", "ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "INVALID_SIGNATURE",
           "MISSING_AUTHENTICATION_TOKEN", "EXPIRED_TOKEN", "UNRECOGNIZED_CLIENT", "HTTP response code: 403",
           "AccessDenied", "Forbidden", "HTTP 401", "HTTP 403")


def classify(err: BaseException) -> str:
    """'not_found', 'denied' or 'retry' for an error of a remote read."""
    if isinstance(err, FileNotFoundError):
        return "not_found"
    msg = str(err)
    if any(s in msg for s in _NOT_FOUND):
        return "not_found"
    if isinstance(err, PermissionError) or any(s in msg for s in _DENIED):
        return "denied"
    return "retry"


def backoff(attempt: int, io: RemoteIO, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (1 = first retry): exponential, capped, full jitter on half."""
    base = min(io.backoff_max_s, io.backoff_s * (2 ** (attempt - 1)))
    return base / 2 + (rng or random).random() * base / 2


def is_remote(fs) -> bool:
    return fs is not None and type(fs).__name__ != "LocalFileSystem"


def fsspec_of(fs):
    """The fsspec filesystem inside a pyarrow ``PyFileSystem(FSSpecHandler(...))``, else None."""
    handler = getattr(fs, "handler", None)
    return getattr(handler, "fs", None)


def object_name(fs, path: str) -> str:
    """``s3://bucket/key`` for messages (pyarrow paths carry no scheme)."""
    scheme = {"S3FileSystem": "s3", "GcsFileSystem": "gs", "HadoopFileSystem": "hdfs"}.get(type(fs).__name__)
    inner = fsspec_of(fs)
    if inner is not None:
        protocol = inner.protocol
        scheme = protocol if isinstance(protocol, str) else protocol[0]
    return f"{scheme}://{path}" if scheme and "://" not in path else path


class FsspecObject:
    """A remote object of an fsspec filesystem read by ranges (``cat_file``): stateless and safe to
    read from several threads at once, unlike a file object (one position, one lock), and without the
    file object's block read-ahead (the loader plans its own)."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self._size = int(_http_errors(lambda: fs.size(path)))
        # a filesystem without a ranged cat_file of its own (HfFileSystem) opens a buffered file per read:
        # no block cache then, or every read would fetch a whole block
        import fsspec  # type: ignore[import-untyped]

        generic = getattr(fs.cat_file, "__func__", None) is fsspec.AbstractFileSystem.cat_file
        self._kw = {"cache_type": "none"} if generic else {}

    def size(self) -> int:
        return self._size

    def read_at(self, size: int, offset: int) -> bytes:
        return _http_errors(lambda: self.fs.cat_file(self.path, start=offset, end=offset + size, **self._kw))

    def close(self) -> None:
        pass


def _http_errors(fn):
    """fsspec's HTTP errors as OSErrors :func:`classify` reads: its ``info`` turns every failed HEAD/GET
    (a 503 too) into FileNotFoundError, and a failed ranged GET raises aiohttp's ClientResponseError."""
    try:
        return fn()
    except FileNotFoundError as e:
        status = getattr(e.__cause__, "status", None)
        if status is None or status == 404:
            raise
        raise OSError(f"HTTP {status}: {e.__cause__}") from None
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - aiohttp.ClientResponseError and friends
        status = getattr(e, "status", None)
        if status == 404:
            raise FileNotFoundError(str(e)) from None
        raise OSError(f"HTTP {status}: {e}" if status is not None else f"{type(e).__name__}: {e}") from None


def open_ranged(fs, path: str):
    """An object opened for ranged reads (``size()``, ``read_at(size, offset)``, ``close()``)."""
    inner = fsspec_of(fs)
    return FsspecObject(inner, path) if inner is not None else fs.open_input_file(path)


def with_retries(what: str, name: str, fn, io: RemoteIO = DEFAULTS, on_retry=None):
    """Run ``fn()`` (one remote request) with our retry policy; raise a RemoteError naming ``name``."""
    attempt = 0
    while True:
        try:
            return fn()
        except (OSError, ValueError) as e:  # pyarrow raises OSError (and ArrowInvalid, a ValueError)
            kind = classify(e)
            if kind == "not_found":
                raise MissingObjectError(f"{name}: object not found while {what} (deleted, or the bucket does not "
                                         f"exist): {e}") from None
            if kind == "denied":
                raise AccessDeniedError(f"{name}: access denied while {what}: the storage refused the credentials "
                                        "(from AWS_ACCESS_KEY_ID / AWS_PROFILE / AWS_SHARED_CREDENTIALS_FILE or "
                                        f"the pod's mounted Secret): {e}") from None
            attempt += 1
            if attempt >= io.attempts:
                raise RemoteUnavailableError(f"{name}: {what} failed after {attempt} attempts: {e}") from None
            if on_retry is not None:
                on_retry()
            time.sleep(backoff(attempt, io))


def s3_filesystem(*, endpoint: str | None = None, region: str | None = None, io: RemoteIO = DEFAULTS) -> pafs.S3FileSystem:
    """An S3 filesystem with the spec's endpoint override and region; credentials from the default
    chain (environment, AWS profile / shared credentials file, instance or pod identity)."""
    kw: dict = {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=1),
                "connect_timeout": io.connect_timeout_s, "request_timeout": io.request_timeout_s}
    if region:
        kw["region"] = region
    kw.update(endpoint_options(endpoint))
    return pafs.S3FileSystem(**kw)


def endpoint_options(endpoint: str | None) -> dict[str, str]:
    """pyarrow's `endpoint_override` and `scheme` for the spec's endpoint (`http://host:port`, or a bare
    `host:port`, which means https); none without one."""
    if not endpoint:
        return {}
    scheme, _, host = endpoint.rpartition("://")
    return {"endpoint_override": host.rstrip("/"), "scheme": scheme or "https"}


def gcs_filesystem(*, endpoint: str | None = None, io: RemoteIO = DEFAULTS) -> pafs.GcsFileSystem:
    """Google Cloud Storage (pyarrow's native client) with the spec's endpoint override; credentials from
    Google's default chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud, workload identity); anonymous with
    MIXPLANE_GCS_ANONYMOUS=1 (public buckets, emulators). pyarrow's own retries are kept short: ours
    (:func:`with_retries`) decide."""
    import datetime

    kw: dict = {"retry_time_limit": datetime.timedelta(seconds=1.0)}
    if settings.get("MIXPLANE_GCS_ANONYMOUS"):
        kw["anonymous"] = True
    kw.update(endpoint_options(endpoint))
    return pafs.GcsFileSystem(**kw)


def fsspec_filesystem(scheme: str, *, endpoint: str | None = None) -> pafs.PyFileSystem:
    """``hf://`` (huggingface_hub's HfFileSystem; token from HF_TOKEN or the huggingface-cli login, the
    spec's endpoint as the Hub's address) and ``http(s)://`` (fsspec's HTTP filesystem; listing a uri
    ending in ``/`` follows the links of its index page) as pyarrow filesystems."""
    if scheme == "hf":
        from huggingface_hub import HfFileSystem

        inner = HfFileSystem(endpoint=endpoint) if endpoint else HfFileSystem()
    else:
        import fsspec

        inner = fsspec.filesystem(scheme)
    return pafs.PyFileSystem(pafs.FSSpecHandler(inner))
