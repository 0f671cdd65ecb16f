"""The kept listing on S3 (loader/listing.py): a source of N keys on moto's server behind the test proxy's latency,
`source_listing` timed and its requests counted three ways -- the first start (the store listed, the listing kept in
the local cache), the second start (the kept listing, no request), and a new pod (an empty cache, the listing kept
beside the data by another: two objects read instead of N/1000 LIST pages).

    python bench/listing.py [--keys 10000] [--latency-ms 20]

One JSON line. The keys are put straight into the in-thread moto server's store (10^4 PUTs over HTTP take minutes
here); every request timed goes over HTTP through the proxy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]

from mixplane.loader.listing import source_listing  # noqa: E402
from mixplane.spec import SourceSpec  # noqa: E402
from tests.s3server import MotoS3, S3Proxy, credentials_env  # noqa: E402


def _timed(proxy: S3Proxy, fn):
    proxy.reset_counts()
    t = time.perf_counter()
    files = fn()
    s = time.perf_counter() - t
    lists = sum(1 for m, p in proxy.seen if m == "GET" and "list-type=" in p)
    return files, {"s": round(s, 3), "requests": proxy.requests, "list_requests": lists, "files": len(files.paths),
                   "kept_from": "listed" if files.kept_from is None else ("beside" if "://" in files.kept_from
                                                                           else "cache")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    args = ap.parse_args()
    os.environ.update(credentials_env())
    server = MotoS3()
    proxy = S3Proxy(server.endpoint, latency_s=args.latency_ms / 1000)
    work = tempfile.mkdtemp(prefix="listing-bench-")
    try:
        server.put_keys("corpus", [f"many/d{i // 1000:03d}/f{i:06d}.parquet" for i in range(args.keys)])
        uri = "s3://corpus/many/"

        def spec(endpoint: str, **kw) -> SourceSpec:
            return SourceSpec(name="web", uri=uri, columns=["tokens"], kind="tokens", endpoint=endpoint,
                              region="us-east-1", **kw)

        cache = os.path.join(work, "cache")
        _, first = _timed(proxy, lambda: source_listing(spec(proxy.endpoint), cache_dir=cache))
        _, second = _timed(proxy, lambda: source_listing(spec(proxy.endpoint), cache_dir=cache))
        # the pods' case: one keeps it beside the data (straight to the server: the proxy does not forward chunked
        # uploads), a new pod with an empty cache starts through the proxy
        source_listing(spec(server.endpoint, index_beside_data=True), cache_dir=os.path.join(work, "pod-a"))
        _, pod = _timed(proxy, lambda: source_listing(spec(proxy.endpoint, index_beside_data=True),
                                                      cache_dir=os.path.join(work, "pod-b")))
        print(json.dumps({"keys": args.keys, "latency_ms": args.latency_ms, "first": first, "second": second,
                          "new_pod_beside": pod, "load": os.getloadavg()}))
    finally:
        proxy.stop()
        server.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
