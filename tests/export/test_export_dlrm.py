"""The DLRM job end to end: TorchRec's DLRM trained on 2 gloo ranks with its tables sharded; ``azulite
export JOB_ID`` gathers the shards into one model, exports the served pipeline (raw Criteo row -> the
parse -> ONNX graph with the training transform, hashing and embeddings: by default one Python step that
parses and runs the graph, ``--pipeline ensemble`` a parse step and the ONNX model chained by an
ensemble) and ``azulite serve`` answers Triton's clients, over HTTP and gRPC, with the scores TorchRec's
own forward gives the same raw rows through the training preprocessing, in either form. A malformed row
is the client's error, named, not a 500."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from azulite.data.criteo_synth import generate
from azulite.errors import ExportError
from azulite.export import ExportOptions, export_checkpoint
from azulite.export.wrappers import python_backend_copy
from azulite.export.dlrm import reference_scores
from azulite.serve import config as serve_config
from azulite.workloads.dlrm.model import load_plain_model
from tests.cli.test_serve import Served
from tests.examples.runner import run_example
from tests.export.test_export_ddp import cli
from tests.serve.anchor import running_triton

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a safety net: a real job trains first
TRITON = Path(__file__).resolve().parents[2] / ".cache" / "anchors" / "bin" / "tritonserver"  # scripts/anchors.sh


@pytest.fixture(scope="module")
def dlrm_job(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dlrm_export")
    generate(root / "tsv", rows=2000, files=2, seed=0)
    mp = pytest.MonkeyPatch()
    mp.setenv("AZULITE_HOME", str(root / "azhome"))
    try:
        rec = run_example("dlrm", f"inputs.dataset.path={root / 'tsv'}", "inputs.epochs=1",
                          "inputs.limit_train_batches=12", "inputs.checkpoint_every=0", timeout=400)
    finally:
        mp.undo()
    rec["home"] = str(root / "azhome")
    rec["data"] = root / "tsv"
    return rec


def held_out_rows(data: Path, n: int) -> np.ndarray:
    """Rows 0..n-1 of the first file: held out from training (row i with i % 1000 < 200)."""
    first = sorted(p for p in data.iterdir() if p.name.startswith("day_"))[0]
    lines = first.read_bytes().splitlines()[:n]
    return np.array(lines, dtype=object).reshape(n, 1)


@pytest.fixture(scope="module")
def exported(dlrm_job, tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("dlrm_repo") / "repo"
    p = cli("export", dlrm_job["id"], "--to", str(repo), "--json", env={"AZULITE_HOME": dlrm_job["home"]})
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(p.stdout)
    # the same checkpoint as an ensemble beside it, under another name
    p = cli("export", dlrm_job["id"], "--to", str(repo), "--name", "dlrm_ens", "--pipeline", "ensemble",
            env={"AZULITE_HOME": dlrm_job["home"]})
    assert p.returncode == 0, p.stdout + p.stderr
    # the text says what serves it: the ensemble clients call, and where its ONNX step lies
    assert "served behind an ensemble" in p.stdout and "-> ensemble 'dlrm_ens' version 1 (the onnx step in " in p.stdout
    assert result["pipeline"] == "fused"
    step_dir = Path(result["checkpoint"])
    model, mc = load_plain_model(step_dir)  # the DLRM engineer's own unsharded loader: independent weights
    rows = held_out_rows(dlrm_job["data"], 24)
    want = reference_scores(model, rows, mc["kwargs"]["num_embeddings_per_feature"])
    return {"repo": repo, "result": result, "step_dir": step_dir, "rows": rows, "want": want}


def test_export_sharded_dlrm_serve_raw_rows_equal_to_torchrec(exported):
    repo, result, step_dir = exported["repo"], exported["result"], exported["step_dir"]
    rows, want = exported["rows"], exported["want"]
    assert (result["name"], result["format"], result["inputs"], result["outputs"], result["pipeline"]) == \
        ("dlrm", "onnx", ["ROW"], ["SCORE"], "fused")
    assert result["verification"]["ok"]
    # every feature looked up in one Gather over the tables laid end to end, not a slice and a lookup each
    for model_dir in ("dlrm", "dlrm_ens_model"):
        ops = [node.op_type for node in onnx.load(repo / model_dir / "1" / "model.onnx").graph.node]
        assert ops.count("Gather") == 1, ops
    assert sorted(x.name for x in repo.iterdir()) == ["dlrm", "dlrm_ens", "dlrm_ens_model", "dlrm_ens_preprocess"]
    assert sorted(x.name for x in (repo / "dlrm" / "1").iterdir()) == ["model.onnx", "model.py"]
    assert serve_config.backend_of(serve_config.parse_config_file(repo / "dlrm" / "config.pbtxt", model="dlrm")) == "python"
    assert json.loads((step_dir / "manifest.json").read_text())["world_size"] == 2
    assert want.shape == (24, 1) and 0 < want.min() and want.max() < 1
    s = Served(str(repo))
    try:
        h = httpclient.InferenceServerClient(f"127.0.0.1:{s.ports['HTTPService']}")
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{s.ports['GRPCInferenceService']}")
        try:
            for (module, client), model in itertools.product(((httpclient, h), (grpcclient, g)), ("dlrm", "dlrm_ens")):
                inp = module.InferInput("ROW", [24, 1], "BYTES")
                inp.set_data_from_numpy(rows)
                got = client.infer(model, [inp]).as_numpy("SCORE")
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
                # rows without their label are the same rows
                bare = np.array([r.split(b"\t", 1)[1] for r in rows.reshape(-1)], dtype=object).reshape(24, 1)
                inp = module.InferInput("ROW", [24, 1], "BYTES")
                inp.set_data_from_numpy(bare)
                np.testing.assert_allclose(client.infer(model, [inp]).as_numpy("SCORE"), got, rtol=1e-6)
                bad = np.array([b"1\t2\tnot-a-row"], dtype=object).reshape(1, 1)
                inp = module.InferInput("ROW", [1, 1], "BYTES")
                inp.set_data_from_numpy(bad)
                with pytest.raises(InferenceServerException, match="3 tab-separated fields"):
                    client.infer(model, [inp])
        finally:
            h.close()
            g.close()
    finally:
        s.stop()


def test_the_pipeline_options_that_cannot_be_are_refused_before_anything_is_written(exported):
    repo, step = exported["repo"], exported["result"]["checkpoint"]
    before = sorted(str(p.relative_to(repo)) for p in repo.rglob("*"))
    with pytest.raises(ExportError, match="runs the model with onnxruntime inside its Python step: --format "
                                          "torchscript") as err:
        export_checkpoint(step, ExportOptions(repo=repo, name="other", format="torchscript"))
    assert "--pipeline ensemble" in err.value.fix
    with pytest.raises(ExportError, match=r"model 'dlrm_ens' .* is ensemble .*: a one-step \(Python backend\) "
                                          "version cannot join it") as err:
        export_checkpoint(step, ExportOptions(repo=repo, name="dlrm_ens"))
    assert "--pipeline ensemble" in err.value.fix
    with pytest.raises(ExportError, match=r"model 'dlrm' .* is python .*: an ensemble cannot add a version to it") as err:
        export_checkpoint(step, ExportOptions(repo=repo, name="dlrm", pipeline="ensemble"))
    assert "--pipeline fused" in err.value.fix
    with pytest.raises(ExportError, match="unknown pipeline 'two-step'"):
        ExportOptions(repo=repo, pipeline="two-step")
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) == before


def test_real_triton_serves_the_exported_repository_with_the_same_scores(exported, tmp_path):
    """The exported repository is a plain Triton one: the anchors' Triton (Python backend only, with
    onnxruntime in its environment) runs the one-step model.py as written, and the ensemble form with its
    ONNX model wrapped in a model.py running the same file with onnxruntime (the ensemble and the Python
    preprocessing step load unchanged)."""
    assert TRITON.exists(), "tritonserver missing: `make test` installs it (scripts/anchors.sh)"
    src = tmp_path / "src_repo"
    shutil.copytree(exported["repo"], src)
    # beside it, the ONNX file under a config written offline by `azulite config generate`
    (src / "generated" / "1").mkdir(parents=True)
    shutil.copy(src / "dlrm" / "1" / "model.onnx", src / "generated" / "1" / "model.onnx")
    p = cli("config", "generate", str(src / "generated" / "1" / "model.onnx"), "--max-batch-size", "16",
            "-o", str(src / "generated" / "config.pbtxt"))
    assert p.returncode == 0, p.stderr
    triton_repo = python_backend_copy(src, tmp_path / "triton_repo")
    with running_triton(triton_repo, tmp_path / "triton.log") as triton:  # ready: every model loaded
        client = httpclient.InferenceServerClient(triton.http_url)
        for model in ("dlrm", "dlrm_ens"):
            assert client.is_model_ready(model)
            inp = httpclient.InferInput("ROW", [24, 1], "BYTES")
            inp.set_data_from_numpy(exported["rows"])
            got = client.infer(model, [inp]).as_numpy("SCORE")
            np.testing.assert_allclose(got, exported["want"], rtol=1e-4, atol=1e-5)
        assert client.is_model_ready("generated")
        meta = client.get_model_metadata("generated")
        assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == \
            [("DENSE_RAW", "INT64", [-1, 13]), ("CATEGORY_IDS", "INT64", [-1, 26])]
        client.close()
