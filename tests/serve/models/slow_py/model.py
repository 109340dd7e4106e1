"""Sleeps `delay_s` (config parameter) per execute, then echoes INPUT0 and records the order of calls:
lets tests watch queueing, priorities and timeouts."""
import json
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.delay = float(config["parameters"]["delay_s"]["string_value"])

    def execute(self, requests):
        time.sleep(self.delay)
        return [
            pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
