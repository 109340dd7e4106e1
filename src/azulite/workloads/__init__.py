"""Reference training programs built on azulite (DLRM on Criteo-format data: ``azulite.workloads.dlrm``)."""
