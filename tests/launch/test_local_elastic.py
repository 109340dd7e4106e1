"""An elastic job (``elastic: {min_nodes: 1}``, 2 nodes) through a node's loss and return, with real torchrun
agents on loopback: it goes on at world size 1 from its last checkpoint, grows back to 2 when the node
returns, and the samples its ranks consumed are exactly the data set's order — none skipped, none seen
twice — while the loss keeps falling.

The script holds at fixed points (files in its ``state`` output) so the test acts at known steps: it kills
node 1 while both ranks hold at world size 2, and brings the node back while the survivor holds at
world size 1. Every rank appends what it did to ``steps-<pid>.jsonl``: when each life started and from which
checkpoint step, then per step its world size, the sample ids it trained on and the full-data loss.
"""

import json
from pathlib import Path

import psutil
import pytest
import torch

from azulite.launch.records import JobState
from azulite.spec.loader import load_job
from tests.launch.jobkit import backend, home, spec_2x1, wait_done, wait_for, write_job

pytestmark = pytest.mark.slow
_ = home  # fixture

DATASET, PER_RANK, SEED = 256, 4, 3

ELASTIC_TRAIN = f"""
import json, os, time
from pathlib import Path
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from azulite import train

state = Path(os.environ["AZULITE_OUTPUT_STATE"])
ctx = train.init(seed=0)
g = torch.Generator().manual_seed(1)
x = torch.randn({DATASET}, 8, generator=g)
y = x @ torch.randn(8, 1, generator=g)
model = torch.nn.Linear(8, 1)
net = DDP(model) if ctx.distributed else model
opt = torch.optim.SGD(net.parameters(), lr=0.05)
sampler = train.ResumableSampler({DATASET}, ctx, seed={SEED})
progress = train.Progress()
ckpt = train.Checkpointer(
    train.CheckpointConfig(uri=os.environ["AZULITE_OUTPUT_CKPT"], interval=2, keep_last=2, async_save=False),
    ctx, state={{"model": train.ModelState(net, opt), "data": sampler, "progress": progress}})
resumed = ckpt.load_latest() or 0
preemption = train.Preemption(ctx).install()  # SIGTERM (torchrun restarting us to grow): save, exit 75
rec = open(state / f"steps-{{os.getpid()}}.jsonl", "a")
def log(**kw):
    rec.write(json.dumps({{"t": time.time(), "rank": ctx.rank, "ws": ctx.world_size, **kw}}) + "\\n")
    rec.flush()
log(event="start", resumed=resumed)

# phases, told apart by the test's files: before node 1 is killed, while it is away, once it is back
phase = "back" if (state / "returned").exists() else "away" if (state / "killed").exists() else "before"
hold_at = {{"before": resumed + 3, "away": resumed + 5, "back": None}}[phase]
end = resumed + 5 if phase == "back" else 10**6
while progress.step < end:
    ids = list(iter(sampler))[:{PER_RANK}]
    loss = torch.nn.functional.mse_loss(net(x[ids]), y[ids])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sampler.advance({PER_RANK} * ctx.world_size)
    progress.step += 1
    with torch.no_grad():
        full = torch.nn.functional.mse_loss(model(x), y).item()
    log(event="step", step=progress.step, ids=ids, loss=full)
    if progress.step == hold_at:
        (state / f"hold-{{phase}}-ws{{ctx.world_size}}-rank{{ctx.rank}}").touch()
        while not preemption.requested and not (phase == "before" and (state / "killed").exists()):
            time.sleep(0.05)
    if preemption.should_stop():  # with a dead peer this collective fails: torchrun restarts the group
        ckpt.save(progress.step, sync=True, raise_on_error=True)
        preemption.exit()
    ckpt.maybe_save(progress.step)
ckpt.save(progress.step, sync=True, raise_on_error=True)
ckpt.close()
log(event="end", step=progress.step)
preemption.uninstall()
train.shutdown(ctx)
"""

SPEC_EXTRA = """max_restarts: 3
    elastic: {min_nodes: 1}
    outputs:
      state: {type: uri_folder, path: state}
      ckpt: {type: uri_folder, path: ckpt}"""


def lineage(state: Path) -> dict[int, dict[int, dict]]:
    """step -> rank -> the record that counts: replayed in time order, a life resuming from step r drops
    what any earlier life did after r (rolled back: its checkpoint never covered it)."""
    records = [json.loads(line) for f in state.glob("steps-*.jsonl") for line in f.read_text().splitlines()]
    kept: dict[int, dict[int, dict]] = {}
    for r in sorted(records, key=lambda r: r["t"]):
        if r["event"] == "start":
            kept = {s: v for s, v in kept.items() if s <= r["resumed"]}
        elif r["event"] == "step":
            kept.setdefault(r["step"], {})[r["rank"]] = r
    return dict(sorted(kept.items()))


def test_an_elastic_job_shrinks_resumes_its_data_where_it_was_and_grows_back(home, tmp_path, monkeypatch):
    monkeypatch.setenv("AZULITE_NODE_RETURN_S", "-1")  # the node comes back when the test says so
    spec = write_job(tmp_path / "el", ELASTIC_TRAIN, spec_2x1(extra=SPEC_EXTRA))
    state = tmp_path / "el" / "state"
    b = backend()
    rec = b.submit(load_job(spec))
    wait_for(lambda: len(list(state.glob("hold-before-ws2-rank*"))) == 2 or b.status(rec.id).state.terminal,
             180, "both ranks to hold at world size 2")

    # node 1 goes, agent and ranks at once (a machine lost), while both ranks hold at world size 2
    agent = next(p for p in b.status(rec.id).processes if p.kind == "agent" and p.name == "node-1")
    node = psutil.Process(agent.pid)
    for p in [node, *node.children(recursive=True)]:
        p.kill()
    (state / "killed").touch()
    wait_for(lambda: list(state.glob("hold-away-ws1-rank0")) or b.status(rec.id).state.terminal,
             180, "the survivor to train on alone and hold at world size 1")

    (state / "returned").touch()
    b.replace_nodes(rec.id)
    rec = wait_done(rec.id, timeout=240)
    assert rec.state == JobState.SUCCEEDED and rec.attempt == 1, rec.reason  # inside the attempt: no requeue
    assert rec.reason == "all 2 ranks exited 0", rec.reason  # grown back: both ranks ended the job
    messages = [e["message"] for e in rec.events]
    assert any(m.startswith("node-1 lost") for m in messages) and any(m.startswith("node-1 back") for m in messages)

    steps = lineage(state)
    assert list(steps) == list(range(1, len(steps) + 1)), sorted(steps)
    worlds = [next(iter(ranks.values()))["ws"] for ranks in steps.values()]
    # every step was taken by every rank of its world
    assert all(sorted(ranks) == list(range(w)) for ranks, w in zip(steps.values(), worlds)), steps
    # stretches of one world size: 2 -> 1 (node 1 lost) -> 2 (back); a slow agent at the very start may
    # add a first stretch at world size 1, which torchrun grows to 2 as it grows the job back later
    runs: list[list[int]] = []
    for i, w in enumerate(worlds):
        if runs and worlds[i - 1] == w:
            runs[-1].append(i)
        else:
            runs.append([i])
    assert [worlds[r[0]] for r in runs][-3:] == [2, 1, 2], worlds
    assert len(runs[-2]) == 5 and len(runs[-1]) == 5, worlds  # the script's own counts: the lineage is whole

    # the data: each step's ranks took the next PER_RANK x world samples of the epoch's order, together
    order = torch.randperm(DATASET, generator=torch.Generator().manual_seed(SEED)).tolist()
    position = 0
    for step, ranks in steps.items():
        world = len(ranks)
        for rank, r in ranks.items():
            assert r["ids"] == order[position + rank :: world][:PER_RANK], (step, rank)
        position += PER_RANK * world
    consumed = [i for ranks in steps.values() for r in ranks.values() for i in r["ids"]]
    assert len(consumed) == len(set(consumed)) == position  # none seen twice, none skipped
    assert sorted(consumed) == sorted(order[:position])

    # and it converges through both changes: each world's stretch ends lower than the one before it
    loss = [ranks[0]["loss"] for ranks in steps.values()]
    ends = [loss[r[-1]] for r in runs]
    assert all(a > b for a, b in zip(ends, ends[1:])), (worlds, loss)
    assert loss[-1] < 0.5 * loss[0], loss
