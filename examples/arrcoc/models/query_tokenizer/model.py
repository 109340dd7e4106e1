"""query_tokenizer: a query STRING [1] -> token ids INT64 [8] for the text embedding.

Lower-cased words (runs of letters) looked up in ``vocab.json`` beside this file, written by
build_repository.py from the training queries' words: 0 pads, 1 is any unknown word; the first 8 words
count, the rest are dropped. build_repository.py imports ``tokenize`` so training sees exactly this.
"""

import json
import re
from pathlib import Path

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by the training script for tokenize(), outside a server
    pb_utils = None

LENGTH = 8
PAD, UNKNOWN = 0, 1


def tokenize(text, vocab: dict) -> np.ndarray:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    ids = [vocab.get(word, UNKNOWN) for word in re.findall(r"[a-z]+", text.lower())][:LENGTH]
    return np.asarray(ids + [PAD] * (LENGTH - len(ids)), dtype=np.int64)


class TritonPythonModel:
    def initialize(self, args):
        path = Path(args["model_repository"]) / args["model_version"] / "vocab.json"
        self.vocab = json.loads(path.read_text())

    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "text").as_numpy()
            ids = np.stack([tokenize(t, self.vocab) for t in texts.reshape(texts.shape[0], -1)[:, 0]])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("token_ids", ids)]))
        return responses
