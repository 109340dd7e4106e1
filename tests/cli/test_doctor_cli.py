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
