"""One scrape port for several components' registries (a loader process hosting a group of Source Loaders)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from mixplane.metrics import make_metrics, serve_merged
from mixplane.planner.server import PlannerState


def test_merged_registries_add_up_per_source_and_take_process_metrics_once():
    a, b = make_metrics("loader"), make_metrics("loader")
    a.loader_tokens.labels("web").inc(5)
    b.loader_tokens.labels("web").inc(7)
    b.loader_tokens.labels("code").inc(2)
    a.loader_read_seconds.observe(0.01)
    b.loader_read_seconds.observe(0.02)
    regs = [a.registry]
    port = serve_merged(lambda: list(regs), "127.0.0.1", 0)
    regs.append(b.registry)  # asked at every scrape: partitions adopted later are served too
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}  # the parser refuses duplicate families
    tok = {s.labels["source"]: s.value for s in fams["mixplane_loader_tokens"].samples if s.name.endswith("_total")}
    assert tok == {"web": 12.0, "code": 2.0}
    count = [s.value for s in fams["mixplane_loader_read_seconds"].samples if s.name.endswith("_count")]
    assert count == [2.0]
    info = [s for s in fams["mixplane_component_info"].samples]
    assert [s.value for s in info] == [1.0]
    rss = [s for s in fams["process_resident_memory_bytes"].samples]
    assert len(rss) == 1 and rss[0].value > 0


def test_planner_state_measures_tokens_per_second_per_source():
    st = PlannerState(started=100.0)
    st.add_source_tokens([100, 0], 101.0)
    st.add_source_tokens([100, 50], 102.0)
    assert st.source_tokens == [200, 50]
    assert st.source_rates(104.0) == [50.0, 12.5]  # since the start (4 s)
    st.rate_window_s = 2.0
    st.add_source_tokens([10, 10], 110.0)  # old samples leave the window
    assert st.source_rates(110.0) == [round(10 / 8, 3), round(10 / 8, 3)]
