"""A BYTES (TYPE_STRING) model: UPPER = each string upper-cased, LENGTH = its length in bytes."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([s.upper() for s in text.reshape(-1)], dtype=np.object_).reshape(text.shape)
            length = np.array([len(s) for s in text.reshape(-1)], dtype=np.int64).reshape(text.shape)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("UPPER", upper), pb_utils.Tensor("LENGTH", length)]))
        return responses
