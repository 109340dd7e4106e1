"""examples/arrcoc end to end: build_repository.py trains the small models on scenes it draws and writes the
Triton repository; azulite serve answers the ARR-COC ensembles over HTTP and gRPC exactly as chaining the
composing models client-side does, on the images shipped with the example; real Triton (the anchors: its
Python backend, the ONNX steps wrapped with onnxruntime inside model.py) gives the same outputs within
the stated tolerance; the seed's vlm_ensemble config.pbtxt loads as written in both."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from azulite.launch.local.procs import free_ports
from tests.serve.frontends import running_server

# the module's first test also trains and exports (about a minute on an idle 2-core machine): a generous net
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "arrcoc"
TRITONSERVER = ROOT / ".cache" / "anchors" / "bin" / "tritonserver"  # scripts/anchors.sh
AZULITE = str(Path(sys.executable).with_name("azulite"))  # the console script beside this interpreter
CASES = json.loads((EXAMPLE / "images" / "queries.json").read_text())
# azulite vs Triton: the ONNX steps run the same onnxruntime build with one thread on both sides and the
# opponent processor computes in float64, so the floats agree to the last bit in practice; the test allows
# 1e-6 on the relevance map (budgets and text exactly).
RELEVANCE_ATOL = 1e-6
OUTPUTS = ("GENERATED_TEXT", "RELEVANCE_MAP", "TOKEN_BUDGET")
MODULES = {"http": httpclient, "grpc": grpcclient}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """Both repositories from one training run: ONNX steps as onnxruntime_onnx (azulite) and as
    Python-backend wrappers (the Triton anchor has no onnxruntime backend)."""
    root = tmp_path_factory.mktemp("arrcoc")
    # azulite's repository has an integrity manifest (unsigned) before the build: the build must add its
    # models to it, or the server refuses every one of them as "not in the manifest"
    (root / "azulite").mkdir()
    sign = subprocess.run([AZULITE, "repo", "sign", str(root / "azulite")],
                          capture_output=True, text=True, cwd=ROOT)
    assert sign.returncode == 0, sign.stderr
    p = subprocess.run([sys.executable, str(EXAMPLE / "build_repository.py"), "--out", str(root / "azulite"),
                        "--also-triton-python", str(root / "triton")],
                       capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return root / "azulite", root / "triton", json.loads(p.stdout.strip().splitlines()[-1])


def raw_image(case: dict) -> np.ndarray:
    return np.frombuffer((EXAMPLE / "images" / case["image"]).read_bytes(), dtype=np.uint8)[None]


def text_tensor(text: str) -> np.ndarray:
    return np.array([[text.encode()]], dtype=np.object_)


def call(module, client, model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict:
    infer_inputs = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        infer_inputs.append(tensor)
    result = client.infer(model, infer_inputs, outputs=[module.InferRequestedOutput(n) for n in outputs])
    return {name: result.as_numpy(name) for name in outputs}


def chain(module, client, case: dict) -> dict:
    """The pipeline as a client would run it model by model, feeding each one's outputs to the next."""
    image = call(module, client, "image_preprocessor", {"raw_bytes": raw_image(case)},
                 ("preprocessed_image",))["preprocessed_image"]
    texture = call(module, client, "texture_array", {"image": image}, ("texture",))["texture"]
    scores = {name: call(module, client, f"{name}_scorer", {"texture": texture}, ("scores",))["scores"]
              for name in ("propositional", "perspectival")}
    ids = call(module, client, "query_tokenizer", {"text": text_tensor(case["query"])}, ("token_ids",))["token_ids"]
    embedding = call(module, client, "text_embedding", {"token_ids": ids}, ("embedding",))["embedding"]
    scores["participatory"] = call(module, client, "participatory_scorer",
                                   {"texture": texture, "embedding": embedding}, ("scores",))["scores"]
    opp = call(module, client, "opponent_processor", scores, ("relevance_map", "token_budget"))
    answer = call(module, client, "decoder",
                  {"texture": texture, "token_budget": opp["token_budget"], "embedding": embedding},
                  ("token_ids",))["token_ids"]
    text = call(module, client, "detokenizer", {"token_ids": answer}, ("text",))["text"]
    return {"GENERATED_TEXT": text, "RELEVANCE_MAP": opp["relevance_map"], "TOKEN_BUDGET": opp["token_budget"]}


def ensemble(module, client, case: dict) -> dict:
    return call(module, client, "arrcoc", {"RAW_IMAGE": raw_image(case), "TEXT_QUERY": text_tensor(case["query"])},
                OUTPUTS)


def seed_ensemble(module, client, case: dict) -> str:
    out = call(module, client, "vlm_ensemble", {"RAW_IMAGE": raw_image(case), "TEXT_QUERY": text_tensor(case["query"])},
               ("GENERATED_TEXT",))
    return out["GENERATED_TEXT"][0, 0].decode()


def client_for(protocol: str, url: str):
    return MODULES[protocol].InferenceServerClient(url)


def test_build_trains_and_verifies_every_export(built) -> None:
    azulite_repo, triton_repo, summary = built
    print(json.dumps(summary))  # the held-out figures, for the record (pytest -rA)
    assert set(summary["models"]) == {p.name for p in azulite_repo.iterdir() if p.is_dir()} == \
        {p.name for p in triton_repo.iterdir()}
    assert all(error <= 1e-4 for error in summary["onnx_max_abs_error"].values()), summary
    # trained, not canned: on 200 fresh scenes most answers are exact and the budget lands on the shape
    assert summary["heldout_accuracy"] >= 0.5, summary
    assert summary["heldout_relevance_hit"] >= 0.8, summary
    assert (azulite_repo / "vlm_ensemble" / "config.pbtxt").read_bytes() == \
        (EXAMPLE / "models" / "vlm_ensemble" / "config.pbtxt").read_bytes()
    assert 'platform: "onnxruntime_onnx"' in (azulite_repo / "decoder" / "config.pbtxt").read_text()
    assert 'backend: "python"' in (triton_repo / "decoder" / "config.pbtxt").read_text()
    assert summary["integrity"] == [f"azulite-manifest.json updated for {', '.join(summary['models'])}"]


def test_a_signed_repository_is_refused_without_its_key_before_training(tmp_path) -> None:
    """A repository `azulite repo sign --key` signed takes new models only re-signed: the build says so
    before its minutes of training (it wrote models the server then refused, and said nothing)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (("repo", "keygen", str(tmp_path / "k.pem"), str(tmp_path / "k.pub.pem")),
                 ("repo", "sign", str(repo), "--key", str(tmp_path / "k.pem"))):
        assert subprocess.run([AZULITE, *args], capture_output=True, cwd=ROOT).returncode == 0
    p = subprocess.run([sys.executable, str(EXAMPLE / "build_repository.py"), "--out", str(repo)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode != 0 and "--sign-key PRIVATE.pem" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert sorted(f.name for f in repo.iterdir()) == ["azulite-manifest.json", "azulite-manifest.sig"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_equals_chaining_its_models_client_side(built, protocol: str) -> None:
    azulite_repo, _, _ = built
    module = MODULES[protocol]
    with running_server(azulite_repo) as server:
        client = client_for(protocol, server.http_url if protocol == "http" else server.grpc_url)
        assert client.is_model_ready("vlm_ensemble")  # the seed's config, as written
        located = 0
        for case in CASES:
            served, chained = ensemble(module, client, case), chain(module, client, case)
            assert served["GENERATED_TEXT"].tolist() == chained["GENERATED_TEXT"].tolist()
            np.testing.assert_array_equal(served["RELEVANCE_MAP"], chained["RELEVANCE_MAP"])
            np.testing.assert_array_equal(served["TOKEN_BUDGET"], chained["TOKEN_BUDGET"])
            budget, relevance = served["TOKEN_BUDGET"], served["RELEVANCE_MAP"]
            assert budget.dtype == np.int32 and budget.shape == (1, 8, 8)
            assert budget.min() >= 64 and budget.max() == 400 and relevance.max() == 1.0 and relevance.min() > 0
            text = served["GENERATED_TEXT"][0, 0].decode()
            assert seed_ensemble(module, client, case) == text
            said, truth = text.split(), case["answer"].split()
            # colour, row and column (the shape word is the decoder's weakest: README "ARR-COC")
            located += len(said) == 4 and all(said[i] == truth[i] for i in (0, 2, 3))
        assert located >= len(CASES) - 1, f"only {located} of {len(CASES)} shipped scenes located right"


def test_bad_image_is_a_clear_client_error(built) -> None:
    azulite_repo, _, _ = built
    with running_server(azulite_repo) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        bad = np.frombuffer(b"not an image at all", dtype=np.uint8)[None]
        with pytest.raises(InferenceServerException) as err:
            call(httpclient, client, "arrcoc", {"RAW_IMAGE": bad, "TEXT_QUERY": text_tensor("red")}, OUTPUTS)
        assert err.value.status() == "400"
        assert "RAW_IMAGE (19 bytes, starting b'not an i') is not an image" in err.value.message()
        truncated = raw_image(CASES[0])[:, :500]  # a PNG header, then nothing
        with pytest.raises(InferenceServerException) as err:
            call(httpclient, client, "arrcoc", {"RAW_IMAGE": truncated, "TEXT_QUERY": text_tensor("red")}, OUTPUTS)
        assert err.value.status() == "400"
        assert "RAW_IMAGE (500 bytes, starting b'\\x89PNG" in err.value.message(), err.value.message()
        # a 24 KB PNG declaring 14000 x 14000 pixels: Pillow's DecompressionBombError was not caught, a 500 that
        # failed every request batched with it; 8000 x 8000 (186 KB) was decoded whole, 64 MP for a 64 x 64 input
        for side, words in ((14000, "exceeds limit"), (8000, "RAW_IMAGE is 8000 x 8000 pixels, more than the 16,777,216")):
            from PIL import Image

            png = io.BytesIO()
            Image.new("1", (side, side)).save(png, "PNG")
            big = np.frombuffer(png.getvalue(), dtype=np.uint8)[None]
            with pytest.raises(InferenceServerException) as err:
                call(httpclient, client, "arrcoc", {"RAW_IMAGE": big, "TEXT_QUERY": text_tensor("red")}, OUTPUTS)
            assert err.value.status() == "400" and words in err.value.message(), err.value.message()


def test_real_triton_gives_the_same_outputs(built, tmp_path: Path) -> None:
    azulite_repo, triton_repo, _ = built
    assert TRITONSERVER.exists(), "tritonserver missing: `make test` installs it (scripts/anchors.sh)"
    with running_server(azulite_repo) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        ours = {case["image"]: ensemble(httpclient, client, case) for case in CASES}
    http_port, grpc_port, metrics_port = free_ports(3)
    log = (tmp_path / "tritonserver.log").open("w")
    proc = subprocess.Popen([str(TRITONSERVER), f"--model-repository={triton_repo}", "--http-address=127.0.0.1",
                             "--grpc-address=127.0.0.1", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
                             f"--metrics-port={metrics_port}", "--allow-metrics=false"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        clients = {"http": httpclient.InferenceServerClient(f"127.0.0.1:{http_port}"),
                   "grpc": grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")}
        deadline = time.monotonic() + 600  # a safety net only: the loop ends when Triton says it is ready
        while True:
            assert proc.poll() is None, (tmp_path / "tritonserver.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (tmp_path / "tritonserver.log").read_text()[-4000:]
            try:
                if clients["http"].is_server_ready():
                    break
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.2)
        assert clients["http"].is_model_ready("vlm_ensemble")  # the seed's config, as written, in Triton too
        for protocol, client in clients.items():
            for case in CASES:
                theirs = ensemble(MODULES[protocol], client, case)
                mine = ours[case["image"]]
                assert theirs["GENERATED_TEXT"].tolist() == mine["GENERATED_TEXT"].tolist(), case
                np.testing.assert_array_equal(theirs["TOKEN_BUDGET"], mine["TOKEN_BUDGET"])
                np.testing.assert_allclose(theirs["RELEVANCE_MAP"], mine["RELEVANCE_MAP"], rtol=0, atol=RELEVANCE_ATOL)
                assert seed_ensemble(MODULES[protocol], client, case) == mine["GENERATED_TEXT"][0, 0].decode()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # Triton shuts its Python stubs down itself
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        try:  # any stub left behind (it runs in Triton's session)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
