"""``azulite job nodes JOB [--add N | --return]``: an elastic job's nodes, and bringing lost ones back.

What a torchrun user does by starting another agent with the job's ``--rdzv-id`` (and a Kubeflow user by
scaling a PyTorchJob's replicas back up to ``elasticPolicy.maxReplicas``), in one verb: the job's
supervisor starts a new agent for each lost node, and torchrun grows the group back at its next round.
Its own module because ``job.py`` holds the job lifecycle commands already.
"""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from azulite.cli import console
from azulite.cli.job import _backend_for
from azulite.cli.job_view import styled_state
from azulite.errors import AzuliteError

_NODE_STYLE = {"running": "bold blue", "lost": "bold red", "finished": "green", "starting": "cyan",
               "failed": "red", "stopped": "yellow", "ended": "dim", "never started": "dim"}


def nodes(
    job_id: str = typer.Argument(..., help="Job id of an elastic job (spec `elastic: {min_nodes: N}`)."),
    add: Optional[int] = typer.Option(None, "--add", help="Bring this many lost nodes back now."),
    return_: bool = typer.Option(False, "--return", help="Bring every lost node back now."),
    json_: bool = typer.Option(False, "--json", help="The nodes as JSON."),
) -> None:
    """Show an elastic job's nodes (running / lost / finished); --add N or --return brings lost nodes back
    now instead of after AZULITE_NODE_RETURN_S: a new agent joins the job's rendezvous and the training group
    grows back at torchrun's next round (the script resumes from its last checkpoint on the larger world).

    Examples:

      azulite job nodes ddp-3

      azulite job nodes ddp-3 --add 1

      azulite job nodes ddp-3 --return --json
    """
    if add is not None and return_:
        raise AzuliteError("--add and --return both given", where="--add/--return",
                           fix="--add N brings N lost nodes back, --return every lost node: use one")
    b = _backend_for(job_id)
    if not hasattr(b, "add_nodes"):
        raise AzuliteError(f"the {b.name} backend does not manage a job's nodes", where=job_id,
                           fix="on AKS an elastic PyTorchJob's replicas come back through its elasticPolicy; "
                               "use the local backend for `job nodes`")
    changing = add is not None or return_
    view = b.add_nodes(job_id, add) if changing else b.nodes(job_id)
    if json_:
        print(json.dumps(view.to_json()))
        return
    c = console.out()
    kind = f"elastic {view.min_nodes}-{view.max_nodes} nodes" if view.elastic else f"{view.max_nodes} node(s), fixed"
    c.print(f"[bold]{view.job_id}[/]  {styled_state(view.job_state)}  attempt {view.attempt}  {kind}")
    t = Table("node", "state", "agent pid", "exit", box=None)
    for n in view.nodes:
        t.add_row(n.name, f"[{_NODE_STYLE.get(n.state, 'white')}]{n.state}[/]", str(n.pid or "-"),
                  "-" if n.exit_code is None else str(n.exit_code))
    c.print(t)
    if changing:
        c.print(f"back: {', '.join(view.started)}; the job grows back at torchrun's next rendezvous round "
                f"(`azulite job logs {view.job_id} --follow`)")
    elif view.lost and view.job_state == "running":
        c.print(f"lost: {', '.join(view.lost)}  ->  azulite job nodes {view.job_id} --return")


def register(job_app: typer.Typer) -> None:
    job_app.command("nodes")(nodes)
