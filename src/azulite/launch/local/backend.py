"""The ``local`` backend: jobs run as real processes on this machine, one detached supervisor per job,
state in SQLite under ``AZULITE_HOME``.

``submit`` validates what can be checked before anything starts (the strategy's preflight: a port in
use, a missing launcher), records the job, snapshots the code folder (like Azure ML's code upload: later
edits do not change a submitted job) and starts the supervisor detached. Everything after that is the
supervisor's; this class only reads the store and writes requests into it (cancel, preempt).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import psutil

from azulite.errors import AzuliteError, LaunchError
from azulite.launch.backend import Backend, register_backend
from azulite.launch.local.capacity import check_capacity
from azulite.launch.local.nodes import NodeView, node_view, wait_reply, write_request
from azulite.launch.local.procs import job_processes, pid_alive, terminate_tree, wait_any_exit
from azulite.launch.local.store import JobStore
from azulite.launch.records import JobRecord, JobState, retries_used
from azulite.launch.snapshot import copytree_ignore

if TYPE_CHECKING:
    from azulite.spec.job import JobSpec
    from azulite.spec.sweep import SweepSpec

#: a supervisor that has not recorded its pid this long after submit is taken for dead
_SUPERVISOR_START_S = 120.0
SUPERVISOR = "azulite.launch.local.supervisor"
SWEEPER = "azulite.launch.local.sweeper"
# double fork: the supervisor ends up re-parented to init, in its own session, never a zombie of ours
_DETACH = "import os,sys; os.setsid(); os._exit(0) if os.fork() else os.execv(sys.argv[1], sys.argv[1:])"


@register_backend("local")
class LocalBackend(Backend):
    unsupported = frozenset()  # spot = preemptible via `job preempt`; mpi/tensorflow via their strategies

    def __init__(self, settings, environ=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(settings, environ)
        self.store = JobStore(settings.db_path)

    # ---- submit --------------------------------------------------------------------------------------
    def _submit_impl(self, spec: JobSpec, *, spec_path: str | None) -> JobRecord:
        # the launch machinery (strategies, the job-spec models, input checks) loads to submit, not to look
        from azulite.launch.data import check_inputs
        from azulite.launch.local.context import build_context
        from azulite.launch.local.strategy import get_strategy

        check_capacity(spec, self.settings.max_local_ranks)  # 100000 processes per node would start
        strategy = get_strategy(spec.distribution_type)
        strategy.preflight(build_context("preflight", 1, spec, self.settings.jobs_dir / "_preflight", self.environ,
                                         make_dirs=False))
        check_inputs(spec, {**self.environ, **spec.environment_variables})  # remote inputs exist and can be read
        rec = self.store.create(
            name=spec.name, backend=self.name, spec=spec.model_dump(mode="json"), spec_path=spec_path,
            environment=spec.environment_label, jobs_dir=self.settings.jobs_dir,
        )
        job_dir = Path(rec.job_dir)
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            home = self.settings.home.resolve()

            def own_state(folder: str, names: list[str]) -> set[str]:
                # never copy azulite's own state (AZULITE_HOME inside the code folder would copy itself)
                return {n for n in names if (Path(folder) / n).resolve() == home}

            # what the folder's .amlignore (else .gitignore) lists stays out, as Azure ML leaves it out
            shutil.copytree(spec.code, job_dir / "code", symlinks=True, ignore=copytree_ignore(spec.code, own_state))
            self._start_supervisor(rec.id, job_dir)
        except (OSError, subprocess.CalledProcessError) as exc:
            self.store.transition(rec.id, JobState.FAILED, message=f"could not start: {exc}", exit_code=1)
            raise LaunchError(f"could not start job {rec.id}: {exc}", where=str(job_dir),
                              fix="check the code folder is readable and AZULITE_HOME is writable") from None
        return self.store.get(rec.id)

    def submit_sweep(self, spec: SweepSpec, *, spec_path: str | None = None) -> JobRecord:
        """Submit a sweep: checked as its trials will be (features, inputs), then run by its own detached
        driver (``sweeper.py``), which submits the trials as child jobs."""
        from azulite.launch.data import check_inputs

        template = spec.trial_spec()
        self.check_supported(template)
        check_capacity(template, self.settings.max_local_ranks, prefix="trial.")
        check_inputs(template, {**self.environ, **template.environment_variables})
        rec = self.store.create(
            name=spec.name, backend=self.name, spec=spec.model_dump(mode="json"), spec_path=spec_path,
            environment=template.environment_label, jobs_dir=self.settings.jobs_dir,
        )
        job_dir = Path(rec.job_dir)
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            self._start_supervisor(rec.id, job_dir, module=SWEEPER)
        except (OSError, subprocess.CalledProcessError) as exc:
            self.store.transition(rec.id, JobState.FAILED, message=f"could not start: {exc}", exit_code=1)
            raise LaunchError(f"could not start sweep {rec.id}: {exc}", where=str(job_dir),
                              fix="check that AZULITE_HOME is writable") from None
        return self.store.get(rec.id)

    def _start_supervisor(self, job_id: str, job_dir: Path, claim: int | None = None, module: str = SUPERVISOR) -> None:
        env = {**self.environ, "AZULITE_HOME": str(self.settings.home)}
        argv = [sys.executable, "-c", _DETACH, sys.executable, "-m", module, job_id]
        if claim is not None:
            argv += ["--claim", str(claim)]
        with open(job_dir / "supervisor.log", "ab") as log:
            subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, check=True,
                           cwd=job_dir)

    # ---- status --------------------------------------------------------------------------------------
    def _status_impl(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id)
        if rec.state.terminal:
            return rec
        # the store is the truth, unless the supervisor that writes it died without a word
        dead = (rec.supervisor_pid is not None and not _supervising(rec.supervisor_pid, job_id)) or (
            rec.supervisor_pid is None and time.time() - rec.created_at > _SUPERVISOR_START_S
        )
        if dead:
            time.sleep(0.5)  # it may be writing its last transition right now
            rec = self.store.get(job_id)
            if not rec.state.terminal and not _supervising(rec.supervisor_pid, job_id):
                self._recover(rec)
                rec = self.store.get(job_id)
        return rec

    def wait_for_change(self, rec: JobRecord, timeout_s: float) -> None:
        """Woken by the supervisor's exit (it writes the job's last state, then exits), else after
        ``timeout_s``: a waiter's look every 0.3 s cost ~8 ms of CPU per second, taken from the job's ranks
        on a small machine."""
        pid = rec.supervisor_pid
        if pid is not None and pid > 0 and not rec.state.terminal:
            wait_any_exit([pid], timeout_s)
        else:
            time.sleep(timeout_s)

    def _recover(self, rec: JobRecord) -> None:
        """A job whose supervisor died (killed, or the machine restarted): end what is left of its attempt
        and requeue it under a new supervisor — its next attempt resumes from the last committed
        checkpoint — while ``max_retries`` lasts (a death counts as a failed attempt); else fail it."""
        token = -int(time.time())  # never a pid: a claim in progress, and since when
        if not self.store.claim_supervision(rec.id, rec.supervisor_pid, token):
            return  # another command is recovering it
        for p in job_processes(rec.job_dir):
            terminate_tree([p.pid], self.settings.kill_grace_s)
        log = Path(rec.job_dir) / "supervisor.log"
        try:
            said = log.stat().st_size > 0
        except OSError:
            said = False
        # killed (kill -9, the OOM killer, a reboot) it says nothing: do not send the reader to an empty file
        why = f"supervisor died (see {log})" if said else "supervisor died without a word (killed: its log is empty)"
        if rec.spec.get("type") == "sweep":  # its trials are jobs of their own; the sweep itself ends here
            stopped = self._end_sweep_trials(rec)
            self.store.transition(rec.id, JobState.FAILED, exit_code=1, message=why.replace("supervisor", "sweep driver")
                                  + (f"; its running trial(s) {', '.join(stopped)} canceled" if stopped else ""))
            return
        from azulite.spec.job import JobSpec

        spec = JobSpec.model_validate(rec.spec)
        if rec.state in (JobState.RUNNING, JobState.PREEMPTED):
            used = retries_used(rec)
            if used >= spec.max_retries:
                self.store.transition(rec.id, JobState.FAILED, exit_code=1,
                                      message=f"{why}; no retries left (max_retries={spec.max_retries})")
                return
            self.store.transition(rec.id, JobState.REQUEUED,
                                  message=f"{why}; retry {used + 1}/{spec.max_retries} as attempt {rec.attempt + 1}")
        try:
            self._start_supervisor(rec.id, Path(rec.job_dir), claim=token)
        except (OSError, subprocess.CalledProcessError) as exc:
            self.store.transition(rec.id, JobState.FAILED, exit_code=1, message=f"{why}; could not restart it: {exc}")

    def _end_sweep_trials(self, rec: JobRecord) -> list[str]:
        """A sweep whose driver died: its running trials are canceled (they ran on with nothing to read their
        results, and `job show` kept listing them as running from the driver's last write), and its state
        file says how each ended."""
        from azulite.launch.local.sweeper import read_state, write_state

        state = read_state(rec.job_dir)
        if not state:
            return []
        stopped = []
        for trial in state.get("trials", []):
            if trial.get("state") == "running":
                try:
                    now = self.store.get(trial["id"]).state
                except AzuliteError:  # a trial the store lost: left as the file says
                    continue
                if now.terminal:
                    trial["state"] = now.value
                else:  # asked, not waited for: its own supervisor ends it (this runs inside `job show`)
                    self.store.set_fields(trial["id"], cancel_requested=1,
                                          reason=f"canceled: sweep {rec.id}'s driver died")
                    trial["state"] = "canceling"
                    stopped.append(trial["id"])
        write_state(rec.job_dir, state)
        return stopped

    def _list_impl(self, limit: int) -> list[JobRecord]:
        # looking is when a dead supervisor's job is noticed and requeued
        return [r if r.state.terminal else self._status_impl(r.id) for r in self.store.list(limit)]

    # ---- cancel / preempt ----------------------------------------------------------------------------
    def _cancel_impl(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id)
        if rec.state.terminal:
            return rec
        self.store.set_fields(job_id, cancel_requested=1)
        deadline = time.monotonic() + self.settings.kill_grace_s + 30
        while time.monotonic() < deadline:
            rec = self.store.get(job_id)
            if rec.state.terminal and not pid_alive(rec.supervisor_pid):
                break
            if rec.supervisor_pid is not None and not pid_alive(rec.supervisor_pid):
                break
            time.sleep(0.2)
        # whatever the supervisor could not end (or if it is gone): end it here, then record the cancel
        left = job_processes(rec.job_dir)
        if left:
            terminate_tree([p.pid for p in left], self.settings.kill_grace_s)
        if not self.store.get(job_id).state.terminal:
            self.store.transition(job_id, JobState.CANCELED, message="canceled by user")
        return self.store.get(job_id)

    def _preempt_impl(self, job_id: str) -> JobRecord:
        self._status_impl(job_id)  # an unknown id: NotFound
        if not self.store.request_preempt(job_id):
            state = self.store.get(job_id).state.value
            raise LaunchError(f"job {job_id} is {state}, not running: nothing to preempt",
                              fix="preempt a running job (see `azulite job list`)")
        self.store.event(job_id, "preempt requested")
        return self.store.get(job_id)

    # ---- nodes of an elastic job ---------------------------------------------------------------------
    def nodes(self, job_id: str) -> NodeView:
        """The job's nodes in its current attempt: running, lost, finished (``azulite job nodes JOB``)."""
        rec = self._status_impl(job_id)  # an unknown id: NotFound
        if rec.spec.get("type") == "sweep":
            raise LaunchError(f"{job_id} is a sweep: its trials are the jobs with nodes",
                              fix=f"look at a trial (`azulite job show {job_id}` lists them)")
        from azulite.spec.job import JobSpec

        spec = JobSpec.model_validate(rec.spec)
        return node_view(rec, spec.node_range, spec.elastic is not None)

    def add_nodes(self, job_id: str, count: int | None = None, *, timeout: float = 60.0) -> NodeView:
        """Bring ``count`` of a running elastic job's lost nodes back now (None: every lost one), rather than
        after ``AZULITE_NODE_RETURN_S``: its supervisor starts a new agent for each, which joins the job's
        rendezvous; torchrun grows the group back at its next round (the training script resumes from its
        last checkpoint on the larger world). Returns once the supervisor has started them; the view then
        shows them running."""
        view = self.nodes(job_id)
        if count is not None and count < 1:
            raise LaunchError(f"--add {count}: the number of nodes to bring back must be at least 1", where="--add",
                              fix="e.g. --add 1, or --return to bring back every lost node")
        if not view.elastic:
            raise LaunchError(f"job {job_id} has a fixed node count ({view.max_nodes}): no node of it is lost "
                              "while it runs, and none can be added", where="elastic",
                              fix="submit the job with `elastic: {min_nodes: N}` to let it shrink and grow back")
        if view.job_state != JobState.RUNNING.value:
            raise LaunchError(f"job {job_id} is {view.job_state}, not running: no node to bring back",
                              fix="bring nodes back to a running job (see `azulite job list`)")
        up = len(view.nodes) - len(view.lost)
        if not view.lost:
            raise LaunchError(f"job {job_id} has all {view.max_nodes} of its nodes (elastic max_nodes = "
                              "instance_count): none is lost, so none can be added", where="--add",
                              fix=f"nothing to do; `azulite job nodes {job_id}` shows its nodes")
        if count is not None and count > len(view.lost):
            raise LaunchError(f"--add {count} would give job {job_id} {up + count} nodes, over its max_nodes "
                              f"({view.max_nodes}, its instance_count): {up} up, {len(view.lost)} lost "
                              f"({', '.join(view.lost)})", where="--add",
                              fix=f"--add {len(view.lost)} (or --return) to bring every lost node back")
        rec = self.store.get(job_id)
        rid = write_request(rec.job_dir, count)
        self.store.event(job_id, f"node return requested ({count or 'every lost'} node(s))")

        def gone() -> str | None:
            now = self._status_impl(job_id)  # notices (and requeues) a dead supervisor
            if now.state.terminal:
                return f"job {job_id} ended ({now.state.value})"
            if now.attempt != rec.attempt or now.state != JobState.RUNNING:
                return f"job {job_id} is {now.state.value} (attempt {now.attempt})"
            return None

        reply = wait_reply(rec.job_dir, rid, gone=gone, timeout=timeout)
        if reply.get("refused"):
            raise LaunchError(f"job {job_id}: no node was brought back: {reply['refused']}",
                              fix="see `azulite job nodes` and `azulite job show` for where the job is")
        return dataclasses.replace(self.nodes(job_id), started=tuple(reply.get("started") or ()))

    def replace_nodes(self, job_id: str) -> JobRecord:
        """Every lost node of a running elastic job back now (``add_nodes(job_id)``)."""
        self.add_nodes(job_id)
        return self.store.get(job_id)

    # ---- logs ----------------------------------------------------------------------------------------
    def _logs_impl(self, job_id: str, *, rank: int | None, follow: bool) -> Iterator[str]:
        rec = self.store.get(job_id)
        return _follow_logs(self, rec, rank, follow)


def _supervising(pid: int | None, job_id: str) -> bool:
    """Whether ``pid`` is this job's live supervisor (a pid reused after a machine restart is not), or a
    claim by a command that is starting a new one (a negative token: the claim's time) less than
    ``_SUPERVISOR_START_S`` old."""
    if pid is None:
        return False
    if pid < 0:
        return time.time() + pid < _SUPERVISOR_START_S
    if not pid_alive(pid):
        return False
    try:
        cmd = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    return (SUPERVISOR in cmd or SWEEPER in cmd) and job_id in cmd


def rank_log_paths(job_dir: Path, attempt: int, rank: int | None, workers: int | None = None) -> list[tuple[str, Path]]:
    """(label, log) of one rank or of all, as ``job logs`` shows them. ``workers``: a TensorFlow job's worker
    count, past which ``--rank N`` is parameter server ``N - workers`` (as on the kubernetes backend), whose
    logs follow the workers' in the view of all ranks."""
    logs = job_dir / f"attempt-{attempt}" / "logs"
    if rank is not None:
        if workers is not None and rank >= workers:
            return [(f"ps {rank - workers}", logs / f"ps-{rank - workers}.log")]
        return [(f"rank {rank}", logs / f"rank-{rank}.log")]
    found: list[tuple[int, str, Path]] = []
    for kind in ("rank", "ps") if workers is not None else ("rank",):
        for p in logs.glob(f"{kind}-*.log"):
            try:
                n = int(p.stem.split("-")[1])
            except ValueError:
                continue
            found.append((n if kind == "rank" else (workers or 0) + n, f"{kind} {n}", p))
    return [(label, p) for _, label, p in sorted(found)]


def _no_rank_ran(rec: JobRecord, rank: int | None) -> Iterator[str]:
    """What `job logs` says of an ended job no rank of which wrote a log (it failed before any ran, in its
    supervisor): why, and the supervisor's own last lines (it printed nothing, and exited 0)."""
    if not rec.state.terminal or rank is not None:
        return
    yield f"azulite: no rank of {rec.id} wrote a log (the job is {rec.state.value}: {rec.reason or 'no reason recorded'})"
    log = Path(rec.job_dir) / "supervisor.log"
    try:
        lines = log.read_text(errors="replace").splitlines()[-20:]
    except OSError:
        return
    if lines:
        yield f"azulite: the last lines of {log}:"
        yield from lines


def _follow_logs(backend: LocalBackend, rec: JobRecord, rank: int | None, follow: bool) -> Iterator[str]:
    """Lines of the latest attempt's rank logs, each prefixed ``[rank R]`` when showing several ranks;
    with ``follow``, keeps reading (switching to each new attempt) until the job ends."""
    job_dir = Path(rec.job_dir)
    attempt = max(rec.attempt, 1)
    offsets: dict[Path, int] = {}
    partial: dict[Path, bytes] = {}
    if rec.attempt > 1 or follow and rec.attempt > 0:
        yield f"--- attempt {attempt} ---"
    dist = rec.spec.get("distribution") or {}
    workers = int(dist.get("worker_count", 1)) if str(dist.get("type", "")).lower() == "tensorflow" else None

    def read_new() -> Iterator[str]:
        for label, path in rank_log_paths(job_dir, attempt, rank, workers):
            try:
                with open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    data = partial.pop(path, b"") + f.read()
                    offsets[path] = f.tell()
            except FileNotFoundError:
                continue
            *lines, rest = data.split(b"\n")
            if rest:
                partial[path] = rest
            for line in lines:
                text = line.decode("utf-8", "replace")
                yield text if rank is not None else f"[{label}] {text}"

    if not follow:
        shown = False
        for line in read_new():
            shown = True
            yield line
        for path, rest in partial.items():
            shown = True
            yield rest.decode("utf-8", "replace")
        if not shown:
            yield from _no_rank_ran(rec, rank)
        return
    while True:
        got = list(read_new())
        yield from got
        rec = backend.status(rec.id)
        if rec.attempt > attempt:
            yield from read_new()
            attempt = rec.attempt
            offsets.clear()
            partial.clear()
            yield f"--- attempt {attempt} ---"
            continue
        if rec.state.terminal and not got:
            yield from read_new()
            for rest in partial.values():
                yield rest.decode("utf-8", "replace")
            if not offsets:  # no rank log was ever there
                yield from _no_rank_ran(rec, rank)
            return
        if not got:
            time.sleep(0.25)
