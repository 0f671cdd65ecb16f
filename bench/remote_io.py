"""Remote I/O benchmark (issue 13 item 5): the bench/loader_io.py dataset served by a real S3-compatible
server on 127.0.0.1 over HTTP (s3rver, a Node server installed by ``make s3rver``, when present: it streams
ranges from disk; else moto's standalone server, which copies a whole object per ranged GET and so caps the
full-size run at ~10 requests/s) through a proxy that adds a fixed latency to
every request and caps each transfer's bandwidth.

Modes (each in its own process, clean peak RSS):
- ``page``: page shuffle with read-ahead of the shuffle order (coalesced requests, bounded in flight);
- ``page_naive``: page shuffle, one request per page and column, nothing fetched ahead;
- ``rowgroup``: row-group shuffle (whole column chunks per request);
- ``hf_streaming``: Hugging Face ``datasets`` streaming of the same objects through the same endpoint
  (plain HTTP GETs of the object URLs, the server allows them), 10,000-sample shuffle buffer;
and ``page`` on the local copy in the same run (``local_page_samples_per_s``).

Per mode: samples_per_s, requests_per_1k_samples and bytes_read_per_sample (counted at the proxy: what
went over the network, index building excluded — it happens once, at open, and is cached in sidecars),
read_amplification (network bytes / delivered text bytes), peak_rss_mb, pair_gap (mean |row distance|
of consecutive samples / rows: 1/3 for a uniform shuffle). Page mode runs once per coalescing gap of
``--gaps`` (0, 64 KiB, 1 MiB by default) at each latency; the best is reported as ``page``.

Usage: python bench/remote_io.py [--quick] [--latency-ms 20,50] [--gaps 0,65536,1048576] [--mode-budget S]
One JSON line per latency; the last (the first latency given, 20 ms by default):
{"latency_ms": .., "local_page_samples_per_s": .., "modes": {NAME: {"samples_per_s": .., "requests_per_1k_samples": ..,
 "bytes_read_per_sample": .., "read_amplification": .., "peak_rss_mb": .., "pair_gap": ..}}, "best_coalesce_gap": ..}
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

FIELDS = ["samples_per_s", "requests_per_1k_samples", "bytes_read_per_sample", "read_amplification", "peak_rss_mb",
          "pair_gap"]
BUCKET, PREFIX = "bench", "loader_io"


def worker(args) -> None:
    """One mode against ``args.endpoint`` (or the local copy); prints one JSON line."""
    from loader_io import _peak_rss_mb, quality

    from mixplane.loader import remote
    from mixplane.loader.memory import configure_allocator

    configure_allocator()
    import pyarrow.compute as pc

    args.mode = args.worker
    for kv in filter(None, args.io.split(",")):
        k, v = kv.split("=")
        setattr(remote.DEFAULTS, k, int(v))
    lat, pos_parts, delivered, got = [], [], 0, 0
    if args.mode == "hf_streaming":
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import datasets

        datasets.disable_progress_bars()
        urls = [f"{args.endpoint}/{BUCKET}/{PREFIX}/{n}" for n in args.names.split(",")]
        ds = datasets.load_dataset("parquet", data_files=urls, split="train", streaming=True, columns=["text", "id"])
        ds = ds.reshard().shuffle(seed=0, buffer_size=10_000)
        it = ds.iter(batch_size=args.batch)
        from loader_io import drain_hf_batches

        t0 = time.perf_counter()
        got, delivered = drain_hf_batches(it, lat, pos_parts,
                                          lambda got: got < args.samples and time.perf_counter() - t0 < args.budget)
    else:
        from mixplane.loader.stream import open_stream
        from mixplane.samples import key_row
        from mixplane.spec import SourceSpec

        mode = "page" if args.mode.startswith("page") else args.mode
        if args.endpoint:
            src = SourceSpec(name="bench", uri=f"s3://{BUCKET}/{PREFIX}/*.parquet", endpoint=args.endpoint,
                             region="us-east-1", columns=["text"], kind="text", shuffle=mode, shuffle_buffer_mb=None)
        else:
            src = SourceSpec(name="bench", uri=args.data, columns=["text"], kind="text", shuffle=mode, shuffle_buffer_mb=None)
        s = open_stream(src, seed=0, buffer_rows=10_000)
        print(json.dumps({"opened": True}), flush=True)  # the parent starts counting requests here
        sys.stdin.readline()
        t0 = time.perf_counter()
        while got < args.samples and time.perf_counter() - t0 < args.budget:
            t = time.perf_counter()
            r = s.take(args.batch)
            lat.append(time.perf_counter() - t)
            pos_parts.append(key_row(r.keys))
            delivered += int(pc.sum(pc.binary_length(r.columns["text"])).as_py() or 0)
            got += len(r)
        local_bytes = s.stats.bytes_read
        s.close()
    wall = time.perf_counter() - t0
    pos = np.concatenate(pos_parts) if pos_parts else np.zeros(0, np.int64)
    pair_gap, _ = quality(pos, args.n_total)
    print(json.dumps({"samples": got, "wall_s": wall, "delivered": delivered, "pair_gap": round(pair_gap, 4),
                      "peak_rss_mb": round(_peak_rss_mb(), 1),
                      "local_bytes": local_bytes if args.mode != "hf_streaming" else 0,
                      "p50_batch_ms": round(float(np.percentile(np.array(lat) * 1000, 50)), 2) if lat else 0.0}))


def run(mode: str, proxy, data: str, names: list[str], n_total: int, samples: int, budget: float, io: str = "") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--data", data, "--n-total", str(n_total),
           "--samples", str(samples), "--budget", str(budget), "--io", io, "--names", ",".join(names),
           "--endpoint", proxy.endpoint if proxy is not None else ""]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if mode != "hf_streaming":
        line = p.stdout.readline()
        if not line.startswith("{"):
            p.kill()
            raise SystemExit(f"mode {mode} failed to open:\n{line}{p.stderr.read()[-3000:]}")
    if proxy is not None:
        proxy.reset_counts()
    if mode != "hf_streaming":
        p.stdin.write("go\n")
        p.stdin.flush()
    out, err = p.communicate(timeout=budget * 4 + 300)
    if p.returncode != 0:
        raise SystemExit(f"mode {mode} failed:\n{err[-3000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    got = max(res["samples"], 1)
    net_bytes = proxy.get_bytes if proxy is not None else res["local_bytes"]
    requests = proxy.requests if proxy is not None else 0
    return {"samples_per_s": round(res["samples"] / res["wall_s"], 1) if res["wall_s"] > 0 else 0.0,
            "requests_per_1k_samples": round(1000 * requests / got, 1),
            "bytes_read_per_sample": round(net_bytes / got, 1),
            "read_amplification": round(net_bytes / max(res["delivered"], 1), 3),
            "peak_rss_mb": res["peak_rss_mb"], "pair_gap": res["pair_gap"],
            "_extra": {"samples": res["samples"], "p50_batch_ms": res["p50_batch_ms"], "requests": requests}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small loader_io dataset, one latency, short runs")
    ap.add_argument("--latency-ms", default=None, help="comma-separated latencies (default 20,50; quick: 20)")
    ap.add_argument("--page-io", default="", help="RemoteIO settings for page mode, e.g. prefetch_pages=64,max_inflight=16")
    ap.add_argument("--bandwidth-mbps", type=float, default=800.0, help="cap per transfer, megabits/s")
    ap.add_argument("--server", choices=["auto", "s3rver", "moto"], default="auto",
                    help="S3-compatible server: s3rver (npm, make s3rver) when installed, else moto")
    ap.add_argument("--gaps", default="0,65536,1048576", help="page mode's coalescing gaps swept (bytes)")
    ap.add_argument("--modes", default="page_naive,rowgroup,hf_streaming", help="modes run besides page and local page")
    ap.add_argument("--mode-budget", type=float, default=None, help="seconds per mode (default 10 quick, 60 full)")
    ap.add_argument("--mode-samples", type=int, default=None, help="samples per mode (default 3000 quick, 30000 full)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default="", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    ap.add_argument("--n-total", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--io", default="", help=argparse.SUPPRESS)
    ap.add_argument("--names", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    from loader_io import build_dataset

    from tests.s3server import S3RVER_KEY, MotoS3, S3Proxy, S3rver, credentials_env

    quick = args.quick
    latencies = [float(x) for x in (args.latency_ms or ("20" if quick else "20,50")).split(",")]
    data = os.path.join(HERE, "data", "loader_io_quick" if quick else "loader_io")
    man = build_dataset(data, int((0.04 if quick else 1.05) * (1 << 30)), quick)
    n_total = man["rows"]
    names = [os.path.basename(p) for p in man["paths"]]
    use = args.server if args.server != "auto" else ("s3rver" if S3rver.available() else "moto")
    if use == "s3rver" and not S3rver.available():
        raise SystemExit("s3rver is not installed: make s3rver")
    os.environ.update(credentials_env(S3RVER_KEY if use == "s3rver" else None))
    cache = tempfile.mkdtemp(prefix="mixplane-remote-index-")
    os.environ["MIXPLANE_INDEX_CACHE"] = cache  # sidecars: the index is built once per object, as in production
    # its own process: no shared interpreter lock with the proxy. s3rver streams ranges from disk; moto
    # copies an object's whole value per ranged GET (on the full-size 70 MB objects ~10 requests/s)
    server = S3rver((BUCKET,)) if use == "s3rver" else MotoS3(process=True)
    t0 = time.time()
    server.upload_dir(data, BUCKET, PREFIX)
    print(json.dumps({"dataset_bytes": man["dataset_bytes"], "rows": n_total, "objects": len(names), "server": use,
                      "upload_s": round(time.time() - t0, 1)}), flush=True)
    samples, budget = (3000, 10.0) if quick else (30_000, 60.0)
    samples, budget = args.mode_samples or samples, args.mode_budget or budget
    local = run("page", None, data, names, n_total, samples, budget)
    print(json.dumps({"local_page": local}), flush=True)
    lines = []
    try:
        for lat in latencies:
            proxy = S3Proxy(server.endpoint, latency_s=lat / 1000, bandwidth_bps=args.bandwidth_mbps * 1e6 / 8)
            try:
                modes, sweep = {}, {}
                gaps = [int(g) for g in args.gaps.split(",")]
                for gap in gaps:
                    sweep[gap] = run("page", proxy, data, names, n_total, samples, budget,
                                     ",".join(filter(None, [f"coalesce_gap={gap}", args.page_io])))
                    print(json.dumps({"latency_ms": lat, "mode": "page", "coalesce_gap": gap, **sweep[gap]}), flush=True)
                best = max(sweep, key=lambda g: sweep[g]["samples_per_s"])
                modes["page"] = sweep[best]
                others = {"page_naive": "prefetch_pages=0,coalesce_gap=0", "rowgroup": "", "hf_streaming": ""}
                for mode, io in ((m, others[m]) for m in filter(None, args.modes.split(","))):
                    modes[mode] = run(mode, proxy, data, names, n_total, samples, budget, io)
                    print(json.dumps({"latency_ms": lat, "mode": mode, **modes[mode]}), flush=True)
                lines.append({"latency_ms": lat, "local_page_samples_per_s": local["samples_per_s"],
                              "modes": {m: {k: r[k] for k in FIELDS} for m, r in modes.items()},
                              "best_coalesce_gap": best})
            finally:
                proxy.stop()
    finally:
        server.stop()
        for f in glob.glob(os.path.join(cache, "*")):
            os.unlink(f)
        os.rmdir(cache)
    for line in reversed(lines):  # the first latency (20 ms) last
        print(json.dumps(line))


if __name__ == "__main__":
    main()
