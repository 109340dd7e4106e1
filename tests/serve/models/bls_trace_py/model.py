import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """OUTPUT0 = 4 * INPUT0: add_sub_py called by BLS twice, once passing the request's trace on (traced as
    its child), once not (not traced, as in Triton)."""

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            inputs = [pb_utils.Tensor("INPUT0", x), pb_utils.Tensor("INPUT1", x)]
            traced = pb_utils.InferenceRequest(model_name="add_sub_py", requested_output_names=["OUTPUT0"],
                                               inputs=inputs, trace=request.trace()).exec()
            plain = pb_utils.InferenceRequest(model_name="add_sub_py", requested_output_names=["OUTPUT0"],
                                              inputs=inputs).exec()
            if traced.has_error() or plain.has_error():
                raise pb_utils.TritonModelException((traced.error() or plain.error()).message())
            out = pb_utils.get_output_tensor_by_name(traced, "OUTPUT0").as_numpy()
            out2 = pb_utils.get_output_tensor_by_name(plain, "OUTPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out + out2)]))
        return responses
