"""``azulite job nodes`` through the real console script, on a real elastic job (torchrun agents on loopback):
a node's agent killed, the job goes on alone, ``--add 1`` brings the node back and the job ends on both;
and the refusals: nothing lost, over max_nodes, a fixed-size job, a job that is not running."""

import json

import psutil
import pytest

from azulite.launch.records import JobState
from tests.cli.test_job_cli import az
from tests.launch.jobkit import backend, home, spec_2x1, wait_done, wait_for, write_job

pytestmark = pytest.mark.slow
_ = home  # fixture

# Every life of a rank leaves a file saying its world size; the ranks all-reduce until they are two again
# after the test said the node returned. A lost peer fails the all-reduce: torchrun restarts the group on
# the node left (min_nodes 1), and again with both once the returned node's agent joins.
GROWING = """
import os, time
from pathlib import Path
import torch, torch.distributed as dist
from azulite import train

state = Path(os.environ["AZULITE_OUTPUT_STATE"])
ctx = train.init(seed=0)
(state / f"up-ws{ctx.world_size}-rank{ctx.rank}-{os.getpid()}").touch()
t = torch.ones(1)
while not (ctx.world_size == 2 and (state / "returned").exists()):
    dist.all_reduce(t)
    time.sleep(0.05)
dist.all_reduce(t)  # both ranks leave together
train.shutdown(ctx)
"""

ELASTIC = """max_restarts: 3
    elastic: {min_nodes: 1}
    outputs:
      state: {type: uri_folder, path: state}"""


def nodes_json(job_id: str) -> dict:
    return json.loads(az("job", "nodes", job_id, "--json", check=0).stdout)


def test_nodes_brings_a_lost_node_back_to_an_elastic_job(home, tmp_path):
    spec = write_job(tmp_path / "el", GROWING, spec_2x1(extra=ELASTIC))
    state = tmp_path / "el" / "state"
    job_id = json.loads(az("job", "submit", str(spec), "--json", check=0).stdout)["id"]
    b = backend()
    wait_for(lambda: len(list(state.glob("up-ws2-*"))) == 2 or b.status(job_id).state.terminal, 180,
             "both ranks up at world size 2")

    view = nodes_json(job_id)
    assert view["elastic"] and (view["min_nodes"], view["max_nodes"]) == (1, 2)
    assert [n["state"] for n in view["nodes"]] == ["running", "running"] and view["lost"] == []
    p = az("job", "nodes", job_id, "--add", "1")  # nothing lost: nothing to add
    assert p.returncode == 2 and "none is lost" in p.stderr and "Traceback" not in p.stderr, p.stderr

    # node 1 goes, agent and rank at once (a machine lost)
    agent = psutil.Process(next(n["pid"] for n in view["nodes"] if n["name"] == "node-1"))
    for proc in [agent, *agent.children(recursive=True)]:
        proc.kill()
    wait_for(lambda: b.nodes(job_id).lost == ["node-1"], 60, "node-1 seen lost")
    view = nodes_json(job_id)
    assert view["lost"] == ["node-1"] and next(n for n in view["nodes"] if n["name"] == "node-1")["exit_code"]
    assert view["job_state"] == "running" and view["running"] == ["node-0"]
    wait_for(lambda: list(state.glob("up-ws1-rank0-*")), 180, "the survivor to go on alone at world size 1")
    shown = az("job", "nodes", job_id, check=0).stdout
    assert "lost" in shown and f"azulite job nodes {job_id} --return" in shown, shown

    p = az("job", "nodes", job_id, "--add", "2")  # one lost: two would be 3 nodes, over max_nodes 2
    assert p.returncode == 2 and "max_nodes" in p.stderr and "--add 1" in p.stderr, p.stderr
    p = az("job", "nodes", job_id, "--add", "1", "--return")
    assert p.returncode == 2 and "--add and --return" in p.stderr, p.stderr

    (state / "returned").touch()
    back = json.loads(az("job", "nodes", job_id, "--add", "1", "--json", check=0).stdout)
    assert back["started"] == ["node-1"] and back["lost"] == [] and back["running"] == ["node-0", "node-1"], back
    assert next(n for n in back["nodes"] if n["name"] == "node-1")["pid"] != agent.pid  # a new agent

    rec = wait_done(job_id, timeout=240)
    assert rec.state == JobState.SUCCEEDED and rec.attempt == 1, rec.reason  # grown back inside the attempt
    assert rec.reason == "all 2 ranks exited 0", rec.reason
    assert len(list(state.glob("up-ws2-*"))) >= 4  # both ranks started again at world size 2
    messages = [e["message"] for e in rec.events]
    assert any(m.startswith("node-1 lost") for m in messages) and any(m.startswith("node-1 back") for m in messages)

    p = az("job", "nodes", job_id, "--return")  # ended: nothing to bring back
    assert p.returncode == 2 and "not running" in p.stderr, p.stderr
    view = nodes_json(job_id)
    assert [n["state"] for n in view["nodes"]] == ["finished", "finished"], view


def test_nodes_refuses_a_job_of_fixed_size(home, tmp_path):
    # a plain command job (no distribution: one process, no torchrun): the cheapest job of fixed size
    spec = write_job(tmp_path / "fixed", "print('done')\n", "name: t\ncode: .\ncommand: python run.py\n")
    job_id = json.loads(az("job", "submit", str(spec), "--json", check=0).stdout)["id"]
    p = az("job", "nodes", job_id, "--return")
    assert p.returncode == 2 and "fixed node count" in p.stderr and "elastic" in p.stderr, p.stderr
    assert wait_done(job_id).state == JobState.SUCCEEDED
    view = nodes_json(job_id)
    assert not view["elastic"] and [n["state"] for n in view["nodes"]] == ["finished"], view
