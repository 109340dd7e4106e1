"""Figures about the machine and the cluster: collective bandwidth with nccl-tests' semantics
(``azulite.bench.collectives``) and the node health check (``azulite.bench.doctor``)."""
