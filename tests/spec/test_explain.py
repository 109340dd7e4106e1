"""Where a spec error is placed and what its fix says: a ``--set`` that caused it is named (not the file's
line of a field it replaced), a check across fields has its own fix (naming the ``--set`` that does it),
and a sweep's trial fields and search space are named as the sweep writes them."""

import pytest

from azulite.errors import SpecError
from azulite.spec.loader import load_job
from azulite.spec.sweep import load_sweep
from tests.spec.test_job_spec import GOOD, error, write
from tests.spec.test_sweep_spec import sweep_text, write as write_sweep

GENERIC = "see the Jobs section of README.md"


@pytest.mark.parametrize("item, field, words", [
    # each was placed at the file: `job.yaml (foo)`, `job.yaml:24 (resources.instance_count)`, `job.yaml:26 (...)`
    ("foo.bar=1", "foo", "unknown field 'foo'"),
    ("resources.instance_count.foo=1", "resources.instance_count", "is not a whole number"),
    ("distribution.type.x=1", "distribution.type", "unknown distribution type"),
])
def test_a_set_inside_a_field_is_blamed_for_its_error(tmp_path, item, field, words):
    e = error(tmp_path, GOOD, [item])
    assert (e.file, e.line, e.field) == (f"--set {item}", None, field), str(e)
    assert words in e.message


@pytest.mark.parametrize("old, new, sets, field, message, fix", [
    # a --set of another field made the file's max_restarts wrong: the fix says how to drop it from the command line
    ("", "", ["distribution.type=mpi"], "max_restarts", "a mpi job is retried whole",
     "remove max_restarts (--set max_restarts=0) and retry whole attempts with max_retries (--set max_retries=3)"),
    ("", "", ["distribution=null"], "max_restarts", "a job without distribution is retried whole", "--set max_restarts=0"),
    ("max_restarts: 3", "max_restarts: 3\nelastic: {min_nodes: 1}", ["distribution.type=mpi", "max_restarts=0"],
     "elastic", "elastic node ranges need distribution type pytorch", "remove elastic (--set elastic=null)"),
    ("", "", ["elastic.min_nodes=3"], "elastic.min_nodes", "elastic.min_nodes (3) is above max_nodes (2)",
     "set elastic.min_nodes to 2 or fewer"),
    ("", "", ["elastic.min_nodes=1", "elastic.max_nodes=4"], "elastic.max_nodes", "must equal instance_count (2)",
     "--set elastic.max_nodes=2); to start 4 nodes, --set resources.instance_count=4"),
    ("", "", ["limits.timeout=1h"], "limits.timeout", "limits.timeout (1h) and timeout (7200 s) disagree",
     "keep timeout and remove limits.timeout (Azure ML's spelling of the same), or make them equal (e.g. --set "
     "limits.timeout=7200)"),
    ("", "", ["queue_settings.job_tier=cheap"], "queue_settings.job_tier", "is not an Azure ML job tier",
     "use one of: spot, basic, standard, premium, null"),
    ("", "", ["queue_settings.job_tier=standard"], "queue_settings.job_tier", "and priority (spot) disagree",
     "keep priority: spot and remove queue_settings.job_tier, or make them agree (--set queue_settings.job_tier=spot"),
    ("", "", ["environment_variables.MASTER_PORT=0"], "environment_variables.MASTER_PORT", "is not a TCP port",
     'MASTER_PORT: "29500"'),
])
def test_a_check_across_fields_has_its_own_fix(tmp_path, old, new, sets, field, message, fix):
    e = error(tmp_path, GOOD.replace(old, new), sets)
    assert e.field == field and message in e.message, str(e)
    assert fix in e.fix and GENERIC not in e.fix, str(e)
    assert "none job" not in e.message


def test_a_null_set_removes_the_field(tmp_path):
    """`--set max_restarts=null` was "None is not a whole number"; now it drops the field (its default, 0)."""
    p = write(tmp_path, GOOD)
    spec = load_job(p, ["distribution.type=mpi", "max_restarts=null", "timeout=~"])
    assert spec.max_restarts == 0 and spec.timeout is None and spec.distribution_type == "mpi"
    assert load_job(p, ["environment_variables.SEED=null", "nothing.here=null"]).environment_variables == {"NCCL_DEBUG": "INFO"}
    e = error(tmp_path, GOOD, ["command=null"])
    assert (e.file, e.message) == ("--set command=null", "required field 'command' is missing")


def test_code_that_is_a_file_says_so(tmp_path):
    e = error(tmp_path, GOOD.replace("code: src", "code: job.yaml"))
    assert e.message == f"code must be a folder: {tmp_path / 'job.yaml'} is a file (got 'job.yaml')"
    assert e.fix.endswith("(this file's folder: code: .)") and "create" not in e.fix


def _sweep_error(tmp_path, text, sets=()) -> SpecError:
    with pytest.raises(SpecError) as e:
        load_sweep(write_sweep(tmp_path, text), sets)
    return e.value


@pytest.mark.parametrize("algo, lr, fix", [
    # was the job distribution's fix: "use `type: pytorch` (also DeepSpeed), `type: tensorflow` or `type: mpi`"
    ("random", "{type: gaussian}", "use type: choice, randint, uniform, loguniform, quniform, qloguniform, normal, "
                                   "lognormal, qnormal, qlognormal, e.g. {type: uniform"),
    ("grid", "{type: gaussian}", "grid sampling takes type: choice, e.g. {type: choice, values: [0.01, 0.1]}; random "
                                 "sampling takes every one: choice, randint,"),
])
def test_an_unknown_sampling_distribution_lists_what_the_sampler_takes(tmp_path, algo, lr, fix):
    e = _sweep_error(tmp_path, sweep_text(algo, lr))
    assert (e.field, e.message) == ("search_space.lr.type", "unknown sampling distribution 'gaussian'")
    assert e.fix.startswith(fix) and "pytorch" not in e.fix, e.fix
    missing = _sweep_error(tmp_path, sweep_text(algo, "{values: [1]}"))
    assert missing.message == "search_space.lr needs a type" and "pytorch" not in missing.fix


@pytest.mark.parametrize("algo, lr, extra, field, fix", [
    ("grid", "{type: uniform, min_value: 0.01, max_value: 0.1}", "", "search_space.lr.type",
     "make search_space.lr one of those, e.g. {type: choice, values: [0.01, 0.1]}; or sample at random"),
    ("bayesian", "{type: uniform, min_value: 0.01, max_value: 0.1}", "early_termination: {type: bandit, slack_factor: 0.1}\n",
     "early_termination", "remove early_termination (--set early_termination=null), or sample at random "
                          "(--set sampling_algorithm.type=random)"),
    ("random", "{type: uniform, min_value: 0.01, max_value: 0.1}", "early_termination: {type: bandits}\n",
     "early_termination.type", "use type: bandit, median_stopping, truncation_selection"),
    ("random", "{type: uniform, min_value: 0.01, max_value: 0.1}", "early_termination: {type: bandit}\n",
     "early_termination", "give one: slack_factor: 0.1"),
])
def test_sweep_checks_have_their_own_fix(tmp_path, algo, lr, extra, field, fix):
    e = _sweep_error(tmp_path, sweep_text(algo, lr) + extra)
    assert e.field == field and e.line is not None and fix in e.fix and GENERIC not in e.fix, str(e)


def test_a_trials_fix_names_the_trial_field(tmp_path):
    text = sweep_text("random", "{type: choice, values: [1]}")
    e = _sweep_error(tmp_path, text, ["trial.resources.instance_count=0"])
    assert e.field == "trial.resources.instance_count"
    assert e.fix == "set trial.resources.instance_count to a whole number >= 1, e.g. 1"  # was "set resources...."
    e = _sweep_error(tmp_path, text, ["trial.max_restarts=2"])
    assert e.field == "trial.max_restarts" and "(--set trial.max_restarts=0)" in e.fix
    e = _sweep_error(tmp_path, text, ["trial.code=sweep.yaml"])
    assert e.field == "trial.code" and "point `trial.code:` at the folder" in e.fix
    e = _sweep_error(tmp_path, text, ["trial.distribution={x: 1}", "trial.resources.instance_count=0"])
    assert "also: --set trial.distribution={x: 1} (trial.distribution)" in e.fix
