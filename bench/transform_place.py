"""Benchmark: where the VLM example's images are decoded (``image.decode_at``) -- loader, constructor, client.

The sources of ``examples/vlm-hybrid.yaml`` (``pairs``: real images of this machine, ``mixplane demo-data
--images``, patch 14, max_side 896, merge 4, at weight 0.8; ``prose``: man pages, 0.2) run on a real embedded
data plane (planner, loader processes, constructor) with two data-parallel ranks in this process, once per
place, the same steps each time. Per place:

* ``loader_cpu_s`` / ``constructor_cpu_s``: user + system CPU of the loader / constructor processes over the
  steps (psutil, from the first step asked to the last received; start-up excluded);
* ``client_cpu_s``: CPU the clients spent decoding images (``MixtureLoader.image_decode_cpu_s``, thread clock);
* ``loader_to_constructor_bytes_per_step``: ``mixplane_loader_bytes_sent_total`` of the loaders (tokens and
  images) over the steps the planner planned; ``constructor_to_client_bytes_per_step``:
  ``mixplane_constructor_bytes_sent_total`` over the steps delivered;
* ``digest``: sha256 of every tensor every rank received (equal for the three places: batches are identical).

``auto``: the place ``loader.transforms.resolve_decode_places`` picks for ``pairs`` from its measured costs
(``measured``: decode CPU ms, raw and decoded bytes per image; ``costs_ms``: imagedecode.place_costs).

Last stdout line: {"places": {place: {...}}, "auto": place, "measured": {...}, "costs_ms": {...}, "identical": bool,
"steps": n, "images": n, "load": [1, 5, 15 min]}. ``--quick``: 200 images, 6 steps (under a minute).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mixplane.client import MixtureLoader  # noqa: E402
from mixplane.imagedecode import place_costs  # noqa: E402
from mixplane.loader.transforms import measure_image_costs, resolve_decode_places  # noqa: E402
from mixplane.runtime import EmbeddedRuntime  # noqa: E402
from mixplane.spec import parse_spec  # noqa: E402

PLACES = ("loader", "constructor", "client")


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def data(cache: Path, images: int) -> Path:
    from mixplane.demo.data import build_image_pairs, ensure_demo_data

    d = cache / "demo-data"
    ensure_demo_data(d, max_mb=1.0)
    mark = d / "pairs" / ".images"  # how many images the pairs hold now (a --quick run after a full one rebuilds)
    if not mark.exists() or mark.read_text() != str(images):
        build_image_pairs(d / "pairs", max_images=images)
        mark.write_text(str(images))
    return d


def spec(d: Path, place: str, run_dir: Path, *, sequences: int, seq_len: int):
    """examples/vlm-hybrid.yaml's sources and weights on a small mesh (2 data-parallel ranks, vanilla strategy)."""
    tok = str(d / "tokenizer.json")
    return parse_spec({
        "name": "transform-place",
        "sources": [{"name": "pairs", "uri": str(d / "pairs"), "kind": "image_text", "columns": ["image", "caption"],
                     "tokenizer": tok, "image": {"patch_size": 14, "max_side": 896, "merge": 4, "decode_at": place}},
                    {"name": "prose", "uri": str(d / "man"), "tokenizer": tok}],
        "mixture": {"weights": {"pairs": 0.8, "prose": 0.2}},
        "batch": {"sequences": sequences, "seq_len": seq_len, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 2}}},
        "strategy": {"name": "vanilla"},
        "runtime": {"metrics": True, "run_dir": str(run_dir)},
    })


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name) and not l.startswith("#"))


def run(s, run_dir: Path, steps: int) -> dict:
    import psutil

    with EmbeddedRuntime(s, run_dir, log_level="WARNING") as rt:
        comps = rt.endpoints()["components"]
        procs = {n: psutil.Process(c["pid"]) for n, c in comps.items()}

        def cpu(prefix: str) -> float:
            return sum(sum(p.cpu_times()[:2]) for n, p in procs.items() if n.startswith(prefix))

        clients = [MixtureLoader(rt.planner_endpoint, rank=r, timeout_s=120, max_steps=steps) for r in range(2)]
        c0 = {k: cpu(k) for k in ("loader", "constructor")}
        h = hashlib.sha256()
        images = 0
        try:
            for _ in range(steps):
                for cl in clients:
                    b = next(cl)
                    images += len(b["image_ids"]) if "image_ids" in b else 0
                    for k in sorted(b):
                        h.update(k.encode())
                        h.update(b[k].numpy().tobytes())
            out = {k + "_cpu_s": round(cpu(k) - c0[k], 3) for k in ("loader", "constructor")}
            out["client_cpu_s"] = round(sum(cl.image_decode_cpu_s for cl in clients), 3)
            planned = metric(comps["planner"]["metrics_port"], "mixplane_planner_steps_planned_total")
            sent = sum(metric(c["metrics_port"], "mixplane_loader_bytes_sent_total") for n, c in comps.items()
                       if n.startswith("loader"))
            delivered = sum(metric(c["metrics_port"], "mixplane_constructor_bytes_sent_total") for n, c in comps.items()
                            if n.startswith("constructor"))
            out["loader_to_constructor_bytes_per_step"] = int(sent / max(planned, 1))
            out["constructor_to_client_bytes_per_step"] = int(delivered / steps)
            out["steps_planned"] = int(planned)
            out["images"] = images
            out["digest"] = h.hexdigest()[:16]
        finally:
            for cl in clients:
                cl.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200 images, 6 steps")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--images", type=int, default=None)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "mixplane" / "transform-place"))
    a = ap.parse_args()
    steps = a.steps or (6 if a.quick else 30)
    n_img = a.images or (200 if a.quick else 2000)
    d = data(Path(a.cache), n_img)
    t0 = time.monotonic()
    base = spec(d, "auto", Path(a.cache) / "run", sequences=4, seq_len=4096)
    costs = measure_image_costs(base.sources[0], base.mixture.seed)
    auto = resolve_decode_places(base, lambda _s, _seed: costs).sources[0].image.decode_at
    log(f"pairs: {costs.images} images measured: {costs.decode_s * 1e3:.2f} ms CPU, {costs.raw_bytes:.0f} raw bytes, "
        f"{costs.decoded_bytes:.0f} decoded bytes per image -> auto: {auto}")
    places = {}
    with tempfile.TemporaryDirectory(prefix="transform-place-") as tmp:
        for place in PLACES:
            places[place] = run(spec(d, place, Path(tmp) / place, sequences=4, seq_len=4096), Path(tmp) / place, steps)
            log(place, places[place])
    out = {"places": places, "auto": auto,
           "measured": {"images": costs.images, "decode_ms": round(costs.decode_s * 1e3, 3),
                        "raw_bytes": int(costs.raw_bytes), "decoded_bytes": int(costs.decoded_bytes)},
           "costs_ms": {k: round(v * 1e3, 3) for k, v in place_costs(costs).items()},
           "identical": len({p["digest"] for p in places.values()}) == 1,
           "steps": steps, "images": n_img, "wall_s": round(time.monotonic() - t0, 1),
           "load": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
