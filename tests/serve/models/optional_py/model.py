"""Every input optional: COUNT is how many the request gave (none is a valid request)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("COUNT", np.array(
            [sum(pb_utils.get_input_tensor_by_name(r, n) is not None for n in ("A", "B"))], dtype=np.int32))])
            for r in requests]
