"""The GPU and training alert rules, as data for the one renderer (:mod:`azulite.observe.rules`), over the
series ``azulite observe`` exports: DCGM's GPU fields (the PrometheusRule of seed 001 §2.5, plus
temperature) and the job store's jobs (``azulite.observe.jobs``: no progress, a stale checkpoint, a loss that
is NaN or infinite, a rank restarting again and again).

    from azulite.observe.rules import rule_file
    open("rules.yml", "w").write(rule_file(gpu_rule_groups() + training_rule_groups()))
"""

from __future__ import annotations

from azulite.observe.rules import Alert, RuleGroup

RUNNING = 'on (job_id) azulite_job_state{state="running"} == 1'


def gpu_rule_groups(*, fb_free_mib: int = 1024, temp_c: int = 85, idle_utilization: int = 5,
                    memory_for: str = "2m") -> list[RuleGroup]:
    """The one copy of the GPU alerts: ``azulite rules`` and ``azulite cluster render`` (its PrometheusRule,
    seed 001 §2.5) both render these."""
    return [RuleGroup(name="gpu.rules", rules=(
        # seed 001 §2.5, as written there
        Alert(alert="GPUMemoryExhausted", expr=f"DCGM_FI_DEV_FB_FREE < {fb_free_mib}", for_=memory_for,
              labels={"severity": "critical"},
              annotations={"summary": "GPU {{ $labels.gpu }} memory exhausted",
                           "description": "Only {{ $value }}MB free GPU memory"}),
        Alert(alert="GPUTemperatureHigh", expr=f"DCGM_FI_DEV_GPU_TEMP > {temp_c}", for_="5m",
              labels={"severity": "warning"},
              annotations={"summary": "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} runs hot",
                           "description": f"{{{{ $value }}}} C for 5 minutes (over {temp_c} C): clocks will be throttled"}),
        # a GPU node paid for and not used (spot or not, the autoscaler only removes nodes with no pods)
        Alert(alert="GPUIdle", expr=f"avg_over_time(DCGM_FI_DEV_GPU_UTIL[10m]) < {idle_utilization}", for_="30m",
              labels={"severity": "info"},
              annotations={"summary": "GPU {{ $labels.gpu }} idle for 30 minutes",
                           "description": "Utilisation {{ $value }}%: a node paid for and not used"}),
    ))]


def training_rule_groups(*, no_progress_minutes: int = 15, checkpoint_k: float = 3, restarts: int = 3,
                         restart_window: str = "30m") -> list[RuleGroup]:
    return [RuleGroup(name="azulite-training", rules=(
        Alert(alert="AzuliteTrainingNoProgress",
              expr=f"(time() - azulite_job_last_progress_timestamp_seconds) > {no_progress_minutes * 60}\n  and {RUNNING}",
              for_="1m", labels={"severity": "warning"},
              annotations={"summary": "Job {{ $labels.job_id }} has made no progress for "
                                      f"{no_progress_minutes} minutes",
                           "description": "No rank of the running attempt has written to its log: a hang "
                                          "(a collective waiting on a lost rank, a stuck data loader)?"}),
        Alert(alert="AzuliteCheckpointStale",
              expr=("(time() - azulite_job_checkpoint_last_timestamp_seconds)\n"
                    f"  > {checkpoint_k:g} * azulite_job_checkpoint_interval_seconds\n  and {RUNNING}"),
              for_="1m", labels={"severity": "warning"},
              annotations={"summary": "Job {{ $labels.job_id }}'s last checkpoint is older than "
                                      f"{checkpoint_k:g} checkpoint intervals",
                           "description": "A preemption now would lose that much work; check the checkpoint "
                                          "storage (azulite doctor --checkpoint ...)."}),
        Alert(alert="AzuliteTrainingLossNotFinite",
              # NaN is the one value not equal to itself; Inf compares equal to the Inf literal
              expr=f"(azulite_job_train_loss != azulite_job_train_loss or abs(azulite_job_train_loss) == Inf)\n  and {RUNNING}",
              labels={"severity": "critical"},
              annotations={"summary": "Job {{ $labels.job_id }} logs a loss that is NaN or infinite",
                           "description": "Training diverged: stop it and resume from the last checkpoint "
                                          "with a lower learning rate, or check the input data."}),
        Alert(alert="AzuliteRankRestarting",
              expr=f"increase(azulite_job_rank_restarts_total[{restart_window}]) > {restarts}",
              labels={"severity": "warning"},
              annotations={"summary": "Rank {{ $labels.rank }} of job {{ $labels.job_id }} restarted over "
                                      f"{restarts} times in {restart_window}",
                           "description": "A crash loop: read the rank's log (azulite job logs ID --rank R)."}),
    ))]
