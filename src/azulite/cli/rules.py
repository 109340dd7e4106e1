"""``azulite rules render``: every part's alert rules through the one renderer (azulite.observe.rules), as a
Prometheus rule file or a prometheus-operator PrometheusRule."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from azulite.cli.console import check_output_file
from azulite.errors import SpecError

if TYPE_CHECKING:
    from azulite.observe.rules import RuleGroup

PARTS = ("gpu", "training", "serving")

app = typer.Typer(
    no_args_is_help=True,
    help=(
        "Alert rules for GPUs, training jobs and serving (checked with promtool).\n\n"
        "Examples:\n\n"
        "  azulite rules render -o rules.yml && promtool check rules rules.yml\n\n"
        "  azulite rules render --format prometheusrule --name azulite | kubectl apply -f -"
    ),
)


def groups_for(parts: list[str], *, p99_target_ms: float, no_progress_minutes: int, checkpoint_k: float) -> list[RuleGroup]:
    parts = [p.lower() for p in parts]
    if not parts:  # an empty rule file would load, and alert on nothing
        raise SpecError("no rule part given", field="--parts", fix=f"name one or more of: {', '.join(PARTS)}")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SpecError(f"unknown rule part(s): {', '.join(unknown)}", field="--parts", fix=f"choose from {', '.join(PARTS)}")
    from azulite.observe.alerts import gpu_rule_groups, training_rule_groups  # the rule renderer (yaml)
    from azulite.serve.alerts import latency_rule_groups, serving_rule_groups

    out: list[RuleGroup] = []
    if "gpu" in parts:
        out += gpu_rule_groups()
    if "training" in parts:
        out += training_rule_groups(no_progress_minutes=no_progress_minutes, checkpoint_k=checkpoint_k)
    if "serving" in parts:
        out += serving_rule_groups() + latency_rule_groups(p99_target_ms=p99_target_ms)
    return out


@app.command("render")
def render(
    parts: str = typer.Option(",".join(PARTS), "--parts", help="Comma-separated: gpu, training, serving."),
    format_: str = typer.Option("file", "--format", help="file (Prometheus rule_files) or prometheusrule (Kubernetes object)."),
    name: str = typer.Option("azulite", "--name", help="PrometheusRule object name."),
    namespace: str = typer.Option("monitoring", "--namespace", help="PrometheusRule namespace."),
    rule_label: list[str] = typer.Option([], "--rule-label", help="KEY=VALUE label of the PrometheusRule, repeatable (kube-prometheus-stack loads rules labelled release=<its Helm release>)."),
    p99_target_ms: float = typer.Option(500, "--p99-target-ms", help="Serving p99 latency target."),
    no_progress_minutes: int = typer.Option(15, "--no-progress-minutes", help="Training: minutes without progress before alerting."),
    checkpoint_k: float = typer.Option(3, "--checkpoint-k", help="Training: alert when the last checkpoint is older than k intervals (k > 1)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write here (atomically) instead of stdout."),
) -> None:
    """Render the rules.

      azulite rules render --parts gpu,training -o rules.yml
    """
    from azulite.observe.rules import prometheus_rule_yaml, rule_file

    if format_ not in ("file", "prometheusrule"):
        raise SpecError(f"unknown format {format_!r}", field="--format", fix="file or prometheusrule")
    if format_ == "file" and ((name, namespace) != ("azulite", "monitoring") or rule_label):  # a Kubernetes object's
        raise SpecError("--name, --namespace and --rule-label are the PrometheusRule object's", field="--format",
                        fix="add --format prometheusrule, or drop --name/--namespace/--rule-label")
    from azulite.cli.deploy import parse_labels

    labels = parse_labels(rule_label, "--rule-label")
    if not (0 < p99_target_ms < math.inf and no_progress_minutes >= 1):  # nan too
        raise SpecError("thresholds must be positive", field="--p99-target-ms/--no-progress-minutes",
                        fix="e.g. --p99-target-ms 250 --no-progress-minutes 15")
    if not 1 < checkpoint_k < math.inf:  # nan too
        # a running job's last checkpoint is up to one interval old (plus the save) at every moment: at k <= 1 the
        # alert fires in every interval (at 0.5, for half of each)
        raise SpecError(f"must be > 1, got {checkpoint_k:g}: the alert fires when the last checkpoint is older than k "
                        "intervals, and between two saves it is up to 1 interval old", field="--checkpoint-k",
                        fix="e.g. --checkpoint-k 3 (3 intervals: two saves in a row missed)")
    groups = groups_for([p.strip() for p in parts.split(",") if p.strip()], p99_target_ms=p99_target_ms,
                        no_progress_minutes=no_progress_minutes, checkpoint_k=checkpoint_k)
    try:
        text = rule_file(groups) if format_ == "file" else prometheus_rule_yaml(groups, name=name, namespace=namespace,
                                                                                          labels=labels)
    except SpecError as exc:  # the object's name or namespace: said as the flag that gave it
        if exc.field not in ("name", "namespace"):
            raise
        raise SpecError(exc.message, field=f"--{exc.field}", fix=exc.fix) from None
    if out is None:
        typer.echo(text, nl=False)
        return
    check_output_file(out, "--out", "rules.yml")
    # never a half-written rule file where Prometheus reloads it
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)  # no stray temp file beside the rules on a failed write
        raise
