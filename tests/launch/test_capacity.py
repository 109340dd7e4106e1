"""A local job is refused at submit, before anything is recorded or started, when it starts far more
processes than this machine runs (`--set distribution.process_count_per_instance=100000` validated and
would start them); a count a cloud cluster takes still validates and renders."""

import pytest

from azulite.errors import AzuliteError, LaunchError
from azulite.launch.backend import get_backend
from azulite.launch.local.capacity import check_capacity, usable_cores
from azulite.launch.settings import Settings
from azulite.spec.job import JobSpec


def _spec(nodes=1, per_node=1, kind="pytorch", **dist) -> JobSpec:
    d = {"type": kind, **dist} if kind == "tensorflow" else {"type": kind, "process_count_per_instance": per_node}
    return JobSpec.model_validate({"command": "x", "resources": {"instance_count": nodes},
                                   **({"distribution": d} if kind != "none" else {})})


def test_the_default_limit_is_four_ranks_per_core_and_at_least_eight():
    check_capacity(_spec(2, 4), cores=2)  # 8 = max(8, 4 x 2)
    check_capacity(_spec(4, 4), cores=4)
    with pytest.raises(LaunchError) as e:
        check_capacity(_spec(3, 3), cores=2)
    assert e.value.message == ("this job starts 9 processes (3 node(s) x 3 process(es)); this machine runs at "
                               "most 8 (4 per usable core, 2 core(s) here)")
    assert e.value.where == "resources.instance_count, distribution.process_count_per_instance"
    assert "--set distribution.process_count_per_instance=2" in e.value.fix and "AZULITE_MAX_LOCAL_RANKS=9" in e.value.fix
    assert usable_cores() >= 1


@pytest.mark.parametrize("spec, where, example", [
    (_spec(100, kind="none"), "resources.instance_count", "--set resources.instance_count=16"),
    (_spec(kind="tensorflow", worker_count=30, parameter_server_count=2),
     "distribution.worker_count, distribution.parameter_server_count", "--set distribution.worker_count=14"),
])
def test_each_distribution_counts_its_own_processes(spec, where, example):
    with pytest.raises(LaunchError) as e:
        check_capacity(spec, cores=4)
    assert e.value.where == where and example in e.value.fix, str(e.value)


def test_the_setting_replaces_the_limit_and_a_bad_one_is_refused():
    big = _spec(2, 100)
    check_capacity(big, limit=200, cores=1)
    with pytest.raises(LaunchError, match=r"at most 100 \(AZULITE_MAX_LOCAL_RANKS=100\)"):
        check_capacity(big, limit=99 + 1, cores=64)
    assert Settings.from_environ({"AZULITE_MAX_LOCAL_RANKS": "64", "HOME": "/tmp"}).max_local_ranks == 64
    assert Settings.from_environ({"HOME": "/tmp"}).max_local_ranks is None
    for raw in ("0", "abc", "-3"):
        with pytest.raises(AzuliteError) as e:
            Settings.from_environ({"AZULITE_MAX_LOCAL_RANKS": raw, "HOME": "/tmp"})
        assert e.value.where == "AZULITE_MAX_LOCAL_RANKS" and "such as 64" in e.value.fix


def test_a_local_submit_beyond_the_machine_records_nothing(tmp_path):
    backend = get_backend("local", Settings(home=tmp_path, max_local_ranks=8))
    with pytest.raises(LaunchError, match="this job starts 2,048 processes"):
        backend.submit(_spec(2, 1024))
    assert backend.list() == []
