"""The shared preprocessing rule: hashing ids into table rows, checked against Python's own ``%``."""

from __future__ import annotations

import numpy as np
import pytest

from azulite.data.criteo import hash_ids

RNG = np.random.default_rng(7)
IDS = np.concatenate([
    RNG.integers(0, 2**32, size=(40, 26), dtype=np.int64),  # Criteo's 8 hex digits
    RNG.integers(-2**63, 2**63 - 1, size=(40, 26), dtype=np.int64, endpoint=True),  # every int64
    np.array([[0] * 26, [-1] * 26, [2**63 - 1] * 26, [-2**63] * 26], dtype=np.int64),
])


def python_mod(ids: np.ndarray, sizes) -> list:
    sizes = np.broadcast_to(np.asarray(sizes), ids.shape)
    return [[int(i) % int(n) for i, n in zip(row, nrow)] for row, nrow in zip(ids, sizes)]


@pytest.mark.parametrize("sizes", [[1000] * 26, [1] * 26, [2**40] * 26, [97],
                                   [int(x) for x in RNG.integers(1, 10**7, 26)], [7, 100] + [1000] * 24])
def test_hash_ids_is_python_modulo(sizes):
    # one size for all tables takes the scalar-division path, mixed sizes np.remainder: both are id % n
    assert hash_ids(IDS, sizes).tolist() == python_mod(IDS, sizes)


@pytest.mark.parametrize("sizes", [[1000] * 26, [7, 100] + [1000] * 24])
def test_hash_ids_feature_major_in_place(sizes):
    # the npy reader hashes a feature-major copy of the ids in place (out is ids itself)
    ids_t = np.array(IDS.T, order="C")
    got = hash_ids(ids_t, np.asarray(sizes)[:, None], out=ids_t)
    assert got is ids_t
    assert got.T.tolist() == python_mod(IDS, sizes)
