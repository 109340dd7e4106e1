"""``azulite ARGS`` run in the test's own process (capsys sees its output): its exit code."""

from __future__ import annotations

from azulite.cli import main


def exit_code(*args: object) -> int:
    """typer exits even on success: SystemExit's code, 0 when it returns."""
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return e.code or 0
    return 0
