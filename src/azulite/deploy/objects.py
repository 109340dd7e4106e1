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
#: the flavor a distribution type always renders as (the others: indexed-job or pytorchjob)
_OWN = {"tensorflow": "tfjob", "mpi": "mpijob"}
_WHAT = {"pytorchjob": "a PyTorchJob runs torchrun in each worker",
         "tfjob": "a TFJob runs TensorFlow's workers and parameter servers",
         "mpijob": "an MPIJob runs mpirun over its workers"}


def training_objects(spec: JobSpec, opts: AksOptions, name: str | None = None) -> list[dict]:
    """The objects of ``spec`` for ``opts.flavor``."""
    kind = spec.distribution_type
    own = _OWN.get(kind)
    if own and opts.flavor not in ("indexed-job", own):
        raise DeployError(f"{_WHAT[opts.flavor]}; this job is {kind}", where="--flavor",
                          fix=f"use --flavor {own} (or leave the flavor out)")
    if not own and opts.flavor in _OWN.values():
        raise DeployError(f"{_WHAT[opts.flavor]}; this job is {kind}", where="--flavor",
                          fix="use --flavor indexed-job or pytorchjob")
    if kind == "tensorflow":
        return tf_job(spec, opts, name)
    if kind == "mpi":
        return mpi_job(spec, opts, name)
    return indexed_job(spec, opts, name) if opts.flavor == "indexed-job" else pytorch_job(spec, opts, name)
