"""The Grafana dashboard against a real Prometheus (Debian `prometheus`) scraping a real `mixplane run`.

Two trainer ranks consume steps while Prometheus scrapes every component's /metrics; then every panel's
PromQL query must return data (series with finite values), and a few must say the right thing.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import yaml

from mixplane.client import MixtureLoader, source_loss
from mixplane.control import KEYS_SUBDIR
from mixplane.operator.dashboard import PANELS
from tests.conftest import token_mixture
from tests.k8s.cluster import binaries, free_port


def _read_components(proc: subprocess.Popen, timeout: float) -> tuple[str, dict[str, int]]:
    """Planner endpoint and each component's metrics port from `mixplane run`'s banner."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    planner, ports = None, {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if m := re.search(r"export MIXPLANE_PLANNER=(\S+?)\)", line):
            planner = m.group(1)
        elif m := re.match(r"\s+(\S+)\s+pid \d+.*metrics_port=(\d+)", line):
            ports[m.group(1)] = int(m.group(2))
        elif planner and ports and "step" in line:  # first progress line: the banner is complete
            return planner, ports
    raise AssertionError(f"mixplane run did not start (exit {proc.poll()}); planner={planner} ports={ports}")


PANELS_BY_TITLE = {p.title: p for p in PANELS}


def _query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _finite(result: list[dict]) -> list[dict]:
    return [s for s in result if math.isfinite(float(s["value"][1]))]


def test_every_panel_query_returns_data_from_a_real_run(token_sources, tmp_path, monkeypatch):
    prom_bin = binaries(("prometheus",))["prometheus"]
    # source c with one unreadable file: its pages are quarantined, so that panel shows real counts
    root = tmp_path / "sources"
    for n in ("a", "b", "c"):
        shutil.copytree(token_sources["root"] / n, root / n)
    bad = sorted((root / "c").glob("*.parquet"))[-1]
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2)
    doc = token_mixture(root, strategy={"name": "llm_balance"}, runtime={"window": 64, "metrics": True})
    spec_file = tmp_path / "mixture.yaml"
    spec_file.write_text(yaml.safe_dump(doc))
    run = subprocess.Popen([sys.executable, "-m", "mixplane.cli", "run", str(spec_file), "--run-dir", str(tmp_path / "run"),
                            "--max-seconds", "150"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    prom = None
    stop = threading.Event()
    threads: list[threading.Thread] = []
    errors: list[BaseException] = []
    try:
        planner, ports = _read_components(run, 90)
        assert any(n.startswith("loader") for n in ports) and "planner" in ports, ports
        cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
               "scrape_configs": [{"job_name": "mixplane", "static_configs": [
                   {"targets": [f"127.0.0.1:{p}"], "labels": {"mixplane_process": n}} for n, p in ports.items()]}]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        port = free_port()
        prom = subprocess.Popen([prom_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
        base = f"http://127.0.0.1:{port}"

        # the run is secure by default: trainers present the client key the runtime generated into its run dir
        monkeypatch.setenv("MIXPLANE_CURVE_DIR", str(tmp_path / "run" / KEYS_SUBDIR))

        def consume(rank: int) -> None:
            try:
                loader = MixtureLoader(planner, rank=rank, timeout_s=60)
                for batch in loader:
                    if stop.is_set():
                        break
                    # what a trainer reports after its step: per-source token losses (here 1 + source id), for the loss panel
                    ids = batch["source_ids"]
                    loss_sum, tokens = source_loss((ids.clamp(min=0) + 1).double(), ids, len(loader.sources))
                    loader.report_loss(int(batch["step"]), loss_sum, tokens)
                    time.sleep(0.05)  # a trainer's step time: keeps the run going while Prometheus scrapes
                loader.close()
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=consume, args=(r,), daemon=True) for r in (0, 1)]
        for t in threads:
            t.start()

        exprs = [q.expr for p in PANELS for q in p.queries]

        def check(results: dict[str, list[dict]]) -> None:
            empty = [f"{p.title}: {q.expr}" for p in PANELS for q in p.queries if not results.get(q.expr)]
            assert not empty, "panels without data:\n" + "\n".join(empty)

            def series(title: str, i: int = 0) -> dict[str, float]:
                return {s["metric"].get("source", s["metric"].get("part", "")): float(s["value"][1])
                        for s in results[PANELS_BY_TITLE[title].queries[i].expr]}

            assert set(series("Tokens read per source")) == {"a", "b", "c"}
            assert set(series("Tokens planned per source")) == {"a", "b", "c"}
            assert all(v > 0 for v in series("Tokens planned per source").values())
            target = series("Realised vs target weight", 1)
            assert set(target) == {"a", "b", "c"} and all(abs(target[k] - v) < 1e-9 for k, v in {"a": 0.5, "b": 0.3, "c": 0.2}.items())
            assert series("Source Loaders per source") == {"a": 1.0, "b": 1.0, "c": 1.0}
            assert series("Loss per source") == {"a": 1.0, "b": 2.0, "c": 3.0}  # the reported 1 + source index
            assert all(v >= 1.0 for v in series("Rank imbalance").values())
            quarantined = series("Quarantined pages")
            assert quarantined["c"] > 0 and quarantined["a"] == quarantined["b"] == 0, quarantined
            mem = results[PANELS_BY_TITLE["Memory per component"].queries[0].expr]
            assert {s["metric"]["component"] for s in mem} == {"planner", "loader", "constructor"}
            assert all(float(s["value"][1]) > 10e6 for s in mem)

        deadline = time.monotonic() + 90
        while True:
            assert not errors, errors
            try:
                results = {e: _finite(_query(base, e)) for e in exprs}
                check(results)
                break
            except (OSError, AssertionError):  # Prometheus still starting, or not every series scraped yet
                if time.monotonic() > deadline:
                    log = (tmp_path / "prometheus.log").read_text()[-2000:]
                    print(f"prometheus log: {log}")
                    raise
                time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        run.terminate()
        try:
            run.wait(30)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait(5)
