"""The end of the demo, from a finished DLRM job: score its held-out rows through the served pipeline with
Triton's own clients (HTTP and gRPC), beside the PyTorch model rebuilt from the same checkpoint, and print
the served AUC.  Usage: python scripts/demo_serve.py JOB_ID HTTP_PORT GRPC_PORT CHECKPOINT_DIR"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def held_out(dataset: Path, permille: int, limit: int) -> np.ndarray:
    """Row i of each file with i % 1000 < permille: the rows training held out (examples/dlrm/train.py)."""
    rows: list[bytes] = []
    for f in sorted(p for p in dataset.iterdir() if p.name.startswith("day_") and p.suffix in ("", ".gz")):
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rb") as fh:
            for i, line in enumerate(fh):
                if i % 1000 < permille:
                    rows.append(line.rstrip(b"\r\n"))
                if len(rows) >= limit:
                    return np.array(rows, dtype=object).reshape(-1, 1)
    return np.array(rows, dtype=object).reshape(-1, 1)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    from torchmetrics.functional.classification import binary_auroc
    import torch

    return float(binary_auroc(torch.from_numpy(scores.astype(np.float32)), torch.from_numpy(labels.astype(np.int64))))


def main() -> int:
    job_id, http_port, grpc_port, step_dir = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    rec = json.loads(subprocess.run(["azulite", "job", "show", job_id, "--json"], check=True, capture_output=True,
                                    text=True).stdout)
    inputs = rec["spec"]["inputs"]
    dataset = Path(inputs["dataset"]["path"])
    permille = round(float(inputs.get("validation_fraction", 0.1)) * 1000)
    rows = held_out(dataset, permille, 2000)
    labels = np.array([int(r.split(b"\t", 1)[0]) for r in rows.reshape(-1)])

    from azulite.export.dlrm import reference_scores
    from azulite.workloads.dlrm.model import load_plain_model

    with warnings.catch_warnings():  # DCP: "torch.distributed is disabled ... load in a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        model, mc = load_plain_model(step_dir)
    torch_scores = reference_scores(model, rows, mc["kwargs"]["num_embeddings_per_feature"]).reshape(-1)
    served = {}
    for proto, module, client in (("http", httpclient, httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")),
                                  ("grpc", grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}"))):
        out = []
        for start in range(0, len(rows), 64):  # the model's max_batch_size
            batch = rows[start:start + 64]
            inp = module.InferInput("ROW", list(batch.shape), "BYTES")
            inp.set_data_from_numpy(batch)
            out.append(client.infer("dlrm", [inp]).as_numpy("SCORE").reshape(-1))
        served[proto] = np.concatenate(out)
        client.close()
    print(f"{len(rows)} held-out rows (raw Criteo TSV lines) scored by the served model 'dlrm' over HTTP and gRPC:")
    print(f"{'row':>4} {'label':>5} {'served HTTP':>12} {'served gRPC':>12} {'PyTorch':>12}")
    for i in range(8):
        print(f"{i:>4} {labels[i]:>5} {served['http'][i]:>12.6f} {served['grpc'][i]:>12.6f} {torch_scores[i]:>12.6f}")
    worst = max(float(np.abs(served[p] - torch_scores).max()) for p in served)
    ok = all(np.allclose(served[p], torch_scores, rtol=1e-4, atol=1e-5) for p in served)
    print(f"max |served - PyTorch| = {worst:.3g} over {len(rows)} rows: "
          + ("within the export's verified tolerance (atol 1e-5 + rtol 1e-4)" if ok else "OUT OF TOLERANCE"))
    print(f"served AUC {auc(served['http'], labels):.4f} (PyTorch {auc(torch_scores, labels):.4f}) "
          f"on {len(rows)} held-out rows")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
