"""``azulite keys``: endpoint keys for ``azulite serve --auth`` (create, list, revoke, rotate).

The store is ``$AZULITE_HOME/keys.db`` (beside the job store) unless ``--key-store`` names another file;
``azulite serve --auth`` reads the same default. A secret is printed once, at create and rotate.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from azulite.cli import console as consoles

app = typer.Typer(no_args_is_help=True, help="Endpoint keys for azulite serve --auth.\n\n"
                  "Examples:\n\n  azulite keys create team-a --models densenet_onnx --rps 50 --quota 100000/day\n\n"
                  "  azulite keys create ops --admin\n\n  azulite keys list\n\n  azulite keys revoke team-a")

STORE_HELP = "The key store (SQLite). Default: $AZULITE_HOME/keys.db (~/.azulite/keys.db)."


def default_store(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    home = Path(env.get("AZULITE_HOME") or Path(env.get("HOME", "~")) / ".azulite").expanduser()
    return home / "keys.db"


def _store(path: Optional[Path], *, create: bool = False):
    from azulite.serve.keystore import KeyStore

    check_store_path(path)
    return KeyStore(path or default_store(), create=create)


def check_store_path(path: Optional[Path]) -> None:
    """What the store would misreport: a directory ("does not exist" / "unable to open database file"), and a
    small file that is not SQLite's, which SQLite would silently take over as a new database."""
    from azulite.errors import KeyStoreError

    p = path or default_store()
    where = "--key-store" if path else "AZULITE_HOME"
    if p.is_dir():
        raise KeyStoreError(f"key store {str(p)!r} is a directory", where=where,
                            fix=f"name the store's file, e.g. --key-store {p / 'keys.db'}")
    if p.is_file() and p.stat().st_size:
        with open(p, "rb") as f:
            if f.read(16) != b"SQLite format 3\x00":
                raise KeyStoreError(f"{str(p)!r} is not a key store (not an SQLite file)", where=where,
                                    fix="point --key-store at the file `azulite keys create` wrote, or at a new path")


def _print_secret(console: Console, record, token: str, as_json: bool, done: str = "created") -> None:
    if as_json:
        print(json.dumps({**record.public(), "key": token}))
        return
    console.print(f"key [bold]{record.name}[/] (id {record.id}) {done}. Its secret, shown only now:")
    print(token)
    console.print("send it as 'Authorization: Bearer <key>' (gRPC: 'authorization' metadata)")


@app.command("create")
def create(
    name: str = typer.Argument(..., help="A name for the key (who holds it)."),
    models: Optional[List[str]] = typer.Option(None, "--models", help="Models it reaches (repeatable; default all)."),
    rps: Optional[float] = typer.Option(None, "--rps", help="Requests per second (token bucket)."),
    quota: Optional[str] = typer.Option(None, "--quota", help="Requests per UTC day, e.g. 10000/day."),
    expires: Optional[str] = typer.Option(None, "--expires", help="Expiry date, e.g. 2027-01-31."),
    admin: bool = typer.Option(False, "--admin", help="Also reaches the restricted APIs (model repository...)."),
    key_store: Optional[Path] = typer.Option(None, "--key-store", help=STORE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the key's record and secret as JSON."),
) -> None:
    """Create a key and print its secret once (only a salted hash is stored)."""
    from azulite.serve.keystore import check_key, parse_expiry, parse_quota

    names = [m for item in models or () for m in item.split(",") if m]
    quota_per_day = parse_quota(quota) if quota is not None else None
    expiry = parse_expiry(expires) if expires is not None else None
    # the key as typed, checked before the store is opened (a refused key does not create it)
    check_key(name, rps=rps, quota_per_day=quota_per_day, expires=expiry, expires_as_typed=expires)
    store = _store(key_store, create=True)
    record, token = store.create(name, models=names or None, rps=rps, quota_per_day=quota_per_day, admin=admin,
                                 expires=expiry)
    _print_secret(consoles.err(), record, token, as_json)


@app.command("list")
def list_(
    key_store: Optional[Path] = typer.Option(None, "--key-store", help=STORE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the keys as JSON."),
) -> None:
    """Every key: id, name, models, limits, state (never a secret)."""
    path = key_store or default_store()
    # no store yet is an empty list; a --key-store that does not exist (a typo) is an error
    records = _store(key_store, create=False).records() if Path(path).exists() or key_store else []
    if as_json:
        print(json.dumps([r.public() for r in records]))
        return
    table = Table(title=f"Keys ({path})", title_justify="left")
    for col in ("id", "name", "models", "rps", "quota/day", "admin", "expires", "state"):
        table.add_column(col)
    for r in records:
        p = r.public()
        state = "revoked" if r.revoked is not None else ("expired" if not r.live(time.time()) else "live")
        table.add_row(r.id, r.name, ",".join(p["models"]) if p["models"] else "*", f"{r.rps:g}" if r.rps else "-",
                      str(r.quota_per_day or "-"), "yes" if r.admin else "", (p["expires"] or "-")[:19], state)
    consoles.out().print(table)


@app.command("revoke")
def revoke(
    name: str = typer.Argument(..., help="Key name (every live key of that name) or id."),
    key_store: Optional[Path] = typer.Option(None, "--key-store", help=STORE_HELP),
) -> None:
    """Revoke a key; a running server refuses it within a fraction of a second (no restart)."""
    for r in _store(key_store).revoke(name):
        print(f"revoked {r.name} (id {r.id})")


@app.command("rotate")
def rotate(
    name: str = typer.Argument(..., help="Key name or id."),
    key_store: Optional[Path] = typer.Option(None, "--key-store", help=STORE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the new record and secret as JSON."),
) -> None:
    """Replace a key's secret (same name, models and limits); the old secret stops working."""
    record, token = _store(key_store).rotate(name)
    _print_secret(consoles.err(), record, token, as_json,
                  "rotated: a new id and secret; the old secret no longer works")
