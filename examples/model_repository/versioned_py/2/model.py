"""Two versions share this file: OUTPUT0 = INPUT0 + <model version> (1 or 2)."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.add = np.float32(int(args["model_version"]))

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + self.add)])
            for r in requests
        ]
