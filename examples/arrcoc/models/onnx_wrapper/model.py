"""An ONNX model served by Triton's Python backend: onnxruntime inside model.py.

The Triton that runs here (scripts/anchors.sh) ships only its Python backend, so build_repository.py
--triton-python writes each ONNX step of the pipeline as this file beside its model.onnx, with the
same inputs, outputs and ``intra_op_thread_count`` / ``inter_op_thread_count`` parameters (names of
Triton's onnxruntime backend) as the onnxruntime_onnx config azulite serves: the same onnxruntime with
the same thread counts computes the same floats.
"""

import json
from pathlib import Path

import onnxruntime as ort

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        options = ort.SessionOptions()
        for key, attr in (("intra_op_thread_count", "intra_op_num_threads"),
                          ("inter_op_thread_count", "inter_op_num_threads")):
            if key in params:
                setattr(options, attr, int(params[key]["string_value"]))
        path = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        self.session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
        self.inputs = [t["name"] for t in config["input"]]
        self.outputs = [t["name"] for t in config["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            feed = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.inputs}
            results = self.session.run(self.outputs, feed)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, value) for name, value in zip(self.outputs, results)]))
        return responses
