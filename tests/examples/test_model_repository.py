"""examples/model_repository, as the README's serving commands use it: every model loads and answers over
HTTP and gRPC (ONNX, TorchScript, Python, two versions, an ensemble), and the committed binary models are
what generate.py writes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.serve.frontends import running_server

REPO = Path(__file__).resolve().parents[2] / "examples" / "model_repository"


def _inputs(module, names, x, y):
    out = []
    for name, value in zip(names, (x, y)):
        i = module.InferInput(name, list(value.shape), "FP32")
        i.set_data_from_numpy(value)
        out.append(i)
    return out


def test_every_example_model_serves_over_http_and_grpc():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    y = rng.standard_normal((3, 16)).astype(np.float32)
    with running_server(REPO) as s:
        h = httpclient.InferenceServerClient(s.http_url)
        g = grpcclient.InferenceServerClient(s.grpc_url)
        try:
            index = {(m["name"], m.get("version")): m.get("state") for m in h.get_model_repository_index()}
            assert index == {("add_sub_onnx", "1"): "READY", ("add_sub_pt", "1"): "READY",
                             ("add_sub_py", "1"): "READY", ("pipeline", "1"): "READY",
                             ("versioned_py", "1"): "READY", ("versioned_py", "2"): "READY"}, index
            assert h.is_server_ready()
            for module, client in ((httpclient, h), (grpcclient, g)):
                for model, ins, outs in (("add_sub_onnx", ("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1")),
                                         ("add_sub_pt", ("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1")),
                                         ("add_sub_py", ("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1"))):
                    r = client.infer(model, _inputs(module, ins, x, y))
                    np.testing.assert_array_equal(r.as_numpy(outs[0]), x + y)
                    np.testing.assert_array_equal(r.as_numpy(outs[1]), x - y)
                r = client.infer("pipeline", _inputs(module, ("INPUT0", "INPUT1"), x, y))  # (x+y)+(x-y), (x+y)-(x-y)
                np.testing.assert_allclose(r.as_numpy("OUTPUT0"), 2 * x, atol=1e-5)
                np.testing.assert_allclose(r.as_numpy("OUTPUT1"), 2 * y, atol=1e-5)
                v = module.InferInput("INPUT0", [4], "FP32")
                v.set_data_from_numpy(np.zeros(4, np.float32))
                for version in ("1", "2"):
                    out = client.infer("versioned_py", [v], model_version=version).as_numpy("OUTPUT0")
                    np.testing.assert_array_equal(out, np.full(4, float(version), np.float32))
        finally:
            h.close()
            g.close()


def test_committed_onnx_model_is_what_generate_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", REPO / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.write_onnx(tmp_path / "model.onnx")
    assert (tmp_path / "model.onnx").read_bytes() == (REPO / "add_sub_onnx" / "1" / "model.onnx").read_bytes()
    generate.write_torchscript(tmp_path / "model.pt")  # TorchScript archives carry no stable bytes: it loads
    import torch

    scripted = torch.jit.load(str(tmp_path / "model.pt"))
    committed = torch.jit.load(str(REPO / "add_sub_pt" / "1" / "model.pt"))
    a, b = torch.ones(1, 16), torch.full((1, 16), 2.0)
    assert all(torch.equal(p, q) for p, q in zip(scripted(a, b), committed(a, b)))
