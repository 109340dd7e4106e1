"""What of a job's code folder goes into its snapshot (a local job's copy, the AKS code archive): all of it
but tooling's own folders (``.git``, ``__pycache__``, ``.venv``, ``node_modules``, ``.azulite``, ``*.pyc``)
and what the folder's ``.amlignore`` lists, else its ``.gitignore``, in gitignore syntax, as Azure ML
leaves them out of a job's snapshot (a 50 MB ``data/`` both files listed was copied three times for a
two-node job). The patterns are read with ``pathspec`` (git's own matching rules, negation and anchors
included), not by hand."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from pathlib import Path

ALWAYS = frozenset({".git", "__pycache__", ".venv", "node_modules", ".azulite"})
_ALWAYS_FILES = ("*.pyc",)
IGNORE_FILES = (".amlignore", ".gitignore")  # the first present is the one read, as Azure ML reads them


def ignore_file(code: str | os.PathLike) -> Path | None:
    """The ignore file a snapshot of ``code`` follows (``.amlignore`` first), or None."""
    for name in IGNORE_FILES:
        path = Path(code) / name
        if path.is_file():
            return path
    return None


def excluder(code: str | os.PathLike) -> Callable[[str, bool], bool]:
    """``left_out(rel, is_dir)``: whether the path ``rel`` (relative to ``code``, ``/``-separated) stays out."""
    listed = None
    path = ignore_file(code)
    if path is not None:
        import pathspec

        listed = pathspec.GitIgnoreSpec.from_lines(path.read_text(errors="replace").splitlines())

    def left_out(rel: str, is_dir: bool) -> bool:
        name = rel.rsplit("/", 1)[-1]
        if name in ALWAYS or (not is_dir and any(fnmatch.fnmatch(name, p) for p in _ALWAYS_FILES)):
            return True
        return listed is not None and listed.match_file(rel + "/" if is_dir else rel)

    return left_out


def copytree_ignore(code: str | os.PathLike, also: Callable[[str, list[str]], set[str]] | None = None):
    """An ``ignore=`` for ``shutil.copytree(code, ...)`` leaving out what :func:`excluder` says (and ``also``'s)."""
    root = Path(code).resolve()
    left_out = excluder(root)

    def ignore(folder: str, names: list[str]) -> set[str]:
        base = Path(folder).resolve().relative_to(root).as_posix()
        skip = {n for n in names if left_out(n if base == "." else f"{base}/{n}", (Path(folder) / n).is_dir())}
        return skip | (also(folder, names) if also is not None else set())

    return ignore


def tar_filter(code: str | os.PathLike):
    """A ``filter=`` for ``tarfile.add(code, arcname=".")`` leaving out what :func:`excluder` says."""
    left_out = excluder(code)

    def keep(info):
        rel = info.name.removeprefix("./")
        return None if rel not in ("", ".") and left_out(rel, info.isdir()) else info

    return keep
