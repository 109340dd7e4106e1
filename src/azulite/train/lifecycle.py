"""A Checkpointer's last async save commits before its process group or its process goes: a script that
ends without ``close()``, or destroys its process group first, still gets it committed (see the README,
"Checkpoints and resume")."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from azulite.train.checkpoint import Checkpointer

log = logging.getLogger("azulite.train.checkpoint")

#: every Checkpointer alive in the process, for :func:`commit_pending` (weakly: it never keeps one alive)
live: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def commit_pending() -> None:
    """Wait for every live Checkpointer's pending async save to commit (a failure is logged, not raised).
    Called before the process group is destroyed: the commit's collectives need it."""
    for ck in list(live):
        if ck._pending is not None:
            log.info("waiting for the checkpoint of step %d to commit before the process group goes", ck._pending[1])
            try:
                ck.wait()
            except Exception as e:  # noqa: BLE001 - the failure is logged; the caller goes on
                log.error("%s", e)


def commit_before_destroy() -> None:
    """``torch.distributed.destroy_process_group`` waits for pending async saves first. A script that ends
    without ``close()`` but destroys its process group (examples/ddp does, as torch's tutorials do) lost
    its last save: the commit's gather ran on a destroyed group ("rank 1 wrote no hashes") and the job
    still exited 0. Wrapped once, for every caller (the user's script, azulite's own shutdown)."""
    original = dist.destroy_process_group
    if getattr(original, "azulite_commits_first", False):
        return

    def destroy_process_group(*args, **kwargs):
        commit_pending()
        return original(*args, **kwargs)

    destroy_process_group.azulite_commits_first = True  # type: ignore[attr-defined]
    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group


def commit_before_exit(checkpointer: Checkpointer) -> None:
    """A script that ends without ``close()`` still gets its last async save committed: wait for it when
    the main thread ends, before the interpreter joins threads and refuses new thread pools (which the
    commit uses). ``threading._register_atexit`` is how concurrent.futures itself gets that slot; an
    ``atexit`` handler would run too late."""
    ref = weakref.ref(checkpointer)

    def drain() -> None:
        ck = ref()
        if ck is not None and ck._pending is not None:
            log.info("waiting for the checkpoint of step %d to commit before exiting", ck._pending[1])
            try:
                ck.wait()
            except Exception as e:  # noqa: BLE001 - the failure is logged; exiting goes on
                log.error("%s", e)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(drain)
