"""The Kubernetes objects of a job spec for a flavor (``--flavor``, ``AZULITE_K8S_FLAVOR``): the one place
that picks the renderer, for ``deploy render`` and the kubernetes backend alike.

A tensorflow job is a TFJob and an mpi job an MPIJob whatever flavor was asked for by default (the default
``indexed-job`` could not tell a TF worker from a parameter server, nor run mpirun's launcher); naming
another Kubeflow kind for them, or their kind for another job, is refused with the fix."""

from __future__ import annotations

from azulite.deploy.mpi_job import mpi_job
from azulite.deploy.options import AksOptions
from azulite.deploy.training import indexed_job, pytorch_job, tf_job
from azulite.errors import DeployError
from azulite.spec.job import JobSpec

#: the flavor each job kind is
FLAVOR_OF_KIND = {"Job": "indexed-job", "PyTorchJob": "pytorchjob", "TFJob": "tfjob", "MPIJob": "mpijob"}
#: the distribution type each Kubeflow flavor runs (indexed-job: pytorch or none; pytorchjob: pytorch)
_OWN = {"tfjob": "tensorflow", "mpijob": "mpi"}
_WHAT = {"pytorchjob": "a PyTorchJob runs torchrun in each worker",
         "tfjob": "a TFJob runs TensorFlow's workers and parameter servers",
         "mpijob": "an MPIJob runs mpirun over its workers"}


def training_objects(spec: JobSpec, opts: AksOptions, name: str | None = None) -> list[dict]:
    """The objects of ``spec`` for ``opts.flavor``."""
    kind = spec.distribution_type
    own = next((f for f, t in _OWN.items() if t == kind), None)  # the flavor this job must be, if any
    if opts.flavor != "indexed-job" and opts.flavor != own and (own or opts.flavor in _OWN):
        fix = f"use --flavor {own} (or leave the flavor out)" if own else "use --flavor indexed-job or pytorchjob"
        raise DeployError(f"{_WHAT[opts.flavor]}; this job is {kind}", where="--flavor", fix=fix)
    if kind == "tensorflow":
        return tf_job(spec, opts, name)
    if kind == "mpi":
        return mpi_job(spec, opts, name)
    return indexed_job(spec, opts, name) if opts.flavor == "indexed-job" else pytorch_job(spec, opts, name)
