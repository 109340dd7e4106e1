"""The ``azulite`` command. Each subcommand group lives in its own module; this one only assembles them
and maps :class:`~azulite.errors.AzuliteError` to an exit code and a message (never a traceback)."""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from azulite.cli import console
from azulite.errors import AzuliteError
from azulite.cli import job as _job
from azulite.cli import serve as _serve
from azulite.cli import catalog as _catalog
from azulite.cli import cluster as _cluster
from azulite.cli import deploy as _deploy
from azulite.cli import export as _export
from azulite.cli import keys as _keys
from azulite.cli import repo as _repo
from azulite.cli import bench as _bench
from azulite.cli import doctor as _doctor
from azulite.cli import observe as _observe
from azulite.cli import rules as _rules
from azulite.cli import dashboard as _dashboard
from azulite.cli import agent as _agent
from azulite.cli import job_nodes as _job_nodes

app = typer.Typer(
    name="azulite",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help=(
        "Train models distributed, survive failures, serve them behind a Triton-compatible endpoint.\n\n"
        "Examples:\n\n"
        "  azulite job submit examples/ddp/job.yaml --wait\n\n"
        "  azulite job show ddp-1 --json\n\n"
        "  azulite serve model_repository/ --http-port 8000 --grpc-port 8001"
    ),
)
app.add_typer(_job.app, name="job")
_serve.register(app)
_catalog.register(app)
_cluster.register(app)
app.add_typer(_deploy.app, name="deploy")
app.add_typer(_deploy.cluster_app, name="cluster")
_export.register(app)
app.add_typer(_keys.app, name="keys")
app.add_typer(_repo.app, name="repo")
app.add_typer(_bench.app, name="bench")
_doctor.register(app)
_observe.register(app)
app.add_typer(_rules.app, name="rules")
_dashboard.register(app)
_agent.register(app)
_job_nodes.register(_job.app)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        app(args=argv, prog_name="azulite")
    except AzuliteError as exc:
        console.err().print(f"[bold red]error:[/] {escape(str(exc))}", markup=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
