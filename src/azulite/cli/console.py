"""The CLI's consoles: rich's defaults, except where output is not a terminal (CI logs, pipes, files).

rich wraps and truncates at 80 columns when it cannot ask a terminal for its width: an error message
hard-wrapped mid-phrase (``e.g. \\n1``) and table cells cut with "…" in a CI log. So errors are never
wrapped, and when not writing to a terminal (and COLUMNS is not set) tables get the width they need.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console

UNBOUNDED = 100_000  # "as wide as the content": rich tables only take the width their cells need


def _width(stream) -> int | None:
    if os.environ.get("COLUMNS") or (hasattr(stream, "isatty") and stream.isatty()):
        return None  # rich's own choice: the terminal's (or COLUMNS') width
    return UNBOUNDED


def out() -> Console:
    """Standard output: tables and reports."""
    return Console(highlight=False, soft_wrap=True, width=_width(sys.stdout))


def err() -> Console:
    """Standard error: errors and progress; never wrapped."""
    return Console(stderr=True, highlight=False, soft_wrap=True, width=_width(sys.stderr))


def check_output_file(path: Path, flag: str, example: str) -> None:
    """Refuse an output FILE path that cannot be written before any work is done (a directory, or a folder
    that does not exist), naming the flag; ``example``: a file name for the fix."""
    from azulite.errors import SpecError

    if path.is_dir():
        raise SpecError("is a directory", file=str(path), field=flag, fix=f"name a file, e.g. {flag} {path / example}")
    if not path.parent.is_dir():
        raise SpecError(f"the folder {str(path.parent)!r} does not exist", file=str(path), field=flag,
                        fix=f"create it first (mkdir -p {path.parent}) or write it elsewhere")
