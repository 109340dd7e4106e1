"""Answers the request's parameters as its model sees them (PARAMS: ``request.parameters()``), Y = 2 X, and
never NEVER (a Python model may leave an output out). A negative X[0] is answered with an error response."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x.size and x.reshape(-1)[0] < 0:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("X[0] is negative")))
                continue
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("PARAMS", np.array([request.parameters().encode()], dtype=np.object_)),
                pb_utils.Tensor("Y", (x * 2).astype(np.float32))]))
        return responses
