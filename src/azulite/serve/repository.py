"""A Triton model repository on disk: ``<model>/config.pbtxt``, ``<model>/<version>/<model file>``, label
files next to config.pbtxt. Reads what is there and picks the versions a version policy serves; loading
is the manager's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from azulite.errors import InvalidArgument, ModelLoadError, NotFound, Unsupported
from azulite.serve import config as cfg
from azulite.serve.proto import model_config_pb2 as mc


@dataclass(frozen=True, slots=True)
class ModelSource:
    """One model directory: its parsed config (None when it has no config.pbtxt: auto-completed from the
    model file) and the numeric version directories found."""

    name: str
    path: Path
    config: mc.ModelConfig | None
    versions: tuple[int, ...]


def refuse_repository_name(name: str) -> None:
    """A load or unload naming a repository (gRPC's ``repository_name``, HTTP's ``/v2/repository/NAME/...``):
    refused as Triton 2.51 refuses it (UNIMPLEMENTED / 501), not served from the one repository unasked."""
    if name:
        raise Unsupported("'repository_name' specification is not supported", where=f"repository '{name}'",
                          fix="leave the repository name out: the server serves the one repository it was started "
                              "with (e.g. POST /v2/repository/models/MODEL/load)")


def list_models(root: Path) -> list[str]:
    """Every model directory name in the repository (hidden entries skipped, as Triton does)."""
    if not root.is_dir():
        raise NotFound(f"model repository path '{root}' does not exist or is not a directory")
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def version_dirs(model_dir: Path) -> tuple[int, ...]:
    """Numeric subdirectories; Triton ignores others (and version 0 is invalid: "0" is skipped)."""
    found = []
    for entry in model_dir.iterdir():
        if entry.is_dir() and entry.name.isdigit() and int(entry.name) > 0:
            found.append(int(entry.name))
    return tuple(sorted(found))


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a model (None when it can): a model is one folder of the repository, so
    a name is never empty, ``.`` or ``..`` and holds no path separator (nor NUL) that would reach out of it."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\x00"):
        shown = f"'{name}'" if name.isprintable() else repr(name)
        return (f"{shown} is not a model name: a model is one folder of the model repository, "
                "named without '/', '\\' or '..'")
    return None


def check_model_name(name: str) -> None:
    """The model control API's check of a name a client sent (InvalidArgument: 400 / INVALID_ARGUMENT)."""
    problem = name_problem(name)
    if problem:
        raise InvalidArgument(problem, fix="name a model folder of the repository (the repository index lists them)")


def read_model(root: Path, name: str, *, config_json: str | None = None) -> ModelSource:
    """Read one model's directory. ``config_json`` (the load API's override) replaces config.pbtxt."""
    check_model_name(name)
    path = root / name
    if not path.is_dir():
        raise NotFound(
            f"failed to load '{name}', failed to poll from model repository: no model directory '{name}' in {root}"
        )
    if config_json is not None:
        config: mc.ModelConfig | None = cfg.config_from_json(config_json, model=name)
    elif (path / "config.pbtxt").is_file():
        config = cfg.parse_config_file(path / "config.pbtxt", model=name)
    else:
        config = None
    return ModelSource(name=name, path=path, config=config, versions=version_dirs(path))


def select_versions(policy: mc.ModelVersionPolicy, available: tuple[int, ...], *, model: str,
                    path: Path | None = None) -> list[int]:
    """Triton's version policies: latest N (the default: 1), all, or a specific list."""
    kind = policy.WhichOneof("policy_choice") or "latest"
    if kind == "all":
        chosen = list(available)
    elif kind == "specific":
        wanted = list(policy.specific.versions)
        missing = [v for v in wanted if v not in available]
        if missing:
            raise ModelLoadError(
                f"model '{model}': version_policy.specific asks for version(s) {missing} but the "
                f"repository has {list(available)}",
                where=f"model '{model}' config.pbtxt",
            )
        chosen = sorted(wanted)
    else:
        n = policy.latest.num_versions or 1
        chosen = list(available)[-n:]
    if not available:
        raise ModelLoadError(
            f"failed to load '{model}': no version folder such as 1/ under {path or model + '/'} (each version of a model is a "
            "numbered folder holding the model file)",
            where=f"model '{model}'",
            fix=f"move the model file into {model}/1/ (e.g. {model}/1/model.onnx)",
        )
    if not chosen:
        raise ModelLoadError(
            f"failed to load '{model}': at least one version must be available under the version policy "
            "of the model",
            where=f"model '{model}'",
            fix=f"add a version directory such as {model}/1/ holding the model file",
        )
    return chosen


def model_file(source: ModelSource, config: mc.ModelConfig, version: int) -> Path:
    """The file a version loads: ``default_model_filename`` or the backend's default name."""
    cfg.check_file_names(source.name, config)  # an override's '../elsewhere/model.py' is never read
    backend = cfg.backend_of(config)
    filename = config.default_model_filename or cfg.DEFAULT_FILENAMES.get(backend, "")
    path = source.path / str(version) / filename
    if not path.exists():
        raise ModelLoadError(
            f"failed to load '{source.name}' version {version}: unable to find '{path}'",
            where=f"model '{source.name}'",
            fix=f"put the model file at {source.name}/{version}/{filename}",
        )
    return path


def guess_backend(source: ModelSource) -> str:
    """For a model without config.pbtxt: the backend its files imply (Triton's auto-complete needs a
    model file it can read)."""
    for version in reversed(source.versions):
        vdir = source.path / str(version)
        if (vdir / "model.onnx").exists():
            return "onnxruntime"
        if (vdir / "model.py").exists():
            return "python"
        if (vdir / "model.pt").exists():
            return "pytorch"
    return ""


def read_labels(source: ModelSource, config: mc.ModelConfig) -> dict[str, list[str]]:
    """``label_filename`` of each output: one label per line, index = class index."""
    labels: dict[str, list[str]] = {}
    for output in config.output:
        if output.label_filename:
            path = source.path / output.label_filename
            if not path.is_file():
                raise ModelLoadError(
                    f"model '{source.name}', output '{output.name}': label file '{output.label_filename}' not found",
                    where=str(path),
                )
            labels[output.name] = path.read_text().splitlines()
    return labels


def fingerprint(model_dir: Path) -> tuple:
    """What poll mode compares to decide a model changed: every file's path, size and mtime."""
    if not model_dir.is_dir():
        return ()
    items = []
    for path in sorted(model_dir.rglob("*")):
        if "__pycache__" in path.parts:
            continue
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        items.append((str(path.relative_to(model_dir)), st.st_size, st.st_mtime_ns))
    return tuple(items)
