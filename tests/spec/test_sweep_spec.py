"""Sweep job specs: both public azureml-examples sweep jobs validate; bad search spaces, samplers,
objectives and trial fields are errors naming the file, line and field."""

from pathlib import Path

import pytest

from azulite.errors import SpecError
from azulite.spec.sweep import SweepSpec, load_spec, load_sweep

DATA = Path(__file__).parent / "data" / "azureml-examples"

TRIAL = """\
type: sweep
trial:
  code: .
  command: python train.py --lr ${{search_space.lr}} --k ${{search_space.k}}
sampling_algorithm: ALGO
search_space:
  lr: LR
  k: {type: choice, values: [1, 2]}
objective: {goal: minimize, primary_metric: loss}
limits: {max_total_trials: 4, max_concurrent_trials: 2, timeout: 1h, trial_timeout: 90s}
"""


def sweep_text(algo: str, lr: str) -> str:
    return TRIAL.replace("ALGO", algo).replace("LR", lr)


def write(tmp_path, text: str) -> Path:
    (tmp_path / "train.py").write_text("print(1)\n")
    p = tmp_path / "sweep.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("example", ["lightgbm/iris", "scikit-learn/iris"])
def test_both_public_azureml_sweep_examples_validate(example):
    spec = load_spec(DATA / example / "job-sweep.yml")
    assert isinstance(spec, SweepSpec) and spec.sampling_algorithm.type == "random"
    assert spec.objective.goal == "minimize" and spec.limits.max_total_trials == 20
    assert spec.limits.max_concurrent_trials == 10 and spec.limits.timeout == 7200
    trial = spec.trial_spec({k: 0.5 if d.type == "uniform" else d.values[0] for k, d in spec.search_space.items()})
    assert "${{search_space" not in trial.command and "--iris-csv ${{inputs.iris_csv}}" in trial.command
    assert trial.code.endswith("src") and trial.distribution_type == "none"
    assert spec.azureml["experiment_name"].endswith("sweep-example")


def test_a_valid_sweep_and_its_trial_timeout(tmp_path):
    spec = load_sweep(write(tmp_path, sweep_text("bayesian", "{type: uniform, min_value: 0.01, max_value: 0.1}")))
    assert spec.trial_spec({"lr": 0.05, "k": 2}).command == "python train.py --lr 0.05 --k 2"
    assert spec.trial_spec({"lr": 0.05, "k": 2}).timeout == 90


@pytest.mark.parametrize("algo, lr, field, words", [
    ("random", "{type: uniform, min_value: 0.5, max_value: 0.1}", "search_space.lr.min_value", "must be below max_value"),
    ("grid", "{type: uniform, min_value: 0.01, max_value: 0.1}", None, "grid sampling does not take"),
    ("bayesian", "{type: normal, mu: 0, sigma: 1}", None, "bayesian sampling does not take"),
    ("hyperband", "{type: uniform, min_value: 0.01, max_value: 0.1}", "sampling_algorithm", "hyperband"),
    ("random", "{type: gaussian, mu: 0, sigma: 1}", "search_space.lr.type", "gaussian"),
    ("{type: grid, rule: sobol}", "{type: choice, values: [1, 2]}", None, "rule belongs to random sampling, not grid"),
])
def test_bad_search_spaces_and_samplers_name_the_field(tmp_path, algo, lr, field, words):
    with pytest.raises(SpecError) as e:
        load_sweep(write(tmp_path, sweep_text(algo, lr)))
    assert words in str(e.value), str(e.value)
    if field:
        assert e.value.field == field and e.value.line is not None, str(e.value)


def test_empty_search_space_and_missing_objective_metric(tmp_path):
    text = sweep_text("random", "{type: choice, values: [1]}")
    empty = text.split("search_space:")[0] + "search_space: {}\nobjective: {goal: minimize, primary_metric: loss}\n"
    with pytest.raises(SpecError) as e:
        load_sweep(write(tmp_path, empty))
    assert e.value.field == "search_space"
    with pytest.raises(SpecError) as e:
        load_sweep(write(tmp_path, text.replace("primary_metric: loss", "primary_metric: ''")))
    assert e.value.field == "objective.primary_metric"


def test_trial_errors_name_the_trial_field_and_unknown_search_refs(tmp_path):
    text = sweep_text("random", "{type: choice, values: [1]}")
    with pytest.raises(SpecError) as e:
        load_sweep(write(tmp_path, text.replace("code: .", "code: ./nowhere")))
    assert e.value.field == "trial.code" and e.value.line == 3 and "code folder not found" in e.value.message
    with pytest.raises(SpecError) as e:
        load_sweep(write(tmp_path, text.replace("${{search_space.k}}", "${{search_space.kk}}")))
    assert e.value.field == "trial.command" and "'kk'" in e.value.message


@pytest.mark.parametrize("field, said, fix", [
    # it offered the trial's fields as the sweep's, max_retries among them: "did you mean 'max_retries'?"
    ("max_retries: 2", "unknown field 'max_retries' of a sweep: it is a field of the sweep's trial",
     "--set trial.max_retries="),
    ("timeout: 1h", "unknown field 'timeout' of a sweep", "limits.timeout"),
    ("bogus: 1", "unknown field 'bogus'", "use one of: early_termination,"),
])
def test_a_field_of_the_trial_at_the_sweeps_top_is_placed(tmp_path, field, said, fix):
    text = sweep_text("random", "{type: uniform, min_value: 0.01, max_value: 0.1}") + field + "\n"
    with pytest.raises(SpecError) as e:
        load_sweep(write(tmp_path, text))
    assert said in str(e.value) and fix in e.value.fix, str(e.value)


def test_bayesian_sampling_with_early_termination_is_refused_as_azure_ml_does(tmp_path):
    """Azure ML: "Bayesian sampling does not support any early termination policy" (it ran here)."""
    text = sweep_text("bayesian", "{type: uniform, min_value: 0.01, max_value: 0.1}")
    with pytest.raises(SpecError) as e:
        load_sweep(write(tmp_path, text + "early_termination: {type: bandit, slack_factor: 0.1}\n"))
    assert "bayesian sampling takes no early_termination" in str(e.value) and "random" in str(e.value)
    random = text.replace("sampling_algorithm: bayesian", "sampling_algorithm: {type: random, rule: sobol, seed: 3}")
    spec = load_sweep(write(tmp_path, random + "early_termination: {type: bandit, slack_factor: 0.1}\n"))
    assert spec.sampling_algorithm.rule == "sobol" and spec.early_termination.type == "bandit"
