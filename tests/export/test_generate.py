"""``azulite config generate`` in-process: what an ONNX file says completely, what a TorchScript file
cannot say (listed for the user), batching decided from the first dimension, and unreadable files."""

from __future__ import annotations

import zipfile

import pytest

from azulite.errors import ExportError
from azulite.export import generate
from azulite.serve import config as serve_config
from tests.serve.conftest import write_add_sub_onnx, write_add_sub_torchscript


def parsed(text: str, name: str):
    config = serve_config.parse_config_text(text, model=name)
    serve_config.fill_defaults(config, model=name)
    serve_config.validate_config(config, model=name)
    return config


def test_onnx_batching_follows_the_first_dimension(tmp_path):
    batched = tmp_path / "m" / "1" / "model.onnx"
    write_add_sub_onnx(batched, dim=16, batch=True)
    g = generate(batched, dynamic_batching=True)
    config = parsed(g.text(), "m")
    assert (config.name, config.platform, config.max_batch_size, g.needs_user) == ("m", "onnxruntime_onnx", 8, [])
    assert [(t.name, list(t.dims), serve_config.wire_datatype(t.data_type)) for t in config.input] == \
        [("INPUT0", [16], "FP32"), ("INPUT1", [16], "FP32")]
    assert [t.name for t in config.output] == ["OUTPUT0", "OUTPUT1"] and config.HasField("dynamic_batching")

    fixed = tmp_path / "fixed.onnx"
    write_add_sub_onnx(fixed, dim=16, batch=False)
    config = parsed(generate(fixed).text(), "fixed")
    assert (config.max_batch_size, list(config.input[0].dims)) == (0, [16])
    with pytest.raises(ExportError, match="cannot batch: the first dimension of 'INPUT0', 'INPUT1', 'OUTPUT0', 'OUTPUT1' is fixed"):
        generate(fixed, max_batch_size=4)
    with pytest.raises(ExportError, match="dynamic batching needs a batch dimension"):
        generate(fixed, dynamic_batching=True)


def test_torchscript_lists_what_the_user_must_check(tmp_path):
    path = tmp_path / "add_sub.pt"
    write_add_sub_torchscript(path)
    g = generate(path, name="add_sub")
    config = parsed(g.text(), "add_sub")
    assert [t.name for t in config.input] == ["x__0", "y__1"]  # forward(x, y): Triton's <name>__<index>
    assert [t.name for t in config.output] == ["OUTPUT__0", "OUTPUT__1"]  # a 2-tuple
    assert len(g.needs_user) == 5 and all("TorchScript" in n for n in g.needs_user)
    assert "# CHECK these fields" in g.text()


def test_unreadable_files_are_named(tmp_path):
    for name, data in (("bad.onnx", b"\x00garbage"), ("bad.pt", b"not a zip")):
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ExportError, match=r"cannot read .*bad.onnx as an ONNX model"):
        generate(tmp_path / "bad.onnx")
    with pytest.raises(ExportError, match=r"bad.pt is not a TorchScript model \(not the zip archive"):
        generate(tmp_path / "bad.pt")
    with zipfile.ZipFile(tmp_path / "zip.pt", "w") as z:  # a zip, but not torch.jit.save's
        z.writestr("data.txt", "x")
    with pytest.raises(ExportError, match=r"cannot read zip.pt as a TorchScript model"):
        generate(tmp_path / "zip.pt")
    (tmp_path / "model.tflite").write_bytes(b"x")
    with pytest.raises(ExportError, match="cannot tell the format of model.tflite"):
        generate(tmp_path / "model.tflite")
    with pytest.raises(ExportError, match="does not exist"):
        generate(tmp_path / "missing.onnx")
