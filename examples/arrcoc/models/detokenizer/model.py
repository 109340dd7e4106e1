"""detokenizer: the decoder's answer ids INT64 [5] -> the answer as one STRING [1] ("red circle top left").

``vocab.json`` beside this file is the decoder's word list (written by build_repository.py); words are
joined up to the first <eos>; <pad> and <bos> are skipped.
"""

import json
from pathlib import Path

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by the training script for detokenize(), outside a server
    pb_utils = None


def detokenize(ids, words) -> str:
    out = []
    for i in ids:
        word = words[int(i)] if 0 <= int(i) < len(words) else "<unk>"
        if word == "<eos>":
            break
        if word not in ("<pad>", "<bos>"):
            out.append(word)
    return " ".join(out)


class TritonPythonModel:
    def initialize(self, args):
        path = Path(args["model_repository"]) / args["model_version"] / "vocab.json"
        self.words = json.loads(path.read_text())

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "token_ids").as_numpy()
            texts = np.array([[detokenize(row, self.words).encode()] for row in ids], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text", texts)]))
        return responses
