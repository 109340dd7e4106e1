"""Sampling a sweep's search space: random, grid and bayesian, behind one ask/tell interface.

Random samples every distribution of Azure ML's (with numpy; Optuna has no normal/lognormal), or, with
``rule: sobol``, walks a scrambled Sobol sequence (scipy.stats.qmc: low-discrepancy points, one dimension per
parameter, mapped through each distribution's inverse CDF), as Azure ML's random sampling offers; grid walks
the Cartesian product of the ``choice`` values in the order written; bayesian is Optuna's TPE (Tree-
structured Parzen Estimator) — Azure ML's own bayesian sampling is a Gaussian-process method, TPE is the
accepted stand-in here — told each finished trial's primary metric.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from azulite.errors import SweepError
from azulite.spec.sweep import Objective, SweepSpec


class Sampler:
    """``ask()`` -> (values, token) or None when the space is exhausted; ``tell(token, value)`` with the
    trial's primary metric (None: the trial failed or was stopped early)."""

    def ask(self) -> tuple[dict[str, Any], Any] | None:
        raise NotImplementedError

    def tell(self, token: Any, value: float | None) -> None:
        pass


def _draw(dist: Any, rng: np.random.Generator) -> Any:
    t = dist.type
    if t == "choice":
        return dist.values[int(rng.integers(len(dist.values)))]
    if t == "randint":
        return int(rng.integers(dist.upper))
    if t in ("uniform", "loguniform", "quniform", "qloguniform"):
        return _shaped(dist, float(rng.uniform(dist.min_value, dist.max_value)))
    return _shaped(dist, float(rng.normal(dist.mu, dist.sigma)))


def _shaped(dist: Any, x: float) -> float:
    """A continuous draw made log- and q- as the distribution's type says."""
    if "log" in dist.type:
        x = math.exp(x)
    if dist.type.startswith("q"):
        x = round(x / dist.q) * dist.q
    return x


def _at(dist: Any, u: float) -> Any:
    """The distribution's value at quantile ``u`` in [0, 1) (a Sobol point's coordinate)."""
    from scipy.special import ndtri

    t = dist.type
    if t == "choice":
        return dist.values[min(int(u * len(dist.values)), len(dist.values) - 1)]
    if t == "randint":
        return min(int(u * dist.upper), dist.upper - 1)
    if t in ("uniform", "loguniform", "quniform", "qloguniform"):
        return _shaped(dist, dist.min_value + u * (dist.max_value - dist.min_value))
    u = min(max(u, 1e-12), 1.0 - 1e-12)  # the normal's tails: a point at exactly 0 is -inf
    return _shaped(dist, dist.mu + dist.sigma * float(ndtri(u)))


#: Sobol points drawn at a time: a power of two, which keeps the sequence's balance
_SOBOL_BLOCK = 64


class RandomSampler(Sampler):
    def __init__(self, spec: SweepSpec) -> None:
        self.space = spec.search_space
        seed = spec.sampling_algorithm.seed
        self.rng = np.random.default_rng(seed)
        self._sobol = None
        self._points: Any = iter(())
        if spec.sampling_algorithm.rule == "sobol":
            from scipy.stats import qmc

            self._sobol = qmc.Sobol(d=len(self.space), scramble=True, seed=seed)

    def ask(self) -> tuple[dict[str, Any], Any] | None:
        if self._sobol is None:
            return {k: _draw(d, self.rng) for k, d in self.space.items()}, None
        point = next(self._points, None)
        if point is None:
            self._points = iter(self._sobol.random(_SOBOL_BLOCK))
            point = next(self._points)
        return {k: _at(d, float(u)) for (k, d), u in zip(self.space.items(), point)}, None


class GridSampler(Sampler):
    def __init__(self, spec: SweepSpec) -> None:
        names = list(spec.search_space)
        self._it = (dict(zip(names, combo)) for combo in itertools.product(*(spec.search_space[n].values for n in names)))

    def ask(self) -> tuple[dict[str, Any], Any] | None:
        values = next(self._it, None)
        return None if values is None else (values, None)


class BayesianSampler(Sampler):
    def __init__(self, spec: SweepSpec) -> None:
        import optuna
        from optuna.distributions import CategoricalDistribution, FloatDistribution

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self.space = spec.search_space
        self.dists = {
            k: CategoricalDistribution(d.values) if d.type == "choice" else FloatDistribution(d.min_value, d.max_value)
            for k, d in spec.search_space.items()
        }
        direction = "minimize" if spec.objective.goal == "minimize" else "maximize"
        self.study = optuna.create_study(direction=direction, sampler=optuna.samplers.TPESampler(seed=spec.sampling_algorithm.seed))

    def ask(self) -> tuple[dict[str, Any], Any] | None:
        trial = self.study.ask(self.dists)
        values = dict(trial.params)
        for k, d in self.space.items():
            if d.type == "quniform":
                values[k] = round(values[k] / d.q) * d.q
        return values, trial

    def tell(self, token: Any, value: float | None) -> None:
        state = self._optuna.trial.TrialState
        if value is None or not math.isfinite(value):
            self.study.tell(token, state=state.FAIL)
        else:
            self.study.tell(token, value)


def make_sampler(spec: SweepSpec) -> Sampler:
    kind = spec.sampling_algorithm.type
    cls = {"random": RandomSampler, "grid": GridSampler, "bayesian": BayesianSampler}.get(kind)
    if cls is None:  # the spec refuses it first; a record written by another version may not
        raise SweepError(f"unknown sampling algorithm {kind!r}", where="sampling_algorithm",
                         fix="use random, grid or bayesian")
    return cls(spec)


def better(objective: Objective, a: float, b: float) -> bool:
    """Whether metric ``a`` is better than ``b`` for the sweep's goal."""
    return a < b if objective.goal == "minimize" else a > b
