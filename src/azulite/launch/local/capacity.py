"""What this machine can run: a local job starts a process per rank (and an agent per node), so a count a
cloud cluster takes (`job validate` accepts up to ``spec.job.MAX_NODES`` nodes) is refused at a local submit
when it is far beyond the machine's cores, before anything starts (100000 processes per node started
100000 processes per node).

The limit: ``RANKS_PER_CORE`` ranks per usable core (the cores this process may run on), at least
``MIN_RANKS``; ``AZULITE_MAX_LOCAL_RANKS`` sets another (``Settings.max_local_ranks``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from azulite.errors import LaunchError

if TYPE_CHECKING:
    from azulite.spec.job import JobSpec

#: ranks per usable core a local job may start: a few processes share a core well (most wait on
#: collectives or data); far more only thrash, or run the machine out of memory
RANKS_PER_CORE = 4
#: the least limit, however few the cores: the examples (2 x 2 ranks, 4 MPI ranks) run on one core
MIN_RANKS = 8


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def local_processes(spec: JobSpec) -> tuple[int, str, str]:
    """(processes the job starts, how they are counted, the fields that give them)."""
    d = spec.distribution
    if spec.distribution_type == "tensorflow":
        ps = d.parameter_server_count  # type: ignore[union-attr]
        return (spec.world_size + ps, f"{spec.world_size} worker(s) + {ps} parameter server(s)",
                "distribution.worker_count, distribution.parameter_server_count")
    fields = "resources.instance_count" + (", distribution.process_count_per_instance" if d is not None else "")
    return (spec.world_size, f"{spec.nodes} node(s) x {spec.processes_per_node} process(es)", fields)


def check_capacity(spec: JobSpec, limit: int | None = None, cores: int | None = None, prefix: str = "") -> None:
    """A LaunchError when ``spec`` starts more processes than this machine runs (``limit``: the setting,
    None for the default from ``cores``; ``prefix``: where the fields sit, ``trial.`` in a sweep)."""
    cores = usable_cores() if cores is None else cores
    most = limit if limit is not None else max(MIN_RANKS, RANKS_PER_CORE * cores)
    count, how, fields = local_processes(spec)
    if count <= most:
        return
    said = (f"AZULITE_MAX_LOCAL_RANKS={limit}" if limit is not None
            else f"{RANKS_PER_CORE} per usable core, {cores} core(s) here")
    if spec.distribution_type == "tensorflow":
        example = f"distribution.worker_count={max(1, most - spec.distribution.parameter_server_count)}"  # type: ignore[union-attr]
    elif spec.nodes <= most and spec.processes_per_node > 1:
        example = f"distribution.process_count_per_instance={max(1, most // spec.nodes)}"
    else:
        example = f"resources.instance_count={max(1, most // spec.processes_per_node)}"
    raise LaunchError(
        f"this job starts {count:,} processes ({how}); this machine runs at most {most:,} ({said})",
        where=", ".join(prefix + f for f in fields.split(", ")),
        fix=f"lower the counts for a local run (e.g. --set {prefix}{example}), render the job for a cluster "
            f"(azulite deploy render), or raise the limit with AZULITE_MAX_LOCAL_RANKS={count}")
