"""Per model-version counters: the one source of Triton's statistics endpoint and of the Prometheus
metrics. Updated on the event loop only (the batcher's observer callbacks and the data plane), so plain
integers suffice: no lock, no protobuf on the hot path; messages are built when asked for.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from azulite.serve.backends.base import Timing
from azulite.serve.proto import service_pb2 as pb

FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
#: upper bounds (ms) of the request-latency histogram (Triton's ``histogram_latencies``); Triton's default
#: four buckets (100, 500, 2000, 5000 ms) cannot resolve a p99 of milliseconds, so these are finer
LATENCY_BUCKETS_MS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
_BUCKET_NS = tuple(int(b * 1_000_000) for b in LATENCY_BUCKETS_MS)


@dataclass(slots=True)
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, n: int = 1) -> None:
        self.count += n
        self.ns += ns

    def fill(self, msg: pb.StatisticDuration) -> None:
        msg.count = self.count
        msg.ns = self.ns


@dataclass(slots=True)
class _BatchStat:
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)


@dataclass(slots=True)
class ModelStats:
    """Triton's InferStatistics for one model version, plus the failure reasons the metrics label."""

    name: str
    version: str
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)
    cache_hit: _Duration = field(default_factory=_Duration)  # serve/response_cache.py: lookup time
    cache_miss: _Duration = field(default_factory=_Duration)  # lookup and insertion time
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    pending: int = 0
    batches: dict[int, _BatchStat] = field(default_factory=dict)
    #: successful requests per latency bucket (not cumulative; the last one is +Inf): one bisect and one
    #: increment per request, the cumulative form is built at scrape time
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(_BUCKET_NS) + 1))

    # --- the batcher's Observer -------------------------------------------------------------------

    def queued(self, delta: int) -> None:
        self.pending += delta

    def executed(self, batch_size: int, queue_ns: Sequence[int], timing: Timing, ok: bool) -> None:
        n = len(queue_ns)
        self.queue.add(sum(queue_ns), n)  # one add for the batch, not one per request
        if not ok:
            return
        # Triton counts compute durations per request: each request of a batch spent the batch's time.
        self.compute_input.add(timing.input_ns * n, n)
        self.compute_infer.add(timing.infer_ns * n, n)
        self.compute_output.add(timing.output_ns * n, n)
        self.inference_count += batch_size
        self.execution_count += 1
        stat = self.batches.get(batch_size)
        if stat is None:
            stat = self.batches[batch_size] = _BatchStat()
        stat.compute_input.add(timing.input_ns)
        stat.compute_infer.add(timing.infer_ns)
        stat.compute_output.add(timing.output_ns)

    # --- the data plane ---------------------------------------------------------------------------

    def succeeded(self, ns: int, n: int = 1) -> None:
        """``n`` requests answered in ``ns`` each (n > 1: a front-end's coalesced requests, serve/coalesce.py)."""
        success = self.success  # inlined _Duration.add: this runs once per request and per ensemble step
        success.count += n
        success.ns += ns * n
        self.latency_buckets[bisect_left(_BUCKET_NS, ns)] += n
        self.last_inference_ms = time.time_ns() // 1_000_000

    def failed(self, ns: int, reason: str, n: int = 1) -> None:
        self.fail.add(ns * n, n)
        self.failures[reason] = self.failures.get(reason, 0) + n
        self.last_inference_ms = time.time_ns() // 1_000_000

    def to_proto(self) -> pb.ModelStatistics:
        msg = pb.ModelStatistics(
            name=self.name,
            version=self.version,
            last_inference=self.last_inference_ms,
            inference_count=self.inference_count,
            execution_count=self.execution_count,
        )
        s = msg.inference_stats
        self.success.fill(s.success)
        self.fail.fill(s.fail)
        self.queue.fill(s.queue)
        self.compute_input.fill(s.compute_input)
        self.compute_infer.fill(s.compute_infer)
        self.compute_output.fill(s.compute_output)
        self.cache_hit.fill(s.cache_hit)  # listed even when zero, as Triton 2.51 lists them
        self.cache_miss.fill(s.cache_miss)
        s.cache_hit.SetInParent()
        s.cache_miss.SetInParent()
        for size in sorted(self.batches):
            stat = self.batches[size]
            b = msg.batch_stats.add(batch_size=size)
            stat.compute_input.fill(b.compute_input)
            stat.compute_infer.fill(b.compute_infer)
            stat.compute_output.fill(b.compute_output)
        return msg
