"""The sweep job spec: ``type: sweep`` as Azure ML defines it (sweepJob.schema.json).

A ``trial`` (a command job: code, command, environment, resources, distribution) run once per sample of
the ``search_space``, chosen by ``sampling_algorithm``, judged by ``objective.primary_metric`` (read from
the trial's MLflow metrics), bounded by ``limits`` and cut short by ``early_termination``. The sweep's
``inputs``/``outputs`` are the trial's; the command uses ``${{search_space.NAME}}`` for the sampled values.

Distributions follow Azure ML's (and Hyperopt's) meaning: ``choice(values)``, ``randint(upper)`` in
[0, upper), ``uniform(min_value, max_value)``, ``loguniform(min_value, max_value)`` = exp(uniform(min, max))
(the bounds are logarithms), ``normal(mu, sigma)``, ``lognormal(mu, sigma)`` = exp(normal), and the
q-variants rounding to a multiple of ``q``. As on Azure ML, ``grid`` takes only ``choice``, and
``bayesian`` takes ``choice``, ``uniform`` and ``quniform``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from azulite.spec.job import AZUREML_KEYS, FieldCheck, JobSpec, parse_duration

_SEARCH_REF = re.compile(r"\$\{\{\s*search_space\.([A-Za-z0-9_.-]+?)\s*\}\}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Choice(_Model):
    type: Literal["choice"]
    values: list[Any] = Field(min_length=1)


class RandInt(_Model):
    type: Literal["randint"]
    upper: int = Field(ge=1)


class _Bounded(_Model):
    min_value: float
    max_value: float

    @model_validator(mode="after")
    def _ordered(self) -> "_Bounded":
        if not self.min_value < self.max_value:
            raise FieldCheck(f"min_value ({self.min_value}) must be below max_value ({self.max_value})",
                             field="min_value", fix="make min_value the lower bound (a loguniform's bounds are "
                                                    "logarithms: min_value: -6, max_value: -1 samples e^-6 to e^-1)")
        return self


class Uniform(_Bounded):
    type: Literal["uniform", "loguniform"]


class QUniform(_Bounded):
    type: Literal["quniform", "qloguniform"]
    q: float = Field(gt=0)


class Normal(_Model):
    type: Literal["normal", "lognormal"]
    mu: float
    sigma: float = Field(gt=0)


class QNormal(Normal):
    type: Literal["qnormal", "qlognormal"]  # type: ignore[assignment]
    q: float = Field(gt=0)


Distribution = Annotated[Union[Choice, RandInt, Uniform, QUniform, Normal, QNormal], Field(discriminator="type")]
#: every ``type`` a search_space entry takes (random sampling takes them all)
SAMPLED_TYPES = ("choice", "randint", "uniform", "loguniform", "quniform", "qloguniform", "normal", "lognormal",
                 "qnormal", "qlognormal")
SAMPLERS = ("random", "grid", "bayesian")
#: distributions each sampler takes (Azure ML's rules)
SUPPORTED = {
    "random": None,  # all
    "grid": ("choice",),
    "bayesian": ("choice", "uniform", "quniform"),
}


class Sampling(_Model):
    type: Literal["random", "grid", "bayesian"]
    seed: int | None = None
    rule: Literal["random", "sobol"] | None = None
    logbase: Any = None


class Objective(_Model):
    goal: Literal["minimize", "maximize"]
    primary_metric: str = Field(min_length=1)


class Limits(_Model):
    max_total_trials: int = Field(default=1000, ge=1)
    max_concurrent_trials: int = Field(default=1, ge=1)
    timeout: float | None = None
    trial_timeout: float | None = None

    @field_validator("timeout", "trial_timeout", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return None if v is None else parse_duration(v)


class _Policy(_Model):
    evaluation_interval: int = Field(default=1, ge=1)
    delay_evaluation: int = Field(default=0, ge=0)


class Bandit(_Policy):
    type: Literal["bandit"]
    slack_factor: float | None = Field(default=None, gt=0)
    slack_amount: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_slack(self) -> "Bandit":
        if (self.slack_factor is None) == (self.slack_amount is None):
            raise FieldCheck("a bandit policy needs exactly one of slack_factor or slack_amount",
                             fix="give one: slack_factor: 0.1 (within 10% of the best trial) or slack_amount: 0.2 "
                                 "(within 0.2 of it)")
        return self


class MedianStopping(_Policy):
    type: Literal["median_stopping"]


class TruncationSelection(_Policy):
    type: Literal["truncation_selection"]
    truncation_percentage: int = Field(ge=1, le=99)
    exclude_finished_jobs: bool = False


EarlyTermination = Annotated[Union[Bandit, MedianStopping, TruncationSelection], Field(discriminator="type")]
POLICY_TYPES = ("bandit", "median_stopping", "truncation_selection")


class SweepSpec(_Model):
    """A sweep job. ``trial`` is kept as the raw command-job mapping; :meth:`trial_spec` makes the
    validated JobSpec of one trial."""

    type: Literal["sweep"]
    name: str = Field(default="sweep", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$")
    trial: dict[str, Any]
    inputs: dict[str, Any] = Field(default_factory=dict)
    outputs: dict[str, Any] = Field(default_factory=dict)
    search_space: dict[str, Distribution] = Field(min_length=1)
    sampling_algorithm: Sampling
    objective: Objective
    limits: Limits = Field(default_factory=Limits)
    early_termination: EarlyTermination | None = None
    azureml: dict[str, Any] = Field(default_factory=dict)
    #: the trial as validated when loaded (paths resolved); not part of the YAML
    trial_job: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _split(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        kept = {k: data.pop(k) for k in list(data) if k in AZUREML_KEYS - {"type", "limits"}}
        if kept:
            data["azureml"] = {**data.get("azureml", {}), **kept}
        if isinstance(data.get("sampling_algorithm"), str):
            data["sampling_algorithm"] = {"type": data["sampling_algorithm"]}
        if isinstance(data.get("sampling_algorithm"), dict) and isinstance(data["sampling_algorithm"].get("type"), str):
            data["sampling_algorithm"] = {**data["sampling_algorithm"], "type": data["sampling_algorithm"]["type"].lower()}
        return data

    @model_validator(mode="after")
    def _sampler_takes_the_space(self) -> "SweepSpec":
        kind = self.sampling_algorithm.type
        if kind == "bayesian" and self.early_termination is not None:  # Azure ML's rule: each trial informs the next
            raise FieldCheck("bayesian sampling takes no early_termination (Azure ML refuses it: a trial stopped "
                             "early would inform the next samples)", field="early_termination",
                             fix="remove early_termination (--set early_termination=null), or sample at random "
                                 "(--set sampling_algorithm.type=random)")
        if self.sampling_algorithm.rule is not None and kind != "random":
            raise FieldCheck(f"sampling_algorithm.rule belongs to random sampling, not {kind}",
                             field="sampling_algorithm.rule",
                             fix="remove sampling_algorithm.rule (--set sampling_algorithm.rule=null), or sample at "
                                 "random (--set sampling_algorithm.type=random)")
        allowed = SUPPORTED[self.sampling_algorithm.type]
        if allowed is not None:
            for name, dist in self.search_space.items():
                if dist.type not in allowed:
                    example = ("{type: choice, values: [0.01, 0.1]}" if allowed == ("choice",)
                               else "{type: uniform, min_value: 0.01, max_value: 0.1}")
                    raise FieldCheck(f"search_space.{name} is {dist.type}, which {kind} sampling does not take (it "
                                     f"takes {', '.join(allowed)})", field=("search_space", name, "type"),
                                     fix=f"make search_space.{name} one of those, e.g. {example}; or sample at "
                                         "random, which takes every distribution (--set sampling_algorithm.type=random)")
        return self

    def trial_spec(self, values: dict[str, Any] | None = None) -> JobSpec:
        """The trial's command job with ``${{search_space.NAME}}`` replaced by ``values`` (kept as written
        when None: the validated template)."""
        data = dict(self.trial_job)
        if values is not None:
            data["command"] = _SEARCH_REF.sub(lambda m: _literal(values[m.group(1)]), data["command"])
        return JobSpec.model_validate(data)


def _literal(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def load_sweep(path: str | Path, overrides: Iterable[str] = ()) -> SweepSpec:
    """Read and validate a sweep job, its trial included (as ``load_job`` checks a command job)."""
    from azulite.spec.explain import _Source, _validation_error
    from azulite.spec.loader import _check_and_resolve, read_spec

    data, src, base = read_spec(path, overrides)
    try:
        sweep = SweepSpec.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, data, src) from None
    for m in _SEARCH_REF.finditer(str(sweep.trial.get("command", ""))):
        if m.group(1) not in sweep.search_space:
            raise src.error(f"the trial command uses {m.group(0)} but search_space has no {m.group(1)!r}",
                            ("trial", "command"), m.group(0), fix=f"declare it under search_space (known: "
                            f"{', '.join(sweep.search_space)})")
    # the trial as a command job: the sweep's inputs/outputs, its own command fields; errors name trial.*
    trial = {"name": sweep.name, **sweep.trial, "inputs": sweep.inputs, "outputs": sweep.outputs}
    if sweep.limits.trial_timeout and "timeout" not in trial:
        trial["timeout"] = sweep.limits.trial_timeout
    lines = {p[1:]: n for p, n in src.lines.items() if p[:1] == ("trial",)}
    lines.update({p: n for p, n in src.lines.items() if p[:1] in (("inputs",), ("outputs",))})
    sub = _Source(src.file, lines, {p[1:]: v for p, v in src.overrides.items() if p[:1] == ("trial",)}, prefix="trial.")
    try:  # errors name trial.<field> (the sub-source's prefix), but for the sweep's inputs and outputs
        job = JobSpec.model_validate(trial)
    except ValidationError as exc:
        raise _validation_error(exc, trial, sub) from None
    job = _check_and_resolve(job, base, sub, kinds=("inputs", "outputs", "search_space"))
    return sweep.model_copy(update={"trial_job": job.model_dump(mode="json")})


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> JobSpec | SweepSpec:
    """A command job or a sweep job, by its ``type``."""
    from azulite.spec.loader import load_job, read_spec

    data, _, _ = read_spec(path, overrides)
    return load_sweep(path, overrides) if data.get("type") == "sweep" else load_job(path, overrides)
