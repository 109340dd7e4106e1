"""One supervisor process per job: ``python -m azulite.launch.local.supervisor JOB_ID``.

Started detached by ``LocalBackend.submit`` (its own session, re-parented to init), so the job outlives
the shell that submitted it. It runs attempts until the job ends:

    queued -> running (attempt n) -> succeeded
                                  -> failed      (a rank's non-zero exit; retried while max_retries lasts;
                                                  never after a rank's exit 78, an error no retry can fix)
                                  -> canceled    (SIGTERM to the supervisor / cancel_requested in the store)
                                  -> preempted   (any rank exited 75, or SIGUSR1 / preempt_requested)
                                     -> requeued -> running (attempt n+1, AZULITE_ATTEMPT=n+1)

An elastic job (``elastic: {min_nodes}``) that loses a node goes on inside the attempt on the nodes left;
the lost node comes back (a new agent for it joins the same rendezvous) after ``AZULITE_NODE_RETURN_S``,
or at once on request (``azulite job nodes JOB --add N``, ``nodes.py``), and torchrun grows the group back at
its next round.

It knows nothing about torchrun: the strategy for the job's distribution type (``strategy.py``) gives the
processes to start and the per-rank results. The store is the truth; the supervisor is its only writer
for a running job (cancel writes only when the supervisor is gone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import psutil

from azulite.contract import EXIT_CONFIG, EXIT_PREEMPTED, STACK_DUMP_SIGNAL
from azulite.errors import AzuliteError
from azulite.launch.local.context import build_context
from azulite.launch.local.nodes import take_requests, write_reply
from azulite.launch.local.procs import (
    describe, exit_status, job_processes, signal_groups, terminate_tree, tree, wait_any_exit,
)
from azulite.launch.local.rank import config_errors, shell_exit_code
from azulite.launch.local.stacks import live_rank_pids, request_dumps
from azulite.launch.local.store import JobStore
from azulite.launch.local.strategy import (
    LaunchContext, LaunchStrategy, ProcessSpec, RankResult, get_strategy, read_rank_records,
)
from azulite.launch.records import JobState, ProcessRecord, retries_used
from azulite.launch.data import fetch_inputs, upload_outputs
from azulite.launch.settings import Settings
from azulite.launch.tracking import drop_if_empty, prepare_store
from azulite.spec.job import JobSpec

POLL_S = 0.2
#: between asking a preempted job's stuck ranks for their stacks and SIGKILLing them: time to write them
DUMP_WAIT_S = 2.0
#: rank exits that are effects (a clean end, a preempted save, our own SIGTERM/SIGKILL), never a root cause
_NOT_A_CAUSE = (0, None, EXIT_PREEMPTED, 128 + signal.SIGTERM, 128 + signal.SIGKILL)


@dataclass
class AttemptOutcome:
    exits: dict[str, int | None]
    results: list[RankResult]
    canceled: bool = False
    preempt_asked: bool = False
    timed_out: bool = False
    config_error: dict | None = None  # the rank record of the first rank that exited EXIT_CONFIG
    #: the first agent that died of a signal before anything was stopped (a lost node: kill -9, the OOM
    #: killer): (name, exit code). Its peers, stopped after it, exit 75: that is a failure, not a preemption
    lost_agent: tuple[str, int] | None = None


class Supervisor:
    def __init__(self, store: JobStore, settings: Settings, job_id: str, environ: dict[str, str]) -> None:
        self.store, self.settings, self.job_id, self.environ = store, settings, job_id, environ
        self._cancel = False
        self._preempt = False
        self._node_requests: list[dict] = []  # bring an elastic job's lost nodes back now (nodes.py)
        self._procs: list[subprocess.Popen] = []  # the current attempt's launchers
        self.started = time.monotonic()
        self.job_dir: Path | None = None

    # signals only set flags; the loop acts on them
    def _on_term(self, *_: object) -> None:
        self._cancel = True

    def _on_usr1(self, *_: object) -> None:
        self._preempt = True

    def _flags(self) -> tuple[bool, bool]:
        if self.job_dir is not None:
            self._node_requests += take_requests(self.job_dir)
        cancel, preempt = self.store.flags(self.job_id)
        self._cancel |= cancel
        self._preempt |= preempt
        return self._cancel, self._preempt

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        signal.signal(signal.SIGUSR1, self._on_usr1)
        self.store.set_fields(self.job_id, supervisor_pid=os.getpid())
        rec = self.store.get(self.job_id)
        spec = JobSpec.model_validate(rec.spec)
        job_dir = self.job_dir = Path(rec.job_dir)
        try:
            strategy = get_strategy(spec.distribution_type)
            return self._loop(spec, job_dir, strategy, rec.attempt)
        except AzuliteError as exc:
            self._end(JobState.FAILED, str(exc), exit_code=1)
            return 1
        except BaseException as exc:  # the job must never stay "running" behind a dead supervisor
            traceback.print_exc()
            self._end(JobState.FAILED, f"supervisor error: {exc!r} (see {job_dir / 'supervisor.log'})", exit_code=1)
            return 1
        finally:
            self._refuse_node_requests("the job has ended")
            self._sweep()
            if self.store.get(self.job_id).state.terminal:  # not a requeue handed to the next supervisor
                try:
                    drop_if_empty(job_dir)
                except OSError:
                    pass

    def _refuse_node_requests(self, why: str) -> None:
        if self.job_dir is not None:
            self._node_requests += take_requests(self.job_dir)
            for req in self._node_requests:
                write_reply(self.job_dir, req["id"], started=[], refused=why)
        self._node_requests = []

    def _end(self, state: JobState, message: str, **kw: object) -> None:
        self.store.transition(self.job_id, state, message=message, **kw)  # refused if already ended: fine

    def _loop(self, spec: JobSpec, job_dir: Path, strategy: LaunchStrategy, attempt: int) -> int:
        rec = self.store.get(self.job_id)  # a restarted supervisor carries on the counts of the one before
        failures = retries_used(rec)
        try:
            prepare_store(spec, job_dir)
        except Exception as e:  # noqa: BLE001 - metrics are not worth failing a job over: say so, go on
            self.store.event(self.job_id, f"no MLflow store for this job ({type(e).__name__}: {e}); metrics "
                             "logged by the job will fail")
        preemptions = sum(1 for a in rec.attempts if a.exit_code == EXIT_PREEMPTED)
        while True:
            attempt += 1
            if self._flags()[0]:
                self._end(JobState.CANCELED, "canceled before attempt started")
                return 0
            data_env = {**self.environ, **spec.environment_variables}  # the job's own credentials count
            fetched = fetch_inputs(spec, self.settings.home / "cache" / "inputs", data_env)
            for f in fetched.values():
                self.store.event(self.job_id, f"input {f.name}: {f.uri} -> {f.local} "
                                 f"({'downloaded' if f.downloaded else 'from the cache'})")
            ctx = build_context(self.job_id, attempt, spec, job_dir, self.environ,
                                inputs={n: f.local for n, f in fetched.items()})
            strategy.preflight(ctx)
            if not self.store.transition(self.job_id, JobState.RUNNING, attempt=attempt, message=f"attempt {attempt}"):
                return 0  # canceled meanwhile
            self._preempt = False
            self._refuse_node_requests(f"attempt {attempt} is starting, on all its nodes")  # meant for the last one
            out = self._run_attempt(ctx, strategy, spec)
            self._record(ctx, out)
            # after every attempt, whatever its end (a preempted one included): nothing written is lost
            for uri in upload_outputs(spec, job_dir, data_env)[-1:]:
                self.store.event(self.job_id, f"outputs uploaded (last: {uri})")
            if out.canceled:
                # who asked, when it was not the user (a sweep's driver, or its death) left its reason
                asked = self.store.get(self.job_id).reason or ""
                self._end(JobState.CANCELED, asked if asked.startswith("canceled") else "canceled by user")
                return 0
            if out.timed_out:
                from azulite.launch.local.sweeper import timeout_field  # a sweep's trial: the sweep's field

                field = timeout_field(self.store, spec) or "spec timeout"
                self._end(JobState.FAILED, f"timed out after {spec.timeout:g}s ({field})", exit_code=124)
                return 0
            # no restart or retry can fix it: the job fails now (seen in the attempt, or as it ended)
            if (bad := out.config_error or next(iter(config_errors(ctx.records_dir)), None)) is not None:
                rank, node = int(bad.get("rank", -1)), int(bad.get("node_rank", -1))
                self._end(JobState.FAILED, f"rank {rank} (node {node}) exited {EXIT_CONFIG}: an error no restart can "
                          f"fix (a setting, a URI or credentials); not retried -- its log says what and how to fix it",
                          exit_code=EXIT_CONFIG, failed_rank=rank)
                return 0
            codes = [r.exit_code for r in out.results]
            if finished(out):
                self._end(JobState.SUCCEEDED, f"all {len(codes)} ranks exited 0", exit_code=0)
                return 0
            done = [n for n, c in out.exits.items() if c == 0]
            if spec.elastic and len(done) >= spec.node_range[0] and not out.canceled and not out.preempt_asked and \
                    all(c == 0 or (c or 0) > 128 for c in out.exits.values()):
                # the nodes left finished the job; the others were lost (killed), not failed
                self._end(JobState.SUCCEEDED, f"finished on {len(done)} of {len(out.exits)} node(s) (elastic)", exit_code=0)
                return 0
            if self._preempted(out):
                preemptions += 1
                who = "preempt requested" if out.preempt_asked else \
                    f"rank {codes.index(EXIT_PREEMPTED)} exited {EXIT_PREEMPTED} (preempted)"
                self.store.transition(self.job_id, JobState.PREEMPTED, message=who, exit_code=EXIT_PREEMPTED)
                if preemptions > self.settings.max_preemptions:
                    self._end(JobState.FAILED, f"preempted {preemptions} times, more than AZULITE_MAX_PREEMPTIONS="
                              f"{self.settings.max_preemptions}; not requeued", exit_code=EXIT_PREEMPTED)
                    return 0
                if not self.store.transition(self.job_id, JobState.REQUEUED, message=f"requeued as attempt {attempt + 1}"):
                    return 0
                continue
            rank, code, why = self._root_cause(ctx, out)
            if out.preempt_asked:
                why += " after the preempt request (its checkpoint was not committed: see the rank's log)"
            failures += 1
            if failures <= spec.max_retries:
                self.store.transition(
                    self.job_id, JobState.REQUEUED,
                    message=f"{why}; retry {failures}/{spec.max_retries} as attempt {attempt + 1}", exit_code=code,
                )
                continue
            self._end(JobState.FAILED, why, exit_code=code, failed_rank=rank)
            return 0

    @staticmethod
    def _preempted(out: AttemptOutcome) -> bool:
        """We asked for it, or a rank said so (exit 75: its own eviction notice), while no rank failed by
        itself: a real failure beside a 75 is a failure, and retried as one. Asked for too: a rank that
        exited 1 after the request did not commit its save (Blob down), and "preempted" means committed
        (it was requeued as preempted, not counted against max_retries)."""
        codes = [r.exit_code for r in out.results]
        if out.preempt_asked:
            return all(c in _NOT_A_CAUSE for c in codes)
        if out.lost_agent is not None:  # its peers' 75s answer the stop sent after it: a failure
            return False
        return EXIT_PREEMPTED in codes and all(c in _NOT_A_CAUSE for c in codes)

    @staticmethod
    def _root_cause(ctx: LaunchContext, out: AttemptOutcome) -> tuple[int | None, int, str]:
        """The rank that failed first (a rank we killed after its peer died is an effect, not a cause)."""
        if out.lost_agent is not None:  # it came first (nothing had failed): what failed after is its effect
            name, code = out.lost_agent
            try:
                how = f" ({signal.Signals(code - 128).name})"
            except ValueError:
                how = ""
            return None, code, f"{name}'s agent exited {code}{how}: the node was lost (see {ctx.process_log(name)})"
        bad = [r for r in out.results if r.exit_code not in (0, None)]
        own = [r for r in bad if r.exit_code not in _NOT_A_CAUSE]
        pool = own or bad
        if pool:
            r = min(pool, key=lambda r: (r.ended_at or float("inf"), r.rank))
            return r.rank, int(r.exit_code or 1), f"rank {r.rank} (node {r.node}) exited {r.exit_code}"
        name, code = next(((n, c) for n, c in out.exits.items() if c not in (0, None)), ("?", 1))
        return None, int(code or 1), f"{name} exited {code} (see {ctx.process_log(name)})"

    def _run_attempt(self, ctx: LaunchContext, strategy: LaunchStrategy, spec: JobSpec) -> AttemptOutcome:
        specs = {ps.name: ps for ps in strategy.processes(ctx)}
        self._procs = []
        procs = {name: self._start(ctx, ps) for name, ps in specs.items()}

        out = AttemptOutcome(exits={}, results=[])
        deadline = time.monotonic() + spec.timeout if spec.timeout else None
        first_failure: float | None = None
        preempt_sent: float | None = None
        dumped_at: float | None = None  # when a preempted job past its grace was asked for its stacks
        synced = 0.0
        lost_at: dict[str, float] = {}  # an elastic job's lost nodes, not yet replaced, and since when
        replaced: set[str] = set()
        finished_at: float | None = None  # when the first node ended 0: the job is done, nothing may join
        noted: dict[str, int] = {}  # agents whose exit is in the store (by pid: a replacement is another)
        while True:
            exits = {n: (None if exit_status(p) is None else shell_exit_code(p.returncode)) for n, p in procs.items()}
            running = [n for n, c in exits.items() if c is None]
            ended = [n for n, c in exits.items() if c is not None and noted.get(n) != procs[n].pid]
            if ended:  # as soon as seen: `job nodes` reads which nodes are lost from the store
                self.store.record_processes(self.job_id, [
                    ProcessRecord(ctx.attempt, "agent", n, specs[n].node, None, None, procs[n].pid, exits[n],
                                  str(specs[n].log)) for n in ended])
                noted.update({n: procs[n].pid for n in ended})
                for n in ended:
                    if exits[n] not in (0, None) and (orphans := _end_orphans(ctx, procs[n].pid)):
                        # a node that is lost takes its ranks with it; left running, they went on training
                        # alone and held the survivors in torchrun's exit barrier for its 300 s
                        self.store.event(self.job_id, f"{n}'s agent exited {exits[n]}: its rank(s) {orphans} "
                                         "ended with it, as on a lost node")
                    if (exits[n] or 0) > 128 and exits[n] != 128 + signal.SIGTERM and out.lost_agent is None \
                            and first_failure is None and preempt_sent is None \
                            and not (spec.elastic and len(running) >= spec.node_range[0]) \
                            and not (out.canceled or out.timed_out or out.config_error) \
                            and not _rank_said_so(ctx, procs[n].pid):
                        out.lost_agent = (n, exits[n])
            if not running:
                break
            cancel, preempt = self._flags()
            now = time.monotonic()
            if cancel:
                out.canceled = True
                terminate_tree([procs[n].pid for n in running], self.settings.kill_grace_s)
                continue
            if deadline and now > deadline and not out.timed_out:
                out.timed_out = True
                terminate_tree([procs[n].pid for n in running], self.settings.kill_grace_s)
                continue
            if out.config_error is None and preempt_sent is None and (bad := config_errors(ctx.records_dir)):
                # torchrun restarts a failed group (max_restarts) whatever the exit: stop it before it does
                out.config_error = bad[0]
                self.store.event(self.job_id, f"rank {bad[0].get('rank')} exited {EXIT_CONFIG} (an error no restart "
                                 f"can fix): stopping {', '.join(running)}, no restart, no retry")
                terminate_tree([procs[n].pid for n in running], self.settings.kill_grace_s)
                continue
            if preempt and preempt_sent is None:
                # as a spot eviction would: one SIGTERM to every process of every rank (the strategy says
                # which groups; launchers pass it on), none twice
                out.preempt_asked = True
                preempt_sent = now
                groups = signal_groups(strategy.stop_groups(ctx, {n: procs[n].pid for n in running}),
                                       signal.SIGTERM)
                self.store.event(self.job_id, f"preempt: SIGTERM sent to {len(groups)} process group(s) of the job")
            if preempt_sent is not None and now - preempt_sent > self.settings.preempt_grace_s:
                if dumped_at is None:  # a rank that does not stop is a bug to find: its stacks, then the kill
                    dumped_at = now
                    self._dump_stacks(ctx, [procs[n].pid for n in running],
                                      f"still running {self.settings.preempt_grace_s:g}s after the preempt SIGTERM")
                elif now - dumped_at > DUMP_WAIT_S:
                    terminate_tree([procs[n].pid for n in running], 1.0)
            failed = [n for n, c in exits.items() if c not in (None, 0)]
            if failed and spec.elastic and len(running) >= spec.node_range[0]:
                # an elastic job goes on while min_nodes agents are left: torchrun re-forms the group on them
                for n in failed:
                    if n not in lost_at:
                        lost_at[n] = now
                        self.store.event(self.job_id, f"{n} lost (exit {exits[n]}); continuing on {len(running)} "
                                         f"node(s) (elastic, min {spec.node_range[0]})")
            elif first_failure is None and failed:
                first_failure = now
            if finished_at is None and any(c == 0 for c in exits.values()):
                finished_at = now
            if lost_at and finished_at is None and first_failure is None and preempt_sent is None:
                # the node returns (or a replacement starts): its new agent joins the same rendezvous, the
                # running agents see it waiting and restart their workers, and the next round has it back
                wait = self.settings.node_return_s
                due = [n for n, t in sorted(lost_at.items()) if wait >= 0 and now - t >= wait]
                asked = []
                for req in self._node_requests:  # oldest first; each takes the lost nodes not yet taken
                    left = [n for n in sorted(lost_at) if n not in due]
                    take = left[: req["count"] or len(left)]
                    due += take
                    asked.append((req, take))
                self._node_requests = []
                for n in due:
                    del lost_at[n]
                    replaced.add(n)
                    procs[n] = self._start(ctx, specs[n])
                    self.store.event(self.job_id, f"{n} back: a new agent joins the rendezvous; the job grows "
                                     f"back to {spec.node_range[1]} node(s) at the next round")
                for req, take in asked:
                    write_reply(self.job_dir, req["id"], started=take,
                                refused=None if take else "no lost node left to bring back")
            elif self._node_requests:
                why = ("no lost node to bring back" if not lost_at else "nodes are not brought back once the job "
                       "is finishing, failing or preempted")
                self.store.event(self.job_id, f"node request refused: {why}")
                self._refuse_node_requests(why)
            if finished_at is not None and now - finished_at > self.settings.peer_grace_s and first_failure is None \
                    and (late := [n for n in running if n in replaced and not _has_ranks(ctx, procs[n].pid)]):
                # a replacement that came as the others finished waits for a round that will not come
                self.store.event(self.job_id, f"stopping {', '.join(late)}: the job finished without it")
                terminate_tree([procs[n].pid for n in late], self.settings.kill_grace_s)
                replaced.difference_update(late)
            if first_failure is not None and now - first_failure > self.settings.peer_grace_s and preempt_sent is None:
                self.store.event(self.job_id, f"stopping {', '.join(running)}: a peer failed")
                terminate_tree([procs[n].pid for n in running], self.settings.kill_grace_s)
                first_failure = float("inf")
            if now - synced > 1.0:
                synced = now
                self._sync_ranks(ctx)
                # A node that finished cannot rejoin: a rank lost on another node after that leaves its agent
                # waiting minutes for a rendezvous that cannot happen. End the attempt now instead; it is
                # retried (max_retries) from the last committed checkpoint.
                if first_failure is None and any(c == 0 for c in exits.values()) and (lost := _lost_ranks(ctx)):
                    first_failure = float("inf")
                    self.store.event(self.job_id, f"rank(s) {lost} lost after a node finished: the group cannot "
                                     f"re-form; stopping {', '.join(running)}")
                    terminate_tree([procs[n].pid for n in running], self.settings.kill_grace_s)
            # woken at once by an agent's exit (the attempt's end seen when it happens); the interval only
            # paces the looks at the store (cancel, preempt, node requests) and the rank records
            wait_any_exit([procs[n].pid for n in running], POLL_S)
        out.exits = exits
        out.results = strategy.collect(ctx, exits)
        return out

    def _dump_stacks(self, ctx: LaunchContext, launchers: list[int], why: str) -> None:
        """Before a kill: this supervisor's view of the attempt's processes into its own log, and every
        rank's and rank runner's Python stacks into the rank's log (only processes that registered
        :data:`STACK_DUMP_SIGNAL` are sent it: the launchers and unknown commands would die of it)."""
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} attempt {ctx.attempt} {why}; its processes:", flush=True)
        print("\n".join(describe(tree(launchers))), flush=True)
        ranks = read_rank_records(ctx.records_dir)
        pids = live_rank_pids(ranks)
        sent = request_dumps(pids, STACK_DUMP_SIGNAL)
        self.store.event(self.job_id, f"{why}: asked {len(sent)} process(es) of rank(s) "
                         f"{sorted(r for r, x in ranks.items() if x.get('exit_code') is None)} for their stacks "
                         f"(in the ranks' logs; the process list in supervisor.log); SIGKILL in {DUMP_WAIT_S:g}s")

    def _start(self, ctx: LaunchContext, ps: ProcessSpec) -> subprocess.Popen:
        """Start one of the attempt's processes (in its own session, output appended to its log)."""
        with open(ps.log, "ab") as log:
            p = subprocess.Popen(list(ps.argv), env=dict(ps.env), cwd=ps.cwd, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        self._procs.append(p)
        self.store.record_processes(self.job_id, [
            ProcessRecord(ctx.attempt, "agent", ps.name, ps.node, None, None, p.pid, None, str(ps.log))])
        return p

    def _sync_ranks(self, ctx: LaunchContext) -> None:
        recs = read_rank_records(ctx.records_dir)
        if recs:
            self.store.record_processes(self.job_id, [
                ProcessRecord(ctx.attempt, "rank", f"rank-{r}", int(x.get("node_rank", -1)), r,
                              int(x.get("local_rank", -1)), x.get("child_pid") or x.get("pid"), x.get("exit_code"),
                              x.get("log"), int(x.get("restart", 0)))
                for r, x in recs.items()
            ])

    def _record(self, ctx: LaunchContext, out: AttemptOutcome) -> None:
        self.store.record_processes(self.job_id, [
            ProcessRecord(ctx.attempt, "rank", f"rank-{r.rank}", r.node, r.rank, r.local_rank, r.pid, r.exit_code,
                          r.log, r.restarts)
            for r in out.results
        ])
        rec = self.store.get(self.job_id)
        agents = [p for p in rec.processes if p.kind == "agent" and p.attempt == ctx.attempt]
        for a in agents:
            a.exit_code = out.exits.get(a.name)
        self.store.record_processes(self.job_id, agents)
        self._sweep()

    def _sweep(self) -> None:
        """No orphans: end whatever is left of this job's processes (by tree, then by env marker)."""
        live = [p.pid for p in self._procs if exit_status(p) is None]  # reaped pids may be reused: skip them
        if self.job_dir is None:
            return
        left = job_processes(self.job_dir, exclude=(os.getpid(),))
        if left or live:
            terminate_tree(live, self.settings.kill_grace_s, extra=left)


def finished(out: AttemptOutcome) -> bool:
    """Whether an attempt finished the job: every launcher exited 0 and no rank failed (a rank that never
    started has no exit code). After a preempt request a rank with no exit code was killed at the grace,
    not finished: a launcher's own exit 0 on SIGTERM must not read as success (the attempt is requeued as
    preempted). A preemption that came after every rank had finished is fine."""
    codes = [r.exit_code for r in out.results]
    if not all(c == 0 for c in out.exits.values()) or not all(c in (0, None) for c in codes):
        return False
    return not (out.preempt_asked and None in codes)


def _has_ranks(ctx: LaunchContext, agent_pid: int) -> bool:
    """Whether the agent ``agent_pid`` started ranks in this attempt (it joined a round)."""
    return any(rec.get("agent_pid") == agent_pid for rec in read_rank_records(ctx.records_dir).values())


def _rank_said_so(ctx: LaunchContext, agent_pid: int) -> bool:
    """Whether an agent that died of a signal passed on its rank's own end: a rank it started (or it, a
    rank runner: TF workers, ``none``, mpirun's ranks) recorded a failing exit first. A user's process
    killed with SIGKILL (the OOM killer's signal) was reported as a lost node under mpi, tensorflow and
    ``none``, whose agents exit with their rank's code; a lost node's ranks record nothing."""
    return any(agent_pid in (rec.get("agent_pid"), rec.get("pid")) and rec.get("exit_code") not in (None, 0)
               for rec in read_rank_records(ctx.records_dir).values())


def _end_orphans(ctx: LaunchContext, agent_pid: int) -> list[int]:
    """SIGKILL the unfinished ranks an agent that died had started (they outlive it: nothing ties a rank to
    its agent's life); their ranks."""
    mine = {r: rec for r, rec in read_rank_records(ctx.records_dir).items()  # started by it, or it (no launcher)
            if agent_pid in (rec.get("agent_pid"), rec.get("pid")) and rec.get("exit_code") is None}
    pids = live_rank_pids(mine)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return sorted(mine) if pids else []


def _lost_ranks(ctx: LaunchContext) -> list[int]:
    """Ranks of this attempt that died: a non-zero exit recorded, or a rank runner gone without a record."""
    lost = []
    for r, rec in read_rank_records(ctx.records_dir).items():
        code = rec.get("exit_code")
        if code not in (None, 0) or (code is None and not psutil.pid_exists(int(rec.get("pid") or 0) or -1)):
            lost.append(r)
    return sorted(lost)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 3) or (len(argv) == 3 and argv[1] != "--claim"):
        print("usage: python -m azulite.launch.local.supervisor JOB_ID [--claim TOKEN]", file=sys.stderr)
        return 2
    environ = dict(os.environ)
    settings = Settings.from_environ(environ)
    store = JobStore(settings.db_path)
    # a restarted supervisor takes over only if its claim still stands (exactly one takes over)
    if len(argv) == 3 and not store.claim_supervision(argv[0], int(argv[2]), os.getpid()):
        return 0
    return Supervisor(store, settings, argv[0], environ).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
