"""scripts/test.sh, what `make test` runs: the tests on xdist workers, then those marked `serial` alone in
the main process; arguments narrow both parts; its exit status is the first failure's, and 5 only when no
test matched at all. Run on small test files of its own, with this repository's pytest settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TESTS = '''
import os
from pathlib import Path

import pytest

OUT = Path(__file__).with_name("ran")


def _ran(name):
    with OUT.open("a") as f:
        f.write(f"{name} {os.environ.get('PYTEST_XDIST_WORKER', 'main')}\\n")


def test_plain():
    _ran("plain")
    assert os.environ.get("FAIL_PLAIN") != "1"


@pytest.mark.serial
def test_alone():
    _ran("alone")
'''


def run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    (tmp_path / "test_sample.py").write_text(TESTS)
    ran = tmp_path / "ran"
    ran.unlink(missing_ok=True)
    # this run's own xdist variables (PYTEST_XDIST_WORKER...) must not reach the pytest runs it starts
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    p = subprocess.run(["bash", str(REPO / "scripts" / "test.sh"), "-c", str(REPO / "pyproject.toml"),
                        "--rootdir", str(tmp_path), "-p", "no:cacheprovider", str(tmp_path), *args],
                       capture_output=True, text=True, timeout=300, env={**clean, "VENV": sys.prefix, **env})
    lines = sorted(line.split() for line in ran.read_text().splitlines()) if ran.exists() else []
    return p, lines


def test_plain_tests_run_on_workers_and_serial_ones_alone_after(tmp_path):
    p, ran = run(tmp_path, "-q")
    assert p.returncode == 0, p.stdout + p.stderr
    (alone, alone_where), (plain, plain_where) = ran
    assert (alone, alone_where) == ("alone", "main") and plain == "plain" and plain_where.startswith("gw")


def test_a_failure_on_the_workers_is_the_status_and_the_serial_part_still_runs(tmp_path):
    p, ran = run(tmp_path, "-q", FAIL_PLAIN="1")
    assert p.returncode == 1, p.stdout + p.stderr
    assert [name for name, _ in ran] == ["alone", "plain"]


def test_a_selection_one_part_lacks_is_not_a_failure_and_none_at_all_is_5(tmp_path):
    p, ran = run(tmp_path, "-q", "-k", "plain")
    assert p.returncode == 0 and [name for name, _ in ran] == ["plain"], p.stdout + p.stderr
    p, ran = run(tmp_path, "-q", "-k", "no_such_test")
    assert p.returncode == 5 and ran == [] and "no test matched" in p.stderr, p.stdout + p.stderr
