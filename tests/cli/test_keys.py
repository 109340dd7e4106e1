"""``azulite keys`` and ``azulite repo`` through the real console script: a secret printed once and
never stored, list/revoke/rotate, sign/verify exit codes, bad input without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

AZULITE = str(Path(sys.executable).parent / "azulite")


def run(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([AZULITE, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AZULITE_HOME": str(home)})


def test_keys_lifecycle(tmp_path):
    out = run("keys", "create", "team-a", "--models", "m1,m2", "--rps", "5", "--quota", "100/day", "--json",
              home=tmp_path)
    assert out.returncode == 0, out.stderr
    created = json.loads(out.stdout)
    assert created["models"] == ["m1", "m2"] and created["quota_per_day"] == 100
    secret = created["key"].split("_", 2)[2]
    assert secret not in (tmp_path / "keys.db").read_bytes().decode("latin-1")
    listed = json.loads(run("keys", "list", "--json", home=tmp_path).stdout)
    assert [k["name"] for k in listed] == ["team-a"] and "key" not in listed[0]
    rotated = run("keys", "rotate", "team-a", "--json", home=tmp_path)
    assert rotated.returncode == 0 and json.loads(rotated.stdout)["key"] != created["key"]
    assert run("keys", "revoke", "team-a", home=tmp_path).returncode == 0
    states = [k["revoked"] is not None for k in json.loads(run("keys", "list", "--json", home=tmp_path).stdout)]
    assert states == [True, True]
    bad = run("keys", "revoke", "team-a", home=tmp_path)
    assert bad.returncode == 2 and "no live key named 'team-a'" in bad.stderr and "Traceback" not in bad.stderr
    bad = run("keys", "create", "x", "--expires", "someday", home=tmp_path)
    assert bad.returncode == 2 and "not a date" in bad.stderr


def test_repo_sign_and_verify(tmp_path):
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    (repo / "m" / "config.pbtxt").write_text('name: "m"\n')
    (repo / "m" / "1" / "model.onnx").write_bytes(b"weights")
    assert run("repo", "keygen", str(tmp_path / "k.pem"), str(tmp_path / "k.pub"), home=tmp_path).returncode == 0
    signed = run("repo", "sign", str(repo), "--key", str(tmp_path / "k.pem"), home=tmp_path)
    assert signed.returncode == 0 and "2 files, signed" in signed.stdout
    ok = run("repo", "verify", str(repo), "--public-key", str(tmp_path / "k.pub"), home=tmp_path)
    assert ok.returncode == 0 and "signature verified" in ok.stdout
    (repo / "m" / "1" / "model.onnx").write_bytes(b"evil")
    bad = run("repo", "verify", str(repo), "--public-key", str(tmp_path / "k.pub"), home=tmp_path)
    assert bad.returncode == 2 and "changed: m/1/model.onnx" in bad.stderr and "Traceback" not in bad.stderr


def test_keys_store_mistakes_and_wording_in_process(capsys, tmp_path, monkeypatch):
    from tests.cli.inprocess import exit_code

    monkeypatch.setenv("AZULITE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("COLUMNS", raising=False)  # piped output, no width asked for (xdist's workers set 80)
    # a directory: was "does not exist" (list) and "unable to open database file" (create)
    for cmd in (("list",), ("create", "a")):
        assert exit_code("keys", *cmd, "--key-store", tmp_path) == 2
        assert "is a directory" in capsys.readouterr().err
    # a small file that is not SQLite's: SQLite took it over as a new store
    notes = tmp_path / "notes.txt"
    notes.write_text("\n")
    assert exit_code("keys", "create", "a", "--key-store", notes) == 2
    assert "not a key store" in capsys.readouterr().err and notes.read_text() == "\n"
    # an explicit store that does not exist (a typo) is an error, not an empty table
    assert exit_code("keys", "list", "--key-store", tmp_path / "typo.db") == 2
    assert "does not exist" in capsys.readouterr().err
    assert exit_code("keys", "list") == 0  # no default store yet: an empty list
    assert exit_code("keys", "create", "team-a", "--models", "densenet_onnx") == 0
    capsys.readouterr()
    assert exit_code("keys", "rotate", "team-a") == 0
    err = capsys.readouterr().err
    assert "rotated" in err and "created" not in err
    assert exit_code("keys", "list") == 0
    out = capsys.readouterr().out
    assert "densenet_onnx" in out and "…" not in out  # not cut at 80 columns when piped


def test_repo_path_mistakes_in_process(capsys, tmp_path):
    from tests.cli.inprocess import exit_code

    # a missing folder: a traceback (FileNotFoundError)
    assert exit_code("repo", "keygen", tmp_path / "no" / "k.pem", tmp_path / "no" / "k.pub") == 2
    assert "does not exist" in capsys.readouterr().err
    # one path for both: the public key was written over the private one, exit 0
    assert exit_code("repo", "keygen", tmp_path / "k.pem", tmp_path / "k.pem") == 2
    assert "same file" in capsys.readouterr().err and not (tmp_path / "k.pem").exists()
    # a repository that does not exist is not "not a directory"; both say how to fix it
    assert exit_code("repo", "sign", tmp_path / "nope") == 2
    err = capsys.readouterr().err
    assert "'" + str(tmp_path / "nope") + "' does not exist" in err and "fix:" in err
    (tmp_path / "f").write_text("x")
    assert exit_code("repo", "verify", tmp_path / "f") == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "fix:" in err


def test_keys_create_refuses_bad_limits_as_typed_before_creating_the_store(capsys, tmp_path, monkeypatch):
    from tests.cli.inprocess import exit_code

    monkeypatch.setenv("AZULITE_HOME", str(tmp_path))
    for flags, says in ((("--rps", "-1"), "error: --rps -1 is not a positive rate"),  # was "--rps -1.0 must be ..."
                        (("--rps", "0"), "error: --rps 0 is not a positive rate"),
                        (("--rps", "inf"), "error: --rps inf is not a positive rate"),  # was created, unlimited
                        (("--quota", "0/day"), "error: --quota '0/day' must be at least 1 request a day"),
                        # was SQLite's OverflowError, as a traceback
                        (("--quota", "99999999999999999999999/day"), "is more than 1000000000000 requests a day"),
                        # was FileNotFoundError's traceback
                        (("--key-store", "/proc/nope/k.db"), "its folder cannot be made"),
                        # was "--expires is in the past", not naming the date
                        (("--expires", "2020-01-31"), "error: --expires 2020-01-31 is in the past (now: ")):
        assert exit_code("keys", "create", "team-a", *flags) == 2, flags
        err = capsys.readouterr().err
        assert says in err and "fix: " in err, err
    assert not (tmp_path / "keys.db").exists()
