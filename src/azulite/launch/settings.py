"""Launcher settings, read once from an environment mapping and passed down (never os.environ deep inside)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from azulite.errors import AzuliteError


@dataclass(frozen=True)
class Settings:
    """``home``: azulite's state dir (``AZULITE_HOME``, default ``~/.azulite``): ``jobs.db`` (SQLite, WAL)
    and ``jobs/<id>/`` (code snapshot, per-node working dirs, per-attempt logs and rank records)."""

    home: Path
    backend: str = "local"  # AZULITE_BACKEND
    kill_grace_s: float = 10.0  # SIGTERM -> SIGKILL on cancel (AZULITE_KILL_GRACE_S)
    preempt_grace_s: float = 60.0  # SIGTERM -> SIGKILL on preempt: time to commit a checkpoint
    #: after one process of an attempt failed, how long its peers get to end by themselves before SIGTERM
    #: (a DDP peer of a dead rank blocks in a collective until gloo's 30-minute timeout otherwise)
    peer_grace_s: float = 5.0
    #: a job preempted more often than this fails instead of requeuing (AZULITE_MAX_PREEMPTIONS)
    max_preemptions: int = 20
    #: an elastic job's lost node comes back (a replacement agent joins) this long after it was lost, as a
    #: cloud brings up a replacement VM (AZULITE_NODE_RETURN_S; negative: only on request)
    node_return_s: float = 60.0
    #: the most processes a local job may start (AZULITE_MAX_LOCAL_RANKS; None: 4 per usable core, at least
    #: 8: ``azulite.launch.local.capacity``)
    max_local_ranks: int | None = None

    @property
    def db_path(self) -> Path:
        return self.home / "jobs.db"

    @property
    def jobs_dir(self) -> Path:
        return self.home / "jobs"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        home = Path(env.get("AZULITE_HOME") or Path(env.get("HOME", "~")) / ".azulite").expanduser().resolve()
        def number(name: str, default: str) -> float:
            raw = env.get(name, default)
            try:
                return float(raw)
            except ValueError:
                raise AzuliteError(f"{name}={raw!r} is not a number", where=name,
                                   fix=f"set it to a number such as {default}, or unset it") from None

        return cls(
            home=home,
            backend=env.get("AZULITE_BACKEND", "local"),
            kill_grace_s=number("AZULITE_KILL_GRACE_S", "10"),
            preempt_grace_s=number("AZULITE_PREEMPT_GRACE_S", "60"),
            peer_grace_s=number("AZULITE_PEER_GRACE_S", "5"),
            max_preemptions=int(number("AZULITE_MAX_PREEMPTIONS", "20")),
            node_return_s=number("AZULITE_NODE_RETURN_S", "60"),
            max_local_ranks=_positive_int(env, "AZULITE_MAX_LOCAL_RANKS"),
        )


def _positive_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise AzuliteError(f"{name}={raw!r} is not a whole number >= 1", where=name,
                           fix="set it to the most processes a local job may start, such as 64, or unset it "
                               "(4 per usable core)")
    return int(raw)
