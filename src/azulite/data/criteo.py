"""The Criteo click-log format and the preprocessing every consumer of it must share.

A Criteo TSV line is ``label \\t I1..I13 \\t C1..C26``: a 0/1 label, 13 integer counts (may be empty or
negative) and 26 categorical features as hex strings (8 digits in the real logs; may be empty). Training
(``azulite.data.criteo_reader``), the npy converter (``criteo_npy``) and a serving pipeline that rebuilds
the model must turn a line into the same numbers; these pure functions (numpy only, no torch) are that
rule, and :func:`preprocess_spec` describes it as data for the checkpoint manifest:

- dense:  ``log(1 + max(x, 0))`` as float32, an empty field counting as 0;
- sparse: ``int(hex, 16) % num_embeddings`` of the feature's table, an empty field counting as id 0.

(TorchRec's own ``tsv_to_npys`` uses ``log(x - min + 2)`` over a whole file, which a streaming reader or a
server answering one request cannot reproduce; modulo hashing is the rule of TorchRec's DLRM example.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
FIELD_COUNT = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
#: TorchRec's names for the 26 sparse features (KeyedJaggedTensor keys) and their tables (``t_<name>``)
CAT_FEATURE_NAMES: tuple[str, ...] = tuple(f"cat_{i}" for i in range(CAT_FEATURE_COUNT))
INT_FEATURE_NAMES: tuple[str, ...] = tuple(f"int_{i}" for i in range(INT_FEATURE_COUNT))

# One line, exactly: a 0/1 label, 13 optional (possibly negative) decimal integers, 26 optional hex
# strings of 1-16 digits. A line that does not match is malformed (counted and skipped by the readers).
# Stricter than Python's int(), which would also take "+5", " 5" or "1_000". A lone "-" matches: it reads as
# 0, like an empty value (as the serving preprocessing reads it, azulite.export.dlrm_preprocess).
LINE_RE = re.compile(
    rb"[01]" + rb"\t-?[0-9]*" * INT_FEATURE_COUNT + rb"(?:\t[0-9a-fA-F]{0,16})" * CAT_FEATURE_COUNT + rb"\r?\n?"
)


def transform_dense(values: Any) -> np.ndarray:
    """Dense features as the model sees them: ``log(1 + max(x, 0))`` in float32. ``values``: integers
    (any shape), or strings where ``""`` (and a lone ``"-"``) means 0."""
    arr = np.asarray(values)
    if arr.dtype.kind in "US":
        empty = (arr == arr.dtype.type("")) | (arr == arr.dtype.type("-"))
        arr = np.where(empty, arr.dtype.type("0"), arr).astype(np.int64)
    return np.log1p(np.maximum(arr.astype(np.float64), 0.0)).astype(np.float32)


def category_ids(values: Sequence[str | bytes]) -> np.ndarray:
    """Raw category ids: ``int(hex, 16)``, ``""`` -> 0 (int64)."""
    return np.array([int(v, 16) if v else 0 for v in values], dtype=np.int64)


def hash_ids(ids: np.ndarray, num_embeddings_per_feature: Sequence[int] | np.ndarray, *,
             out: np.ndarray | None = None, scratch: np.ndarray | None = None) -> np.ndarray:
    """Row of each id in its feature's table: ``id % num_embeddings`` (ids: ``[..., 26]`` int64, the sizes
    broadcast against them; ``out``: where to write, e.g. a feature-major array for ``ids.T``; ``scratch``:
    an int64 array of ids' shape for the intermediate quotients, instead of a new one)."""
    ids = np.asarray(ids, dtype=np.int64)
    n = np.asarray(num_embeddings_per_feature, dtype=np.int64)
    first = int(n.flat[0]) if n.size else 0
    if first > 0 and (n.size == 1 or not (n != first).any()):
        # one size for every table: ids - (ids // n) * n with a scalar n, which numpy divides with
        # libdivide (a multiply and a shift); np.remainder by an array of sizes runs a hardware division per
        # element, ~5x the time (~35 vs ~7 us for a 256-row batch: a training step's reader cost). The same
        # floor semantics as np.remainder for every int64, negative ids included.
        q = np.floor_divide(ids, first, out=scratch)
        q *= first
        return np.subtract(ids, q, out=q if out is None else out)  # ``out`` may be ``ids`` itself
    return np.remainder(ids, n, out=out)


def hash_categories(values: Sequence[str | bytes], num_embeddings_per_feature: Sequence[int]) -> np.ndarray:
    """The 26 hex strings of one line -> their table rows (int64 ``[26]``)."""
    return hash_ids(category_ids(values), num_embeddings_per_feature)


def preprocess_spec(num_embeddings_per_feature: Sequence[int]) -> dict[str, Any]:
    """What a serving pipeline needs to turn raw Criteo features into model inputs (JSON-able)."""
    return {
        "format": "criteo-tsv",
        "dense_features": list(INT_FEATURE_NAMES),
        "sparse_features": list(CAT_FEATURE_NAMES),
        "dense_transform": "log(1 + max(x, 0)) as float32; empty -> 0",
        "dense_function": "azulite.data.criteo:transform_dense",
        "category_hash": "int(hex, 16) % num_embeddings_per_feature[i]; empty -> 0",
        "category_function": "azulite.data.criteo:hash_categories",
        "num_embeddings_per_feature": [int(n) for n in num_embeddings_per_feature],
        "ids_per_feature": 1,
    }


def parse_line(line: bytes) -> tuple[int, list[int], list[int]] | None:
    """One TSV line -> (label, 13 dense ints, 26 raw category ids), or None when it is malformed."""
    if LINE_RE.fullmatch(line) is None:
        return None
    fields = line.rstrip(b"\r\n").split(b"\t")
    dense = [int(x) if x and x != b"-" else 0 for x in fields[1 : 1 + INT_FEATURE_COUNT]]
    cats = [int(x, 16) if x else 0 for x in fields[1 + INT_FEATURE_COUNT :]]
    return int(fields[0]), dense, cats
