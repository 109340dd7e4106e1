"""A client's inputs as a Python model sees them: random subsets of every Triton datatype (optional
inputs), random shapes (zero-sized ones too) and random BYTES, sent by tritonclient over HTTP (binary and
JSON) and gRPC to a model that echoes each input and reports what it got (numpy dtype, shape, the types
of BYTES elements). Each echo is the array sent, bit for bit, and the report says what Triton's Python
backend hands a model; real Triton 2.51 reports the same for the same seeds. FP16 cannot travel as JSON
on either (a 400). ``make test`` runs 80 seeds; ``make soak`` (AZULITE_SOAK=1) 2,000 more."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from .frontends import running_server

TYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
         "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
         "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_}
MODEL = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

NAMES = {names!r}


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            seen, tensors = {{}}, []
            for n in NAMES:
                t = pb_utils.get_input_tensor_by_name(r, "IN_" + n)
                if t is None:
                    continue
                a = t.as_numpy()
                kinds = sorted({{type(v).__name__ for v in a.reshape(-1)}}) if a.dtype == object else None
                seen[n] = [a.dtype.str, list(a.shape), kinds]
                tensors.append(pb_utils.Tensor("OUT_" + n, a))
            tensors.append(pb_utils.Tensor("SEEN", np.array([json.dumps(seen, sort_keys=True).encode()], dtype=object)))
            out.append(pb_utils.InferenceResponse(tensors))
        return out
'''.format(names=list(TYPES))


def config() -> str:
    def typ(t: str) -> str:
        return "TYPE_STRING" if t == "BYTES" else f"TYPE_{t}"
    ins = ",\n  ".join(f'{{ name: "IN_{t}" data_type: {typ(t)} dims: [ -1, -1 ] optional: true }}' for t in TYPES)
    outs = ",\n  ".join(f'{{ name: "OUT_{t}" data_type: {typ(t)} dims: [ -1, -1 ] }}' for t in TYPES)
    return (f'name: "echo_all"\nbackend: "python"\nmax_batch_size: 0\ninput [\n  {ins}\n]\n'
            f'output [\n  {outs},\n  {{ name: "SEEN" data_type: TYPE_STRING dims: [ 1 ] }}\n]\n')


def inputs_of(seed: int, *, text: bool = False) -> dict[str, np.ndarray]:
    """The seed's inputs; ``text``: BYTES elements as UTF-8 (each byte as its Latin-1 character: what a JSON
    request can carry; tritonclient refuses other bytes there)."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in [t for t in TYPES if rng.random() < 0.3] or ["FP32"]:
        shape = (int(rng.integers(0, 3)), int(rng.integers(0, 4)))
        if t == "BYTES":
            a = np.empty(shape[0] * shape[1], dtype=object)
            a[:] = [rng.bytes(int(rng.integers(0, 5))) for _ in range(a.size)]
            if text:
                a[:] = [v.decode("latin-1").encode() for v in a]
            out[t] = a.reshape(shape)
        elif t == "BOOL":
            out[t] = rng.random(shape) < 0.5
        else:
            out[t] = (rng.standard_normal(shape) * 50).astype(TYPES[t])
    return out


def what_a_model_sees(sent: dict[str, np.ndarray]) -> dict:
    """What Triton's Python backend hands a model for these inputs (as_numpy): the datatype's numpy type,
    the shape sent, BYTES as an object array of bytes."""
    return {t: [np.dtype(TYPES[t]).str, list(a.shape), sorted({"bytes"} if a.size else set()) if t == "BYTES" else None]
            for t, a in sent.items()}


def exchange(kind: str, client, sent: dict[str, np.ndarray]):
    """-> (SEEN, {datatype: echoed array}) or (status, message) for a refusal."""
    binary = kind != "http_json"
    module = tg if kind == "grpc" else th
    tensors = []
    for t, a in sent.items():
        tensor = module.InferInput(f"IN_{t}", list(a.shape), t)
        if kind == "grpc":
            tensor.set_data_from_numpy(a)
        else:
            tensor.set_data_from_numpy(a, binary_data=binary)
        tensors.append(tensor)
    try:
        if kind == "grpc":
            result = client.infer("echo_all", tensors)
        else:
            outputs = [th.InferRequestedOutput(f"OUT_{t}", binary_data=binary) for t in sent]
            result = client.infer("echo_all", tensors, outputs=outputs + [th.InferRequestedOutput("SEEN", binary_data=True)])
    except InferenceServerException as exc:
        return str(exc.status()), exc.message()
    echoed = {}
    for t in sent:
        a = result.as_numpy(f"OUT_{t}")
        if a.dtype == object:  # JSON answers give text for BYTES (tritonclient), binary ones bytes
            as_bytes = np.empty(a.size, dtype=object)
            as_bytes[:] = [v.encode() if isinstance(v, str) else v for v in a.reshape(-1)]
            a = as_bytes.reshape(a.shape)
        echoed[t] = a
    return json.loads(result.as_numpy("SEEN")[0]), echoed


def clients(http_url: str, grpc_url: str) -> dict:
    return {"http": th.InferenceServerClient(http_url), "http_json": th.InferenceServerClient(http_url),
            "grpc": tg.InferenceServerClient(grpc_url)}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs_repo")
    (root / "echo_all" / "1").mkdir(parents=True)
    (root / "echo_all" / "config.pbtxt").write_text(config())
    (root / "echo_all" / "1" / "model.py").write_text(MODEL)
    return root


def check_seeds(url_http: str, url_grpc: str, seeds) -> dict:
    """Every exchange against the oracle; returns what the model reported, by (seed, kind)."""
    reports = {}
    for seed in seeds:
        for kind, client in clients(url_http, url_grpc).items():
            sent = inputs_of(seed, text=kind == "http_json")
            got = exchange(kind, client, sent)
            if kind == "http_json" and "FP16" in sent:
                assert got[0] == "400" and "FP16" in got[1] and "JSON" in got[1], (seed, got)
                reports[seed, kind] = got[0]
                continue
            seen, echoed = got
            assert seen == what_a_model_sees(sent), (seed, kind)
            for t, a in sent.items():
                assert echoed[t].dtype == a.dtype and echoed[t].shape == a.shape, (seed, kind, t)
                # bit for bit, floats sent as JSON numbers included
                assert (echoed[t].tolist() == a.tolist()) if a.dtype == object else (echoed[t].tobytes() == a.tobytes()), \
                    (seed, kind, t)
            reports[seed, kind] = seen
    return reports


def test_a_clients_inputs_reach_a_model_as_sent(repo):
    with running_server(repo) as s:
        check_seeds(s.http_url, s.grpc_url, range(80))


@pytest.mark.soak
def test_a_clients_inputs_soak(repo):
    with running_server(repo) as s:
        check_seeds(s.http_url, s.grpc_url, range(80, 2080 if os.environ.get("AZULITE_SOAK") == "1" else 280))


def test_real_triton_hands_a_model_the_same_inputs(repo, tmp_path):
    """The oracle's rules are Triton's: real Triton 2.51 reports the same dtypes, shapes and BYTES element
    types to its model for the same seeds, and echoes the same values (an FP64 sent as JSON may come back
    one unit in the last place off there: its JSON reader rounds; azulite's does not, checked above)."""
    from .anchor import running_triton

    with running_triton(repo, tmp_path / "triton.log") as triton:
        for seed in range(40):
            for kind, client in clients(triton.http_url, triton.grpc_url).items():
                sent = inputs_of(seed, text=kind == "http_json")
                got = exchange(kind, client, sent)
                if kind == "http_json" and "FP16" in sent:
                    assert got[0] == "400", (seed, got)
                    continue
                seen, echoed = got
                assert seen == what_a_model_sees(sent), (seed, kind)
                for t, a in sent.items():
                    assert echoed[t].dtype == a.dtype and echoed[t].shape == a.shape, (seed, kind, t)
                    if a.dtype.kind == "f" and kind == "http_json":
                        np.testing.assert_array_max_ulp(echoed[t], a, maxulp=1)
                    else:
                        assert echoed[t].tolist() == a.tolist(), (seed, kind, t)
