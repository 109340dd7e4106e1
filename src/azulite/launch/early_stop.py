"""Early termination of sweep trials: Azure ML's bandit, median stopping and truncation selection.

Each trial's primary metric is a series of reports (its MLflow history, in step order). A policy looks at
a running trial each time its report count n reaches a multiple of ``evaluation_interval`` after the first
``delay_evaluation`` reports, comparing it with the other trials' n-th reports (finished ones included):

- bandit: stop when the trial is worse than the best n-th report by more than the slack — a factor
  (best * (1 + f) for minimize, best / (1 + f) for maximize) or an amount (best ± a);
- median stopping: stop when the trial's running average of its first n reports is worse than the median
  of the other trials' running averages at n;
- truncation selection: stop when the trial's n-th report is in the worst ``truncation_percentage``
  percent of all n-th reports.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from azulite.spec.sweep import Bandit, MedianStopping, Objective, TruncationSelection


def due_at(policy: Bandit | MedianStopping | TruncationSelection, reports: int) -> int:
    """The report count of the latest evaluation point a trial with ``reports`` reports has reached: a
    multiple of ``evaluation_interval`` after ``delay_evaluation``; 0 when none."""
    n = reports // policy.evaluation_interval * policy.evaluation_interval
    return n if n > policy.delay_evaluation else 0


def should_stop(policy: Bandit | MedianStopping | TruncationSelection, objective: Objective, trial: str,
                reports: Mapping[str, Sequence[float]]) -> bool:
    """Whether running trial ``trial`` stops at its latest evaluation point, given every trial's reports
    so far. Another trial counts with its report at that point, or its last one if it has fewer (a trial
    that finished early still sets the bar)."""
    n = due_at(policy, len(reports[trial]))
    if not n:
        return False
    minimize = objective.goal == "minimize"
    at_n = {t: r[min(n, len(r)) - 1] for t, r in reports.items() if r}
    if len(at_n) < 2:
        return False
    mine = reports[trial]
    value = mine[n - 1]
    if isinstance(policy, Bandit):
        best = min(at_n.values()) if minimize else max(at_n.values())
        if policy.slack_factor is not None:
            limit = best * (1 + policy.slack_factor) if minimize else best / (1 + policy.slack_factor)
        else:
            limit = best + policy.slack_amount if minimize else best - policy.slack_amount
        return value > limit if minimize else value < limit
    if isinstance(policy, MedianStopping):
        avg = statistics.fmean(mine[:n])
        median = statistics.median(statistics.fmean(r[:min(n, len(r))]) for t, r in reports.items() if t != trial and r)
        return avg > median if minimize else avg < median
    ranked = sorted(at_n.values(), reverse=minimize)  # worst first
    cut = max(1, int(len(ranked) * policy.truncation_percentage / 100))
    best = min(at_n.values()) if minimize else max(at_n.values())
    return value in ranked[:cut] and value != best
