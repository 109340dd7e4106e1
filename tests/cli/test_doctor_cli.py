"""``azulite doctor``'s flags: a negative or zero expectation is a usage error naming the flag, before any
check runs (a probe held to 0 would always pass; a GPU count of -1 read as a failed node)."""

from __future__ import annotations

import pytest

from tests.cli.inprocess import exit_code as run


@pytest.mark.parametrize("args", [("--gpus", "-1"), ("--matmul-tflops", "0"), ("--gpu-mem-gbps", "-3"),
                                  ("--min-write-gbps", "-1")])
def test_bad_expectation_is_a_usage_error_naming_the_flag(capsys, args):
    assert run("doctor", *args, "--json") == 2
    captured = capsys.readouterr()
    assert args[0] in captured.err and captured.out == ""


@pytest.mark.parametrize("under", ["", "sub/dir"])
def test_checkpoint_that_is_a_file_is_a_usage_error_not_file_exists(capsys, tmp_path, under):
    f = tmp_path / "ckpt.pt"
    f.write_bytes(b"x")
    assert run("doctor", "--checkpoint", f / under if under else f, "--json") == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert "--checkpoint" in err and "is a file" in err and "fix:" in err and "File exists" not in err
    assert captured.out == ""
