"""A job's code snapshot (launch/snapshot.py): what .amlignore, else .gitignore, lists stays out, as Azure
ML leaves it out, for a local job's copy and for the AKS code archive alike."""

from __future__ import annotations

import io
import shutil
import tarfile

from azulite.launch.snapshot import copytree_ignore, tar_filter


def _code(tmp_path, ignore_name: str | None, patterns: str):
    code = tmp_path / "code"
    for rel in ("train.py", "data/big.bin", "data/keep.txt", "logs/run.log", "src/pkg/mod.py",
                "src/pkg/__pycache__/mod.cpython-311.pyc", "notes.md", ".git/HEAD"):
        (code / rel).parent.mkdir(parents=True, exist_ok=True)
        (code / rel).write_text(rel)
    if ignore_name:
        (code / ignore_name).write_text(patterns)
    return code


def _copied(code, tmp_path) -> set[str]:
    shutil.copytree(code, tmp_path / "copy", ignore=copytree_ignore(code))
    return {p.relative_to(tmp_path / "copy").as_posix() for p in (tmp_path / "copy").rglob("*") if p.is_file()}


def _archived(code) -> set[str]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(code, arcname=".", filter=tar_filter(code))
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        return {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}


def test_what_the_amlignore_lists_stays_out_of_both_snapshots(tmp_path):
    code = _code(tmp_path, ".amlignore", "data/*\n!data/keep.txt\n*.log\n")
    (code / ".gitignore").write_text("notes.md\n")  # .amlignore is the one read when both are there
    want = {".amlignore", ".gitignore", "train.py", "data/keep.txt", "src/pkg/mod.py", "notes.md"}
    assert _copied(code, tmp_path) == want
    assert _archived(code) == want


def test_a_gitignore_is_read_when_there_is_no_amlignore(tmp_path):
    code = _code(tmp_path, ".gitignore", "/data/\nlogs\n")
    assert _copied(code, tmp_path) == {".gitignore", "train.py", "src/pkg/mod.py", "notes.md"}


def test_without_either_only_tooling_folders_stay_out(tmp_path):
    code = _code(tmp_path, None, "")
    assert _copied(code, tmp_path) == {"train.py", "data/big.bin", "data/keep.txt", "logs/run.log", "src/pkg/mod.py",
                                       "notes.md"}
