"""Model repository integrity: a manifest of the sha256 of every file, optionally signed with Ed25519.

Layout, at the repository root (real Triton ignores both files: they are not model directories):

- ``azulite-manifest.json``: ``{"format": "azulite-manifest/1", "algorithm": "sha256", "files":
  {"<model>/<path>": "<hex>", ...}}``, keys sorted, paths with ``/``.
- ``azulite-manifest.sig``: the raw 64-byte Ed25519 signature of the manifest file's exact bytes.

Who calls it: ``azulite repo sign|verify`` and ``azulite keys``-style key generation (the CLI), the server
before it loads a model (:meth:`Manifest.check_model`), and the exporter after it writes into a
repository (:func:`update_manifest`). No serve/ dependency on purpose: the exporter must not import the
server. Signing is ``cryptography``'s Ed25519 (the field's well-kept library; nothing hand-rolled).

Python's ``__pycache__`` folders are not listed or checked (Python writes them): the Python backend never
runs bytecode from a repository (serve/backends/python.py compiles the signed source). Symlinked folders
are followed (each real folder once): a version added as a link is listed, and refused when unsigned.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from azulite.errors import IntegrityError

MANIFEST = "azulite-manifest.json"
SIGNATURE = "azulite-manifest.sig"
FORMAT = "azulite-manifest/1"
_SKIP_DIRS = {"__pycache__"}
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _real_ancestors(base: Path, folder: Path) -> set[str]:
    """The real paths of ``folder`` and of every folder between it and ``base`` (as walked, links and all)."""
    out = {os.path.realpath(base)}
    walked = base
    for part in folder.relative_to(base).parts:
        walked = walked / part
        out.add(os.path.realpath(walked))
    return out


def repository_files(root: Path, model: str | None = None) -> list[str]:
    """Every file of the repository (or of one model), as sorted ``/`` paths relative to ``root``."""
    root = Path(root)
    base = root / model if model else root
    out = []
    for folder, dirs, files in os.walk(base, followlinks=True):  # a linked folder's files are the model's too
        ancestors = _real_ancestors(Path(base), Path(folder))
        # a link back to a folder above it would loop: not followed
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS
                         and os.path.realpath(os.path.join(folder, d)) not in ancestors)
        for name in files:
            rel = Path(folder, name).relative_to(root).as_posix()
            if rel in (MANIFEST, SIGNATURE) or name.endswith(".tmp-manifest"):
                continue
            out.append(rel)
    return sorted(out)


# --- keys --------------------------------------------------------------------------------------------


def generate_keypair(private_path: Path, public_path: Path) -> None:
    """A new Ed25519 key: PKCS8 PEM (private, mode 0600) and SubjectPublicKeyInfo PEM (public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    for p in (private_path, public_path):
        if Path(p).exists():
            raise IntegrityError(f"{p} already exists", fix="choose another path; keys are never overwritten")
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    Path(public_path).write_bytes(public)


def _load_private(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise IntegrityError(f"cannot read the signing key: {exc}", where=str(path),
                             fix="give the private PEM written by: azulite repo keygen") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IntegrityError("the signing key is not an Ed25519 key", where=str(path))
    return key


def _load_public(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise IntegrityError(f"cannot read the public key: {exc}", where=str(path),
                             fix="give the public PEM written by: azulite repo keygen") from None
    if not isinstance(key, Ed25519PublicKey):
        raise IntegrityError("the public key is not an Ed25519 key", where=str(path))
    return key


# --- the manifest ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Manifest:
    root: Path
    files: dict[str, str]
    signed: bool

    def check_model(self, name: str, root: Path | None = None) -> None:
        """Raise IntegrityError naming the first tampered, missing or unlisted file of model ``name``."""
        root = Path(root or self.root)
        prefix = name + "/"
        listed = {p for p in self.files if p.startswith(prefix)}
        present = set(repository_files(root, name)) if (root / name).is_dir() else set()
        for rel in sorted(present - listed):
            raise IntegrityError(f"model '{name}': file '{rel}' is not in the manifest",
                                 where=str(root / MANIFEST),
                                 fix="remove the file, or re-sign the repository: azulite repo sign REPO [--key PRIVATE.pem]")
        for rel in sorted(listed):
            path = root / rel
            if rel not in present:
                raise IntegrityError(f"model '{name}': file '{rel}' is in the manifest but missing",
                                     where=str(root / MANIFEST), fix="restore the file, or re-sign the repository")
            if sha256_file(path) != self.files[rel]:
                raise IntegrityError(f"model '{name}': file '{rel}' does not match its sha256 in the manifest "
                                     "(tampered or changed since signing)", where=str(root / MANIFEST),
                                     fix="restore the signed file, or re-sign: azulite repo sign REPO [--key PRIVATE.pem]")

    def problems(self) -> list[str]:
        """Every mismatch of the whole repository, one line each (``azulite repo verify``)."""
        out = []
        present = set(repository_files(self.root))
        for rel in sorted(present - self.files.keys()):
            out.append(f"unlisted: {rel}")
        for rel in sorted(self.files):
            if rel not in present:
                out.append(f"missing: {rel}")
            elif sha256_file(self.root / rel) != self.files[rel]:
                out.append(f"changed: {rel}")
        return out


def _encode(files: dict[str, str]) -> bytes:
    doc = {"format": FORMAT, "algorithm": "sha256", "files": dict(sorted(files.items()))}
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp-manifest")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write(root: Path, files: dict[str, str], private_key: Path | None) -> Path:
    data = _encode(files)
    signature = _load_private(private_key).sign(data) if private_key is not None else None
    _write_atomic(root / MANIFEST, data)
    if signature is not None:
        _write_atomic(root / SIGNATURE, signature)
    else:
        (root / SIGNATURE).unlink(missing_ok=True)
    return root / MANIFEST


def sign_repository(root: Path, private_key: Path | None = None) -> Path:
    """Hash every file and write the manifest (and its signature with ``private_key``)."""
    root = Path(root)
    if not root.is_dir():
        raise IntegrityError(f"model repository {str(root)!r} is not a directory")
    if private_key is None and (root / SIGNATURE).is_file():  # re-signing as a fix said would drop the signature
        raise IntegrityError("the repository is signed: signing it again without the key would drop its signature",
                             where=str(root / SIGNATURE),
                             fix="pass --key PRIVATE.pem, or remove azulite-manifest.sig first to unsign it on purpose")
    return _write(root, {rel: sha256_file(root / rel) for rel in repository_files(root)}, private_key)


def has_manifest(root: Path) -> bool:
    return (Path(root) / MANIFEST).is_file()


def load_manifest(root: Path, public_key: Path | None = None, *, require_signature_check: bool = True) -> Manifest:
    """Read and check the manifest (and its signature). A signed manifest without ``public_key`` is an
    error when ``require_signature_check`` (the server's choice: never trust a signature it cannot check)."""
    root = Path(root)
    path = root / MANIFEST
    try:
        data = path.read_bytes()
        doc = json.loads(data)
    except OSError as exc:
        raise IntegrityError(f"cannot read the manifest: {exc}", where=str(path),
                             fix="write one with: azulite repo sign REPO [--key PRIVATE.pem]") from None
    except ValueError as exc:
        raise IntegrityError(f"the manifest is not valid JSON: {exc}", where=str(path),
                             fix="re-sign the repository: azulite repo sign REPO [--key PRIVATE.pem]") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if (not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("algorithm") != "sha256"
            or not isinstance(files, dict)
            or not all(isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in files.items())):
        raise IntegrityError(f"the manifest is not an {FORMAT} manifest of sha256 hashes", where=str(path),
                             fix="re-sign the repository: azulite repo sign REPO [--key PRIVATE.pem]")
    sig_path = root / SIGNATURE
    signed = sig_path.is_file()
    if public_key is not None and not signed:
        raise IntegrityError("a public key was given but the manifest is not signed", where=str(sig_path),
                             fix="sign it: azulite repo sign REPO --key PRIVATE.pem")
    if signed:
        if public_key is None:
            if require_signature_check:
                raise IntegrityError("the manifest is signed but no public key was given to check it",
                                     where=str(sig_path), fix="pass --manifest-key PUBLIC.pem")
        else:
            from cryptography.exceptions import InvalidSignature

            try:
                _load_public(public_key).verify(sig_path.read_bytes(), data)
            except InvalidSignature:
                raise IntegrityError("the manifest's signature does not verify with the given public key "
                                     "(the manifest was changed after signing, or another key signed it)",
                                     where=str(sig_path), fix="re-sign with the right key") from None
    return Manifest(root, dict(files), signed)


def verify_repository(root: Path, public_key: Path | None = None) -> Manifest:
    """Signature and every file; IntegrityError listing each problem."""
    manifest = load_manifest(root, public_key, require_signature_check=False)
    problems = manifest.problems()
    if problems:
        raise IntegrityError(f"{len(problems)} file(s) do not match the manifest:\n  " + "\n  ".join(problems),
                             where=str(Path(root) / MANIFEST),
                             fix="restore the files, or re-sign: azulite repo sign REPO [--key PRIVATE.pem]")
    return manifest


def update_manifest(root: Path, changed: Iterable[str] | None = None, *, private_key: Path | None = None) -> Path:
    """After writing into a repository (``azulite export``): re-hash ``changed`` paths (relative to the
    root; a path that no longer exists leaves the manifest; a folder means every file under it), or every
    file when None, and re-sign with ``private_key``. A signed repository without a key fails before
    anything is written, so the manifest never silently loses its signature."""
    root = Path(root)
    if not has_manifest(root):
        return sign_repository(root, private_key)
    signed = (root / SIGNATURE).is_file()
    if signed and private_key is None:
        raise IntegrityError("the repository's manifest is signed: updating it needs the signing key",
                             where=str(root / SIGNATURE), fix="pass the private key used to sign it (--sign-key)")
    if private_key is not None:
        _load_private(private_key)  # a bad key fails before anything changes
    files = dict(load_manifest(root, require_signature_check=False).files)
    if changed is None:
        files = {rel: sha256_file(root / rel) for rel in repository_files(root)}
    else:
        for rel in changed:
            rel = Path(rel).as_posix().strip("/")
            path = root / rel
            if path.is_dir():
                for k in [k for k in files if k.startswith(rel + "/")]:
                    del files[k]
                for sub in repository_files(root, rel):
                    files[sub] = sha256_file(root / sub)
            elif path.is_file():
                files[rel] = sha256_file(path)
            else:
                files.pop(rel, None)
    return _write(root, files, private_key)
