"""``azulite export JOB_ID|CHECKPOINT_URI --to REPO`` and ``azulite config generate MODEL_FILE``.

Thin: a job id is resolved to its ``outputs.checkpoints`` location here (the job store is the CLI's to
read), everything else is :mod:`azulite.export`. Errors are AzuliteErrors (exit 2 for bad input, 1 for an
export that does not verify); nothing is half-written into the repository either way.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from azulite.contract import CHECKPOINT_OUTPUT
from azulite.errors import CheckpointError, JobNotFound, SpecError

config_app = typer.Typer(
    no_args_is_help=True,
    help=(
        "Model configurations (config.pbtxt) for Triton model repositories.\n\n"
        "Examples:\n\n"
        "  azulite config generate model_repository/dlrm/1/model.onnx --max-batch-size 64 --dynamic-batching\n\n"
        "  azulite config generate model.pt -o model_repository/m/config.pbtxt"
    ),
)

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*-\d+$")


def _checkpoint_uri(source: str) -> tuple[str, dict[str, str]]:
    """A job id -> its checkpoint location and its environment (Blob credentials); a URI stays itself."""
    if "://" in source or "/" in source or os.path.exists(source) or not _JOB_ID.match(source):
        return source, dict(os.environ)
    from azulite.launch.backend import get_backend
    from azulite.launch.settings import Settings
    from azulite.spec.job import Output

    settings = Settings.from_environ()
    try:
        rec = get_backend(settings.backend, settings).status(source)
    except JobNotFound:  # a usage error, exit 2 as `azulite job show` (was a CheckpointError, exit 1)
        raise JobNotFound(f"no job {source!r} and no checkpoint directory of that name",
                          fix="pass a job id from `azulite job list`, or a checkpoint directory / az:// URI") from None
    raw = (rec.spec.get("outputs") or {}).get(CHECKPOINT_OUTPUT)
    if raw is None:
        raise CheckpointError(f"job {source} has no outputs.{CHECKPOINT_OUTPUT}: it wrote no checkpoints to export",
                              where=source, fix=f"declare outputs.{CHECKPOINT_OUTPUT} in the job spec and pass it "
                                                "to train.CheckpointConfig(uri=...)")
    location = Output.model_validate(raw).location(rec.job_dir, CHECKPOINT_OUTPUT)
    return location, {**os.environ, **rec.spec.get("environment_variables", {})}


def export(
    source: str = typer.Argument(..., help="A job id (ddp-3), a checkpoint location, or one step directory."),
    to: Path = typer.Option(..., "--to", help="The Triton model repository to write into (created if missing)."),
    name: Optional[str] = typer.Option(None, "--name", help="Model name (default: the job's name)."),
    version: Optional[int] = typer.Option(None, "--version", help="Version folder (default: the next one)."),
    format_: str = typer.Option("auto", "--format", help="auto | onnx | torchscript | python."),
    step: Optional[int] = typer.Option(None, "--step", help="Checkpoint step (default: the newest committed)."),
    max_batch_size: Optional[int] = typer.Option(
        None, "--max-batch-size", help="config.pbtxt max_batch_size (0: no batching). Default: 64 for a new "
                                       "model, the model's own for a new version."),
    dynamic_batching: Optional[bool] = typer.Option(
        None, "--dynamic-batching/--no-dynamic-batching",
        help="Default: on for a new model that batches, the model's own for a new version."),
    max_queue_delay_us: Optional[int] = typer.Option(None, "--max-queue-delay-us", help="Dynamic batching queue delay."),
    atol: float = typer.Option(1e-5, "--atol", help="Verification: absolute tolerance."),
    rtol: float = typer.Option(1e-4, "--rtol", help="Verification: relative tolerance."),
    rows: int = typer.Option(64, "--rows", help="Verification: sample rows."),
    sign_key: Optional[Path] = typer.Option(None, "--sign-key",
                                            help="Private key (PEM) re-signing the repository's integrity manifest."),
    pipeline: str = typer.Option(
        "auto", "--pipeline",
        help="A model served from raw records (DLRM): fused = one Python step preprocessing them and running the "
             "ONNX model; ensemble = the preprocessing step and the model chained by an ensemble; auto = fused "
             "where the model has that form."),
    json_: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
) -> None:
    """Export a trained checkpoint into a Triton model repository: rebuild the model from the checkpoint's
    own metadata, export it (ONNX, else TorchScript, else Python backend), write config.pbtxt, and verify it
    against PyTorch (max abs / rel error; fails past the tolerance, writing nothing).

    A new version of a model already in the repository keeps its config.pbtxt (Triton's one config per
    model): it is exported in the model's format and must have its inputs, outputs and batch size.

    Examples:

      azulite export ddp-1 --to model_repository/

      azulite export runs/ckpt/step-00000040 --to model_repository/ --name mlp --format torchscript
    """
    from azulite.export import ExportOptions, Tolerance, export_checkpoint

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    # else a traceback after the model was rebuilt
    _check_folder_arg(to, "--to", "give a folder (created if missing), e.g. --to model_repository/")
    # the flags first: a bad number was refused only after the checkpoint was read and the model rebuilt
    options = ExportOptions(repo=to, name=name, version=version, format=format_, step=step,
                            max_batch_size=max_batch_size, dynamic_batching=dynamic_batching,
                            max_queue_delay_us=max_queue_delay_us, tolerance=Tolerance(atol=atol, rtol=rtol), rows=rows,
                            sign_key=sign_key, pipeline=pipeline)
    uri, environ = _checkpoint_uri(source)
    # a path the user typed (a job's own location may not exist before its first checkpoint: the export
    # says so with its fix)
    if uri == source and ("://" not in uri or uri.startswith("file://")):
        local = Path(uri[len("file://"):] if uri.startswith("file://") else uri).expanduser()
        if not local.exists():  # was "no committed checkpoint under ... (no step directories)", exit 1
            raise SpecError(f"checkpoint location {uri!r} does not exist", field="SOURCE",
                            fix="pass a job id from `azulite job list`, a checkpoint directory or an az:// URI")
        if not local.is_dir():
            raise SpecError(f"checkpoint location {uri!r} is a file, not a checkpoint directory", field="SOURCE",
                            fix="pass the checkpoint directory (it holds step-NNNNNNNN/ folders) or one step folder")
    result = export_checkpoint(uri, options, environ=environ, progress=lambda m: err.print(m, markup=False))
    if json_:
        print(json.dumps(result.as_dict()))
        return
    out = Console(highlight=False, soft_wrap=True)
    why = "" if not result.skipped else " (" + "; ".join(f"{f} not possible: {r}" for f, r in result.skipped) + ")"
    served = {"fused": ", served by one Python step that parses raw records and runs it",
              "ensemble": ", served behind an ensemble: a parsing step, then the model"}.get(result.pipeline or "", "")
    out.print(f"exported {result.checkpoint} as [bold]{result.format}[/]{served}{why}", markup=True)
    where = (f"ensemble '{result.name}' version {result.version} (the {result.format} step in "
             f"{result.model_dir}/{result.version})" if result.pipeline == "ensemble" else
             f"{result.model_dir}/{result.version}  model '{result.name}' version {result.version}")
    out.print(f"  -> {where}; inputs {', '.join(result.inputs)}; outputs {', '.join(result.outputs)}", markup=False)
    v = result.verification
    out.print(f"  verified: max abs error {v.max_abs:.3g}, max rel error {v.max_rel:.3g} over {v.rows} rows "
              f"(atol {v.tolerance.atol:g}, rtol {v.tolerance.rtol:g})", markup=False)
    if result.integrity:
        out.print(f"  integrity: {result.integrity}", markup=False)


@config_app.command("generate")
def generate(
    model_file: Path = typer.Argument(..., help="An ONNX (.onnx) or TorchScript (.pt) model file."),
    name: Optional[str] = typer.Option(None, "--name", help="Model name (default: the repository folder's)."),
    max_batch_size: Optional[int] = typer.Option(None, "--max-batch-size",
                                                 help="Default: 8 if the model has a variable first dimension, else 0."),
    dynamic_batching: bool = typer.Option(False, "--dynamic-batching", help="Add dynamic_batching { }."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write here instead of printing."),
) -> None:
    """Write a complete config.pbtxt for a model file, offline (no server): names, datatypes, dims,
    batching. For TorchScript, which records no types or shapes, the comments list the fields to check.

    Examples:

      azulite config generate repo/dlrm/1/model.onnx --max-batch-size 64 --dynamic-batching -o repo/dlrm/config.pbtxt
    """
    from azulite.export import generate as gen

    if model_file.is_dir():  # was "model file DIR does not exist"
        raise SpecError(f"{str(model_file)!r} is a directory", field="MODEL_FILE",
                        fix=f"name the model file in it, e.g. {model_file / 'model.onnx'}")
    if output is not None:
        if output.is_dir():  # was a traceback, leaving a .tmp file beside the folder
            raise SpecError("is a directory", file=str(output), field="--output",
                            fix=f"name the file, e.g. -o {output / 'config.pbtxt'}")
        _check_folder_arg(output.parent, "--output", f"write it elsewhere, e.g. -o model_repository/m/{output.name}")
    result = gen(model_file, name=name, max_batch_size=max_batch_size, dynamic_batching=dynamic_batching)
    text = result.text()
    if output is None:
        print(text, end="")
    else:
        tmp = output.with_name(f".{output.name}.tmp")
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, output)
        Console(stderr=True, highlight=False).print(f"wrote {output}", markup=False)
    if result.needs_user:
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        err.print("check these fields (the model file cannot tell them):", markup=False)
        for note in result.needs_user:
            err.print(f"  - {note}", markup=False)


def _check_folder_arg(folder: Path, flag: str, fix: str) -> None:
    """A folder the command creates if missing: refused when it, or a folder above it, is a file."""
    for p in (folder, *folder.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file, not a folder" if p == folder else f"cannot be created: {str(p)!r} is a file"
                raise SpecError(f"{str(folder)!r} {what}", field=flag, fix=fix)
            return


def register(app: typer.Typer) -> None:
    """Adds ``export`` and the ``config`` group to the top-level app."""
    app.command("export", no_args_is_help=True)(export)
    app.add_typer(config_app, name="config")
