"""Echoes INPUT0, but each execution first waits at a gate the test holds: a Unix socket named by the
config parameter ``gate``. While the socket exists, execute connects and blocks until the test closes its
end (the call is then certainly inside the server); once the test has removed it, executions pass through.
Lets tests act on calls that are known to be executing, without timing anything."""
import json
import socket

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.gate = json.loads(args["model_config"])["parameters"]["gate"]["string_value"]

    def execute(self, requests):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(300)  # a safety net only: the test opens the gate in a finally
            try:
                s.connect(self.gate)
                s.recv(1)
            except OSError:  # the gate is gone or was closed under us: open
                pass
        return [
            pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests
        ]
