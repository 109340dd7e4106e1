"""Nodes of a running elastic job, and bringing lost ones back (``azulite job nodes JOB --add N``).

An elastic job (``elastic: {min_nodes}``) that loses a node goes on with the nodes left; torchrun grows the
group back when an agent for the lost node joins the job's rendezvous (torchrun's own scale-up, as when a
machine returns to a ``--nnodes=MIN:MAX`` job, or Kubeflow brings a PyTorchJob's replicas back up to
``elasticPolicy.maxReplicas``). The supervisor does that by itself after ``AZULITE_NODE_RETURN_S``; a user
asks for it now through a request file in the job folder:

    <job dir>/node-requests/<id>.json   {"id": ..., "count": N or null (every lost node)}   written by the CLI
    <job dir>/node-requests/<id>.reply  {"id": ..., "started": ["node-1"], "refused": null | "why"}   supervisor

One file per request (renamed into place), so two shells asking at once each get their own answer, and the
answer says what happened (a node started, or why not: the job was finishing, the attempt ended) rather
than the asker guessing from the job's events. The view of the nodes (:func:`node_view`) is read from the
job store, where the supervisor records each agent's exit as soon as it sees it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from azulite.errors import LaunchError
from azulite.launch.records import JobRecord

REQUESTS_DIR = "node-requests"


@dataclass(frozen=True)
class NodeState:
    """One simulated node (its torchrun agent) in the job's current attempt."""

    name: str  # node-0, node-1, ...
    node: int
    #: running (its agent is alive), lost (its agent ended non-zero: killed, a machine gone), finished
    #: (exited 0), starting (no agent recorded yet)
    state: str
    pid: int | None
    exit_code: int | None


@dataclass(frozen=True)
class NodeView:
    job_id: str
    job_state: str
    attempt: int
    min_nodes: int
    max_nodes: int
    elastic: bool
    nodes: tuple[NodeState, ...]
    #: the nodes a request (``add_nodes``) just started
    started: tuple[str, ...] = ()

    @property
    def lost(self) -> list[str]:
        return [n.name for n in self.nodes if n.state == "lost"]

    @property
    def running(self) -> list[str]:
        return [n.name for n in self.nodes if n.state == "running"]

    def to_json(self) -> dict:
        return {**asdict(self), "nodes": [asdict(n) for n in self.nodes], "lost": self.lost, "running": self.running}


def node_view(rec: JobRecord, node_range: tuple[int, int], elastic: bool) -> NodeView:
    """The nodes of ``rec``'s current attempt from its agents' process records: an agent with an exit code
    recorded has ended (0: finished; else lost while the job runs, stopped or failed once it has ended);
    one without is running (its supervisor records the exit
    within a poll of seeing it). Launchers named otherwise than per node (``mpirun``, TF's ``worker-i``)
    are listed under their own names."""
    agents = sorted((p for p in rec.processes if p.kind == "agent" and p.attempt == rec.attempt),
                    key=lambda p: (p.node, p.name))
    per_node = all(a.name.startswith("node-") for a in agents)
    ended = rec.state.terminal  # a node of a job that ended is not lost (nothing would bring it back)
    nodes = []
    for a in agents:
        if a.exit_code is None:
            state = "ended" if ended else "running"
        elif a.exit_code == 0:
            state = "finished"
        elif not ended:
            state = "lost"
        else:  # stopped by the supervisor (a cancel, a timeout, a peer's failure), or failed by itself
            state = "stopped" if a.exit_code in (128 + 15, 128 + 9, 130) else "failed"
        nodes.append(NodeState(a.name, a.node, state, a.pid, a.exit_code))
    if per_node:  # not started yet: each node's agent is recorded as it starts
        seen = {a.name for a in agents}
        nodes += [NodeState(f"node-{k}", k, "never started" if ended else "starting", None, None)
                  for k in range(node_range[1]) if f"node-{k}" not in seen]
        nodes.sort(key=lambda n: n.node)
    return NodeView(rec.id, rec.state.value, rec.attempt, node_range[0], node_range[1], elastic, tuple(nodes))


# ---- the request files --------------------------------------------------------------------------------
def write_request(job_dir: str | Path, count: int | None) -> str:
    """Ask the job's supervisor to bring ``count`` lost nodes back (None: all of them); returns the id."""
    folder = Path(job_dir) / REQUESTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    rid = f"{time.time_ns()}-{secrets.token_hex(3)}"  # sorts by time: the supervisor answers oldest first
    tmp = folder / f".{rid}.tmp"
    tmp.write_text(json.dumps({"id": rid, "count": count}))
    os.replace(tmp, folder / f"{rid}.json")
    return rid


def take_requests(job_dir: str | Path) -> list[dict]:
    """The supervisor's side: every pending request, oldest first, removed from the folder (each is answered
    exactly once, with :func:`write_reply`)."""
    folder = Path(job_dir) / REQUESTS_DIR
    if not folder.is_dir():
        return []
    out = []
    for p in sorted(folder.glob("*.json")):
        try:
            req = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        finally:
            p.unlink(missing_ok=True)
        count = req.get("count")
        out.append({"id": str(req.get("id", p.stem)), "count": count if isinstance(count, int) and count > 0 else None})
    return out


def write_reply(job_dir: str | Path, rid: str, *, started: list[str], refused: str | None = None) -> None:
    folder = Path(job_dir) / REQUESTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{rid}.reply.tmp"
    tmp.write_text(json.dumps({"id": rid, "started": started, "refused": refused}))
    os.replace(tmp, folder / f"{rid}.reply")


def wait_reply(job_dir: str | Path, rid: str, *, gone: Callable[[], str | None], timeout: float = 60.0) -> dict:
    """The supervisor's answer to request ``rid`` (the reply file is removed once read). ``gone`` says why no
    answer can come (the job ended, its supervisor died), checked between looks; ``timeout`` is a safety net
    only: a live supervisor answers within a poll (0.2 s)."""
    path = Path(job_dir) / REQUESTS_DIR / f"{rid}.reply"
    deadline = time.monotonic() + timeout
    checked = 0.0
    while True:
        try:
            reply = json.loads(path.read_text())
            path.unlink(missing_ok=True)
            return reply
        except FileNotFoundError:
            pass
        now = time.monotonic()
        if now - checked > 1.0:
            checked = now
            why = gone()
            if why is not None and not path.exists():
                (Path(job_dir) / REQUESTS_DIR / f"{rid}.json").unlink(missing_ok=True)
                raise LaunchError(f"no node was brought back: {why}", fix="see `azulite job show` for the job's state")
        if now > deadline:
            (Path(job_dir) / REQUESTS_DIR / f"{rid}.json").unlink(missing_ok=True)
            raise LaunchError(f"the job's supervisor did not answer the node request within {timeout:g} s",
                              where=str(path.parent), fix="check the job with `azulite job show` and its supervisor.log")
        time.sleep(0.05)
