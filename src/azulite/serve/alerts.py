"""The serving alert rules, as data for the one renderer (:mod:`azulite.observe.rules`): output drift
(PSI, KS), failures, guard refusals, fallbacks in use, lost audit lines, queue backlog. The metric names
are the ones this package exports (Triton's ``nv_*`` and azulite's ``azulite_*``).

    from azulite.observe.rules import rule_file, prometheus_rule_yaml
    open("serving-rules.yml", "w").write(rule_file(serving_rule_groups()))
"""

from __future__ import annotations

from azulite.observe.rules import Alert, Record, RuleGroup

#: PSI over 0.25 is the usual "significant shift" line; 0.1-0.25 a moderate one
PSI_CRITICAL = 0.25
KS_WARNING = 0.2


def serving_rule_groups(*, psi_threshold: float = PSI_CRITICAL, ks_threshold: float = KS_WARNING,
                        error_ratio: float = 0.05, drift_for: str = "15m") -> list[RuleGroup]:
    drift = RuleGroup(name="azulite-serving-drift", rules=(
        Alert(alert="AzuliteOutputDriftPSI", expr=f"max by (model, output) (azulite_output_psi) > {psi_threshold}",
              for_=drift_for, labels={"severity": "warning"},
              annotations={"summary": "Output {{ $labels.output }} of model {{ $labels.model }} drifted (PSI)",
                           "description": "PSI {{ $value | printf \"%.3f\" }} of the current window against the "
                                          f"reference window is over {psi_threshold} for {drift_for}: the model's "
                                          "inputs or behaviour changed."}),
        Alert(alert="AzuliteOutputDriftKS", expr=f"max by (model, output) (azulite_output_ks) > {ks_threshold}",
              for_=drift_for, labels={"severity": "info"},
              annotations={"summary": "Output {{ $labels.output }} of model {{ $labels.model }} drifted (KS)",
                           "description": "KS statistic {{ $value | printf \"%.3f\" }} is over "
                                          f"{ks_threshold} for {drift_for}."}),
    ))
    health = RuleGroup(name="azulite-serving", rules=(
        Record(record="model:nv_inference_request_failure:rate5m",
               expr="sum by (model) (rate(nv_inference_request_failure[5m]))"),
        Record(record="model:nv_inference_request_success:rate5m",
               expr="sum by (model) (rate(nv_inference_request_success[5m]))"),
        Alert(alert="AzuliteInferenceErrors",
              expr=("model:nv_inference_request_failure:rate5m\n  / (model:nv_inference_request_failure:rate5m"
                    f" + model:nv_inference_request_success:rate5m) > {error_ratio}"),
              for_="10m", labels={"severity": "critical"},
              annotations={"summary": "Model {{ $labels.model }} fails over "
                                      f"{error_ratio:.0%} of its requests"}),
        Alert(alert="AzuliteQueueBacklog", expr="max by (model) (nv_inference_pending_request_count) > 100",
              for_="5m", labels={"severity": "warning"},
              annotations={"summary": "Model {{ $labels.model }} has over 100 requests waiting",
                           "description": "Add instances (instance_group count) or replicas, or bound the "
                                          "queue (max_queue_size) and name a fallback model."}),
        Alert(alert="AzuliteFallbackInUse", expr="sum by (model, reason) (rate(azulite_fallback_total[5m])) > 0",
              for_="10m", labels={"severity": "warning"},
              annotations={"summary": "Model {{ $labels.model }} is answered by its fallback ({{ $labels.reason }})"}),
        Alert(alert="AzuliteRateLimited",
              expr='sum(rate(azulite_requests_rejected_total{status="RESOURCE_EXHAUSTED"}[5m])) > 1',
              for_="15m", labels={"severity": "info"},
              annotations={"summary": "Clients are refused by rate limits or quotas (429)"}),
        Alert(alert="AzuliteAuthFailures",
              expr='sum(rate(azulite_requests_rejected_total{status=~"UNAUTHENTICATED|PERMISSION_DENIED"}[5m])) > 5',
              for_="10m", labels={"severity": "warning"},
              annotations={"summary": "Many requests without a valid key, or outside their keys' rights"}),
        Alert(alert="AzuliteAuditLogLosing",
              expr="increase(azulite_audit_write_errors_total[10m]) + increase(azulite_audit_dropped_total[10m]) > 0",
              labels={"severity": "critical"},
              annotations={"summary": "Audit log lines are being lost (disk full or unwritable?)"}),
    ))
    return [drift, health]


def latency_rule_groups(*, p99_target_ms: float = 500, window: str = "5m") -> list[RuleGroup]:
    """p99 over its target (from the request-latency histogram, Triton's ``histogram_latencies``) and a
    model that stopped being served (its series were there in the last hour and are gone)."""
    return [RuleGroup(name="azulite-serving-latency", rules=(
        Record(record="model:nv_inference_first_response_ms:p99",
               expr=f"histogram_quantile(0.99, sum by (model, le) (rate(nv_inference_first_response_histogram_ms_bucket[{window}])))"),
        Alert(alert="AzuliteLatencyP99High", expr=f"model:nv_inference_first_response_ms:p99 > {p99_target_ms:g}",
              for_="10m", labels={"severity": "warning"},
              annotations={"summary": "Model {{ $labels.model }} p99 latency {{ $value | printf \"%.0f\" }} ms "
                                      f"is over its {p99_target_ms:g} ms target"}),
        Alert(alert="AzuliteModelUnavailable",
              expr=("max by (model) (max_over_time(nv_inference_request_success[1h]))\n"
                    "  unless max by (model) (nv_inference_request_success)"),
              labels={"severity": "critical"},
              annotations={"summary": "Model {{ $labels.model }} is no longer served",
                           "description": "It was served in the last hour and its metrics are gone: unloaded, "
                                          "failed to load, or its server is down."}),
    ))]
