"""``azulite repo``: a model repository's integrity manifest (sign, verify) and its Ed25519 key pair."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from azulite.cli import console as consoles
from azulite.errors import IntegrityError, SpecError

app = typer.Typer(no_args_is_help=True, help="Model repository integrity: a sha256 manifest, optionally signed.\n\n"
                  "Examples:\n\n  azulite repo keygen signing.pem signing.pub.pem\n\n"
                  "  azulite repo sign model_repository/ --key signing.pem\n\n"
                  "  azulite repo verify model_repository/ --public-key signing.pub.pem")


@app.command("keygen")
def keygen(
    private: Path = typer.Argument(..., help="Where to write the private key (PEM, mode 0600)."),
    public: Path = typer.Argument(..., help="Where to write the public key (PEM)."),
) -> None:
    """Create an Ed25519 key pair for signing manifests."""
    from azulite.integrity import generate_keypair

    if private.resolve() == public.resolve():  # the public key would be written over the private one
        raise SpecError("PRIVATE and PUBLIC are the same file", file=str(private),
                        fix="give two paths, e.g. azulite repo keygen signing.pem signing.pub.pem")
    for path, name, example in ((private, "PRIVATE", "signing.pem"), (public, "PUBLIC", "signing.pub.pem")):
        consoles.check_output_file(path, name, example)  # a missing folder was a traceback after nothing was written
    generate_keypair(private, public)
    print(f"wrote {private} (keep it secret) and {public} (give it to servers: --manifest-key)")


@app.command("sign")
def sign(
    repository: Path = typer.Argument(..., help="The model repository."),
    key: Optional[Path] = typer.Option(None, "--key", help="Private key (PEM) to sign the manifest with."),
) -> None:
    """Write azulite-manifest.json (sha256 of every file) and, with --key, its signature."""
    from azulite.integrity import repository_files, sign_repository

    _check_repository(repository)
    path = sign_repository(repository, key)
    n = len(repository_files(repository))
    print(f"wrote {path} ({n} files{', signed' if key else ''})")


@app.command("verify")
def verify(
    repository: Path = typer.Argument(..., help="The model repository."),
    public_key: Optional[Path] = typer.Option(None, "--public-key", help="Public key (PEM) to check the signature."),
) -> None:
    """Check every file against the manifest (and the signature with --public-key). Exit 2 on any mismatch."""
    from azulite.integrity import verify_repository

    _check_repository(repository)
    manifest = verify_repository(repository, public_key)
    sig = "signature verified" if manifest.signed and public_key else (
        "signed, signature NOT checked (give --public-key)" if manifest.signed else "unsigned")
    consoles.out().print(f"[green]ok[/]: {len(manifest.files)} files match the manifest ({sig})")


def _check_repository(repository: Path) -> None:
    if not repository.is_dir():
        what = "is not a directory" if repository.exists() else "does not exist"
        raise IntegrityError(f"model repository {str(repository)!r} {what}", where="REPOSITORY",
                             fix="give the repository's folder (it holds <model>/config.pbtxt), e.g. model_repository/")
