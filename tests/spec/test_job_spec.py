"""Job spec: the Azure ML command-job shape loads; every bad input names file, line, field, value, fix."""

import textwrap
from pathlib import Path

import pytest

from azulite.errors import SpecError
from azulite.spec.job import MpiDistribution, PathInput, PyTorchDistribution, TensorFlowDistribution
from azulite.spec.loader import load_job, parse_overrides, render_command

REPO = Path(__file__).resolve().parents[2]

GOOD = """\
$schema: https://azuremlschemas.azureedge.net/latest/commandJob.schema.json
type: command
experiment_name: exp
display_name: nice
compute: azureml:gpu-cluster
tags: {team: ml}
code: src
command: python train.py --data ${{inputs.data}} --epochs ${{inputs.epochs}} --out ${{outputs.ckpt}}
inputs:
  data:
    type: uri_folder
    path: data
  epochs: 3
outputs:
  ckpt:
    type: uri_folder
environment:
  image: mcr.microsoft.com/azureml/openmpi4.1.0-ubuntu20.04
environment_variables:
  NCCL_DEBUG: INFO
  SEED: 1
resources:
  instance_type: Standard_NC24rs_v3
  instance_count: 2
distribution:
  type: PyTorch
  process_count_per_instance: 4
priority: spot
timeout: 2h
max_retries: 1
max_restarts: 3
"""


def write(tmp_path: Path, text: str, *, dirs=("src", "data")) -> Path:
    for d in dirs:
        (tmp_path / d).mkdir(exist_ok=True)
    p = tmp_path / "job.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def error(tmp_path, text, overrides=(), dirs=("src", "data")) -> SpecError:
    with pytest.raises(SpecError) as e:
        load_job(write(tmp_path, text, dirs=dirs), overrides)
    return e.value


def test_azure_ml_command_job_loads(tmp_path):
    spec = load_job(write(tmp_path, GOOD))
    assert spec.name == tmp_path.name  # defaults to the spec folder's name
    assert spec.code == str(tmp_path / "src")
    assert isinstance(spec.distribution, PyTorchDistribution)
    assert spec.nodes == 2 and spec.processes_per_node == 4 and spec.world_size == 8
    assert spec.priority == "spot" and spec.timeout == 7200 and spec.max_restarts == 3
    assert spec.environment_variables == {"NCCL_DEBUG": "INFO", "SEED": "1"}
    assert spec.azureml["compute"] == "azureml:gpu-cluster" and spec.azureml["type"] == "command"
    assert isinstance(spec.inputs["data"], PathInput) and spec.inputs["data"].path == str(tmp_path / "data")
    assert spec.environment_label.startswith("mcr.microsoft.com")
    cmd = render_command(spec.command, spec.inputs, {"ckpt": "/out/ck"})
    assert cmd == f"python train.py --data {tmp_path / 'data'} --epochs 3 --out /out/ck"


def test_other_distributions_and_defaults(tmp_path):
    tf = load_job(write(tmp_path, "command: python m.py\ninstance_count: 2\ndistribution: {type: tensorflow, worker_count: 2}\n"))
    assert isinstance(tf.distribution, TensorFlowDistribution) and tf.world_size == 2
    assert tf.distribution.parameter_server_count == 0
    mpi = load_job(write(tmp_path, "command: python m.py\ndistribution: {type: mpi, process_count_per_instance: 3}\n"))
    assert isinstance(mpi.distribution, MpiDistribution) and mpi.world_size == 3
    plain = load_job(write(tmp_path, "command: echo hi\n"))
    assert plain.distribution_type == "none" and plain.world_size == 1 and plain.name == tmp_path.name


def test_example_specs_validate():
    spec = load_job(REPO / "examples/ddp/job.yaml")
    assert spec.name == "ddp" and spec.nodes == 2 and spec.processes_per_node == 2


def test_set_overrides_and_their_errors(tmp_path):
    p = write(tmp_path, GOOD)
    spec = load_job(p, ["distribution.process_count_per_instance=1", "inputs.epochs=7", "environment_variables.X=y"])
    assert spec.processes_per_node == 1 and spec.inputs["epochs"] == 7 and spec.environment_variables["X"] == "y"
    e = error(tmp_path, GOOD, ["distribution.process_count_per_instance=0"])
    assert e.file == "--set distribution.process_count_per_instance=0" and e.field == "distribution.process_count_per_instance"
    assert e.value == 0 and e.fix
    with pytest.raises(SpecError) as bad:
        parse_overrides(["no-equals-sign"])
    assert "--set path=value" in bad.value.fix
    for item in ("resources..instance_count=1", "inputs.=3"):  # were "unknown field ''" at a line of the file
        with pytest.raises(SpecError) as bad:
            parse_overrides([item])
        assert bad.value.file == "--set" and item in bad.value.message


def test_set_with_no_value_is_an_error_and_a_quoted_empty_string_is_not(tmp_path):
    p = write(tmp_path, GOOD)
    for item in ("inputs.epochs=", "inputs.epochs=  "):  # an empty shell variable: was inputs.epochs == ""
        with pytest.raises(SpecError) as bad:
            load_job(p, [item])
        assert bad.value.field == "inputs.epochs" and "no value" in bad.value.message and "--set" in bad.value.fix
    assert load_job(p, ['environment_variables.X=""']).environment_variables["X"] == ""


# ---- the bad-input list -------------------------------------------------------------------------
def test_missing_code_folder(tmp_path):
    e = error(tmp_path, GOOD.replace("code: src", "code: nowhere"))
    assert (e.line, e.field, e.value) == (7, "code", "nowhere")
    assert "code folder not found" in e.message and "create" in e.fix
    assert str(e).startswith(f"{tmp_path / 'job.yaml'}:7 (code)")


def test_conda_file_is_relative_to_the_spec_and_must_exist(tmp_path):
    text = GOOD.replace("  image: mcr", "  conda_file: env/conda.yml\n  image: mcr")
    e = error(tmp_path, text)
    assert (e.field, e.value) == ("environment.conda_file", "env/conda.yml")
    assert "conda file not found" in e.message and str(tmp_path / "env" / "conda.yml") in e.fix
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "conda.yml").write_text("dependencies: [python=3.11]\n")
    assert load_job(write(tmp_path, text)).environment.conda_file == str(tmp_path / "env" / "conda.yml")


def test_unknown_distribution_type(tmp_path):
    e = error(tmp_path, GOOD.replace("type: PyTorch", "type: horovod"))
    assert (e.line, e.field, e.value) == (26, "distribution.type", "horovod")
    assert "unknown distribution type" in e.message and "pytorch" in e.fix and "tensorflow" in e.fix


@pytest.mark.parametrize(
    "old,new,line,field",
    [
        ("process_count_per_instance: 4", "process_count_per_instance: 0", 27, "distribution.process_count_per_instance"),
        ("  instance_count: 2", "  instance_count: -1", 24, "resources.instance_count"),
        ("max_restarts: 3", "max_restarts: -2", 31, "max_restarts"),
    ],
)
def test_counts_must_be_positive(tmp_path, old, new, line, field):
    e = error(tmp_path, GOOD.replace(old, new))
    assert (e.line, e.field) == (line, field)
    assert e.value == int(new.split(":")[1]) and ">=" in e.message and "whole number" in e.fix


def test_worker_count_zero(tmp_path):
    e = error(tmp_path, "command: x\ndistribution:\n  type: tensorflow\n  worker_count: 0\n")
    assert (e.line, e.field, e.value) == (4, "distribution.worker_count", 0)


def test_missing_input_path(tmp_path):
    e = error(tmp_path, GOOD, dirs=("src",))
    assert (e.line, e.field, e.value) == (12, "inputs.data.path", "data")
    assert "does not exist" in e.message and e.fix


def test_unknown_input_reference(tmp_path):
    e = error(tmp_path, GOOD.replace("${{inputs.epochs}}", "${{inputs.epoch}}"))
    assert (e.line, e.field, e.value) == (8, "command", "${{inputs.epoch}}")
    assert "no input named 'epoch'" in e.message and "${{inputs.epochs}}" in e.fix


def test_unknown_field_suggests_the_right_one(tmp_path):
    e = error(tmp_path, GOOD.replace("max_retries: 1", "max_retry: 1"))
    assert (e.line, e.field) == (30, "max_retry") and "max_retries" in e.fix


def test_wrong_types_and_yaml_errors(tmp_path):
    e = error(tmp_path, GOOD.replace("instance_count: 2", "instance_count: two"))
    assert (e.line, e.field, e.value) == (24, "resources.instance_count", "two") and "whole number" in e.message
    e = error(tmp_path, GOOD.replace("priority: spot", "priority: cheap"))
    assert e.field == "priority" and "dedicated" in e.fix
    e = error(tmp_path, "command: [unclosed\n")
    assert e.line and "YAML" in e.message
    e = error(tmp_path, "code: src\n")
    assert e.field == "command" and "missing" in e.message and "command:" in e.fix
    e = error(tmp_path, "command: x\ninstance_count: 2\nresources: {instance_count: 3}\n")
    assert "disagree" in e.message


def test_missing_file():
    with pytest.raises(SpecError) as e:
        load_job("/nonexistent/job.yaml")
    assert e.value.file == "/nonexistent/job.yaml" and e.value.fix


def test_set_of_an_undeclared_input_or_output_is_an_error_with_did_you_mean(tmp_path):
    p = write(tmp_path, GOOD)
    with pytest.raises(SpecError) as e:
        load_job(p, ["inputs.epoch=7"])
    assert e.value.file == "--set inputs.epoch=7" and e.value.field == "inputs.epoch"
    assert "no input named 'epoch'" in e.value.message and e.value.fix.startswith("did you mean inputs.epochs?")
    with pytest.raises(SpecError) as e:
        load_job(p, ["outputs.chkpt.path=/tmp/x"])
    assert "no output named 'chkpt'" in e.value.message and "did you mean outputs.ckpt?" in e.value.fix


def test_instance_count_disagreement_fix_names_the_field(tmp_path):
    p = write(tmp_path, GOOD)
    with pytest.raises(SpecError) as e:
        load_job(p, ["instance_count=1"])
    assert "disagree" in e.value.message and "--set resources.instance_count=1" in e.value.fix
    assert load_job(p, ["resources.instance_count=1"]).nodes == 1  # the --help example works


def test_directory_and_empty_file_say_so(tmp_path):
    # they read as "cannot read the job spec (IsADirectoryError)" and "required field 'command' is missing"
    (tmp_path / "job.yaml").write_text(GOOD)
    with pytest.raises(SpecError) as e:
        load_job(tmp_path)
    assert e.value.message == "is a directory, not a job spec file" and str(tmp_path / "job.yaml") in e.value.fix
    empty = tmp_path / "empty.yaml"
    empty.write_text("\n# nothing yet\n")
    with pytest.raises(SpecError) as e:
        load_job(empty)
    assert e.value.message == "the job spec is empty" and "command:" in e.value.fix
    assert load_job(empty, ["command=echo hi"]).command == "echo hi"  # all from --set is still a spec


@pytest.mark.parametrize("old, new, line, field, words", [
    # each was accepted: true as 1 node; the last of two keys silently; max_restarts doing nothing
    ("  instance_count: 2", "  instance_count: true", 24, "resources.instance_count", "True is not a whole number"),
    ("max_retries: 1", "max_retries: 1\nmax_retries: 2", 31, None, "max_retries is given twice (lines 30 and 31)"),
    ("type: PyTorch\n  process_count_per_instance: 4", "type: mpi\n  process_count_per_instance: 4", 31,
     "max_restarts", "a mpi job is retried whole: use max_retries"),
    ("timeout: 2h", "timeout: 1h30m", 29, "timeout", "90s, 30m, 2h, 1.5h, 2d"),
    ("  SEED: 1", "  SEED:", 21, "environment_variables.SEED", "has no value"),
    ("type: PyTorch", "type: none", 26, "distribution.type", "remove `distribution:`"),
    # each was taken silently (Azure ML refuses the tier; one of the two timeouts was lost)
    ("priority: spot", "priority: spot\nqueue_settings: {job_tier: cheap}", 29, "queue_settings.job_tier",
     "'cheap' is not an Azure ML job tier (spot, basic, standard, premium, null)"),
    ("priority: spot", "priority: dedicated\nqueue_settings: {job_tier: Spot}", 29, "queue_settings.job_tier",
     "job_tier (Spot) and priority (dedicated) disagree"),
    ("timeout: 2h", "timeout: 2h\nlimits: {timeout: 3600}", 30, "limits.timeout",
     "limits.timeout (3600) and timeout (7200 s) disagree"),
    ("timeout: 2h", "timeout: null\nlimits: {timeout: 3600}", 30, "limits.timeout", "and timeout (none) disagree"),
])
def test_spec_mistakes_that_passed_or_said_too_little(tmp_path, old, new, line, field, words):
    e = error(tmp_path, GOOD.replace(old, new))
    assert (e.line, e.field) == (line, field), (e.line, e.field, str(e))
    assert words in e.message + (e.fix or ""), str(e)


def test_a_check_across_fields_is_placed_at_the_field_it_names(tmp_path):
    e = error(tmp_path, GOOD.replace("max_restarts: 3", "max_restarts: 3\nelastic: {min_nodes: 3}"))
    assert (e.line, e.field) == (32, "elastic.min_nodes") and "is above max_nodes (2)" in e.message


@pytest.mark.parametrize("command", [
    "python s.py ${{outputs.o}} ${{inputs.d}}",
    'python s.py "${{outputs.o}}" "${{inputs.d}}"',
    "python s.py '${{outputs.o}}' '${{inputs.d}}'",
    'sh -c "echo x" && python s.py ${{outputs.o}} ${{inputs.d}}',
])
def test_a_path_with_spaces_and_quotes_stays_one_word(command):
    """An AZULITE_HOME with a space ("My Files") split every job's output path into two arguments."""
    import shlex

    out, data = "/tmp/sp ace/home x/jobs/o-1/outputs/o", "/tmp/it's here/d"
    rendered = render_command(command, {"d": PathInput(type="uri_folder", path=data)}, {"o": out})
    assert shlex.split(rendered)[-2:] == [out, data], rendered
    assert render_command("python s.py ${{outputs.o}}", {}, {"o": "/tmp/plain/o"}) == "python s.py /tmp/plain/o"


@pytest.mark.parametrize("item, most", [
    ("resources.instance_count=99999999999999999999", "10,000"),  # validated, and `submit` started 1 agent per node
    ("instance_count=10001", "10,000"),
    ("distribution.process_count_per_instance=100000", "1,024"),
    ("elastic.min_nodes=20000", "10,000"),
])
def test_absurd_counts_are_refused_and_large_real_ones_are_not(tmp_path, item, most):
    e = error(tmp_path, GOOD, [item])
    assert e.message.endswith(f"is too large: must be <= {most}") and e.file == f"--set {item}", str(e)
    assert "no Azure ML or AKS cluster runs more" in e.fix
    spec = load_job(write(tmp_path, GOOD), ["resources.instance_count=5000", "distribution.process_count_per_instance=8"])
    assert spec.world_size == 40_000  # a cloud job's size: `job validate` and `deploy render` take it
