"""The ``azulite`` command. Each subcommand group lives in its own module; this one only assembles them
and maps :class:`~azulite.errors.AzuliteError` to an exit code and a message (never a traceback).

Every ``azulite`` call imports all the subcommand modules, so they import typer, rich and light azulite
modules at the top and the heavy ones (the job-spec models, the price catalog, numpy, prometheus-client,
fsspec, torch) inside the commands that use them: tests/cli/test_main.py checks a fresh interpreter."""

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
from azulite.cli import audit as _audit
from azulite.cli import repo as _repo
from azulite.cli import bench as _bench
from azulite.cli import doctor as _doctor
from azulite.cli import observe as _observe
from azulite.cli import rules as _rules
from azulite.cli import dashboard as _dashboard
from azulite.cli import agent as _agent
from azulite.cli import job_nodes as _job_nodes



def _flags_show_no_type() -> None:
    """typer 0.2x's help prints every option's type, a flag's as ``<bool>``, which reads as a value to pass
    (``--wait true`` is then refused as an extra argument). A flag takes none: its type is not shown. A
    typer without ``display_type_rich`` (older help, which shows no type for flags) is left as it is."""
    option = getattr(typer.core, "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if shown is None or getattr(shown, "azulite", False):
        return

    def display_type_rich(self, ctx):  # type: ignore[no-untyped-def]
        return None if getattr(self, "is_flag", False) else shown(self, ctx)

    display_type_rich.azulite = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich  # type: ignore[union-attr]


_flags_show_no_type()

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
app.add_typer(_audit.app, name="audit")
app.add_typer(_repo.app, name="repo")
app.add_typer(_bench.app, name="bench")
_doctor.register(app)
_observe.register(app)
app.add_typer(_rules.app, name="rules")
_dashboard.register(app)
_agent.register(app)
_job_nodes.register(_job.app)


# click's UsageError and ClickException, found through typer's public BadParameter: typer vendors click as
# the private typer._click in recent releases and uses click itself in older ones
_UsageError = typer.BadParameter.__mro__[1]
_ClickException = _UsageError.__mro__[1]


def _usage_error(exc: Exception) -> None:
    """Click's own parse errors (unknown option, missing argument, a value of the wrong type) in the house's
    shape: the usage line, then ``error:`` and a ``fix:`` line naming the --help that lists what is accepted."""
    if type(exc).__name__ == "NoArgsIsHelpError":  # `azulite job` alone: typer prints the help itself
        from typer import rich_utils

        rich_utils.rich_format_error(exc)
        return
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "azulite"
    out = console.err()
    if ctx is not None:
        out.print(escape(ctx.get_usage()), markup=True)
    out.print(f"[bold red]error:[/] {escape(where)}: {escape(exc.format_message())}\n"
              f"  fix: run `{escape(where)} --help` for what it accepts", markup=True)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    # not standalone: click's usage errors come back here to get a fix line (standalone, typer prints them
    # in its own panel and exits); no command returns a value, so what comes back is None or Exit's code
    try:
        rv = typer.main.get_command(app).main(args=argv, prog_name="azulite", standalone_mode=False)
    except _UsageError as exc:
        _usage_error(exc)
        sys.exit(exc.exit_code)
    except _ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except typer.Abort:
        console.err().print("Aborted.")
        sys.exit(1)
    except AzuliteError as exc:
        console.err().print(f"[bold red]error:[/] {escape(str(exc))}", markup=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
