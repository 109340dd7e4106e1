"""A spec's validation errors in the user's words: each pydantic error placed at the file's line or the
``--set`` that caused it (:class:`_Source`), with a message and a fix for what it is (:func:`_describe`), a
check across fields (:class:`~azulite.spec.job.FieldCheck`) at the field it names, with its own fix.

Why by hand: PyYAML's composed node tree carries the line of every key; pydantic reports the field path.
No library joins the two, so :func:`~azulite.spec.yaml_text.line_map` walks the node tree once and
:func:`_validation_error` maps each pydantic error's location onto it.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from azulite.errors import SpecError
from azulite.spec.job import DURATION_FIX, FieldCheck
from azulite.spec.yaml_text import Path_, dotted

_EXAMPLES = {
    "command": "command: python train.py --epochs ${{inputs.epochs}}",
    "code": "code: ./src",
    "name": "name: my-job",
    "distribution": "distribution: {type: pytorch, process_count_per_instance: 2}",
    "distribution.type": "type: pytorch   (or tensorflow, mpi)",
}



class _Source:
    """Where each field came from: a line of the file, or a ``--set`` flag. ``prefix``: where the fields
    sit in the file (``trial.`` for a sweep's trial), for the paths a fix names."""

    def __init__(self, file: str, lines: dict[Path_, int], overrides: dict[Path_, str], prefix: str = "") -> None:
        self.file, self.lines, self.overrides, self.prefix = file, lines, overrides, prefix

    def error(self, message: str, path: Path_, value: Any = None, fix: str | None = None, *,
              say_value: bool = True) -> SpecError:
        if say_value and value is not None and repr(value) not in message and not isinstance(value, (dict, list)):
            message += f" (got {value!r})"
        field = dotted(path) or None
        if field and self.prefix and path[0] not in ("inputs", "outputs"):  # a sweep's are its own, not the trial's
            field = self.prefix + field
        for n in range(len(path), 0, -1):
            if path[:n] in self.overrides:
                return SpecError(message, file=f"--set {self.overrides[path[:n]]}", field=field, value=value, fix=fix)
        # a --set inside the field (`--set foo.bar=1` made `foo`; `--set resources.instance_count.x=1` made a
        # mapping of a count): the error is the --set's, not the line the field has in the file
        inside = [item for over, item in self.overrides.items() if path and over[:len(path)] == path]
        if inside:
            return SpecError(message, file=f"--set {inside[0]}", field=field, value=value, fix=fix)
        line = None
        for n in range(len(path), 0, -1):
            if path[:n] in self.lines:
                line = self.lines[path[:n]]
                break
        return SpecError(message, file=self.file, line=line, field=field, value=value, fix=fix)


def _data_path(data: Any, loc: tuple, err_type: str) -> tuple[Path_, Any, bool]:
    """Strip pydantic's union-branch names from ``loc``: the path as it exists in the data, the value
    there, and whether the full path exists."""
    path: list[Any] = []
    cur = data
    found = True
    for i, part in enumerate(loc):
        if isinstance(cur, dict) and part in cur:
            path.append(part)
            cur = cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
            path.append(part)
            cur = cur[part]
        elif i == len(loc) - 1 and err_type == "missing":
            path.append(part)
            found = False
        # else: a union branch / tag name (e.g. "PathInput", "pytorch"): not part of the user's path
    return tuple(path), cur, found


def _known_fields(model: type[BaseModel]) -> list[str]:
    return sorted(model.model_fields)


def _model_at(path: Path_, data: Any) -> type[BaseModel] | None:
    """The pydantic model that validates the mapping at ``path`` (for did-you-mean on unknown keys)."""
    from azulite.spec import job as m

    if not path:
        return m.JobSpec
    head = path[0]
    if head == "resources" and len(path) == 1:
        return m.Resources
    if head == "distribution" and len(path) == 1:
        t = str((data.get("distribution") or {}).get("type", "")).lower() if isinstance(data, dict) else ""
        return {"pytorch": m.PyTorchDistribution, "tensorflow": m.TensorFlowDistribution, "mpi": m.MpiDistribution}.get(t)
    if head == "inputs" and len(path) == 2:
        return m.PathInput
    if head == "outputs" and len(path) == 2:
        return m.Output
    if head == "environment" and len(path) == 1:
        return m.Environment
    return None


#: a job's node and process counts (a bound on them is what a cluster runs)
_COUNTS = ("instance_count", "max_instance_count", "process_count_per_instance", "worker_count",
           "parameter_server_count", "min_nodes", "max_nodes")
UNIFORM_EXAMPLE = "{type: uniform, min_value: 0.01, max_value: 0.1}"
def _union_tag(t: str, ctx: dict, path: Path_, value: Any, data: Any) -> tuple[str, str]:
    """An unknown or missing ``type`` of a distribution, a sweep's search-space entry or its early
    termination policy: the types that union takes."""
    from azulite.spec.sweep import POLICY_TYPES, SAMPLED_TYPES, SUPPORTED

    tag, missing = ctx.get("tag", value), t == "union_tag_not_found"
    sweep = isinstance(data, dict) and str(data.get("type", "")).lower() == "sweep"
    if sweep and path[:1] == ("search_space",):
        sampler = data.get("sampling_algorithm")
        sampler = str(sampler.get("type", "") if isinstance(sampler, dict) else sampler or "").lower()
        allowed = SUPPORTED.get(sampler)
        what = f"search_space.{path[1]}" if len(path) > 1 else "a search space entry"
        message = f"{what} needs a type" if missing else f"unknown sampling distribution {tag!r}"
        if allowed:
            example = "{type: choice, values: [0.01, 0.1]}" if "uniform" not in allowed else UNIFORM_EXAMPLE
            return message, (f"{sampler} sampling takes type: {', '.join(allowed)}, e.g. {example}; random "
                             f"sampling takes every one: {', '.join(SAMPLED_TYPES)}")
        return message, f"use type: {', '.join(SAMPLED_TYPES)}, e.g. {UNIFORM_EXAMPLE}"
    if sweep and path[:1] == ("early_termination",):
        return ("early_termination needs a type" if missing else f"unknown early termination policy {tag!r}",
                f"use type: {', '.join(POLICY_TYPES)}, e.g. {{type: bandit, slack_factor: 0.1}}")
    none = str(tag).lower() in ("none", "null", "")
    return (
        "distribution needs a type" if missing else f"unknown distribution type {tag!r}",
        "use `type: pytorch` (also DeepSpeed), `type: tensorflow` or `type: mpi`"
        + ("; to run the command once per node without a launcher, remove `distribution:`" if none else ""),
    )


def _describe(err: dict, path: Path_, value: Any, data: Any, prefix: str = "") -> tuple[str, str]:
    """(message, fix) for one pydantic error, in the user's words; ``prefix``: where ``path`` sits in the
    file (``trial.``)."""
    t, field, ctx = err["type"], prefix + dotted(path), err.get("ctx") or {}
    if isinstance(ctx.get("error"), FieldCheck):
        return str(ctx["error"]), ctx["error"].fix
    if t == "extra_forbidden":
        sweep = isinstance(data, dict) and str(data.get("type", "")).lower() == "sweep"
        if sweep and len(path) == 1:  # a sweep's own fields, not its trial's (it offered the trial's as its)
            from azulite.spec import job as m
            from azulite.spec.sweep import SweepSpec

            if str(path[-1]) == "timeout":
                return ("unknown field 'timeout' of a sweep", "the whole sweep's: limits.timeout; each trial's: "
                        "limits.trial_timeout (on the command line: --set limits.timeout=...)")
            if str(path[-1]) in m.JobSpec.model_fields:
                return (f"unknown field '{path[-1]}' of a sweep: it is a field of the sweep's trial",
                        f"move it under `trial:` (on the command line: --set trial.{path[-1]}=...)")
            model = SweepSpec
        else:
            model = _model_at(path[:-1], data)
        known = _known_fields(model) if model else []
        known = [k for k in known if k != "azureml"]
        close = difflib.get_close_matches(str(path[-1]), known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return (f"unknown field '{path[-1]}'", f"{hint}remove it or use one of: {', '.join(known)}" if known else "remove it")
    if t == "missing":
        example = _EXAMPLES.get(field) or _EXAMPLES.get(str(path[-1]), f"{path[-1]}: ...")
        return (f"required field '{field}' is missing", f"add it, e.g. `{example}`")
    if t in ("union_tag_invalid", "union_tag_not_found"):
        return _union_tag(t, ctx, path, value, data)
    if t in ("greater_than_equal", "greater_than"):
        bound = ctx.get("ge", ctx.get("gt"))
        if isinstance(bound, float):  # a rate, a duration: not counted in whole numbers
            op = ">=" if t == "greater_than_equal" else ">"
            return (f"{value!r} is too small: must be {op} {bound:g}", f"set {field} to a number {op} {bound:g}")
        least = bound if t == "greater_than_equal" else bound + 1
        return (f"{value!r} is too small: must be >= {least}", f"set {field} to a whole number >= {least}, e.g. {least}")
    if t in ("less_than_equal", "less_than"):
        bound = ctx.get("le", ctx.get("lt"))
        most = bound if t == "less_than_equal" else bound - 1
        why = "; no Azure ML or AKS cluster runs more" if path and path[-1] in _COUNTS else ""
        return (f"{value!r} is too large: must be <= {most:,}", f"set {field} to a whole number <= {most:,}{why}")
    if t in ("int_parsing", "int_type", "int_from_float"):
        return (f"{value!r} is not a whole number", f"set {field} to a whole number, e.g. 2")
    if t == "literal_error":
        return (f"{value!r} is not allowed", f"use one of: {ctx.get('expected')}")
    if t == "string_pattern_mismatch" and path and path[-1] == "name":
        return (f"{value!r} is not a valid job name", "use letters, digits, '-' and '_' (starting with a letter or digit), e.g. my-job")
    if t in ("dict_type", "model_type", "model_attributes_type"):
        return (f"expected a mapping, got {value!r}", f"write {field} as `key: value` lines")
    if t in ("string_type", "string_too_short") and path[:1] == ("environment_variables",) and value is None:
        return ("has no value (YAML reads an empty value as null)", f'give it one, e.g. {path[-1]}: "" for empty')
    if t in ("string_type", "string_too_short"):
        return (f"{value!r} is not a valid text value", f"set {field} to a non-empty string")
    msg = err["msg"].removeprefix("Value error, ")
    if path and path[-1] in ("timeout", "trial_timeout"):
        said = "must be more than 0 seconds" if "> 0" in msg else "is not a duration"  # 0 was "not a duration"
        return (f"{value!r} {said}", DURATION_FIX)
    return (msg, f"correct {field or 'the spec'} (see the Jobs section of README.md)")


def _value_at(data: Any, path: Path_) -> Any:
    for part in path:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return None
    return data


def _validation_error(exc: ValidationError, data: Any, src: _Source) -> SpecError:
    best: dict[Path_, tuple[int, dict, Any]] = {}
    for err in exc.errors():
        path, value, found = _data_path(data, tuple(err["loc"]), err["type"])
        if err["type"] == "union_tag_invalid" and isinstance(value, dict) and "type" in value:
            path, value = path + ("type",), value["type"]
        # union branches repeat one problem per branch: keep the most specific (longest loc)
        if err["type"] in ("bool_type", "bool_parsing", "int_type", "int_parsing", "float_type", "float_parsing", "string_type") and isinstance(value, dict):
            continue
        score = len(err["loc"])
        if path not in best or score > best[path][0]:
            best[path] = (score, err, value if found or err["type"] != "missing" else None)
    if not best:  # every error was a union-branch echo: report the first one
        err = exc.errors()[0]
        path, value, _ = _data_path(data, tuple(err["loc"]), err["type"])
        best[path] = (0, err, value)
    problems = []
    for path, (_, err, value) in best.items():
        message, fix = _describe(err, path, value, data, src.prefix)
        check = (err.get("ctx") or {}).get("error")
        if isinstance(check, FieldCheck) and check.field:  # at the field the check names
            path = path + (tuple(check.field.split(".")) if isinstance(check.field, str) else tuple(check.field))
            value = _value_at(data, path)
            if src.prefix:  # `--set max_restarts=0` in a sweep's trial is `--set trial.max_restarts=0`
                fix = re.sub(r"--set (?!inputs\.|outputs\.)", f"--set {src.prefix}", fix)
        elif not path and (named := re.match(r"([a-z_]+(?:\.[a-z_]+)*)\b", message)):
            # a check across fields ("elastic.min_nodes (3) is above ..."): at the line of the field it names
            candidate = tuple(named.group(1).split("."))
            if any(candidate[:n] in src.lines or candidate[:n] in src.overrides for n in range(len(candidate), 0, -1)):
                path = candidate
        problems.append(src.error(message, path, value, fix, say_value=not isinstance(check, FieldCheck)))
    first = problems[0]
    if len(problems) > 1:
        first.fix = (first.fix or "") + "".join(f"\n  also: {p.where}: {p.message} (fix: {p.fix})" for p in problems[1:])
    return first
