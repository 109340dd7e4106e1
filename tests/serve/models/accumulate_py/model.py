"""A sequence model with implicit state: OUTPUT = the running sum of INPUT over the sequence (the sum
lives in INPUT_STATE / OUTPUT_STATE, kept by the server); CORR echoes the CORRID control input and
FLAGS = START + 2 * END + 4 * READY of the control inputs."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            def get(name):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            total = (get("INPUT_STATE") + get("INPUT")).astype(np.int32)
            flags = (get("START") + 2 * get("END") + 4 * get("READY")).astype(np.int32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT", total),
                pb_utils.Tensor("OUTPUT_STATE", total),
                pb_utils.Tensor("CORR", get("CORRID").astype(np.uint64)),
                pb_utils.Tensor("FLAGS", flags),
            ]))
        return responses
