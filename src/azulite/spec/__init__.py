"""azulite.spec: typed, validated specs read from YAML (job; later deployment and cluster)."""

from azulite.spec.job import JobSpec
from azulite.spec.loader import load_job, render_command

__all__ = ["JobSpec", "load_job", "render_command"]
