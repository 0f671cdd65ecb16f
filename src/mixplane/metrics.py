"""Prometheus metrics of every component, in one place so dashboards and code agree on names."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from mixplane import settings

_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class PlannerSourceSeries:
    """The planner's per-source and per-window series, kept as arrays and turned into samples only when
    Prometheus scrapes. A step updates 4 series per source and 1 per loader window: 5,120 `labels()`
    children set one by one cost ~5 ms a step at 1,024 sources (bench/plan_scale.py), while a scrape
    comes every few seconds. Each update replaces one tuple, so a scrape on the HTTP thread reads one
    consistent step."""

    def __init__(self, registry: CollectorRegistry):
        self._names: list[str] = []
        self._windows: list[tuple[str, str]] = []  # (source, replica) labels of each window
        # (tokens, samples, target, realised, window samples); None until the first step
        self._values: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        registry.register(self)

    def label(self, names: list[str], windows: list[tuple[str, str]]) -> None:
        """The sources' and windows' labels, in the order of the arrays `add_step` gets; totals restart."""
        self._names, self._windows, self._values = list(names), list(windows), None

    def add_step(self, tokens: Any, samples: Any, target: Any, realized: Any, window_samples: Any) -> None:
        """One planned step: tokens / samples per source are added to the totals; the shares and window sizes
        replace the last ones."""
        n = len(self._names)
        old = self._values
        tok = np.asarray(tokens, np.float64)
        smp = np.asarray(samples, np.float64)
        if old is not None:
            tok, smp = old[0] + tok, old[1] + smp
        self._values = (tok.reshape(n), smp.reshape(n), np.array(target, np.float64).reshape(n),
                        np.array(realized, np.float64).reshape(n),
                        np.asarray(window_samples, np.float64).reshape(len(self._windows)))

    def collect(self) -> Iterator[Metric]:
        values, names, windows = self._values, self._names, self._windows
        fams: tuple[CounterMetricFamily | GaugeMetricFamily, ...] = (
            CounterMetricFamily("mixplane_planner_tokens_total", "Tokens planned per source", labels=["source"]),
                CounterMetricFamily("mixplane_planner_samples_total", "Samples planned per source", labels=["source"]),
                GaugeMetricFamily("mixplane_planner_target_fraction", "Target share of each source in the current phase",
                                  labels=["source"]),
                GaugeMetricFamily("mixplane_planner_realized_fraction", "Realised share of each source in the current phase",
                                  labels=["source"]))
        win = GaugeMetricFamily("mixplane_planner_window_samples", "Samples visible in a loader replica's window",
                                labels=["source", "replica"])
        if values is not None:
            for fam, arr in zip(fams, values):
                for name, v in zip(names, arr.tolist()):
                    fam.add_metric([name], v)
            for lbl, v in zip(windows, values[4].tolist()):
                win.add_metric(list(lbl), v)
        yield from fams
        yield win


@dataclass
class Metrics:
    registry: CollectorRegistry
    # wire (all components)
    bad_messages: Counter
    refused: Counter
    handshakes_failed: Counter
    liveness_detections: Counter
    silent_peers: Gauge
    # planner
    steps_planned: Counter
    plan_seconds: Histogram
    planner_step: Gauge
    planner_phase: Gauge
    planner_sources: PlannerSourceSeries  # per source and per loader window (tokens, samples, shares, window size)
    planner_waiting: Gauge
    packing_efficiency: Gauge
    mixture_generation: Gauge
    # loader
    loader_samples_read: Counter
    loader_tokens: Counter
    loader_bytes_sent: Counter
    loader_quarantined_pages: Counter
    loader_quarantined_samples: Counter
    loader_dropped_overlong: Counter
    loader_overlong_docs: Counter
    loader_buffer_samples: Gauge
    loader_dry: Gauge
    loader_outbox_messages: Gauge
    loader_read_seconds: Histogram
    loader_remote_requests: Counter
    loader_remote_bytes: Counter
    loader_remote_retries: Counter
    loader_remote_cache_hits: Counter
    loader_remote_request_seconds: Histogram
    # constructor
    constructor_steps: Counter
    constructor_build_seconds: Histogram
    constructor_bytes_sent: Counter
    constructor_pending_steps: Gauge
    constructor_client_wait_seconds: Histogram
    constructor_quarantined_images: Counter
    # planner (appended)
    rank_imbalance: Gauge
    # fault tolerance (appended): loader restarts seen by the planner, steps resent, duplicate payloads dropped
    loader_rejoins: Counter
    replayed_steps: Counter
    constructor_duplicate_samples: Counter
    # trainer restarts and elastic resharding (appended)
    trainer_rejoins: Counter
    reshards: Counter
    # recovery (appended): planner restarts from the journal, constructor restarts, damaged payloads
    planner_recoveries: Counter
    recovered_steps: Counter
    recovery_mismatches: Counter
    constructor_rejoins: Counter
    resent_samples: Counter
    payload_damaged: Counter
    # every component: which one this endpoint is (join key for process_* metrics on dashboards)
    component_info: Gauge
    # trainers' per-source loss reports (appended)
    loss_reports: Counter
    source_loss: Gauge
    source_loss_tokens: Counter


def make_metrics(component: str) -> Metrics:
    """A fresh registry per process/component (tests create several in one process)."""
    r = CollectorRegistry()
    lbl = ["component"]

    def c(name: str, doc: str, labels: list[str] | None = None) -> Counter:
        return Counter(name, doc, labels or [], registry=r)

    def g(name: str, doc: str, labels: list[str] | None = None) -> Gauge:
        return Gauge(name, doc, labels or [], registry=r)

    def h(name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=_FAST, registry=r)

    m = Metrics(
        registry=r,
        bad_messages=c("mixplane_wire_bad_messages_total", "Malformed or unexpected messages dropped", lbl + ["reason"]),
        liveness_detections=c("mixplane_liveness_detections_total", "Peers found silent for longer than the miss budget",
                              lbl + ["peer"]),
        silent_peers=g("mixplane_liveness_silent_peers", "Registered peers silent for longer than the miss budget", lbl),
        refused=c("mixplane_wire_refused_total", "Messages refused because the sender's role may not send their kind",
                  lbl + ["kind", "role"]),
        handshakes_failed=c("mixplane_wire_handshakes_failed_total", "Connections to a CURVE socket refused before any message: "
                            "auth (a key not in the run's key set), protocol (no CURVE, another protocol, garbage), other",
                            lbl + ["socket", "reason"]),
        steps_planned=c("mixplane_planner_steps_planned_total", "Steps planned"),
        plan_seconds=h("mixplane_planner_plan_seconds", "Time to plan one step"),
        planner_step=g("mixplane_planner_step", "Last planned step"),
        planner_phase=g("mixplane_planner_phase", "Mixture phase of the last planned step"),
        planner_sources=PlannerSourceSeries(r),
        planner_waiting=g("mixplane_planner_waiting_windows", "Loader windows the next step is waiting for"),
        packing_efficiency=g("mixplane_planner_packing_efficiency", "Fraction of row tokens holding data in the last step"),
        mixture_generation=g("mixplane_planner_mixture_generation", "Spec generation in force"),
        loader_samples_read=c("mixplane_loader_samples_read_total", "Samples read and transformed", ["source"]),
        loader_tokens=c("mixplane_loader_tokens_total", "Tokens produced", ["source"]),
        loader_bytes_sent=c("mixplane_loader_bytes_sent_total", "Payload bytes sent to constructors", ["source"]),
        loader_quarantined_pages=c("mixplane_loader_quarantined_pages_total", "Bad units (pages, row groups, files) skipped", ["source"]),
        loader_quarantined_samples=c("mixplane_loader_quarantined_samples_total", "Samples a transform could not decode (e.g. a broken image): dropped, or, when only an image's pixels failed, delivered with that image blank (image_quarantined)", ["source"]),
        loader_dropped_overlong=c("mixplane_loader_dropped_overlong_total", "Samples longer than seq_len dropped (batch.overlong: drop)", ["source"]),
        loader_overlong_docs=c("mixplane_loader_overlong_docs_total", "Documents over sources[].max_doc_bytes / max_doc_tokens, by what was done (cut: first piece kept; split: delivered as several pieces)", ["source", "action"]),
        loader_buffer_samples=g("mixplane_loader_buffer_samples", "Samples held in the read buffer", ["source"]),
        loader_dry=g("mixplane_loader_dry", "1 while a live source has no new data", ["source"]),
        loader_outbox_messages=g("mixplane_loader_outbox_messages", "Sample messages waiting for a constructor to take them", ["source"]),
        loader_read_seconds=h("mixplane_loader_read_seconds", "Time to read and transform one chunk"),
        loader_remote_requests=c("mixplane_loader_remote_requests_total", "Requests to object storage (ranged GETs, HEADs of opens)", ["source"]),
        loader_remote_bytes=c("mixplane_loader_remote_bytes_total", "Bytes read from object storage", ["source"]),
        loader_remote_retries=c("mixplane_loader_remote_retries_total", "Object-storage requests retried (throttling, 5xx, cut transfers, timeouts)", ["source"]),
        loader_remote_cache_hits=c("mixplane_loader_remote_cache_hits_total", "Remote reads served from the reader's read-ahead, footer and disk caches", ["source"]),
        loader_remote_request_seconds=Histogram("mixplane_loader_remote_request_seconds", "Latency of one object-storage request",
                                                ["source"], buckets=_FAST, registry=r),
        constructor_steps=c("mixplane_constructor_steps_total", "Steps materialised"),
        constructor_build_seconds=h("mixplane_constructor_build_seconds", "Time to materialise one step"),
        constructor_bytes_sent=c("mixplane_constructor_bytes_sent_total", "Bytes delivered to clients"),
        constructor_pending_steps=g("mixplane_constructor_pending_steps", "Steps planned but not yet complete"),
        constructor_client_wait_seconds=h("mixplane_constructor_client_wait_seconds", "How long a client request waited for its step"),
        constructor_quarantined_images=c("mixplane_constructor_quarantined_images_total", "Images whose header read but whose pixels did not decode here, delivered as zeros (image_quarantined)"),
        rank_imbalance=g("mixplane_planner_rank_imbalance", "Balancer's cost imbalance across ranks of the last step (max / mean, 1 = perfect)", ["part"]),
        loader_rejoins=c("mixplane_planner_loader_rejoins_total", "Loaders that said HELLO again (restarted)", ["loader"]),
        replayed_steps=c("mixplane_planner_replayed_steps_total", "Planned steps a restarted loader was told to send again"),
        constructor_duplicate_samples=c("mixplane_constructor_duplicate_samples_total",
                                        "SAMPLES messages of a (step, loader) already held, dropped (loader restarts)"),
        trainer_rejoins=c("mixplane_planner_trainer_rejoins_total", "Trainer ranks that resumed mid-session from their own state_dict (no rewind)"),
        reshards=c("mixplane_planner_reshards_total", "Live topology changes (elastic resharding)"),
        planner_recoveries=c("mixplane_planner_recoveries_total", "Planner starts that recovered a running session from its journal"),
        recovered_steps=c("mixplane_planner_recovered_steps_total", "Journaled steps planned again (and re-sent) after a planner restart"),
        recovery_mismatches=c("mixplane_planner_recovery_mismatches_total",
                              "Steps re-planned after a restart whose layout differs from the journal's digest"),
        constructor_rejoins=c("mixplane_planner_constructor_rejoins_total", "Constructors that said HELLO again (restarted)",
                              ["constructor"]),
        resent_samples=c("mixplane_loader_resent_samples_total", "SAMPLES messages pushed again to a restarted constructor",
                         ["source"]),
        payload_damaged=c("mixplane_wire_payload_damaged_total",
                          "Payload messages (SAMPLES, STEP_DATA) refused as damaged or truncated, by sender",
                          lbl + ["kind", "sender"]),
        component_info=g("mixplane_component_info", "1 per component endpoint; joins process_* metrics to the component", lbl),
        loss_reports=c("mixplane_planner_loss_reports_total", "Per-source loss reports received from trainer ranks"),
        source_loss=g("mixplane_planner_source_loss", "Mean token loss per source over the newest report of each trainer rank",
                      ["source"]),
        source_loss_tokens=c("mixplane_planner_source_loss_tokens_total", "Tokens whose loss trainer ranks reported, per source",
                             ["source"]),
    )
    m.component_info.labels(component).set(1)
    ProcessCollector(registry=r)  # process_resident_memory_bytes etc.: memory per component on the dashboard
    return m


def metrics_host(default: str) -> str:
    """Where /metrics binds: MIXPLANE_METRICS_HOST (a pod sets 0.0.0.0 so Prometheus reaches it), else `default`."""
    return settings.get("MIXPLANE_METRICS_HOST") or default


def serve_metrics(m: Metrics, host: str = "127.0.0.1", port: int = 0) -> int:
    """Start /metrics on a background thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=metrics_host(host), registry=m.registry)
    return int(server.server_port)


class MergedRegistries:
    """Several components' registries as one scrape target (a loader process hosting a group of Source Loaders
    serves them on one fixed port). Samples with the same name and labels are added up (counters, histograms,
    per-source gauges of replicas in one process); process_*, *_info and *_created samples describe the one
    process and are taken once."""

    def __init__(self, registries: Iterable[CollectorRegistry] | Callable[[], Iterable[CollectorRegistry]]):
        self.registries = registries if callable(registries) else list(registries)  # a callable: asked at every scrape

    def collect(self) -> Iterator[Metric]:
        fams: dict[str, Metric] = {}
        index: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
        regs = self.registries() if callable(self.registries) else self.registries
        for reg in regs:
            for fam in reg.collect():
                out = fams.get(fam.name)
                if out is None:
                    out = fams[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                once = fam.name.startswith("process_") or fam.type == "info" or fam.name == "mixplane_component_info"
                for s in fam.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    at = index.get(key)
                    if at is None:
                        index[key] = len(out.samples)
                        out.samples.append(s)
                    elif not (once or s.name.endswith("_created")):
                        prev = out.samples[at]
                        out.samples[at] = prev._replace(value=prev.value + s.value)
        yield from fams.values()


def serve_merged(registries: Iterable[CollectorRegistry] | Callable[[], Iterable[CollectorRegistry]], host: str = "127.0.0.1", port: int = 0) -> int:
    """One /metrics for several registries (see MergedRegistries); returns the bound port."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(MergedRegistries(registries))
    server, _thread = start_http_server(port, addr=metrics_host(host), registry=reg)
    return int(server.server_port)


@dataclass
class HandoffMetrics:
    """Partition handoff (planner.partitions): moves, promotions, fenced messages, warm windows."""

    handoffs: Counter  # planner: partitions moved, by reason (request, failover, restart)
    fenced: Counter  # planner / constructor: messages of a partition's older epoch dropped
    partitions_hosted: Gauge  # loader host: partitions it serves as primary
    partitions_shadowed: Gauge  # loader host: partitions it keeps warm as a shadow
    warm_samples: Counter  # loader: samples a seek kept (already read and transformed) instead of reading again
    without_host: Gauge  # planner: partitions no live loader host serves (primary silent, no live shadow)


def handoff_metrics(m: Metrics) -> HandoffMetrics:
    """Register the handoff metrics in a component's registry (once per component)."""
    r = m.registry
    return HandoffMetrics(
        handoffs=Counter("mixplane_partition_handoffs_total", "Partitions moved to another loader host", ["reason"], registry=r),
        fenced=Counter("mixplane_fenced_messages_total",
                       "Messages of a partition's older epoch (a host that lost it) dropped", ["kind"], registry=r),
        partitions_hosted=Gauge("mixplane_loader_host_partitions", "Partitions this loader host serves as primary", registry=r),
        partitions_shadowed=Gauge("mixplane_loader_host_shadows", "Partitions this loader host keeps warm as a shadow", registry=r),
        warm_samples=Counter("mixplane_loader_warm_samples_total",
                             "Samples a seek kept from what was already read (shadow promotion, replay)", ["source"], registry=r),
        without_host=Gauge("mixplane_partitions_without_host",
                           "Partitions no live loader host serves: the primary is silent and no live shadow could take "
                           "over; delivery of their steps waits for a restart or another host", registry=r),
    )
