"""``azulite job`` through the real console script: the DDP example 2x2 to success with identical params,
errors without tracebacks (exit 2), show/logs/list --json, concurrent submits from two shells."""

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.launch.jobkit import FAILING_RANK, REPO, SLEEPER, home, spec_2x1, wait_done, write_job

_ = home
AZULITE = [str(Path(sys.executable).parent / "azulite")]  # the installed console script


def az(*args, timeout=300, check=None):
    p = subprocess.run([*AZULITE, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                       env={**os.environ, "COLUMNS": "200"})
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


@pytest.mark.slow
def test_ddp_example_2x2_succeeds_with_identical_params(home):
    p = az("job", "submit", "examples/ddp/job.yaml", "--wait", "--set", "inputs.steps=10")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "succeeded" in p.stdout
    job_id = re.search(r"(ddp-\d+)", p.stdout).group(1)
    show = json.loads(az("job", "show", job_id, "--json", check=0).stdout)
    assert show["state"] == "succeeded" and show["exit_code"] == 0 and show["attempt"] == 1
    ranks = [x for x in show["processes"] if x["kind"] == "rank"]
    # global rank = NODE_RANK * process_count_per_instance + LOCAL_RANK, as Azure ML numbers them
    assert sorted((x["node"], x["local_rank"], x["rank"]) for x in ranks) == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    assert {x["node"] for x in ranks} == {0, 1} and all(x["exit_code"] == 0 and x["pid"] for x in ranks)
    last = {x["rank"]: Path(x["log"]).read_text().strip().splitlines()[-1] for x in ranks}
    assert all(v.startswith("final_params_sha256=") for v in last.values()), last
    assert len(set(last.values())) == 1, last  # all ranks ended with identical parameters
    # each simulated node ran in its own working directory
    cwds = {re.search(r"cwd (\S+)", Path(x["log"]).read_text()).group(1) for x in ranks}
    assert len(cwds) == 2
    logs = az("job", "logs", job_id, "--rank", "0", check=0).stdout
    assert "step 10 loss" in logs and "step 11" not in logs  # --set inputs.steps=10 reached the command
    lst = [json.loads(line) for line in az("job", "list", "--json", check=0).stdout.splitlines()]
    assert [j["id"] for j in lst] == [job_id]


@pytest.mark.slow
def test_failed_rank_shows_exit_code_and_log_tail(home, tmp_path):
    spec = write_job(tmp_path / "f", FAILING_RANK, spec_2x1())
    p = az("job", "submit", str(spec), "--wait")
    assert p.returncode == 3, p.stdout + p.stderr  # --wait exits with the failed rank's code
    job_id = re.search(r"(t-\d+)", p.stdout).group(1)
    show = az("job", "show", job_id, check=0).stdout
    assert "failed" in show and "rank 1" in show
    assert "last 20 lines of rank 1" in show and "rank 1: something broke" in show and "rank 1 line 29" in show
    d = json.loads(az("job", "show", job_id, "--json", check=0).stdout)
    assert d["exit_code"] == 3 and d["failed_rank"] == 1
    assert d["failed_rank_log_tail"][-1] == "rank 1: something broke" and len(d["failed_rank_log_tail"]) == 20


@pytest.mark.parametrize(
    "args,expect",
    [
        (["job", "submit", "examples/nope/job.yaml"], "job spec not found"),
        (["job", "validate", "examples/ddp/job.yaml", "--set", "distribution.type=horovod"], "unknown distribution type"),
        (["job", "submit", "examples/ddp/job.yaml", "--set", "instance_count=0"], "instance_count"),
        (["job", "show", "nope-1"], "no job 'nope-1'"),
        (["job", "logs", "nope-1"], "no job 'nope-1'"),
        (["job", "wait", "nope-1", "--timeout", "-5"], "'--timeout'"),  # was read as 0: wait forever
        # blamed AZULITE_K8S_FLAVOR; and without --backend kubernetes the job ran locally, the flag dropped
        (["job", "submit", "examples/ddp/job.yaml", "--backend", "kubernetes", "--flavor", "pytorchjb"],
         "--flavor: 'pytorchjb' is not a flavor"),
        (["job", "submit", "examples/ddp/job.yaml", "--flavor", "pytorchjob"], "--flavor chooses the Kubernetes objects"),
    ],
)
def test_user_errors_exit_2_without_traceback(home, args, expect):
    p = az(*args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert expect in p.stderr and "fix:" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout


def test_validate_ok_and_json(home):
    p = az("job", "validate", "examples/ddp/job.yaml", check=0)
    assert "4 rank(s)" in p.stdout
    d = json.loads(az("job", "validate", "examples/ddp/job.yaml", "--json", check=0).stdout)
    assert d["distribution"] == {"type": "pytorch", "process_count_per_instance": 2}


def test_help_has_examples():
    p = az("job", "--help", check=0)
    assert "azulite job submit examples/ddp/job.yaml --wait" in p.stdout
    for cmd in ("submit", "list", "show", "logs", "cancel", "preempt", "validate"):
        assert cmd in p.stdout


@pytest.mark.slow
def test_two_shells_submitting_at_once(home, tmp_path):
    spec = write_job(tmp_path / "c", "print('hi')\n", spec_2x1(nodes=1))
    procs = [subprocess.Popen([*AZULITE, "job", "submit", str(spec), "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for _ in range(4)]
    ids = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        ids.append(json.loads(out)["id"])
    assert sorted(ids) == ["t-1", "t-2", "t-3", "t-4"]
    for i in ids:
        assert wait_done(i).state.value == "succeeded"
    every = [json.loads(line) for line in az("job", "list", "--json", check=0).stdout.splitlines()]
    newest = [json.loads(line) for line in az("job", "list", "--limit", "2", "--json", check=0).stdout.splitlines()]
    assert len(every) == 4 and newest == every[:2]  # newest first, cut at --limit
    assert [j["id"] for j in every] == [j["id"] for j in sorted(every, key=lambda j: j["created_at"], reverse=True)]


TICKER = """
import os, time
for i in range(5):
    print(f"tick {i} rank {os.environ['RANK']}", flush=True)
    time.sleep(0.3)
"""


@pytest.mark.slow
def test_logs_follow_streams_until_the_job_ends(home, tmp_path):
    spec = write_job(tmp_path / "tick", TICKER, spec_2x1(nodes=1, per_node=2))
    job_id = json.loads(az("job", "submit", str(spec), "--json", check=0).stdout)["id"]
    out = az("job", "logs", job_id, "--follow", timeout=180, check=0).stdout.splitlines()
    for r in (0, 1):
        assert [l for l in out if l.startswith(f"[rank {r}] tick")] == [f"[rank {r}] tick {i} rank {r}" for i in range(5)]
    assert wait_done(job_id).state.value == "succeeded"


@pytest.mark.slow
def test_cancel_from_the_cli(home, tmp_path):
    from tests.launch.jobkit import SLEEPER, job_procs, wait_for

    spec = write_job(tmp_path / "s", SLEEPER, spec_2x1(nodes=1, per_node=2))
    job_id = json.loads(az("job", "submit", str(spec), "--json", check=0).stdout)["id"]
    job_dir = Path(json.loads(az("job", "show", job_id, "--json", check=0).stdout)["job_dir"])
    wait_for(lambda: (job_dir / "nodes/node-0/started-1").exists(), 120, "rank 1 to start")
    assert json.loads(az("job", "cancel", job_id, "--json", check=0).stdout) == {"id": job_id, "state": "canceled",
                                                                               "already_ended": False}
    assert not job_procs({job_id})
    p = az("job", "preempt", job_id)
    assert p.returncode == 2 and "not running" in p.stderr


def test_wait_times_out_with_124_then_reports_the_outcome(home, tmp_path):
    spec = write_job(tmp_path / "s", SLEEPER, spec_2x1(nodes=1, per_node=1,
                                                       extra="outputs: {checkpoints: {type: uri_folder}}"))
    job = json.loads(az("job", "submit", str(spec), "--json", check=0).stdout)["id"]
    p = az("job", "wait", job, "--checkpoint", "--timeout", "1", check=124)
    assert f"timed out after 1 s waiting for a committed checkpoint of {job}" in p.stderr
    p = az("job", "wait", job, "--timeout", "1", "--json", check=124)  # a script gets the record as it stands
    assert json.loads(p.stdout)["state"] in ("queued", "running")
    az("job", "cancel", job, check=0)
    p = az("job", "wait", job, "--json", check=130)  # the outcome's exit code, as submit --wait
    assert json.loads(p.stdout)["state"] == "canceled"
    p = az("job", "wait", "nope-9", check=2)  # an unknown id: a message, not a traceback
    assert "nope-9" in p.stderr and "Traceback" not in p.stderr


GATED = """
import os, time
print("step 1 loss 0.5", flush=True)
while not os.path.exists({gate!r}):  # the test opens the gate once it has seen the progress line
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_submit_wait_shows_progress_and_job_commands_check_their_arguments(home, tmp_path):
    gate = tmp_path / "go"
    spec = write_job(tmp_path / "g", GATED.format(gate=str(gate)), spec_2x1(nodes=1, per_node=2))
    p = subprocess.Popen([*AZULITE, "job", "submit", str(spec), "--wait"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO)
    killer = threading.Timer(300, p.kill)  # a safety net only
    killer.start()
    try:
        seen = []
        for line in p.stderr:  # not a terminal: progress comes as lines
            seen.append(line)
            if "rank 0: step 1 loss 0.5" in line:
                break
        assert "rank 0: step 1 loss 0.5" in seen[-1], seen
        job_id = re.search(r"(t-\d+)", "".join(seen)).group(1)
        r = az("job", "logs", job_id, "--rank", "7", check=2)
        assert f"job {job_id} has no rank 7" in r.stderr and "its ranks are 0, 1" in r.stderr
        r = az("job", "wait", job_id, "--checkpoint", "--timeout", "600", check=2)  # at once, not at the end
        assert "outputs.checkpoints" in r.stderr
        gate.touch()
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    finally:
        killer.cancel()
        p.kill()
        p.wait()
    r = az("job", "cancel", job_id, check=0)
    assert f"{job_id} had already ended (succeeded): nothing to cancel" in r.stdout
    listed = [json.loads(line) for line in az("job", "list", "--json", check=0).stdout.splitlines()]
    assert [j["id"] for j in listed] == [job_id] and not {"processes", "attempts", "events"} & set(listed[0])


def az_piped(*args):
    """As a CI log sees it: not a terminal, no COLUMNS."""
    return subprocess.run([*AZULITE, *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={k: v for k, v in os.environ.items() if k != "COLUMNS"})


@pytest.mark.slow
def test_errors_are_never_wrapped_and_tables_not_cut_outside_a_terminal(home, tmp_path):
    p = az_piped("job", "validate", "examples/ddp/job.yaml", "--set", "instance_count=1")
    assert p.returncode == 2
    first = p.stderr.splitlines()[0]
    assert first.startswith("error: ") and first.endswith("disagree; set one of them"), p.stderr
    name = "a-job-whose-name-alone-is-wider-than-eighty-columns-of-a-terminal-" + "x" * 20
    spec = write_job(tmp_path / "long", "print('hi')\n", spec_2x1(nodes=1).replace("name: t", f"name: {name}"))
    job_id = json.loads(az_piped("job", "submit", str(spec), "--json").stdout)["id"]
    assert wait_done(job_id).state.value == "succeeded"
    listed = az_piped("job", "list").stdout
    assert job_id in listed and "…" not in listed, listed


def test_list_limit_below_one_is_a_usage_error(home):
    # `-n 0` printed an empty table with exit 0 (and -1 every job): it reads as "no jobs"
    for n in ("0", "-1"):
        p = az("job", "list", "-n", n, check=2)
        assert "--limit" in p.stderr and "greater than or equal to 1" in " ".join(p.stderr.split()).replace("│", "")
    az("job", "list", "-n", "1", check=0)


def test_azulite_home_that_is_a_file_is_an_error(tmp_path, monkeypatch):
    f = tmp_path / "home"
    f.write_text("")
    monkeypatch.setenv("AZULITE_HOME", str(f))
    for args in (("list",), ("show", "x-1")):
        p = az("job", *args, check=2)  # was a FileExistsError traceback, exit 1
        assert "the azulite home is a file, not a folder" in p.stderr and "Traceback" not in p.stderr


def test_azulite_home_that_cannot_be_created_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("AZULITE_HOME", str(tmp_path / "file" / "home"))
    (tmp_path / "file").write_text("")  # a folder under a file cannot be made (as /proc/x for anyone)
    p = az("job", "list", check=2)  # was mkdir's traceback
    assert "cannot create the azulite home" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("command, said", [
    # each passed validate and failed at run time with the shell's "Bad substitution"
    ("python a.py ${{input.x}}", "'${{input.x}}', which is not a reference azulite fills in"),
    ("python a.py ${{inputs.x}", "'${{inputs.x}', which is not a reference azulite fills in"),
    ("python a.py ${{search_space.y}}", "belongs in a sweep job's trial"),
])
def test_validate_refuses_a_reference_azulite_cannot_fill(home, tmp_path, command, said):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"command: {command}\ninputs: {{x: 1}}\n")
    p = az("job", "validate", str(spec), check=2)
    assert said in p.stderr and "job.yaml:1 (command)" in p.stderr
    spec.write_text("command: echo ${HOME} ${{inputs.x}} $((1+1))\ninputs: {x: 1}\n")  # the shell's own ${...} stay
    az("job", "validate", str(spec), check=0)


@pytest.mark.parametrize("outputs, said", [
    ("{o: {type: uri_folder, path: afile}}", "afile is a file, and a uri_folder output is a folder"),
    ("{o: {type: uri_folder, path: afile/sub}}", "cannot be created:"),
    # os.access says yes to root there: the job failed in its supervisor with a bare FileNotFoundError
    ("{o: {type: uri_folder, path: /proc/nope}}", "/proc/nope cannot be created: /proc takes no new folder"),
    ("{o: {type: uri_folder, path: az://results/run1, mode: uplaod}}", "(outputs.o.mode): 'uplaod' is not allowed"),
])
def test_validate_refuses_an_output_that_cannot_be_written(home, tmp_path, outputs, said):
    (tmp_path / "afile").write_text("")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"command: python a.py\noutputs: {outputs}\n")
    p = az("job", "validate", str(spec), check=2)  # a FileExistsError at run time; azure-ai-ml refused the mode
    assert said in p.stderr, p.stderr


def test_a_timeout_of_0_says_it_must_be_more(home, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("command: python a.py\ntimeout: 0\n")
    p = az("job", "validate", str(spec), check=2)  # was "0 is not a duration"
    assert "job.yaml:2 (timeout): 0 must be more than 0 seconds" in p.stderr and "leave it out" in p.stderr


@pytest.mark.parametrize("variables, name, said", [
    ('{"A=B": y}', "A=B", "'A=B' is not an environment variable name"),  # failed inside the supervisor
    ('{FOO: "${{inputs.x}}"}', "FOO", "azulite fills no ${{...}} in environment_variables"),  # the process saw the text
    ("{MASTER_PORT: abc}", "MASTER_PORT", "MASTER_PORT 'abc' is not a TCP port"),  # refused only at submit
])
def test_validate_refuses_environment_variables_a_process_cannot_have(home, tmp_path, variables, name, said):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"command: python a.py\ninputs: {{x: 1}}\nenvironment_variables: {variables}\n")
    p = az("job", "validate", str(spec), check=2)
    assert said in p.stderr and f"job.yaml:3 (environment_variables.{name})" in p.stderr, p.stderr
    assert "see the Jobs section" not in p.stderr
    spec.write_text("command: python a.py\nenvironment_variables: {1: x, MASTER_PORT: 29500}\n")  # 1 is a name
    az("job", "validate", str(spec), check=0)


@pytest.mark.slow
def test_ctrl_c_while_waiting_leaves_the_job_running_and_says_so(home, tmp_path):
    import signal

    from tests.launch.jobkit import wait_for

    spec = write_job(tmp_path / "s", SLEEPER, spec_2x1(nodes=1, per_node=1))
    # SIGINT as a terminal's Ctrl-C gives it: a shell's background job (CI runs `make test` under one) starts
    # with SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    p = subprocess.Popen([*AZULITE, "job", "submit", str(spec), "--wait"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: json.loads(az("job", "list", "--json", check=0).stdout.splitlines()[0])["state"] == "running"
                 if az("job", "list", "--json", check=0).stdout.strip() else False, 120, "the job to run")
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    job = json.loads(az("job", "list", "--json", check=0).stdout.splitlines()[0])
    assert p.returncode == 130 and f"stopped waiting; {job['id']} goes on (azulite job cancel {job['id']}" in err, err
    assert job["state"] == "running"
    az("job", "cancel", job["id"], check=0)


def test_validate_says_the_shape_the_launcher_will_run(home):
    # a TF job was "2 node(s) x 1 process(es) = 5 rank(s)"; an elastic one showed no range
    p = az("job", "validate", "examples/tensorflow/job.yaml", "--set", "distribution.worker_count=5", check=0)
    assert "tensorflow 5 worker(s) on 2 node(s)" in p.stdout
    p = az("job", "validate", "examples/ddp/job.yaml", "--set", "elastic.min_nodes=1", check=0)
    assert "1-2 node(s) (elastic) x 2 process(es) = 2-4 rank(s)" in p.stdout


@pytest.mark.parametrize("kind, said", [("commnd", "did you mean type: command?"),
                                        ("pipeline", "job type 'pipeline' is not one azulite runs")])
def test_a_job_type_azulite_does_not_run_is_named(home, tmp_path, kind, said):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"type: {kind}\ncommand: python a.py\n")  # commnd ran, and rendered, as a command job
    p = az("job", "validate", str(spec), check=2)
    assert said in p.stderr and "job.yaml:1 (type)" in p.stderr


def test_a_log_tail_is_read_from_the_end_cut_and_shown_not_obeyed(tmp_path):
    """A rank that wrote 20 MB without a newline made `job show` print all of it, and a rank's escape
    sequences and NULs went to the terminal as they were."""
    from azulite.cli.job_view import log_tail

    log = tmp_path / "rank-1.log"
    log.write_bytes(b"early\n" * 5 + b"x" * 5_000_000 + b"\n" + b"y" * 3000 + b"\n\x1b[2J\x00gone\n")
    tail = log_tail(str(log))
    assert tail == ["y" * 1000 + " ... (2000 more characters)", "\\x1b[2J\\x00gone"]
    assert sum(len(line) for line in log_tail(str(log))) < 2000


def test_wait_for_a_checkpoint_counts_only_the_jobs_own(home, tmp_path):
    """A job that failed at once, its checkpoint location holding another job's checkpoint: `job wait
    --checkpoint` exited 0 as if it had committed one."""
    from azulite.train import CheckpointConfig, Checkpointer, ModelState, init

    location = tmp_path / "shared-ck"
    other = init({"AZULITE_JOB_ID": "other-1"})
    import torch

    Checkpointer(CheckpointConfig(uri=str(location)), other, {"m": ModelState(torch.nn.Linear(2, 2))}).save(1, sync=True)
    spec = write_job(tmp_path / "f", "raise SystemExit(3)\n", spec_2x1(
        nodes=1, per_node=1, extra=f"outputs: {{checkpoints: {{type: uri_folder, path: '{location}'}}}}"))
    job = json.loads(az("job", "submit", str(spec), "--json", check=0).stdout)["id"]
    p = az("job", "wait", job, "--checkpoint", "--timeout", "600", check=1)
    assert f"{job} ended (failed) without a committed checkpoint" in p.stderr


def test_submit_warns_of_variables_the_launcher_replaces_and_says_what_master_port_pins(tmp_path):
    from azulite.cli.job import environment_notes
    from azulite.spec.job import JobSpec

    spec = JobSpec.model_validate({"command": "x", "distribution": {"type": "pytorch"},
                                   "environment_variables": {"MASTER_PORT": "29555", "RANK": "7", "FOO": "1"}})
    warning, note = environment_notes(spec, "local")
    assert warning == ("warning: environment_variables: RANK is set for every process of a pytorch job by its launcher "
                       "and azulite, so the spec's value is replaced; remove it from the spec")
    assert note.startswith("note: environment_variables.MASTER_PORT=29555 pins torchrun's c10d rendezvous "
                           "(--rdzv-endpoint 127.0.0.1:29555); each process's MASTER_PORT is the port of torchrun's")
    assert environment_notes(spec, "kubernetes") == [warning]
    assert environment_notes(spec.model_copy(update={"environment_variables": {"FOO": "1"}}), "local") == []


@pytest.mark.slow
def test_a_job_without_distribution_keeps_its_master_port_and_is_warned_of_replaced_ones(home, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("command: python -c \"import os; print('seen', os.environ['MASTER_PORT'], os.environ['AZULITE_RANK'])\"\n"
                    "environment_variables: {MASTER_PORT: 29555, AZULITE_RANK: 5}\n")
    p = az("job", "submit", str(spec), "--wait", check=0)
    assert ("warning: environment_variables: AZULITE_RANK is set for every process of a job without distribution"
            in p.stderr), p.stderr
    job_id = re.search(r"(\S+-\d+)", p.stdout).group(1)
    assert "seen 29555 0" in az("job", "logs", job_id, check=0).stdout  # MASTER_PORT was dropped from such a job
