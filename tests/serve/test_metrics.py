"""The request-latency histogram (Triton's ``histogram_latencies`` metric) beside Triton's counters:
consistent with them, slow requests in slow buckets, and an exposition promtool accepts."""

from __future__ import annotations

import asyncio
import subprocess

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from azulite.serve.metrics import HISTOGRAM
from azulite.serve.stats import LATENCY_BUCKETS_MS

from .test_dataplane import add_sub_request, fp32, plane
from azulite.serve.types import InferRequest


def test_latency_histogram_matches_the_counters_and_the_delays(model_repository):
    dp = plane(model_repository, control_mode="explicit", load_models=("add_sub_py", "slow_py"))

    async def main():
        ok = np.ones((1, 16), np.float32)
        for _ in range(5):
            await dp.infer(add_sub_request("add_sub_py", ok, ok))
        for _ in range(2):  # slow_py sleeps 0.2 s per execution
            await dp.infer(InferRequest(model_name="slow_py", inputs=[fp32("INPUT0", np.ones((1, 1), np.float32))]))
        text = dp.metrics.metrics_text().decode()
        await dp.shutdown()
        return text

    text = asyncio.run(main())
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    hist = fams[HISTOGRAM]
    assert hist.type == "histogram"
    by_model: dict[str, dict] = {}
    for s in hist.samples:
        by_model.setdefault(s.labels["model"], {})[(s.name, s.labels.get("le"))] = s.value
    success = {s.labels["model"]: s.value for s in fams["nv_inference_request_success"].samples}
    duration_us = {s.labels["model"]: s.value for s in fams["nv_inference_request_duration_us"].samples}
    for model, n in (("add_sub_py", 5), ("slow_py", 2)):
        h = by_model[model]
        buckets = [h[(HISTOGRAM + "_bucket", repr(float(b)))] for b in LATENCY_BUCKETS_MS] + [h[(HISTOGRAM + "_bucket", "+Inf")]]
        assert buckets == sorted(buckets), "cumulative"
        assert buckets[-1] == h[(HISTOGRAM + "_count", None)] == success[model] == n
        assert abs(h[(HISTOGRAM + "_sum", None)] * 1000 - duration_us[model]) <= n  # us rounding per request
    slow = by_model["slow_py"]
    assert slow[(HISTOGRAM + "_bucket", "100.0")] == 0  # each took >= 200 ms
    assert slow[(HISTOGRAM + "_bucket", "10000.0")] == 2
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    # promtool parses the exposition and lints names; Triton's own names (``_ms``, ``histogram``, counters
    # without ``_total``) draw naming lints, kept on purpose, but the text must parse
    assert "parsing error" not in lint.stdout + lint.stderr and "error while" not in lint.stdout + lint.stderr, lint.stderr
