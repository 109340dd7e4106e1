"""``azulite audit verify``: whether a sealed audit log (``azulite serve --audit-seal`` / ``--audit-key``)
is as the server wrote it. Exit 0 when every seal holds, 1 at the first place one does not (named: file,
lines, what it means), 2 for a mistake in the call (no log there, a key that cannot be read)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from azulite.cli import console as consoles

app = typer.Typer(no_args_is_help=True, help="The audit log of azulite serve.\n\n"
                  "Examples:\n\n  azulite audit verify audit.jsonl\n\n  azulite audit verify audit.jsonl --key audit.key")


@app.command("verify")
def verify(
    log: Path = typer.Argument(..., help="The file --audit-log named (its rotated files beside it are read too)."),
    key: Optional[Path] = typer.Option(None, "--key", help="The key file the server was given with --audit-key."),
    json_: bool = typer.Option(False, "--json", help="Print the verdict as JSON."),
) -> None:
    """Recompute every seal of the log and its rotated files (oldest first) and hold each to the one before:
    a line changed, added or removed, a write removed whole, or lines no seal covers are reported where they
    are. Exit 1 when the log does not verify.

      azulite audit verify /var/log/azulite/audit.jsonl --key /etc/azulite/audit.key
    """
    from azulite.serve.audit import read_key
    from azulite.serve.audit_verify import verify as check

    verdict = check(log, read_key(key, "--key") if key is not None else None)
    if json_:
        print(json.dumps({"ok": verdict.ok, "files": [str(f) for f in verdict.files], "lines": verdict.lines,
                          "seals": verdict.seals, "alg": verdict.alg or None, "problem": verdict.problem,
                          "where": verdict.where}))
    elif verdict.ok:
        consoles.out().print(f"{log}: {len(verdict.files)} file(s), {verdict.lines:,} lines under {verdict.seals:,} "
                             f"seals ({verdict.alg}): the chain holds", markup=False, highlight=False)
    else:
        consoles.err().print(f"error: {verdict.where}: {verdict.problem}", markup=False, highlight=False)
    if not verdict.ok:
        raise typer.Exit(1)
