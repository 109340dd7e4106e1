"""Model backends behind one small interface (base.py), chosen by name from a registry."""

from azulite.serve.backends.base import Backend, ModelInstance, Timing, WorkItem, get_backend, register

__all__ = ["Backend", "ModelInstance", "Timing", "WorkItem", "get_backend", "register"]
