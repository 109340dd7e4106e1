"""azulite: train distributed, survive failures, serve Triton-compatible, plan the GPU cluster."""

__version__ = "0.1.0"
