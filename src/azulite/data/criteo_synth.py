"""Synthetic Criteo: TSV files in the real format with a planted click signal whose true click
probability per row the generator knows, so the best AUC any model can reach on its rows is computable.

Categories are Zipf-distributed over per-feature vocabularies of random 8-hex-digit strings (as the real
logs: a few values carry most rows), some fields are empty, dense counts are log-normal with empty and
negative values. The click logit is a bias plus per-value effects of a few categorical features plus
linear effects of ``log(1 + max(I, 0))`` of a few dense ones; the label is Bernoulli(sigmoid(logit)).
Beside each ``day_N`` file, ``day_N.p.npy`` holds the true probability of each of its rows (float64), and
``synthetic.json`` the generator's parameters.

    python -m azulite.data.criteo_synth OUT_DIR --rows 20000 --files 2 [--gzip] [--seed 0]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

import numpy as np

from azulite.data.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT
from azulite.errors import DataError

#: the features that carry signal (0-based), and their vocabulary sizes
SIGNAL_CATS = (0, 1, 2, 3, 4, 5)
SIGNAL_DENSE = (0, 1, 2)
VOCAB_SIGNAL = 10
VOCAB_NOISE = 200
ZIPF_A = 1.3
EMPTY_RATE = 0.03


def _zipf_index(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks ** -ZIPF_A
    return rng.choice(vocab, size=n, p=p / p.sum())


def generate(out_dir: str | os.PathLike, *, rows: int, files: int = 1, seed: int = 0, gzip_files: bool = False,
             signal: float = 1.0) -> list[str]:
    """Write ``files`` files of ``rows`` rows each (``day_0``, ``day_1``, ... or ``.gz``); return their paths."""
    if rows < 1 or files < 1:
        raise DataError(f"rows={rows} files={files}: both must be >= 1", where="criteo_synth", fix="e.g. --rows 20000")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file, not a folder", where="criteo_synth", fix="name a folder to write day_0, day_1, ... into")
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = [VOCAB_SIGNAL if i in SIGNAL_CATS else VOCAB_NOISE for i in range(CAT_FEATURE_COUNT)]
    hexes = [np.array([f"{v:08x}" for v in rng.choice(2**32, size=n, replace=False)]) for n in vocab]
    effects = {i: rng.normal(0.0, 1.2 * signal, size=vocab[i]) for i in SIGNAL_CATS}
    dense_w = rng.normal(0.0, 0.5 * signal, size=len(SIGNAL_DENSE))
    bias = -1.0
    paths = []
    for day in range(files):
        cat_idx = np.stack([_zipf_index(rng, rows, v) for v in vocab], axis=1)
        cat_empty = rng.random((rows, CAT_FEATURE_COUNT)) < EMPTY_RATE
        dense = np.floor(rng.lognormal(1.0, 1.2, size=(rows, INT_FEATURE_COUNT))).astype(np.int64)
        dense[:, 1] -= 2  # like the real I2, which goes negative
        dense_empty = rng.random((rows, INT_FEATURE_COUNT)) < EMPTY_RATE
        logit = np.full(rows, bias)
        for i in SIGNAL_CATS:
            logit += np.where(cat_empty[:, i], 0.0, effects[i][cat_idx[:, i]])
        for w, j in zip(dense_w, SIGNAL_DENSE):
            x = np.where(dense_empty[:, j], 0, dense[:, j])
            feat = np.log1p(np.maximum(x, 0))
            logit += w * (feat - 1.0)
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(rows) < p).astype(np.int64)
        name = out / (f"day_{day}.gz" if gzip_files else f"day_{day}")
        lines = []
        for r in range(rows):
            d = ["" if dense_empty[r, j] else str(dense[r, j]) for j in range(INT_FEATURE_COUNT)]
            c = ["" if cat_empty[r, i] else hexes[i][cat_idx[r, i]] for i in range(CAT_FEATURE_COUNT)]
            lines.append("\t".join([str(labels[r]), *d, *c]))
        data = ("\n".join(lines) + "\n").encode()
        with (gzip.open(name, "wb") if gzip_files else open(name, "wb")) as f:
            f.write(data)
        np.save(out / f"day_{day}.p.npy", p)
        paths.append(str(name))
    (out / "synthetic.json").write_text(json.dumps(
        {"rows_per_file": rows, "files": files, "seed": seed, "signal": signal, "zipf_a": ZIPF_A,
         "signal_categories": list(SIGNAL_CATS), "signal_dense": list(SIGNAL_DENSE)}, indent=1))
    return paths


def true_probabilities(dataset_path: str | os.PathLike) -> list[np.ndarray] | None:
    """Per file (in the readers' order), the true click probability of each row; None for other data."""
    from azulite.data.criteo_stream import list_files

    root = Path(dataset_path)
    root = root if root.is_dir() else root.parent
    kind, files = list_files(dataset_path)
    out = []
    for f in files:
        stem = Path(f).name
        for suffix in ("_dense", ".gz"):
            stem = stem.removesuffix(suffix)
        p = root / f"{stem}.p.npy"
        if not p.exists():
            return None
        out.append(np.load(p))
    return out


def best_auc(dataset_path: str | os.PathLike, validation_permille: int) -> float | None:
    """AUC of the true probabilities against the labels of the held-out rows (row i of a file when
    i % 1000 < validation_permille): what a perfect model would reach there. None if not synthetic."""
    import torch
    from torchmetrics.functional.classification import binary_auroc

    from azulite.data.criteo_reader import open_reader

    probs = true_probabilities(dataset_path)
    if probs is None or validation_permille <= 0:
        return None
    # the labels as the readers see them (a well-formed row's index is its position in the file)
    reader = open_reader(dataset_path, rank=0, world_size=1, batch_size=1024, num_embeddings_per_feature=[1] * 26,
                         split="val", validation_permille=validation_permille, shuffle_files=False,
                         max_bad_fraction=1.0, warn=False)  # the run itself enforces the limit
    labels = []
    while (rows := reader.next_rows()) is not None:
        labels.append(rows.labels[rows.weight > 0])
    reader.close()
    held = np.concatenate([p[np.arange(len(p)) % 1000 < validation_permille] for p in probs])
    y = np.concatenate(labels)
    if len(held) != len(y):
        return None  # rows were dropped as malformed: the sidecar no longer lines up
    return float(binary_auroc(torch.from_numpy(held), torch.from_numpy(y).long()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write synthetic Criteo TSV with a planted click signal")
    ap.add_argument("out_dir")
    ap.add_argument("--rows", type=int, default=20000, help="rows per file")
    ap.add_argument("--files", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gzip", action="store_true")
    args = ap.parse_args(argv)
    try:
        paths = generate(args.out_dir, rows=args.rows, files=args.files, seed=args.seed, gzip_files=args.gzip)
    except DataError as e:  # a user's mistake: the message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"wrote {len(paths)} file(s), {args.rows * len(paths)} rows, to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
