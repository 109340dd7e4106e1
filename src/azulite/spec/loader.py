"""Reading a job spec from YAML: line-tracking load, ``--set`` overrides, pydantic validation, path and
``${{inputs.NAME}}`` checks — every failure a :class:`~azulite.errors.SpecError` naming the file, the
line, the field path, the offending value and a fix.

Where each error goes and what it says: :mod:`azulite.spec.explain`.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml
from pydantic import ValidationError

from azulite.errors import SpecError
from azulite.spec.explain import _data_path, _describe, _Source, _validation_error  # noqa: F401 - cluster, sweep
from azulite.spec.job import DISTRIBUTION_TYPES, Environment, JobSpec, PathInput
from azulite.spec.yaml_text import Path_, check_shape, dotted, line_map, override_as_written, parse

_REF_RE = re.compile(r"\$\{\{\s*(inputs|outputs)\.([A-Za-z0-9_.-]+?)\s*\}\}")


def parse_overrides(items: Iterable[str]) -> list[tuple[Path_, Any, str]]:
    """``["a.b=3", "env.X=y"]`` -> [(("a","b"), 3, "a.b=3"), ...]; values parse as YAML scalars."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        # an empty segment (`resources..x`, `a.`) would surface as "unknown field ''" at a line of the file
        if not sep or not key.strip() or any(not part.strip() for part in key.strip().split(".")):
            raise SpecError(
                f"cannot read override {item!r}",
                file="--set",
                value=item,
                fix="write --set path=value, e.g. --set distribution.process_count_per_instance=2",
            )
        if not raw.strip():  # `--set inputs.steps=` (a shell variable that was empty) must not pass as ""
            raise SpecError(
                "no value after '='",
                file=f"--set {item}",
                field=key.strip(),
                value=item,
                fix=f"give a value, e.g. --set {key.strip()}=3; for an empty string write --set '{key.strip()}=\"\"'",
            )
        try:
            check_shape(raw, f"--set {item}")  # `--set 'x=&a [*a]'`, 3000 brackets: as in a file
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        except SpecError as e:
            raise SpecError(e.message, file=f"--set {item}", field=key.strip(), value=item, fix=e.fix) from None
        path = tuple(int(p) if p.isdigit() else p for p in key.strip().split("."))
        out.append((path, override_as_written(path, value, raw), item))
    return out


def _apply_override(data: dict, path: Path_, value: Any, item: str) -> None:
    """Set ``path`` to ``value`` in ``data``, making the mappings on the way; a null (``--set max_restarts=null``,
    ``=~``) removes the field, which then takes its default (for a field that may be null, null itself)."""
    cur: Any = data
    if value is None:
        for part in path[:-1]:
            cur = cur.get(part) if isinstance(cur, dict) else None
        if isinstance(cur, dict):
            cur.pop(path[-1], None)
        return
    for i, part in enumerate(path[:-1]):
        if isinstance(cur, list) and isinstance(part, int) and part < len(cur):
            cur = cur[part]
            continue
        if not isinstance(cur, dict):
            raise SpecError(
                f"--set {item}: {dotted(path[:i])} is not a mapping", file="--set", field=dotted(path), value=value,
                fix="set a field inside a mapping, e.g. --set inputs.epochs=3",
            )
        if not isinstance(cur.get(part), (dict, list)):
            cur[part] = {}
        cur = cur[part]
    if isinstance(cur, list) and isinstance(path[-1], int) and path[-1] < len(cur):
        cur[path[-1]] = value
    elif isinstance(cur, dict):
        cur[path[-1]] = value
    else:
        raise SpecError(f"--set {item}: cannot set {dotted(path)}", file="--set", field=dotted(path), value=value,
                        fix="point --set at a mapping field, e.g. --set inputs.epochs=3")


def _check_named_overrides(data: dict, over: list[tuple[Path_, Any, str]]) -> None:
    """``--set inputs.NAME=...`` / ``outputs.NAME...`` must name an input or output the spec declares: a
    typo would otherwise add one the command never reads, and the run would silently use the old value."""
    for path, value, item in over:
        if len(path) < 2 or path[0] not in ("inputs", "outputs"):
            continue
        declared = data.get(path[0]) if isinstance(data.get(path[0]), dict) else {}
        if path[1] in declared:
            continue
        close = difflib.get_close_matches(str(path[1]), [str(k) for k in declared], n=1)
        hint = f"did you mean {path[0]}.{close[0]}? " if close else ""
        known = f"the spec declares: {', '.join(map(str, declared))}" if declared else f"the spec declares no {path[0]}"
        raise SpecError(f"the spec has no {path[0][:-1]} named {path[1]!r}", file=f"--set {item}",
                        field=dotted(path[:2]), value=value, fix=f"{hint}{known}")


def _is_remote(path: str) -> bool:
    return "://" in path or path.startswith("azureml:")


def load_job(path: str | Path, overrides: Iterable[str] = ()) -> JobSpec:
    """Read, override, validate and check a job spec. Local paths (``code``, ``uri_file``/``uri_folder``
    inputs, output paths) come back absolute, resolved against the spec file's folder; ``name`` defaults
    to that folder's name."""
    data, src, base = read_spec(path, overrides)
    if data.get("type") == "sweep":
        raise src.error("this is a sweep job, not a command job", ("type",), "sweep",
                        fix="submit it with `azulite job submit` (sweeps run their trials as command jobs)")
    if data.get("type", "command") != "command":  # a typo (commnd) ran as a command job and rendered as one
        kind = data["type"]
        close = difflib.get_close_matches(str(kind), ["command", "sweep"], n=1)
        raise src.error(f"job type {kind!r} is not one azulite runs: command and sweep jobs are", ("type",), kind,
                        fix=(f"did you mean type: {close[0]}? " if close else "")
                            + "a pipeline's steps can each be submitted as a command job")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, data, src) from None

    return _check_and_resolve(spec, base, src)


def read_spec(path: str | Path, overrides: Iterable[str] = ()) -> tuple[dict, "_Source", Path]:
    """The YAML mapping of a spec with ``--set`` overrides applied, where each field came from, and the
    spec file's folder (``name`` defaulted to that folder's name)."""
    file = Path(path)
    shown = str(path)
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise SpecError("job spec not found", file=shown, fix="check the path, e.g. azulite job submit examples/ddp/job.yaml") from None
    except IsADirectoryError:
        inside = file / "job.yaml"
        raise SpecError("is a directory, not a job spec file", file=shown,
                        fix=f"pass the YAML file itself, e.g. {inside}" if inside.is_file() else "pass the job's YAML file") from None
    except (PermissionError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read the job spec ({exc.__class__.__name__})", file=shown, fix="pass a readable YAML file") from None
    data, node = parse(text, shown)
    if data is None:
        if not overrides:  # else it reads as "required field 'command' is missing", as if one line were lost
            raise SpecError("the job spec is empty", file=shown,
                            fix="start with `command: ...`; see examples/ddp/job.yaml for a whole one")
        data = {}
    if not isinstance(data, dict):
        raise SpecError("a job spec must be a YAML mapping", file=shown, line=1, value=data, fix="start with `command: ...`")

    over = parse_overrides(overrides)
    _check_named_overrides(data, over)
    for p, value, item in over:
        _apply_override(data, p, value, item)
    src = _Source(shown, line_map(node), {p: item for p, _, item in over})
    base = file.resolve().parent
    data.setdefault("name", re.sub(r"[^A-Za-z0-9_-]", "-", base.name).strip("-_") or "job")
    return data, src, base


_ANY_REF_RE = re.compile(r"\$\{\{(?:[^}]|\}(?!\}))*(?:\}\})?")  # from ${{ to the next }} (or the end)


def _stray_reference(command: str, kinds: tuple[str, ...]) -> str | None:
    """The first ``${{...`` in the command that is not a reference to ``kinds`` (``${{input.x}}``, a missing
    brace, ``${{search_space.y}}`` outside a sweep): left in, the shell fails it as "Bad substitution"."""
    for m in _ANY_REF_RE.finditer(command):
        ref = re.fullmatch(r"\$\{\{\s*([A-Za-z_]+)\.[A-Za-z0-9_.-]+?\s*\}\}", m.group(0))
        if ref is None or ref.group(1) not in kinds:
            return m.group(0)
    return None


def _unwritable(path: Path, kind: str) -> str | None:
    """Why a local output path cannot be what its type says (the job would fail at start with a bare
    FileExistsError), or None."""
    if path.exists():
        if kind == "uri_file":
            return "a uri_file output must not be a folder" if path.is_dir() else None
        return None if path.is_dir() else f"{path} is a file, and a {kind} output is a folder"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be created: {parent} is not writable"
    try:  # access() answers yes to root everywhere (/proc too): a folder made and removed says for sure
        os.rmdir(tempfile.mkdtemp(prefix=".azulite-probe-", dir=parent))
    except OSError as e:
        return f"{path} cannot be created: {parent} takes no new folder ({e.strerror or e})"
    return None


def _check_and_resolve(spec: JobSpec, base: Path, src: _Source, kinds: tuple[str, ...] = ("inputs", "outputs")) -> JobSpec:
    code = (base / spec.code).resolve()
    key = f"`{src.prefix}code:`"
    if not code.exists():
        raise src.error("code folder not found", ("code",), spec.code,
                        fix=f"create {code} or point {key} at the folder holding your script (relative to the spec file)")
    if not code.is_dir():
        here = os.path.relpath(code.parent, base)
        raise src.error(f"code must be a folder: {code} is a file", ("code",), spec.code,
                        fix=f"point {key} at the folder holding your script, relative to the spec file (this file's "
                            f"folder: {src.prefix}code: {here})")
    inputs: dict[str, Any] = {}
    for name, value in spec.inputs.items():
        if isinstance(value, PathInput) and not _is_remote(value.path):
            local = (base / value.path.removeprefix("file://")).resolve()
            if not local.exists():
                raise src.error(
                    f"input path does not exist: {local}", ("inputs", name, "path"), value.path,
                    fix="create it, fix the path (relative to the spec file), or use a remote URI (az://, azureml://)",
                )
            if value.type == "uri_folder" and not local.is_dir():
                raise src.error("a uri_folder input must be a folder", ("inputs", name, "path"), value.path, fix="use `type: uri_file` for a file")
            if value.type == "uri_file" and not local.is_file():
                raise src.error("a uri_file input must be a file", ("inputs", name, "path"), value.path, fix="use `type: uri_folder` for a folder")
            value = value.model_copy(update={"path": str(local)})
        inputs[name] = value
    outputs = {
        name: (o.model_copy(update={"path": str((base / o.path).resolve())}) if o.path and not _is_remote(o.path) else o)
        for name, o in spec.outputs.items()
    }
    for name, o in outputs.items():
        if o.path and not _is_remote(o.path) and (problem := _unwritable(Path(o.path), o.type)):
            raise src.error(problem, ("outputs", name, "path"), spec.outputs[name].path,
                            fix="point it at a folder the job may create or write (relative to the spec file), "
                                "or leave `path:` out for <job dir>/outputs/" + name)
    for m in _REF_RE.finditer(spec.command):
        kind, name = m.group(1), m.group(2)
        known = spec.inputs if kind == "inputs" else spec.outputs
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f"did you mean ${{{{{kind}.{close[0]}}}}}? " if close else ""
            raise src.error(
                f"the command uses ${{{{{kind}.{name}}}}} but the spec has no {kind[:-1]} named {name!r}",
                ("command",), m.group(0),
                fix=f"{hint}declare it under `{kind}:`" + (f" (known: {', '.join(known)})" if known else ""),
            )
    if (stray := _stray_reference(spec.command, kinds)) is not None:
        head = re.match(r"\$\{\{\s*([A-Za-z_]*)", stray)
        close = difflib.get_close_matches(head.group(1) if head else "", list(kinds), n=1)
        raise src.error(
            f"the command has {stray!r}, which is not a reference azulite fills in",
            ("command",), stray,
            fix=(f"did you mean ${{{{{close[0]}.NAME}}}}? " if close else "") + "references are "
                + " or ".join(f"${{{{{k}.NAME}}}}" for k in kinds) + ", closed by }}"
                + ("; ${{search_space.NAME}} belongs in a sweep job's trial (type: sweep)"
                   if head and head.group(1) == "search_space" else ""),
        )
    if spec.distribution is not None and spec.distribution.type not in DISTRIBUTION_TYPES:  # pragma: no cover
        raise src.error("unknown distribution type", ("distribution", "type"), spec.distribution.type)
    env = spec.environment
    if isinstance(env, Environment) and env.conda_file:
        # relative to the spec file, like code: rendered documents are written elsewhere (a job dir, --out)
        conda = (base / env.conda_file).resolve()
        if not conda.is_file():
            raise src.error("conda file not found", ("environment", "conda_file"), env.conda_file,
                            fix=f"create {conda} or point `environment.conda_file:` at it (relative to the spec file)")
        env = env.model_copy(update={"conda_file": str(conda)})
    return spec.model_copy(update={"code": str(code), "inputs": inputs, "outputs": outputs, "environment": env})


def _quote_state(command: str, end: int) -> str:
    """The shell's quoting at ``command[end]``: "" (none), "'" or '"' (inside such quotes)."""
    state, i = "", 0
    while i < end:
        c = command[i]
        if state == "'":
            if c == "'":
                state = ""
        elif c == "\\":
            i += 1  # an escaped character (outside single quotes)
        elif state == '"':
            if c == '"':
                state = ""
        elif c in "'\"":
            state = c
        i += 1
    return state


def _shell_word(path: str, state: str) -> str:
    """``path`` written so the shell reads it as one word where it stands (unquoted, or inside the user's
    own quotes): a path with a space (an AZULITE_HOME under "My Files") split the command."""
    if not path or _SAFE_WORD.fullmatch(path):
        return path
    if state == '"':
        return re.sub(r'(["\\$`])', r"\\\1", path)
    if state == "'":
        return path.replace("'", "'\\''")
    return shlex.quote(path)


_SAFE_WORD = re.compile(r"[\w@%+=:,./-]+")


def render_command(command: str, inputs: Mapping[str, Any], outputs: Mapping[str, str]) -> str:
    """Substitute ``${{inputs.NAME}}`` (a literal, or a path input's path) and ``${{outputs.NAME}}``
    (the output's resolved path). Names were checked by :func:`load_job`. A path is written as one shell
    word where the reference stands (quoted as it needs: a space in it no longer splits the command); a
    literal is put as given, as Azure ML puts it."""

    def one(m: re.Match) -> str:
        kind, name = m.group(1), m.group(2)
        if kind == "outputs":
            return _shell_word(str(outputs[name]), _quote_state(command, m.start()))
        v = inputs[name]
        if isinstance(v, PathInput):
            return _shell_word(v.path, _quote_state(command, m.start()))
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v)

    return _REF_RE.sub(one, command)
