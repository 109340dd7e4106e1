"""The sweep samplers (launch/sampling.py): a random sweep's ``rule: sobol`` walks a scrambled Sobol sequence
(it was accepted and sampled at random), every distribution mapped through its inverse CDF, reproducible
from the seed; the plain random rule as before."""

from __future__ import annotations

import math

import numpy as np

from azulite.launch.sampling import make_sampler
from azulite.spec.sweep import SweepSpec


def _spec(space: dict, rule: str | None = "sobol", seed: int = 7) -> SweepSpec:
    return SweepSpec.model_validate({
        "type": "sweep", "trial": {"command": "true"}, "search_space": space,
        "sampling_algorithm": {"type": "random", "seed": seed, **({"rule": rule} if rule else {})},
        "objective": {"goal": "minimize", "primary_metric": "loss"}})


def _draws(spec: SweepSpec, n: int) -> list[dict]:
    sampler = make_sampler(spec)
    return [sampler.ask()[0] for _ in range(n)]


UNIT = {"x": {"type": "uniform", "min_value": 0, "max_value": 1}, "y": {"type": "uniform", "min_value": 0, "max_value": 1}}


def _cells(draws: list[dict]) -> np.ndarray:
    """How many of the draws fall in each cell of an 8 x 8 grid over the unit square."""
    counts = np.zeros((8, 8), int)
    for d in draws:
        counts[int(d["x"] * 8), int(d["y"] * 8)] += 1
    return counts


def test_sobol_covers_the_space_evenly_where_random_does_not():
    """64 points of a 2-D Sobol sequence put exactly one in each of the 64 cells of an 8 x 8 grid (a (0,m,2)-net,
    which scrambling keeps); the same seed at random leaves cells empty and doubles others up."""
    assert (_cells(_draws(_spec(UNIT), 64)) == 1).all()
    assert (_cells(_draws(_spec(UNIT), 128)) == 2).all()  # the next block goes on with the same sequence
    assert not (_cells(_draws(_spec(UNIT, rule=None), 64)) == 1).all()


def test_sobol_is_reproducible_from_its_seed_and_maps_every_distribution():
    space = {"c": {"type": "choice", "values": ["a", "b", "c"]}, "n": {"type": "randint", "upper": 5},
             "q": {"type": "quniform", "min_value": 0, "max_value": 10, "q": 2},
             "lu": {"type": "loguniform", "min_value": math.log(1e-4), "max_value": math.log(1e-1)},
             "g": {"type": "normal", "mu": 10, "sigma": 2}, "ln": {"type": "lognormal", "mu": 0, "sigma": 1}}
    a, b = _draws(_spec(space), 100), _draws(_spec(space), 100)
    assert a == b and a != _draws(_spec(space, seed=8), 100)
    assert {d["c"] for d in a} == {"a", "b", "c"} and {d["n"] for d in a} == {0, 1, 2, 3, 4}
    assert all(d["q"] % 2 == 0 and 0 <= d["q"] <= 10 for d in a)
    assert all(1e-4 <= d["lu"] <= 1e-1 for d in a) and all(d["ln"] > 0 for d in a)
    normal = np.array([d["g"] for d in a])
    assert abs(normal.mean() - 10) < 0.4 and abs(normal.std() - 2) < 0.5
    # evenly spread: the first 64 points put 12-14 in each fifth of [0, 1), the next 32 put 6-8, the last 4 0-4
    counts = np.bincount([d["n"] for d in a], minlength=5)
    assert counts.min() >= 18 and counts.max() <= 26, counts
