"""A repository real Triton runs when its build has no ONNX Runtime backend (the CPU Triton the anchors
installer brings ships only the Python backend): every ``onnxruntime_onnx`` model becomes a Python-backend
model whose model.py runs the very same model.onnx with onnxruntime (installed in Triton's Python
environment). Ensembles and Python models are copied unchanged. Used to compare azulite serve with real
Triton on the same exported models; onnxruntime's thread counts are fixed so outputs are reproducible.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from google.protobuf import text_format

from azulite.serve import config as serve_config

ORT_PYTHON_MODEL = '''"""Written by azulite.export.wrappers: {name}'s model.onnx run by onnxruntime inside Triton's Python
backend (for Triton builds without the ONNX Runtime backend)."""

import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = {threads}
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        here = os.path.dirname(os.path.abspath(__file__))
        self.session = ort.InferenceSession(os.path.join(here, "model.onnx"), sess_options=options,
                                            providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]

    def execute(self, requests):
        # one session run over every request the dynamic batcher handed over, split back by row counts
        feeds = [[pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs] for r in requests]
        sizes = [f[0].shape[0] for f in feeds]
        merged = {{n: np.concatenate([f[i] for f in feeds]) for i, n in enumerate(self.inputs)}}
        out = self.session.run(self.outputs, merged)
        responses, start = [], 0
        for size in sizes:
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(n, np.ascontiguousarray(o[start:start + size])) for n, o in zip(self.outputs, out)]))
            start += size
        return responses
'''


def python_backend_copy(src_repo: Path, dst_repo: Path, *, threads: int = 1) -> Path:
    """Copy ``src_repo`` to ``dst_repo`` with every ONNX model wrapped as a Python-backend model."""
    if dst_repo.exists():
        shutil.rmtree(dst_repo)
    shutil.copytree(src_repo, dst_repo, ignore=shutil.ignore_patterns(".*", "__pycache__"))
    for model_dir in sorted(p for p in dst_repo.iterdir() if p.is_dir()):
        config_path = model_dir / "config.pbtxt"
        if not config_path.is_file():
            continue
        config = serve_config.parse_config_file(config_path, model=model_dir.name)
        if serve_config.backend_of(config) != "onnxruntime":
            continue
        config.platform = ""
        config.backend = "python"
        config_path.write_text(text_format.MessageToString(config))
        for version in (v for v in model_dir.iterdir() if v.is_dir() and v.name.isdigit()):
            (version / "model.py").write_text(ORT_PYTHON_MODEL.format(name=model_dir.name, threads=threads))
    return dst_repo
