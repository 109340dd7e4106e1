"""``azulite export``: checkpoint -> rebuilt model -> exported file + config.pbtxt, verified, in the next
version folder of a Triton model repository. The only bridge between training and serving: what it writes
is a plain Triton repository, and the server never imports training code."""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from azulite.errors import ExportError, ExportVerificationError
from azulite.export import pbtxt
from azulite.export.formats import EXPORTERS, FORMATS, Exported
from azulite.export.plan import ServingPlan, plan_for
from azulite.export.recipe import ModelRecipe, TensorSpec
from azulite.export.repository import (ExistingModel, check_fits, check_integrity_before, check_model_name,
                                       existing_model, formats_for, stage, update_integrity)
from azulite.export.signature import check_onnx_file, check_returns
from azulite.export.source import CheckpointRef, fetch_verified, resolve
from azulite.export.verify import Tolerance, Verification, compare
from azulite.export.weights import load_module_state


#: how a preprocessing step and the exported model are served (ExportOptions.pipeline)
PIPELINES = ("auto", "fused", "ensemble")


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    #: repository root the model folder goes into
    repo: Path
    #: model name (folder); default: the job's name (``ddp`` for job ``ddp-3``), else the factory's name
    name: str | None = None
    #: version folder; default: one past the newest already there (1 for a new model)
    version: int | None = None
    #: "auto" tries onnx, then torchscript, then python
    format: str = "auto"
    #: checkpoint step when the source is a location holding several; default the newest committed one
    step: int | None = None
    #: config.pbtxt batching; None: the existing model's config's (a new version shares it), else 64 with
    #: dynamic batching and no queue delay. Given and different from an existing model's: refused.
    max_batch_size: int | None = None
    dynamic_batching: bool | None = None
    max_queue_delay_us: int | None = None
    tolerance: Tolerance = field(default_factory=Tolerance)
    #: rows the export is verified on (a batch: the batch dimension is exercised too)
    rows: int = 64
    seed: int = 0
    #: Ed25519 private key (PEM) re-signing the repository's integrity manifest (azulite.integrity)
    sign_key: Path | None = None
    #: for a model served from raw records (a preprocessing step): "fused", one Python-backend model that
    #: preprocesses and runs the exported ONNX file (when the plan has that form), or "ensemble", the
    #: preprocessing step and the exported model chained by an ensemble; "auto": fused when the plan has
    #: that form, else ensemble. Ignored for other models.
    pipeline: str = "auto"

    def __post_init__(self) -> None:
        if self.format != "auto" and self.format not in FORMATS:
            raise ExportError(f"unknown format {self.format!r}", fix=f"use one of auto, {', '.join(FORMATS)}")
        if self.pipeline not in PIPELINES:
            raise ExportError(f"unknown pipeline {self.pipeline!r}", fix=f"use one of {', '.join(PIPELINES)}")
        self._check_numbers()
        if self.name is not None:
            check_model_name(self.name)

    def _check_numbers(self) -> None:
        """Every number given, checked before the checkpoint is read and the model rebuilt (a version 0, rows
        0 or a negative batch size was refused only then; a negative queue delay was a traceback)."""
        if self.version is not None and self.version < 1:
            raise ExportError(f"--version {self.version} must be >= 1 (Triton ignores version folder 0)",
                              fix="e.g. --version 1, or omit --version for the next one")
        if self.rows < 2:
            raise ExportError(f"--rows {self.rows} must be >= 2 (verification runs a batch of rows)",
                              fix="e.g. --rows 64 (the default)")
        if self.max_batch_size is not None and self.max_batch_size < 0:
            raise ExportError(f"--max-batch-size {self.max_batch_size} must be >= 0 (0: no batching)",
                              fix="e.g. --max-batch-size 64")
        if self.dynamic_batching and self.max_batch_size == 0:
            raise ExportError("--dynamic-batching needs a batch dimension: --max-batch-size is 0",
                              fix="pass --max-batch-size N (N >= 1) with --dynamic-batching, or drop it")
        if self.max_queue_delay_us is not None and self.max_queue_delay_us < 0:
            raise ExportError(f"--max-queue-delay-us {self.max_queue_delay_us} must be >= 0",
                              fix="e.g. --max-queue-delay-us 100 (0: no delay)")
        default = Tolerance()
        for flag, value, usual in (("--atol", self.tolerance.atol, default.atol),
                                   ("--rtol", self.tolerance.rtol, default.rtol)):
            if not (math.isfinite(value) and value >= 0):  # a negative one failed every export after the rebuild
                raise ExportError(f"{flag} {value:g} must be a number >= 0", fix=f"e.g. {flag} {usual:g} (the default)")


@dataclass(frozen=True)
class ExportResult:
    checkpoint: str
    step: int
    name: str
    version: int
    model_dir: Path
    format: str
    #: formats tried before the one used, each with why it failed
    skipped: tuple[tuple[str, str], ...]
    verification: Verification
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    integrity: str | None
    #: how the preprocessing step is served ("fused" or "ensemble"); None: the model has none
    pipeline: str | None = None

    def as_dict(self) -> dict[str, Any]:
        v = self.verification
        return {
            "checkpoint": self.checkpoint, "step": self.step, "name": self.name, "version": self.version,
            "model_dir": str(self.model_dir), "format": self.format,
            "skipped": [{"format": f, "reason": r} for f, r in self.skipped],
            "verification": {"rows": v.rows, "max_abs_error": v.max_abs, "max_rel_error": v.max_rel,
                             "atol": v.tolerance.atol, "rtol": v.tolerance.rtol, "ok": v.ok},
            "inputs": list(self.inputs), "outputs": list(self.outputs), "integrity": self.integrity,
            "pipeline": self.pipeline,
        }


def export_checkpoint(source: str, options: ExportOptions, *, environ: Mapping[str, str] | None = None,
                      progress: Callable[[str], None] = lambda _: None) -> ExportResult:
    check_integrity_before(options.repo, options.sign_key)
    ref = resolve(source, step=options.step, environ=environ)
    ranks = ref.manifest.get("world_size", "?")
    progress(f"checkpoint {ref.display} (step {ref.step}, saved by {ranks} rank{'' if ranks == 1 else 's'})")
    recipe = ModelRecipe.from_model_config(ref.manifest.get("model_config"), where=f"{ref.display}/manifest.json")
    model = _rebuild(ref, recipe)
    kwargs = json.dumps(dict(recipe.kwargs))
    progress(f"rebuilt {recipe.factory}(**{kwargs if len(kwargs) < 160 else kwargs[:150] + ' ...}'}) "
             f"and loaded its '{recipe.state_key}' state")
    plan = plan_for(model, recipe)
    client_sample = plan.sample(options.rows, options.seed)
    reference = plan.reference(client_sample)
    sample = plan.preprocess.run(client_sample) if plan.preprocess else client_sample
    name = options.name or default_name(ref, recipe)
    fused = plan.preprocess is not None and (options.pipeline == "fused" or (
        options.pipeline == "auto" and plan.preprocess.fused_model_py is not None))
    # with a preprocessing step, clients call <name>: the one-step model holding the exported file, or the
    # ensemble in front of <name>_model
    core_name = f"{name}_model" if plan.preprocess and not fused else name
    existing = existing_model(options.repo, core_name)
    batching = _batching(options, existing, name)
    candidates = _fused_formats(plan, existing, options.format, name) if fused \
        else formats_for(existing, options.format, FORMATS, name)
    if plan.preprocess and not fused:
        _check_not_fused(options.repo, name)
    if existing is not None and options.format == "auto":
        progress(f"{existing.describe()}: the new version is {existing.format} too")
    skipped: list[tuple[str, str]] = []
    origin = f"exported by `azulite export` from {ref.display} (step {ref.step})"
    with stage(options.repo, core_name, options.version) as staged:
        exported: Exported | None = None
        for fmt in candidates:
            try:
                exported = EXPORTERS[fmt](plan, sample, staged.version_dir, batching.max_batch_size > 0)
                break
            except ExportError as e:
                skipped.append((fmt, e.message))
                progress(f"{fmt}: not possible ({e.message})")
                shutil.rmtree(staged.version_dir, ignore_errors=True)
                staged.version_dir.mkdir()
        if exported is None:
            raise ExportError("no format could export the model: " + "; ".join(f"{f}: {r}" for f, r in skipped),
                              fix="make the model traceable (torch.export / torch.jit.trace), or keep its factory "
                                  "importable and use --format python")
        if fused:  # verified as served: the written model.py, parsing the client's records and running model.onnx
            (staged.version_dir / "model.py").write_text(plan.preprocess.fused_model_py)
            got = _run_fused(staged.root, staged.version)(client_sample)
        else:
            got = exported.run(sample)
        # the config about to be written against the exported file: what it returns, and what an ONNX file declares
        by = f"the {exported.format} export"
        check_returns([got.get(t.name) for t in plan.outputs], plan.outputs, options.rows, where=recipe.where, by=by)
        if exported.format == "onnx":
            check_onnx_file(staged.version_dir / exported.filename, plan.inputs, plan.outputs, batching.max_batch_size,
                            where=recipe.where)
        verification = compare(reference, _outputs(got, reference), options.tolerance, options.rows)
        if not verification.ok:
            bad = [o for o in verification.outputs if not o.ok]
            raise ExportVerificationError(
                f"the {exported.format} export does not match PyTorch: {verification.summary()}; out of tolerance: "
                + ", ".join(f"{o.name} (max abs {o.max_abs:.3g})" for o in bad),
                where=f"model '{name}'", fix="nothing was written; loosen --atol/--rtol only if this error is acceptable")
        platform, backend = {"onnx": (pbtxt.ONNX_PLATFORM, ""), "torchscript": (pbtxt.TORCH_PLATFORM, ""),
                             "python": ("", "python")}["python" if fused else exported.format]
        inputs = list(plan.preprocess.inputs) if fused else _renamed(plan.inputs, exported.input_names)
        config = pbtxt.build(core_name, inputs=inputs, outputs=_renamed(plan.outputs, exported.output_names),
                             batching=batching, platform=platform, backend=backend)
        notes = [f"{origin} as {exported.format}" + (": one Python step preprocessing the records and running "
                                                     "model.onnx (onnxruntime)" if fused else ""),
                 f"verified against PyTorch: {verification.summary()}"]
        text = pbtxt.render(config, notes)
        if existing is None:
            (staged.root / "config.pbtxt").write_text(text)
        else:  # the model's config.pbtxt stays as it is (the user's settings too): the new version must fit it
            check_fits(existing, config, name)
        # the pipeline's models are checked too before this version lands: all of the export, or none of it
        pipeline = _pipeline_configs(options.repo, name, core_name, plan, exported, batching, origin) \
            if plan.preprocess and not fused else []
        version = staged.version
    written = [options.repo / core_name]
    if fused:
        progress(f"raw records in: model '{name}' = one Python step preprocessing them and running its "
                 f"model.{exported.format} (onnxruntime)")
    elif plan.preprocess:
        written += _write_pipeline(options.repo, plan, pipeline)
        progress(f"raw records in: ensemble '{name}' = {name}_preprocess (python) -> {core_name} ({exported.format})")
    integrity = update_integrity(options.repo, written, options.sign_key)
    return ExportResult(checkpoint=ref.display, step=ref.step, name=name, version=version,
                        model_dir=options.repo / core_name, format=exported.format, skipped=tuple(skipped),
                        verification=verification,
                        inputs=tuple(t.name for t in plan.client_inputs) if plan.preprocess else exported.input_names,
                        outputs=tuple(t.name for t in plan.outputs) if plan.preprocess else exported.output_names,
                        integrity=integrity,
                        pipeline=None if not plan.preprocess else "fused" if fused else "ensemble")


def _fused_formats(plan: ServingPlan, existing: ExistingModel | None, requested: str, name: str) -> tuple[str, ...]:
    """The one-step pipeline's model is a Python-backend model running an ONNX file: only onnx, and a new
    version only of a model served that way."""
    assert plan.preprocess is not None
    if plan.preprocess.fused_model_py is None:
        raise ExportError("this model's serving plan has no one-step form (preprocessing and the model in one "
                          "Python step)", where=f"model '{name}'", fix="export with --pipeline ensemble")
    if requested not in ("auto", "onnx"):
        raise ExportError(f"the one-step pipeline runs the model with onnxruntime inside its Python step: "
                          f"--format {requested} cannot be served that way",
                          fix="omit --format (onnx), or export with --pipeline ensemble")
    if existing is not None and existing.format != "python":
        raise ExportError(f"{existing.describe()}: a one-step (Python backend) version cannot join it",
                          where=str(existing.config_path),
                          fix=f"export with --pipeline ensemble (the model's own form), or under another name "
                              f"(--name {name}_fused)")
    return ("onnx",)


def _check_not_fused(repo: Path, name: str) -> None:
    """An ensemble export whose name is taken by a one-step (Python backend) model: refused, naming the form."""
    existing = existing_model(repo, name)
    if existing is not None and existing.format == "python":
        raise ExportError(f"{existing.describe()}: an ensemble cannot add a version to it",
                          where=str(existing.config_path),
                          fix=f"export with --pipeline fused (the model's own form), or under another name "
                              f"(--name {name}_ensemble)")


def _run_fused(model_dir: Path, version: int) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The one-step model.py written in ``model_dir/version``, loaded as a Python backend would (its own
    namespace, initialize with the model's folder), -> its run_batch."""
    path = model_dir / str(version) / "model.py"
    namespace: dict[str, Any] = {"__name__": f"azulite_export_{model_dir.name}", "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - the file just written
    model = namespace["TritonPythonModel"]()
    model.initialize({"model_config": "{}", "model_repository": str(model_dir), "model_version": str(version),
                      "model_name": model_dir.name, "model_instance_kind": "CPU"})
    return model.run_batch


def _outputs(got: dict[str, Any], reference: Mapping[str, Any]) -> dict[str, Any]:
    return {k: got[k] for k in reference}


def _batching(options: ExportOptions, existing: ExistingModel | None, name: str) -> pbtxt.Batching:
    """The batching the export writes: the options', else the existing model's config's (which the new
    version shares), else 64 with dynamic batching. Options that contradict an existing config are refused."""
    if existing is None:
        size = 64 if options.max_batch_size is None else options.max_batch_size
        dynamic = size > 0 if options.dynamic_batching is None else options.dynamic_batching
        return pbtxt.Batching(max_batch_size=size, dynamic=dynamic, max_queue_delay_us=options.max_queue_delay_us or 0)
    old = existing.config
    have = {"--max-batch-size": old.max_batch_size,
            "--dynamic-batching": old.HasField("dynamic_batching"),
            "--max-queue-delay-us": old.dynamic_batching.max_queue_delay_microseconds}
    asked = {"--max-batch-size": options.max_batch_size, "--dynamic-batching": options.dynamic_batching,
             "--max-queue-delay-us": options.max_queue_delay_us}
    clash = [f"{flag} {asked[flag]} (the model's config.pbtxt: {have[flag]})" for flag in have
             if asked[flag] is not None and asked[flag] != have[flag]]
    if clash:
        raise ExportError(f"{existing.describe()}; its config.pbtxt, shared by every version, is kept as it is, "
                          f"so these options cannot apply: {', '.join(clash)}",
                          where=str(existing.config_path),
                          fix=f"omit them (the model's settings are used), edit {existing.config_path} for all "
                              f"versions, or export under another name (--name {name}_new)")
    return pbtxt.Batching(max_batch_size=old.max_batch_size, dynamic=have["--dynamic-batching"],
                          max_queue_delay_us=have["--max-queue-delay-us"])


@dataclass(frozen=True)
class _PipelineModel:
    name: str
    #: config.pbtxt to write; None: the model exists and its config (checked to fit) stays
    text: str | None


def _pipeline_configs(repo: Path, name: str, core_name: str, plan: ServingPlan, exported: Exported,
                      batching: pbtxt.Batching, origin: str) -> list[_PipelineModel]:
    """The configs of ``<name>_preprocess`` (Python backend: raw records -> the model's inputs) and of the
    ensemble ``<name>`` chaining it into the exported model, each checked against the model already there."""
    assert plan.preprocess is not None
    pre_name = f"{name}_preprocess"
    pre = pbtxt.build(pre_name, inputs=list(plan.preprocess.inputs),
                      outputs=_renamed(plan.inputs, exported.input_names), batching=batching, backend="python")
    ens = _ensemble_config(name, pre_name, core_name, plan, exported, batching)
    out = []
    for config, kind, note in ((pre, "python", "the training preprocessing"), (ens, "ensemble", "raw records -> scores")):
        existing = existing_model(repo, config.name)
        formats_for(existing, kind, (kind,), name)
        if existing is not None:
            check_fits(existing, config, name)
        out.append(_PipelineModel(config.name, None if existing else pbtxt.render(config, [f"{origin}: {note}"])))
    return out


def _write_pipeline(repo: Path, plan: ServingPlan, models: list[_PipelineModel]) -> list[Path]:
    """Each of ``models`` a new version, written atomically as the exported model was."""
    assert plan.preprocess is not None
    pre, ens = models
    with stage(repo, pre.name, None) as staged:
        (staged.version_dir / "model.py").write_text(plan.preprocess.model_py)
        for fname, data in plan.preprocess.files.items():
            (staged.version_dir / fname).write_bytes(data)
        if pre.text is not None:
            (staged.root / "config.pbtxt").write_text(pre.text)
    with stage(repo, ens.name, None) as staged:
        if ens.text is not None:
            (staged.root / "config.pbtxt").write_text(ens.text)
    return [repo / pre.name, repo / ens.name]


def _ensemble_config(name: str, pre_name: str, core_name: str, plan: ServingPlan, exported: Exported,
                     batching: pbtxt.Batching) -> Any:
    assert plan.preprocess is not None
    config = pbtxt.build(name, inputs=list(plan.preprocess.inputs),
                         outputs=_renamed(plan.outputs, exported.output_names),
                         batching=pbtxt.Batching(max_batch_size=batching.max_batch_size), platform="ensemble")
    pre = config.ensemble_scheduling.step.add(model_name=pre_name, model_version=-1)
    for t in plan.preprocess.inputs:
        pre.input_map[t.name] = t.name
    for n in exported.input_names:
        pre.output_map[n] = f"_{n}"
    core = config.ensemble_scheduling.step.add(model_name=core_name, model_version=-1)
    for n in exported.input_names:
        core.input_map[n] = f"_{n}"
    for n in exported.output_names:
        core.output_map[n] = n
    return config


def _rebuild(ref: CheckpointRef, recipe: ModelRecipe) -> Any:
    model = recipe.build()
    with tempfile.TemporaryDirectory(prefix="azulite-export-") as tmp:
        local = fetch_verified(ref, Path(tmp))
        load_module_state(model, local, recipe.state_key, where=ref.display)
    return model.eval()


def _renamed(specs: tuple[TensorSpec, ...], names: tuple[str, ...]) -> list[TensorSpec]:
    return [TensorSpec(name=n, dtype=t.dtype, dims=t.dims) for t, n in zip(specs, names)]


def default_name(ref: CheckpointRef, recipe: ModelRecipe) -> str:
    job = ref.manifest.get("job_id")
    if isinstance(job, str) and job:
        return re.sub(r"-\d+$", "", job)
    return re.sub(r"^build_", "", recipe.factory.rpartition(":")[2]) or "model"
