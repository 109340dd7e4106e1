"""pod_entry.py around real torchrun on loopback: a rank's 78 stops torchrun before it restarts the group
and the pod exits 78; ranks that checkpointed after the pod's SIGTERM make it exit 75 (143 for Kubeflow's
ExitCode policy) where torchrun alone exits 1; anything else is torchrun's own code. Then the rendered
pods themselves (the command and args of the Indexed Job and the PyTorchJob, the file from their
ConfigMap) run the same way, and their exit codes meet the policies that read them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from azulite import contract
from azulite.deploy import pod_entry
from azulite.deploy.options import AksOptions
from azulite.deploy.render import render_spec
from azulite.deploy.azureml import AzureMLOptions
from azulite.launch.local.procs import free_port
from tests.deploy.conftest import docs
from tests.launch.jobkit import wait_for

ENTRY = pod_entry.__file__
BIN = str(Path(sys.executable).parent)  # torchrun beside the interpreter, as in an image
RANK_SCRIPT = """
import os, signal, sys
from pathlib import Path

rank, mode, ready = int(os.environ["RANK"]), sys.argv[1], Path(sys.argv[2])
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
# on the stop: a preemptible rank checkpoints and exits 75, another ends as the signal would
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75 if mode == "preempt" else 143))
if mode == "ok":
    sys.exit(0)
if rank == 1 and mode in ("config", "fail"):
    sys.exit(78 if mode == "config" else 3)
(ready / f"rank-{rank}-round-{restart}").touch()
signal.pause()
"""


def env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}


def torchrun(max_restarts: int) -> list[str]:
    return ["torchrun", "--nnodes=1", "--nproc_per_node=2", f"--max_restarts={max_restarts}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--monitor_interval=0.1"]


def command(tmp_path: Path, mode: str, *, max_restarts: int = 3, agent: list[str] | None = None) -> list[str]:
    """torchrun of two ranks running RANK_SCRIPT through the rank runner; under the agent unless ``agent`` is None."""
    (tmp_path / "w.py").write_text(RANK_SCRIPT)
    (tmp_path / "ready").mkdir(exist_ok=True)
    ranks = [ENTRY, "rank", "--python", "--", "w.py", mode, str(tmp_path / "ready")]
    argv = [*torchrun(max_restarts), *ranks]
    if agent is not None:
        argv = [sys.executable, ENTRY, "agent", "--marks", str(tmp_path / "marks"), *agent, "--", *argv]
    return argv


def start(tmp_path: Path, mode: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(command(tmp_path, mode, **kw), cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:  # a failed test leaves nothing running behind it
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"still running after 240 s:\n{out}") from None
    return proc.returncode, out


def marks(tmp_path: Path, prefix: str = pod_entry.SLOT) -> dict[tuple[int, int], int]:
    """(round, rank) -> exit code of each rank process's latest end (or of the 78s), as the ranks recorded them."""
    return {(m["round"], m["rank"]): m["code"] for m in pod_entry.read_marks(str(tmp_path / "marks"), prefix)}


def stop_when_ready(tmp_path: Path, proc: subprocess.Popen, up: int = 2) -> None:
    wait_for(lambda: len(list((tmp_path / "ready").iterdir())) == up or proc.poll() is not None, 120, "ranks up")
    proc.send_signal(signal.SIGTERM)  # the kubelet's stop (an eviction, a drain, a spot node going)


def test_a_ranks_78_stops_torchrun_before_a_restart_and_the_pod_exits_78(tmp_path):
    code, out = finish(start(tmp_path, "config", agent=[]))
    assert code == contract.EXIT_CONFIG, out
    # no second round: rank 1's runner held until the agent's stop reached it, so torchrun never saw a
    # failed group to restart (max_restarts is 3); rank 0 was stopped by that SIGTERM
    assert marks(tmp_path) == {(0, 0): 128 + signal.SIGTERM, (0, 1): contract.EXIT_CONFIG}
    assert marks(tmp_path, pod_entry.CONFIG) == {(0, 1): contract.EXIT_CONFIG}
    assert "rank 1 exited 78" in out and "the pod exits 78" in out


STAND_IN_AGENT = """
import signal, sys
from pathlib import Path
out = Path(sys.argv[1])
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})  # held from here: none is lost before the wait
(out / "ready").touch()
sys.exit(0 if signal.sigtimedwait({signal.SIGUSR2}, 120) else 1)
"""


def test_a_rank_that_exited_78_stays_until_the_stop_reaches_it(tmp_path):
    """The rank's end is what torchrun watches: it comes only after the agent's stop, however slow the agent
    (here a stand-in that only notes the wake-up), so torchrun cannot restart the group first."""
    (tmp_path / "agent.py").write_text(STAND_IN_AGENT)
    agent = subprocess.Popen([sys.executable, str(tmp_path / "agent.py"), str(tmp_path)])
    wait_for(lambda: (tmp_path / "ready").exists(), 60, "the stand-in agent")
    (tmp_path / "marks").mkdir()
    rank = subprocess.Popen([sys.executable, ENTRY, "rank", "--", sys.executable, "-c", "raise SystemExit(78)"],
                            env={**env(), pod_entry.ENV_MARKS: str(tmp_path / "marks"),
                                 pod_entry.ENV_AGENT_PID: str(agent.pid), "RANK": "1"})
    assert agent.wait(timeout=60) == 0  # woken by the rank
    assert marks(tmp_path) == {(0, 1): contract.EXIT_CONFIG}
    assert rank.poll() is None  # holding: its own wait is 60 s
    rank.send_signal(signal.SIGTERM)  # the stop, as torchrun passes it on
    assert rank.wait(timeout=60) == contract.EXIT_CONFIG


@pytest.mark.parametrize("agent, expected", [([], contract.EXIT_PREEMPTED), (["--exit-preempted=143"], 143)])
def test_ranks_that_checkpointed_after_the_pods_stop_make_it_exit_75(tmp_path, agent, expected):
    proc = start(tmp_path, "preempt", agent=agent)
    stop_when_ready(tmp_path, proc)
    code, out = finish(proc)
    assert code == expected, out
    assert marks(tmp_path) == {(0, 0): contract.EXIT_PREEMPTED, (0, 1): contract.EXIT_PREEMPTED}
    assert f"the pod exits {expected}" in out


def _own_pid_namespace() -> bool:
    """Whether this machine lets us start a process as PID 1 of a new PID namespace (root, or user namespaces)."""
    if shutil.which("unshare") is None:
        return False
    p = subprocess.run(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c",
                        "import os; raise SystemExit(0 if os.getpid() == 1 else 1)"], capture_output=True, timeout=60)
    return p.returncode == 0


@pytest.mark.skipif(not _own_pid_namespace(), reason="cannot create a PID namespace here (needs root or user namespaces)")
@pytest.mark.parametrize("mode, expected", [("preempt", contract.EXIT_PREEMPTED), ("config", contract.EXIT_CONFIG)])
def test_as_pid_1_of_its_own_namespace_as_in_a_container(tmp_path, mode, expected):
    """In a container the agent is PID 1, which the kernel gives no default action for SIGTERM: only a
    handler's signal arrives. Run it so (unshare: a PID namespace, the agent its first process) and stop
    it as the kubelet does, with SIGTERM to that process."""
    argv = ["unshare", "--pid", "--fork", "--kill-child", *command(tmp_path, mode, agent=[])]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if mode == "preempt":
        wait_for(lambda: len(list((tmp_path / "ready").iterdir())) == 2, 120, "both ranks up")
        (agent,) = psutil.Process(proc.pid).children()  # PID 1 inside, its own pid out here
        agent.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == expected, out


def test_without_the_agent_torchrun_says_1_for_the_same_preemption(tmp_path):
    """Why the agent exists (and a check that torchrun still behaves so): the ranks' 75s are lost."""
    proc = start(tmp_path, "preempt")
    stop_when_ready(tmp_path, proc)
    code, out = finish(proc)
    assert code == 1, out


def test_success_and_ordinary_failures_are_torchruns_own(tmp_path):
    ok, fail = tmp_path / "ok", tmp_path / "fail"
    ok.mkdir(), fail.mkdir()
    code, out = finish(start(ok, "ok", agent=[]))
    assert code == 0, out
    assert marks(ok) == {(0, 0): 0, (0, 1): 0}
    # an ordinary failure is left to torchrun's restarts (here 1), then its exit 1 is the pod's
    code, out = finish(start(fail, "fail", max_restarts=1, agent=[]))
    assert code == 1, out
    assert marks(fail) == {(1, 0): 128 + signal.SIGTERM, (1, 1): 3}  # each process's latest end: round 1


@pytest.mark.parametrize("torchrun_code, last, config, expected", [
    (1, [75, 143], [], 75),       # checkpointed, and stopped
    (1, [75, 3], [], 1),          # a real failure beside a 75 is a failure
    (1, [75, 75], [(0, 1)], 78),  # a 78 seen in any round wins
    (0, [0, 0], [], 0),           # torchrun succeeded
    (0, [75, 0], [], 0),          # ... whatever a rank said before
    (137, [], [], 137),           # no ranks ran: torchrun's own code
    (1, [143, 137], [], 1),       # stopped, but nothing checkpointed: not a preemption
    (1, [143, 143], [], 1),       # e.g. ranks re-formed after an elastic 75: their latest ends are what count
    (75, [], [], 75),             # a command run once per pod (a TFJob's task) checkpointed: 143 for Kubeflow
    (78, [], [], 78),             # ... or met an error no restart fixes
])
def test_verdict(torchrun_code, last, config, expected):
    ends = [{"round": 0, "rank": k, "code": c, "ended_at": float(k)} for k, c in enumerate(last)]
    errors = [{"round": r, "rank": k, "code": 78, "ended_at": 0.5} for r, k in config]
    code, why = pod_entry.verdict(torchrun_code, ends, errors)
    assert code == expected, why
    assert pod_entry.verdict(torchrun_code, ends, errors, 143)[0] == (143 if expected == 75 else expected)


def test_its_exit_codes_are_the_contracts():
    assert (pod_entry.EXIT_PREEMPTED, pod_entry.EXIT_CONFIG) == (contract.EXIT_PREEMPTED, contract.EXIT_CONFIG)
    # stdlib only: the image need not hold azulite
    imports = [line.split()[1] for line in Path(ENTRY).read_text().splitlines() if line.startswith(("import ", "from "))]
    assert all(m.split(".")[0] in sys.stdlib_module_names for m in imports), imports


@pytest.mark.parametrize("args, words", [
    (["agent", "torchrun"], "no '--' before the command"),
    (["agent", "--"], "no command after '--'"),
    (["agent", "--exit-preempted=300", "--", "true"], "from 1 to 255, not '300'"),
    (["agent", "--marks"], "no '--'"),
    (["agent", "--verbose", "--", "true"], "unknown option '--verbose'"),
    (["ranks", "--", "true"], "the first word is agent or rank"),
])
def test_a_mangled_command_line_is_one_clear_line_and_exit_2(args, words):
    p = subprocess.run([sys.executable, ENTRY, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_missing_launcher_or_command_exits_as_a_shell_would(tmp_path):
    p = subprocess.run([sys.executable, ENTRY, "agent", "--marks", str(tmp_path), "--", "no-such-torchrun"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 127 and "cannot run 'no-such-torchrun'" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, ENTRY, "rank", "--", "./no-such-script.sh"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == 127 and "check the job's command" in p.stderr


# ---- the rendered pods ---------------------------------------------------------------------------------

RENDERED_MODE = "rendered-mode"
PLAIN_SCRIPT = """
import json, os, signal, sys
from pathlib import Path

mode, ready = sys.argv[1], Path(sys.argv[2])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75 if mode == "preempt" else 143))
if mode == "config":
    sys.exit(78)
task = json.loads(os.environ["TF_CONFIG"])["task"] if "TF_CONFIG" in os.environ else None
(ready / (f"{task['type']}-{task['index']}" if task else f"node-{os.environ['NODE_RANK']}")).touch()
signal.pause()
"""


PLAIN = "python w.py ${{inputs.mode}} ${{inputs.ready}}"
SHELL = f"{PLAIN} && echo done"  # not the last command: bash cannot exec it in its own place


def rendered(tmp_path: Path, flavor: str, port: int, distributed: bool = True,
             command: str = PLAIN) -> tuple[dict, dict, dict]:
    """(ConfigMap, the job object, its container) for a 2-rank job on one node whose ranks run RANK_SCRIPT,
    or (``distributed=False``) a command run once per pod, PLAIN_SCRIPT; ``command`` SHELL: through bash."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "w.py").write_text(RANK_SCRIPT if distributed else PLAIN_SCRIPT)
    spec = {"name": "entry", "code": "code", "command": command,
            "inputs": {"mode": RENDERED_MODE, "ready": str(tmp_path / "ready")},
            "environment": {"image": "reg.io/train:1"},
            "resources": {"instance_type": "Standard_NC24rs_v3", "instance_count": 1},
            "outputs": {"checkpoints": {"path": "az://ckpt/run1"}}}
    if distributed:
        spec["distribution"] = {"type": "pytorch", "process_count_per_instance": 2}
    if flavor == "tfjob":
        spec["distribution"] = {"type": "tensorflow", "worker_count": 2, "parameter_server_count": 1}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    files = render_spec(tmp_path / "job.yaml", "aks", AksOptions(flavor=flavor, rdzv_port=port), AzureMLOptions())
    objects = [d for text in files.values() for d in docs(text)]
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap"]
    job = objects[-1]
    pod = job["spec"]["template"]["spec"] if job["kind"] == "Job" else \
        job["spec"].get("pytorchReplicaSpecs", job["spec"].get("tfReplicaSpecs"))["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    entry = tmp_path / "mounted" / "pod_entry.py"  # the ConfigMap, as the kubelet mounts it
    entry.parent.mkdir()
    entry.write_text(cm["data"]["pod_entry.py"])
    container["argv"] = [a.replace(f"{mount['mountPath']}/pod_entry.py", str(entry)) for a in
                         container["command"] + container["args"]]
    return cm, job, container


def run_pod(tmp_path: Path, container: dict, extra_env: dict[str, str], mode: str, stop: bool = False,
            up: int = 2) -> tuple[int, str]:
    """The container's command as the kubelet runs it: its env, ``$(VAR)`` expanded from it, in the
    (local) code folder; the image's python3 is this interpreter. ``mode`` replaces the rendered input."""
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    values.update({e["name"]: "0" for e in container["env"] if "valueFrom" in e})  # the pod's index, here 0
    values.update(extra_env)
    argv = [a.replace("$(MASTER_ADDR)", values.get("MASTER_ADDR", "")) for a in container["argv"]]
    assert argv[0] == "python3" and " ".join(argv).count(RENDERED_MODE) == 1
    argv = [sys.executable, *(a.replace(RENDERED_MODE, mode) for a in argv[1:])]
    assert argv[2] == "agent"  # its marks in this test's folder (the pod's default is a volume of its own)
    argv[3:3] = ["--marks", str(tmp_path / "marks")]
    argv = [sys.executable if a == "python" else a for a in argv]  # a command's own `python`: this one
    shutil.rmtree(tmp_path / "ready", ignore_errors=True)
    (tmp_path / "ready").mkdir()
    proc = subprocess.Popen(argv, cwd=tmp_path / "code", env={**env(), **values}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if stop:
        stop_when_ready(tmp_path, proc, up)
    return finish(proc)


@pytest.mark.parametrize("cmd", [PLAIN, SHELL])  # SHELL: each rank's bash keeps its script's 75 (the trap)
def test_the_indexed_jobs_pod_exits_78_and_its_policy_fails_the_job(tmp_path, cmd):
    port = free_port()
    cm, job, container = rendered(tmp_path, "indexed-job", port, command=cmd)
    assert ("bash" in container["argv"]) == (cmd == SHELL)
    code, out = run_pod(tmp_path, container, {"MASTER_ADDR": "127.0.0.1"}, "config")
    assert code == contract.EXIT_CONFIG, out
    rules = {r["action"]: r for r in job["spec"]["podFailurePolicy"]["rules"] if "onExitCodes" in r}
    assert rules["FailJob"]["onExitCodes"] == {"containerName": container["name"], "operator": "In",
                                               "values": [code]}
    code, out = run_pod(tmp_path, container, {"MASTER_ADDR": "127.0.0.1"}, "preempt", stop=True)
    assert code == contract.EXIT_PREEMPTED, out
    assert rules["Ignore"]["onExitCodes"]["values"] == [code]
    assert cm["metadata"]["name"] == f"{job['metadata']['name']}-entry"


def test_the_pytorchjobs_pod_exits_as_kubeflows_exit_code_policy_reads(tmp_path):
    """The operator's ExitCode policy recreates a pod that exited 130/137/143/138 and fails the job on any
    other code (training-operator's IsRetryableExitCode)."""
    cm, job, container = rendered(tmp_path, "pytorchjob", free_port())
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "ExitCode"
    pet = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"], "PET_RDZV_BACKEND": "c10d",
           "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}  # what the operator sets (elasticPolicy, nprocPerNode)
    code, _ = run_pod(tmp_path, container, pet, "preempt", stop=True)
    assert code == 143  # retryable: recreated, rescheduled
    code, out = run_pod(tmp_path, container, pet, "config")
    assert code == contract.EXIT_CONFIG and code not in (130, 137, 138, 143), out  # permanent: the job fails
    assert json.dumps(cm["data"]["pod_entry.py"]) == json.dumps(Path(ENTRY).read_text())


def test_an_unusable_marks_folder_is_said_and_the_pod_exits_as_torchrun_does(tmp_path):
    (tmp_path / "file").write_text("")
    p = subprocess.run([sys.executable, ENTRY, "agent", "--marks", str(tmp_path / "file" / "marks"), "--",
                        sys.executable, "-c", "raise SystemExit(3)"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "cannot use" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("cmd", [PLAIN, SHELL])
def test_a_command_run_once_per_pod_gets_the_stop_and_its_code_is_the_pods(tmp_path, cmd):
    """Without torchrun (no `distribution`), the agent is PID 1 for the command: it passes the kubelet's
    SIGTERM on to the command's group (PID 1 itself would get none without a handler; through bash, the
    script gets it too, and bash waits for it) and exits with the command's code."""
    cm, job, container = rendered(tmp_path, "indexed-job", free_port(), distributed=False, command=cmd)
    assert container["argv"][2:4] == ["agent", "--"] and "torchrun" not in container["argv"]
    code, out = run_pod(tmp_path, container, {}, "preempt", stop=True, up=1)
    assert code == contract.EXIT_PREEMPTED, out
    code, out = run_pod(tmp_path, container, {}, "config")
    name = "bash" if cmd == SHELL else Path(sys.executable).name
    assert code == contract.EXIT_CONFIG and f"{name} exited 78; it exits 78" in out, out


def test_a_tfjobs_worker_exits_as_kubeflows_exit_code_policy_reads(tmp_path):
    """A TFJob's task runs once under the agent, with the TF_CONFIG the operator sets: a worker whose script
    checkpointed after the kubelet's SIGTERM exits 143 (recreated), one that met a 78 fails the job."""
    cm, job, container = rendered(tmp_path, "tfjob", free_port(), distributed=False)
    assert container["name"] == "tensorflow" and "torchrun" not in container["argv"]
    assert container["argv"][2:5] == ["agent", "--exit-preempted=143", "--"]
    workers = [f"entry-worker-{i}.default.svc:2222" for i in range(2)]
    tf_config = json.dumps({"cluster": {"worker": workers, "ps": ["entry-ps-0.default.svc:2222"]},
                            "task": {"type": "worker", "index": 1}, "environment": "cloud"})
    code, out = run_pod(tmp_path, container, {"TF_CONFIG": tf_config}, "preempt", stop=True, up=1)
    assert code == 143 and (tmp_path / "ready" / "worker-1").exists(), out
    assert "exited 75 (checkpointed, preempted): the pod exits 143" in out
    code, out = run_pod(tmp_path, container, {"TF_CONFIG": tf_config}, "config")
    assert code == contract.EXIT_CONFIG, out
