"""The serving benchmark's model: y = x @ W with a fixed 256x256 float32 matrix W. The dynamic batcher
hands it a list of requests; it multiplies them as one matrix and splits the result back, as a
Python-backend model on real Triton must do itself. Runs unchanged on Triton and on azulite."""
import numpy as np
import triton_python_backend_utils as pb_utils


def weights():
    """Deterministic, numpy-version independent: the same W on both servers and in tests."""
    return ((np.arange(256 * 256, dtype=np.float32).reshape(256, 256) % 7) - 3.0) / 16.0


class TritonPythonModel:
    def initialize(self, args):
        self.w = weights()

    def execute(self, requests):
        xs = [pb_utils.get_input_tensor_by_name(r, "x").as_numpy() for r in requests]
        y = np.concatenate(xs) @ self.w if len(xs) > 1 else xs[0] @ self.w
        responses, start = [], 0
        for x in xs:
            n = x.shape[0]
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", y[start:start + n])]))
            start += n
        return responses
