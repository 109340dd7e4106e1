"""Triton's Prometheus metrics, named and labelled as Triton names them (``model``, ``version``; failures
also ``reason``), read from the per-version statistics at scrape time — the infer path pays nothing.

Built on prometheus_client (a ``Collector`` registered in a private ``CollectorRegistry``: no global
state, one registry per server). ``metrics_text()`` renders Prometheus text format 0.0.4 itself because
prometheus_client appends ``_total`` to every counter name on exposition, and Triton's counters
(``nv_inference_request_success``...) carry no suffix: dashboards and alerts written for Triton query
the bare names.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import psutil
from prometheus_client.core import CollectorRegistry, Metric

from azulite.serve.stats import LATENCY_BUCKETS_MS, ModelStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS: tuple[tuple[str, str, Callable[[ModelStats], float]], ...] = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
     lambda s: s.success.count),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)",
     lambda s: s.inference_count),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     lambda s: s.execution_count),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds"
     " (includes cached requests)",
     lambda s: (s.success.ns + s.fail.ns) // 1000),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds"
     " (includes cached requests)",
     lambda s: s.queue.ns // 1000),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds"
     " (does not include cached requests)",
     lambda s: s.compute_input.ns // 1000),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds"
     " (does not include cached requests)",
     lambda s: s.compute_infer.ns // 1000),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds"
     " (does not include cached requests)",
     lambda s: s.compute_output.ns // 1000),
)


class TritonCollector:
    """A prometheus_client collector over the live statistics (``stats()`` returns them)."""

    def __init__(self, stats: Callable[[], Iterable[ModelStats]]) -> None:
        self._stats = stats
        psutil.cpu_percent(interval=None)  # prime: the first call has no interval to measure

    def collect(self) -> Iterable[Metric]:
        all_stats = list(self._stats())
        failure = Metric("nv_inference_request_failure",
                         "Number of failed inference requests, all batch sizes", "counter")
        for s in all_stats:
            for reason, count in s.failures.items():
                failure.add_sample("nv_inference_request_failure",
                                   {"model": s.name, "version": s.version, "reason": reason}, count)
        yield failure
        for name, doc, get in _COUNTERS:
            metric = Metric(name, doc, "counter")
            for s in all_stats:
                metric.add_sample(name, {"model": s.name, "version": s.version}, get(s))
            yield metric
        yield _latency_histogram(all_stats)
        pending = Metric("nv_inference_pending_request_count",
                         "Instantaneous number of pending requests awaiting execution per-model.", "gauge")
        for s in all_stats:
            pending.add_sample("nv_inference_pending_request_count", {"model": s.name, "version": s.version}, s.pending)
        yield pending
        memory = psutil.virtual_memory()
        for name, doc, value in (
            # azulite keeps no pinned-memory pool: 0, as Triton's CPU build reports (dashboards made for Triton
            # read these two)
            ("nv_pinned_memory_pool_total_bytes", "Pinned memory pool total memory size, in bytes", 0),
            ("nv_pinned_memory_pool_used_bytes", "Pinned memory pool used memory size, in bytes", 0),
            ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", psutil.cpu_percent(interval=None) / 100.0),
            ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", memory.total),
            ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", memory.total - memory.available),
        ):
            metric = Metric(name, doc, "gauge")
            metric.add_sample(name, {}, value)
            yield metric


HISTOGRAM = "nv_inference_first_response_histogram_ms"
_LE = tuple(repr(float(b)) for b in LATENCY_BUCKETS_MS) + ("+Inf",)


def _latency_histogram(all_stats: list[ModelStats]) -> Metric:
    """Triton's ``histogram_latencies`` metric: for a non-decoupled model the first response is the
    response, so this is the request latency; ``histogram_quantile`` over it gives p50/p99."""
    m = Metric(HISTOGRAM, "Duration from request to first response in milliseconds", "histogram")
    for s in all_stats:
        labels = {"model": s.name, "version": s.version}
        total = 0
        for le, n in zip(_LE, s.latency_buckets):
            total += n
            m.add_sample(HISTOGRAM + "_bucket", {**labels, "le": le}, total)
        m.add_sample(HISTOGRAM + "_count", labels, total)
        m.add_sample(HISTOGRAM + "_sum", labels, s.success.ns / 1e6)
    return m


def _value(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(metrics: Iterable[Metric]) -> bytes:
    lines: list[str] = []
    for m in metrics:
        name = m.name
        if m.type == "counter" and m.samples and m.samples[0].name == name + "_total":
            name += "_total"  # a counter named as Prometheus names them (prometheus-client's families do)
        lines.append(f"# HELP {name} {m.documentation}")
        lines.append(f"# TYPE {name} {m.type}")
        for s in m.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels.items())
            lines.append(f"{s.name}{{{labels}}} {_value(s.value)}" if labels else f"{s.name} {_value(s.value)}")
    return ("\n".join(lines) + "\n").encode()


class ServerMetrics:
    """One per server: ``registry`` for prometheus_client users, ``metrics_text()`` for /metrics."""

    content_type = CONTENT_TYPE

    def __init__(self, stats: Callable[[], Iterable[ModelStats]]) -> None:
        self.collector = TritonCollector(stats)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        #: more collect() callables rendered after Triton's (the guard's counters)
        self.extra: list[Callable[[], Iterable[Metric]]] = []

    def metrics_text(self) -> bytes:
        if not self.extra:
            return render(self.collector.collect())
        return render(itertools.chain(self.collector.collect(), *(collect() for collect in self.extra)))
