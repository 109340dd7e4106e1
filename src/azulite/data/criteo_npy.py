"""Criteo TSV -> TorchRec's preprocessed npy layout, streamed.

Writes ``<stem>_dense.npy`` (float32 ``[n, 13]``, already ``log(1 + max(x, 0))``), ``<stem>_sparse.npy``
(int64 ``[n, 26]`` raw category ids, hashed by the reader with the run's table sizes) and
``<stem>_labels.npy`` (int32 ``[n, 1]``) per input file (``day_3.gz`` -> ``day_3_*.npy``), the file names
and dtypes of ``torchrec.datasets.criteo``. Not TorchRec's ``tsv_to_npys``: it holds a whole file in
Python lists (a Criteo day is ~180M rows) and its dense transform ``log(x - min + 2)`` depends on the whole
file. Here rows go through in blocks into raw files that become the npy bodies: memory stays at one block,
the transform is this package's (:mod:`azulite.data.criteo`), and malformed lines follow the readers'
rule (skipped with a warning, a clear error past ``max_bad_fraction``).

    python -m azulite.data.criteo_npy IN_FILE_OR_FOLDER OUT_FOLDER
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from azulite.data.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT
from azulite.errors import DataError
from azulite.data.criteo_reader import CriteoTSVReader
from azulite.data.criteo_stream import list_files

log = logging.getLogger(__name__)

_BLOCK = 65_536
#: the input argument, as the usage line names it
_IN = "IN_FILE_OR_FOLDER"


def _stem(path: str) -> str:
    name = Path(path).name
    for suffix in (".gz", ".tsv", ".txt"):
        name = name.removesuffix(suffix)
    return name


def convert_file(path: str, out_dir: str | os.PathLike, *, max_bad_fraction: float = 0.001) -> tuple[str, int]:
    """Convert one TSV file; returns (the output prefix, rows written). Outputs appear complete or not at
    all (written under temporary names, renamed at the end)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = str(out / _stem(path))
    # the reader, on one rank in big chunks, gives every row with its own checks; raw ids (no table
    # sizes): hashing happens when a run reads them
    reader = CriteoTSVReader([path], rank=0, world_size=1, batch_size=_BLOCK, num_embeddings_per_feature=None,
                             split="all", shuffle_files=False, max_bad_fraction=max_bad_fraction)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=out)
    parts = {name: open(os.path.join(tmp, name), "wb") for name in ("dense", "sparse", "labels")}  # noqa: SIM115
    n = 0
    try:
        while (rows := reader.next_rows()) is not None:
            keep = rows.weight > 0
            parts["dense"].write(np.ascontiguousarray(rows.dense[keep], np.float32).tobytes())
            parts["sparse"].write(np.ascontiguousarray(rows.sparse[keep], np.int64).tobytes())
            parts["labels"].write(np.ascontiguousarray(rows.labels[keep], np.int32).tobytes())
            n += int(keep.sum())
        if n == 0:  # a day of no rows converts to arrays that break training later, far from here
            raise DataError(f"{path} holds no Criteo rows", where=str(path),
                            fix="check the file (an empty or cut download?) or leave it out of the dataset")
        for f in parts.values():
            f.close()
        shapes = {"dense": ((n, INT_FEATURE_COUNT), np.float32), "sparse": ((n, CAT_FEATURE_COUNT), np.int64),
                  "labels": ((n, 1), np.int32)}
        for name, (shape, dtype) in shapes.items():
            final = os.path.join(tmp, f"{name}.npy")
            with open(final, "wb") as fout, open(os.path.join(tmp, name), "rb") as fin:
                np.lib.format.write_array_header_1_0(
                    fout, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape})
                shutil.copyfileobj(fin, fout, 1 << 22)
        for name in shapes:
            os.replace(os.path.join(tmp, f"{name}.npy"), f"{prefix}_{name}.npy")
        # a synthetic file's true click probabilities (azulite.data.criteo_synth) follow its rows
        truth = Path(path).with_name(f"{_stem(path)}.p.npy")
        if truth.exists():
            shutil.copyfile(truth, out / truth.name)
    finally:
        for f in parts.values():
            f.close()
        reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return prefix, n


def convert(dataset_path: str | os.PathLike, out_dir: str | os.PathLike, *, max_bad_fraction: float = 0.001,
            where: str = "dataset_path") -> list[str]:
    """Convert every TSV file of ``dataset_path``; returns the output prefixes. ``where`` names the argument
    in errors."""
    try:
        kind, files = list_files(dataset_path, where=where)
    except DataError as e:  # the trainer's fix (it also reads npy folders) is not this tool's
        raise DataError(e.message, where=e.where, fix="pass a Criteo TSV file (plain or .gz) or a folder of them") \
            from None
    if kind == "npy":  # its prefixes were read as TSV files: FileNotFoundError's traceback
        raise DataError(f"{str(dataset_path)!r} already holds TorchRec's npy layout (day_N_*.npy)", where=where,
                        fix="train on it as it is (--dataset_path), or pass the TSV files it was made from")
    made = not Path(out_dir).exists()
    prefixes = []
    try:
        for f in files:
            prefix, n = convert_file(f, out_dir, max_bad_fraction=max_bad_fraction)
            log.info("%s -> %s_{dense,sparse,labels}.npy (%d rows)", f, prefix, n)
            prefixes.append(prefix)
    except BaseException:
        if made and not prefixes:  # a failed first file leaves no empty folder behind
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return prefixes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="convert Criteo TSV (plain or gzip) to TorchRec's npy layout")
    ap.add_argument("dataset_path", metavar=_IN)
    ap.add_argument("out_dir", metavar="OUT_FOLDER")
    ap.add_argument("--max_bad_lines_fraction", type=float, default=0.001)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from azulite.errors import AzuliteError

    try:
        # positional: named as the usage line names it (it said "--dataset_path", a flag this tool has not)
        prefixes = convert(args.dataset_path, args.out_dir, max_bad_fraction=args.max_bad_lines_fraction, where=_IN)
    except AzuliteError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"wrote {len(prefixes)} day(s) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
