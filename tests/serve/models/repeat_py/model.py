"""A decoupled model (as Triton's repeat example): one response per element of IN, sent from a thread
after execute returns — OUT = the element, IDX = its position — then the final flag alone. An element
< 0 ends the request with an error response instead; an empty IN gets the final flag only."""

import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            thread = threading.Thread(target=self.answer, args=(request.get_response_sender(), values))
            thread.start()
            self.threads.append(thread)
        return None

    @staticmethod
    def answer(sender, values):
        for i, v in enumerate(values):
            if v < 0:
                error = pb_utils.TritonError(f"element {i} is negative: {v}")
                sender.send(pb_utils.InferenceResponse(error=error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", np.array([v], dtype=np.int32)),
                pb_utils.Tensor("IDX", np.array([i], dtype=np.uint32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
