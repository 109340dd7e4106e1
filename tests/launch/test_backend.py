"""The backend boundary: registry refuses duplicates, unknown names are a clear error, unsupported
features are data checked at submit."""

import pytest

from azulite.errors import AzuliteError, LaunchError
from azulite.launch import backend as bmod
from azulite.launch.backend import Backend, Feature, get_backend, register_backend
from azulite.launch.local.strategy import LaunchStrategy, get_strategy, register_strategy
from azulite.launch.settings import Settings
from azulite.spec.job import JobSpec


def test_local_is_registered_and_duplicates_are_refused(tmp_path):
    b = get_backend("local", Settings(home=tmp_path))
    assert b.name == "local"
    with pytest.raises(ValueError, match="already registered"):
        register_backend("local")(type(b))


def test_unknown_backend_names_the_choices(tmp_path):
    with pytest.raises(AzuliteError) as e:
        get_backend("slurm", Settings(home=tmp_path))
    assert "local" in e.value.fix


def test_unsupported_features_are_refused_before_submit(tmp_path):
    @register_backend("test-nospot")
    class NoSpot(Backend):
        unsupported = frozenset({Feature.SPOT, Feature.TENSORFLOW})

        def _submit_impl(self, spec, *, spec_path):  # pragma: no cover - must not be reached
            raise AssertionError("submit reached")

        _status_impl = _list_impl = _logs_impl = _cancel_impl = _submit_impl

    try:
        b = get_backend("test-nospot", Settings(home=tmp_path))
        spec = JobSpec.model_validate({"command": "x", "priority": "spot", "distribution": {"type": "tensorflow"}})
        with pytest.raises(LaunchError, match="spot, tensorflow"):
            b.submit(spec)
    finally:
        bmod._REGISTRY.pop("test-nospot")


def test_strategy_registry():
    assert get_strategy("PyTorch").distribution_type == "pytorch"
    with pytest.raises(LaunchError):
        get_strategy("horovod")

    class Dup(LaunchStrategy):
        distribution_type = "pytorch"

        def processes(self, ctx):  # pragma: no cover
            return []

    with pytest.raises(ValueError, match="already registered"):
        register_strategy(Dup)


def test_a_local_waiter_is_woken_by_the_supervisors_exit(tmp_path):
    """`job wait` / `submit --wait` look at a job once a second; the job's end (its supervisor exiting after
    writing the last state) wakes them at once instead of at the next look."""
    import subprocess
    import sys
    import threading

    from azulite.launch.records import JobRecord, JobState

    b = get_backend("local", Settings(home=tmp_path))
    supervisor = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    rec = JobRecord(id="j-1", name="j", backend="local", state=JobState.RUNNING, attempt=0, created_at=0.0,
                    started_at=None, ended_at=None, exit_code=None, reason=None, spec={}, spec_path=None,
                    environment=None, job_dir=str(tmp_path), supervisor_pid=supervisor.pid)
    woken = threading.Event()
    waiter = threading.Thread(target=lambda: (b.wait_for_change(rec, 3600.0), woken.set()), daemon=True)
    waiter.start()
    assert not woken.wait(0.2)  # a live supervisor keeps it waiting
    supervisor.stdin.close()  # the supervisor ends
    assert woken.wait(120), "the waiter slept on after the supervisor exited"
    supervisor.wait()


def test_logs_of_a_job_no_rank_of_which_ran_say_why(tmp_path):
    """A job that failed in its supervisor before any rank ran: `job logs` printed nothing and exited 0."""
    from pathlib import Path

    from azulite.launch.records import JobState

    b = get_backend("local", Settings(home=tmp_path))
    rec = b.store.create(name="early", backend="local", spec={}, spec_path=None, environment=None,
                         jobs_dir=tmp_path / "jobs")
    Path(rec.job_dir).mkdir(parents=True)
    (Path(rec.job_dir) / "supervisor.log").write_text("Traceback (most recent call last):\nValueError: boom\n")
    b.store.transition(rec.id, JobState.RUNNING, message="attempt 1")
    b.store.transition(rec.id, JobState.FAILED, message="supervisor error: ValueError('boom')", exit_code=1)
    lines = list(b.logs(rec.id))
    assert lines[0] == f"azulite: no rank of {rec.id} wrote a log (the job is failed: supervisor error: ValueError('boom'))"
    assert lines[-1] == "ValueError: boom"
    assert list(b.logs(rec.id, follow=True))[-1] == "ValueError: boom"
