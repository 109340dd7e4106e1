"""The CLI's consoles: rich's defaults, except where output is not a terminal (CI logs, pipes, files).

rich wraps and truncates at 80 columns when it cannot ask a terminal for its width: an error message
hard-wrapped mid-phrase (``e.g. \\n1``) and table cells cut with "…" in a CI log. So errors are never
wrapped, and when not writing to a terminal (and COLUMNS is not set) tables get the width they need.
"""

from __future__ import annotations

import os
import sys

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
