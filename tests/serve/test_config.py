"""config.pbtxt parsing, Triton's defaults and validation errors, JSON rendering."""

from __future__ import annotations

import json

import pytest

from azulite.errors import ModelLoadError
from azulite.serve import config as cfg
from azulite.serve.proto import model_config_pb2 as mc

GOOD = """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 100 }
"""


def load(text: str, model: str = "m") -> mc.ModelConfig:
    config = cfg.parse_config_text(text, model=model)
    cfg.fill_defaults(config, model=model)
    cfg.validate_config(config, model=model)
    return config


def test_parse_and_defaults():
    config = load(GOOD)
    assert config.backend == "onnxruntime" and config.platform == "onnxruntime_onnx"
    assert config.input[0].dims == [16] and config.max_batch_size == 8
    assert config.version_policy.latest.num_versions == 1
    assert [(g.name, g.count, g.kind) for g in config.instance_group] == [("m", 1, mc.ModelInstanceGroup.KIND_CPU)]
    assert config.default_model_filename == "model.onnx"
    nameless = load(GOOD.replace('name: "m"', ""), model="m")
    assert nameless.name == "m"
    gpu = load(GOOD + "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0 ] } ]")
    assert gpu.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU and gpu.instance_group[0].count == 2


def test_defaults_are_tritons_normalization():
    """What Triton 2.51's /config shows for a config that leaves them out (compared against real Triton in
    test_metadata_triton.py): here each rule alone, including where it must not apply."""
    db = load(GOOD.replace("preferred_batch_size: [ 4 ] ", ""))
    assert list(db.dynamic_batching.preferred_batch_size) == [8]  # max_batch_size when none named
    assert list(load(GOOD).dynamic_batching.preferred_batch_size) == [4]  # named ones are kept
    groups = load(GOOD + 'instance_group [ { count: 2 }, { name: "x" } ]')
    assert [g.name for g in groups.instance_group] == ["m_0", "x"]  # given groups: <model>_<index>
    python = load(GOOD.replace('platform: "onnxruntime_onnx"', 'backend: "python"'))
    assert python.default_model_filename == "model.py"
    assert python.optimization.input_pinned_memory.enable and python.optimization.output_pinned_memory.enable
    assert not python.HasField("model_transaction_policy")  # only an ensemble shows it (Triton does)
    own = load(GOOD + 'default_model_filename: "net.onnx" optimization { input_pinned_memory { enable: false } }')
    assert own.default_model_filename == "net.onnx" and not own.optimization.input_pinned_memory.enable
    assert own.optimization.output_pinned_memory.enable
    seq = load(GOOD.replace("dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 100 }",
                            "sequence_batching { oldest { max_candidate_sequences: 2 } }"))
    assert seq.sequence_batching.max_sequence_idle_microseconds == cfg.DEFAULT_SEQUENCE_IDLE_US == 1_000_000
    assert list(seq.sequence_batching.oldest.preferred_batch_size) == [8]
    kept = load(GOOD.replace("dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 100 }",
                             "sequence_batching { max_sequence_idle_microseconds: 5 direct { } }"))
    assert kept.sequence_batching.max_sequence_idle_microseconds == 5
    ensemble = load(GOOD.replace('platform: "onnxruntime_onnx"', 'platform: "ensemble"').replace(
        "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 100 }",
        'ensemble_scheduling { step [ { model_name: "a" model_version: -1 input_map { key: "X" value: "INPUT0" } '
        'output_map { key: "Y" value: "OUTPUT0" } } ] }'))
    assert not ensemble.instance_group and not ensemble.default_model_filename
    assert not ensemble.HasField("optimization") and ensemble.HasField("model_transaction_policy")
    assert not ensemble.model_transaction_policy.decoupled


def test_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text('name: "m"\nmax_batch_size: "eight"\n')
    with pytest.raises(ModelLoadError) as info:
        cfg.parse_config_file(path, model="m")
    assert str(path) in str(info.value) and "line 2 column 17: " in str(info.value) and "'m'" in str(info.value)
    with pytest.raises(ModelLoadError, match="no_such_field"):
        cfg.parse_config_text("no_such_field: 1", model="m")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.replace('name: "m"', 'name: "other"'), "name 'other' does not match the model directory name 'm'"),
        (lambda t: t.replace('platform: "onnxruntime_onnx"', ""), "must specify 'platform' or 'backend'"),
        (lambda t: t.replace('platform: "onnxruntime_onnx"', 'backend: "tensorrt"'), "backend 'tensorrt' is not supported"),
        (lambda t: t.replace("data_type: TYPE_FP32 dims: [ 16 ] } ]\noutput", "dims: [ 16 ] } ]\noutput"),
         "input 'INPUT0': data_type must be set"),
        (lambda t: t.replace("preferred_batch_size: [ 4 ]", "preferred_batch_size: [ 16 ]"),
         "preferred size 16 must be positive and <= max_batch_size 8"),
        (lambda t: t.replace("max_batch_size: 8", "max_batch_size: 0"), "dynamic batching requires max_batch_size > 0"),
        (lambda t: t.replace("max_queue_delay_microseconds: 100", "priority_levels: 2 default_priority_level: 3"),
         r"default_priority_level must be in \[1, 2\], got 3"),
        (lambda t: t.replace("dims: [ 16 ] } ]\noutput", "dims: [ 0 ] } ]\noutput"), "dimension 0 is not valid"),
        (lambda t: t + "sequence_batching { }", "sequence_batching.* along with field \"dynamic_batching\""),
        (lambda t: t + "version_policy { latest { num_versions: 0 } }", "num_versions must be >= 1"),
        (lambda t: t + "model_transaction_policy { decoupled: true }", "decoupled models .* are not supported"),
        # as Triton's ValidateIOShape: loaded before, with requests of any rank accepted
        (lambda t: t.replace("dims: [ 16 ] } ]\noutput", "} ]\noutput"), "input 'INPUT0': must specify 'dims'"),
        # was loaded as count 1, and the config reported 1
        (lambda t: t + "instance_group [ { count: -2 } ]", "instance_group 0 has count -2"),
    ],
)
def test_validation_names_model_and_field(change, message):
    with pytest.raises(ModelLoadError, match=message) as info:
        load(change(GOOD))
    assert "model 'm'" in str(info.value) or "'m'" in str(info.value)


SEQUENCE = GOOD.replace("dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 100 }",
                       "sequence_batching { control_input [ %s ] }")


@pytest.mark.parametrize(("controls", "message"), [
    # Triton refuses this load with the same words; azulite fed the model INT32 0/1 (TYPE_INVALID in /config)
    ('{ name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] }',
     "control_input 'S' \\(CONTROL_SEQUENCE_START\\) must specify either 'int32_false_true', 'fp32_false_true' or "
     "'bool_false_true'"),
    ('{ name: "E" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] fp32_false_true: [ 0, 1 ] } ] }',
     "specifies both 'int32_false_true' and 'fp32_false_true'"),
    ('{ name: "R" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 1 ] } ] }',
     "'int32_false_true' must have exactly 2 entries .*got 1"),
    ('{ name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }, '
     '{ name: "S2" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }',
     "specifies multiple CONTROL_SEQUENCE_START tensors"),
    ('{ name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID } ] }',
     "control_input 'C' \\(CONTROL_SEQUENCE_CORRID\\) must specify a data_type of TYPE_UINT64.*got TYPE_INVALID"),
    ('{ name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 int32_false_true: [ 0, 1 ] } ] }',
     "must not specify 'int32_false_true'"),
])
def test_sequence_controls_are_checked_as_triton_checks_them(controls, message):
    with pytest.raises(ModelLoadError, match=message) as info:
        load(SEQUENCE % controls)
    assert "model 'm'" in str(info.value) and info.value.fix


@pytest.mark.parametrize(("field", "value"), [
    ("default_model_filename", "../../../outside/model.py"), ("default_model_filename", "/tmp/evil/model.py"),
    ("default_model_filename", "sub/../../model.py"), ("label_filename", "../../etc/passwd"),
])
def test_file_names_in_a_config_stay_inside_the_model(field, value):
    """A load API config override pointed a model at code outside the repository, which --verify's manifest
    never covered (found running code from another folder): refused, naming the field."""
    text = GOOD + f'default_model_filename: "{value}"' if field == "default_model_filename" else \
        GOOD.replace('output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]',
                     f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] label_filename: "{value}" }} ]')
    with pytest.raises(ModelLoadError, match=f"{field} '{value}' must name a file inside"):
        load(text)
    load(GOOD + 'default_model_filename: "sub/model.onnx"')  # a folder inside is fine


def test_well_formed_sequence_controls_load():
    config = load(SEQUENCE % (
        '{ name: "S" control [ { kind: CONTROL_SEQUENCE_START bool_false_true: [ false, true ] } ] }, '
        '{ name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }'))
    assert [c.name for c in config.sequence_batching.control_input] == ["S", "C"]


def test_json_renders_int64_as_numbers():
    config = load(GOOD + 'parameters { key: "k" value: { string_value: "v" } }')
    data = cfg.config_to_dict(config)
    assert data["input"][0]["dims"] == [16]
    assert data["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert data["dynamic_batching"]["preferred_batch_size"] == [4]
    assert data["max_batch_size"] == 8 and data["parameters"]["k"]["string_value"] == "v"
    text = json.dumps(data)
    assert '"dims": ["16"]' not in text
    assert cfg.config_from_json(text, model="m") == config


def test_datatype_tables():
    assert cfg.wire_datatype(mc.TYPE_STRING) == "BYTES" and cfg.wire_datatype(mc.TYPE_FP32) == "FP32"
    assert cfg.numpy_to_wire(cfg.WIRE_TO_NUMPY["INT64"]) == "INT64"


def test_a_batched_scalar_is_dims_1_reshaped():
    config = load(GOOD.replace('dims: [ 16 ] } ]\noutput', 'dims: [ 1 ] reshape: { shape: [ ] } } ]\noutput'))
    assert list(config.input[0].dims) == [1] and list(config.input[0].reshape.shape) == []
