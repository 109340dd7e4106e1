"""The DLRM job end to end: TorchRec's DLRM trained on 2 gloo ranks with its tables sharded; ``azulite
export JOB_ID`` gathers the shards into one model, exports the served pipeline (raw Criteo row -> Python
parse step -> ONNX graph with the training transform, hashing and embeddings) and ``azulite serve``
answers Triton's clients, over HTTP and gRPC, with the scores TorchRec's own forward gives the same raw
rows through the training preprocessing. A malformed row is the client's error, named, not a 500."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from azulite.data.criteo_synth import generate
from azulite.export.dlrm import reference_scores
from azulite.workloads.dlrm.model import load_plain_model
from tests.cli.test_serve import Served
from tests.examples.runner import run_example
from tests.export.test_export_ddp import cli

pytestmark = pytest.mark.slow


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


def test_export_sharded_dlrm_serve_raw_rows_equal_to_torchrec(dlrm_job, tmp_path):
    repo = tmp_path / "repo"
    p = cli("export", dlrm_job["id"], "--to", str(repo), "--json", env={"AZULITE_HOME": dlrm_job["home"]})
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(p.stdout)
    assert (result["name"], result["format"], result["inputs"], result["outputs"]) == ("dlrm", "onnx", ["ROW"], ["SCORE"])
    assert result["verification"]["ok"]
    assert sorted(x.name for x in repo.iterdir()) == ["dlrm", "dlrm_model", "dlrm_preprocess"]
    step_dir = Path(result["checkpoint"])
    assert json.loads((step_dir / "manifest.json").read_text())["world_size"] == 2

    model, mc = load_plain_model(step_dir)  # the DLRM engineer's own unsharded loader: independent weights
    rows = held_out_rows(dlrm_job["data"], 24)
    want = reference_scores(model, rows, mc["kwargs"]["num_embeddings_per_feature"])
    assert want.shape == (24, 1) and 0 < want.min() and want.max() < 1
    s = Served(str(repo))
    try:
        h = httpclient.InferenceServerClient(f"127.0.0.1:{s.ports['HTTPService']}")
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{s.ports['GRPCInferenceService']}")
        try:
            for module, client in ((httpclient, h), (grpcclient, g)):
                inp = module.InferInput("ROW", [24, 1], "BYTES")
                inp.set_data_from_numpy(rows)
                got = client.infer("dlrm", [inp]).as_numpy("SCORE")
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
                # rows without their label are the same rows
                bare = np.array([r.split(b"\t", 1)[1] for r in rows.reshape(-1)], dtype=object).reshape(24, 1)
                inp = module.InferInput("ROW", [24, 1], "BYTES")
                inp.set_data_from_numpy(bare)
                np.testing.assert_allclose(client.infer("dlrm", [inp]).as_numpy("SCORE"), got, rtol=1e-6)
                bad = np.array([b"1\t2\tnot-a-row"], dtype=object).reshape(1, 1)
                inp = module.InferInput("ROW", [1, 1], "BYTES")
                inp.set_data_from_numpy(bad)
                with pytest.raises(InferenceServerException, match="3 tab-separated fields"):
                    client.infer("dlrm", [inp])
        finally:
            h.close()
            g.close()
    finally:
        s.stop()
