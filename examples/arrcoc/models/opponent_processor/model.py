"""opponent_processor: the three scorers' patch scores -> a relevance map FP32 [8, 8] in [0, 1] and a
token budget INT32 [8, 8] in [64, 400] per patch. The math (README, "ARR-COC"):

    z_k   = (s_k - mean(s_k)) / (std(s_k) + eps)          each scorer standardised over the 64 patches
    alpha = sigmoid(KAPPA * (max(z_Q) - THETA))            exploit (the query) vs explore (bottom-up)
    c     = alpha * z_Q + (1 - alpha) * (z_I + z_S) / 2
    r     = exp((c - max(c)) / T)                          focus vs diversify: T spreads the budget
    b     = 64 + round(336 * r)

Computed in float64 so that numpy versions (the server's and Triton's Python) agree to the last bit of
the FP32 results. build_repository.py imports ``opponent_process`` to train the decoder on exactly the
budgets it will be served.
"""

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by the training script for opponent_process(), outside a server
    pb_utils = None

KAPPA, THETA, T, EPS = 2.0, 2.5, 1.0, 1e-6
MIN_TOKENS, MAX_TOKENS = 64, 400


def _standardise(s: np.ndarray) -> np.ndarray:
    flat = s.reshape(s.shape[0], -1).astype(np.float64)
    z = (flat - flat.mean(axis=1, keepdims=True)) / (flat.std(axis=1, keepdims=True) + EPS)
    return z.reshape(s.shape)


def opponent_process(propositional, perspectival, participatory):
    """[B, 8, 8] x 3 -> (relevance FP32 [B, 8, 8], budget INT32 [B, 8, 8])."""
    z_i, z_s, z_q = (_standardise(np.asarray(s)) for s in (propositional, perspectival, participatory))
    peak = z_q.reshape(z_q.shape[0], -1).max(axis=1)
    alpha = (1.0 / (1.0 + np.exp(-KAPPA * (peak - THETA))))[:, None, None]
    c = alpha * z_q + (1.0 - alpha) * 0.5 * (z_i + z_s)
    top = c.reshape(c.shape[0], -1).max(axis=1)[:, None, None]
    relevance = np.exp((c - top) / T)
    budget = MIN_TOKENS + np.floor((MAX_TOKENS - MIN_TOKENS) * relevance + 0.5)
    return relevance.astype(np.float32), budget.astype(np.int32)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            scores = [pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                      for name in ("propositional", "perspectival", "participatory")]
            relevance, budget = opponent_process(*scores)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("relevance_map", relevance),
                                                         pb_utils.Tensor("token_budget", budget)]))
        return responses
