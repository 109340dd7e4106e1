"""Environment values are the text the spec writes, in every spec kind and on the command line: PyYAML reads
YAML 1.1, where ``yes`` is a boolean, ``010`` octal 8 and ``12:30`` sexagesimal 750, and a process
environment holds only text (a job's ``DEBUG: yes`` reached the process as "true", ``UMASK: 022`` as "18").
A key given twice is refused in serving and cluster specs as in job specs."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from azulite.deploy.azureml import AzureMLOptions
from azulite.deploy.options import AksOptions
from azulite.deploy.render import render_spec
from azulite.errors import SpecError
from azulite.spec.cluster import load_cluster
from azulite.spec.loader import load_job
from azulite.spec.serving import ServingSpec, load_model
from azulite.spec.sweep import load_sweep
from tests.deploy.conftest import EXAMPLES, docs
from tests.spec.test_job_spec import GOOD, write

WRITTEN = """\
environment_variables:
  FLAG: yes
  UMASK: 022
  AT: 12:30
  MASK: 0x1F
  BIG: 1_000
  LR: 1.0
  ON: off
  QUOTED: "010"
  SINGLE: '0x1F'
  7: seven
"""
EXPECTED = {"FLAG": "yes", "UMASK": "022", "AT": "12:30", "MASK": "0x1F", "BIG": "1_000", "LR": "1.0",
            "ON": "off", "QUOTED": "010", "SINGLE": "0x1F", "7": "seven"}


def _job_text() -> str:
    head, _, rest = GOOD.partition("environment_variables:\n  NCCL_DEBUG: INFO\n  SEED: 1\n")
    assert rest, "GOOD's environment_variables moved: update this test"
    return head + WRITTEN + rest


def test_a_jobs_environment_values_are_the_text_it_writes(tmp_path):
    spec = load_job(write(tmp_path, _job_text()))
    assert spec.environment_variables == EXPECTED
    assert yaml.safe_load(WRITTEN)["environment_variables"]["UMASK"] == 18  # what PyYAML alone reads


def test_only_environment_values_keep_their_text(tmp_path):
    """Other fields are typed: an input `010` is still the number YAML reads (as Azure ML reads it)."""
    spec = load_job(write(tmp_path, _job_text().replace("  epochs: 3", "  epochs: 010")))
    assert spec.inputs["epochs"] == 8


def test_set_of_an_environment_value_is_the_text_typed(tmp_path):
    p = write(tmp_path, GOOD)
    spec = load_job(p, ["environment_variables.UMASK=022", "environment_variables.FLAG=yes", "inputs.epochs=010",
                        'environment_variables.Q="7"'])
    assert spec.environment_variables["UMASK"] == "022" and spec.environment_variables["FLAG"] == "yes"
    assert spec.environment_variables["Q"] == "7" and spec.inputs["epochs"] == 8


def test_a_value_left_empty_is_still_refused_at_its_line(tmp_path):
    with pytest.raises(SpecError) as e:
        load_job(write(tmp_path, _job_text().replace("  UMASK: 022\n", "  UMASK:\n")))
    assert e.value.field == "environment_variables.UMASK" and "has no value" in e.value.message


def test_a_sweeps_trial_environment_keeps_its_text(tmp_path):
    (tmp_path / "train.py").write_text("print(1)\n")
    p = tmp_path / "sweep.yaml"
    p.write_text(textwrap.dedent("""\
        type: sweep
        trial:
          code: .
          command: python train.py --lr ${{search_space.lr}}
          environment_variables: {FLAG: yes, UMASK: 022}
        sampling_algorithm: random
        search_space:
          lr: {type: choice, values: [1, 2]}
        objective: {goal: minimize, primary_metric: loss}
        limits: {max_total_trials: 2}
        """))
    trial = load_sweep(p).trial_spec({"lr": 1})
    assert trial.environment_variables == {"FLAG": "yes", "UMASK": "022"}


def _serving_spec(tmp_path, extra: str):
    p = tmp_path / "serve.yaml"
    p.write_text((EXAMPLES / "aks" / "arr-coc-triton.yaml").read_text() + extra)
    return p


def test_a_serving_specs_environment_reaches_the_deployment_as_written(tmp_path):
    p = _serving_spec(tmp_path, WRITTEN)
    assert load_model(p, ServingSpec).environment_variables == EXPECTED
    files = render_spec(p, "aks", AksOptions(storage_account="acct", storage_key_secret="models-storage"), AzureMLOptions())
    deployment = next(d for text in files.values() for d in docs(text) if d["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {k: env[k] for k in EXPECTED} == EXPECTED  # the rendered YAML quotes them: Kubernetes reads text


def test_a_key_given_twice_in_a_serving_or_cluster_spec_is_refused_at_its_line(tmp_path):
    p = _serving_spec(tmp_path, "environment_variables:\n  A: x\n  A: y\n")
    with pytest.raises(SpecError) as e:
        load_model(p, ServingSpec)
    assert "environment_variables.A is given twice" in e.value.message and e.value.line == p.read_text().count("\n")
    cluster = tmp_path / "cluster.yaml"
    text = (EXAMPLES / "cluster" / "cluster.yaml").read_text()
    cluster.write_text(text + text[text.index("pools:"):].split("\n", 1)[0] + "\n")  # `pools:` once more
    with pytest.raises(SpecError) as e:
        load_cluster(cluster)
    assert "pools is given twice" in e.value.message


# ---- a node tree that never ends or goes too deep: each was a RecursionError traceback (exit 1) ------------
@pytest.mark.parametrize("text, line, field, words", [
    ("command: echo hi\ninputs: &a\n  x: *a\n", 3, "inputs.x", "the YAML alias *a refers to itself"),
    ("command: echo hi\nx: &a [*a]\n", 2, "x[0]", "the YAML alias *a refers to itself"),
    ("command: echo hi\nx: &a [1, {y: [*a]}]\n", 2, "x[1].y[0]", "the YAML alias *a refers to itself"),
    ("command: echo hi\nx: " + "[" * 3000 + "]" * 3000 + "\n", 2, "x[0][0][0][0][0][0][0]...",
     "the value is nested deeper than 100 levels"),
    # deep only through aliases: two anchors of 60 levels each, one inside the other
    ("command: echo hi\na: &a " + "[" * 60 + "]" * 60 + "\nb: " + "[" * 60 + "*a" + "]" * 60 + "\n", 3,
     "b[0][0][0][0][0][0][0]...", "nested deeper than 100 levels"),
    ("command: echo hi\na0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
     + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)), 7, "a5[7]",
     "the document's aliases expand to more than 1,000,000 values"),
])
def test_a_recursive_or_too_deep_document_is_an_error_at_its_line(tmp_path, text, line, field, words):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    with pytest.raises(SpecError) as e:
        load_job(p)
    assert (e.value.file, e.value.line, e.value.field) == (str(p), line, field), str(e.value)
    assert words in e.value.message and e.value.fix


def test_aliases_to_values_already_ended_still_load(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("command: echo hi\nenvironment_variables: &v {A: x}\ntags: [[&e y, *e], *v, *v]\n")
    spec = load_job(p)
    assert spec.environment_variables == {"A": "x"} and spec.azureml["tags"] == [["y", "y"], {"A": "x"}, {"A": "x"}]


def test_every_spec_kind_refuses_a_recursive_alias(tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("type: sweep\ntrial: &t {command: echo, code: ., x: *t}\nsampling_algorithm: random\n")
    with pytest.raises(SpecError) as e:
        load_sweep(sweep)
    assert (e.value.line, e.value.field) == (2, "trial.x") and "*t refers to itself" in e.value.message
    serving = _serving_spec(tmp_path, "args: &r [--x, *r]\n")
    with pytest.raises(SpecError) as e:
        load_model(serving, ServingSpec)
    assert e.value.field == "args[1]" and "*r refers to itself" in e.value.message
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text((EXAMPLES / "cluster" / "cluster.yaml").read_text() + "extra: &x {a: *x}\n")
    with pytest.raises(SpecError) as e:
        load_cluster(cluster)
    assert e.value.field == "extra.a" and "*x refers to itself" in e.value.message


def test_a_set_value_that_never_ends_is_an_error_of_the_set(tmp_path):
    p = write(tmp_path, GOOD)
    for item, words in (("tags=&a [*a]", "*a refers to itself"), ("tags=" + "[" * 500 + "]" * 500, "deeper than 100")):
        with pytest.raises(SpecError) as e:
            load_job(p, [item])
        assert (e.value.file, e.value.field) == (f"--set {item}", "tags") and words in e.value.message


def test_the_cli_says_so_and_exits_2(tmp_path, capsys):
    from tests.cli.inprocess import exit_code

    p = tmp_path / "alias.yaml"
    p.write_text("command: echo hi\ninputs: &a\n  x: *a\n")
    for args in (["job", "validate", p], ["deploy", "render", p, "--target", "aks", "--out", tmp_path / "o"]):
        assert exit_code(*args) == 2
        err = capsys.readouterr().err
        assert f"error: {p}:3 (inputs.x): the YAML alias *a refers to itself" in err and "Traceback" not in err
