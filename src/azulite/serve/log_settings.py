"""Triton's logging extension (``GET/POST v2/logging``, gRPC ``LogSettings``): which lines the server
writes (``log_info``, ``log_warning``, ``log_error``, ``log_verbose_level``) and their time format
(``log_format``: ``default`` or ``ISO8601``), changed while it runs, in every process of the server.

One server is several processes: front-ends (``--workers``), the model host, a Python model's instance
processes; and a Python model logs through ``pb_utils.Logger`` in whichever of them runs it. The settings
live in one small JSON file named by ``AZULITE_LOG_SETTINGS``, which the process that configures logging
first (``install``: the CLI's ``azulite serve``; else the first ``update``) creates and every child
inherits through its environment. An update replaces the file atomically; each process's handler reads it
again when its inode or modification time changed (one ``stat`` per log line: lines are rare, a request
never logs). So a setting changed through any front-end holds in all of them and in the instances at once,
with nothing to forward. Python's logging levels stand for Triton's kinds: INFO for info, WARNING,
ERROR (and CRITICAL) for error, DEBUG for verbose (shown from level 1, as is the libraries' INFO).

``log_file`` is read-only here, as in Triton ("log file location can not be updated through network
protocol"): the server writes to its standard error.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from azulite.errors import InvalidArgument, Unsupported

ENV = "AZULITE_LOG_SETTINGS"
FORMATS = ("default", "ISO8601")
_BOOLS = ("log_info", "log_warning", "log_error")


@dataclass(frozen=True)
class LogSettings:
    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"

    def shows(self, levelno: int, name: str) -> bool:
        """Whether a line of this level from this logger is written. The libraries' own info lines (an
        Azure SDK logs each HTTP call) count as verbose; their debug lines are never written."""
        if levelno >= logging.ERROR:
            return self.log_error
        if levelno >= logging.WARNING:
            return self.log_warning
        ours = name == "azulite" or name.startswith("azulite.")
        if levelno >= logging.INFO:
            return self.log_info and (ours or self.log_verbose_level > 0)
        return ours and self.log_verbose_level > 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def checked_update(changes: dict[str, Any]) -> dict[str, Any]:
    """A client's update (HTTP JSON values, or gRPC's typed ones read as Python values), each field checked
    for its type and value; fields Triton does not know are ignored, as Triton ignores them."""
    if not isinstance(changes, dict):
        raise InvalidArgument("the logging settings must be a JSON object", fix='e.g. {"log_verbose_level": 1}')
    out: dict[str, Any] = {}
    for key, value in changes.items():
        if key in _BOOLS:
            if not isinstance(value, bool):
                raise InvalidArgument(f"log setting '{key}' must be a boolean, got {json.dumps(value)}")
        elif key == "log_verbose_level":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"log setting 'log_verbose_level' must be an integer >= 0, got {json.dumps(value)}",
                                      fix="0 turns verbose lines off; 1 or more shows them")
        elif key == "log_format":
            if value not in FORMATS:
                raise InvalidArgument(f"log setting 'log_format' must be one of {', '.join(FORMATS)}, got "
                                      f"{json.dumps(value)}")
        elif key == "log_file":  # any value, as Triton 2.51 answers it (501; tests/serve/test_protocol_triton.py)
            raise Unsupported("log file location can not be updated through network protocol",
                              fix="start the server with its standard error sent where the log should go")
        else:
            continue
        out[key] = value
    return out


# --- the shared file -----------------------------------------------------------------------------------

_cache: tuple[str, tuple[int, int], LogSettings] | None = None  # (path, (inode, mtime), settings) last read here


def _path() -> str | None:
    return os.environ.get(ENV) or None


def _key(st: os.stat_result) -> tuple[int, int]:
    return st.st_ino, st.st_mtime_ns


def _write(path: str, settings: LogSettings) -> None:
    try:
        before = _key(os.stat(path))
    except OSError:
        before = None
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(settings.as_dict(), f)
    os.replace(tmp, path)  # a reader sees the old settings or the new, never half
    after = os.stat(path)
    if _key(after) == before:  # same tick, inode number reused: move the time on so readers see a change
        os.utime(path, ns=(after.st_atime_ns, after.st_mtime_ns + 1))


def _create(initial: LogSettings) -> str:
    _sweep()
    fd, path = tempfile.mkstemp(prefix=f"azulite-log-{os.getpid()}-", suffix=".json")
    os.close(fd)
    _write(path, initial)
    os.environ[ENV] = path  # every child process this one starts reads the same file
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and _unlink(path))
    return path


def _sweep() -> None:
    """Remove the settings files of servers that are gone without their exit handler (killed)."""
    for stale in Path(tempfile.gettempdir()).glob("azulite-log-*-*.json"):
        try:
            os.kill(int(stale.name.split("-")[2]), 0)
        except ProcessLookupError:
            _unlink(str(stale))
        except (ValueError, PermissionError, IndexError):
            pass  # not one of ours, or another user's live server


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def current() -> LogSettings:
    """This server's settings (the defaults where no server set any)."""
    global _cache
    path = _path()
    if path is None:
        return LogSettings()
    try:
        key = _key(os.stat(path))
    except OSError:
        return _cache[2] if _cache is not None and _cache[0] == path else LogSettings()
    if _cache is not None and _cache[0] == path and _cache[1] == key:
        return _cache[2]
    try:
        with open(path) as f:
            settings = LogSettings(**{k: v for k, v in json.load(f).items() if k in LogSettings.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return _cache[2] if _cache is not None else LogSettings()
    _cache = (path, key, settings)
    return settings


def update(changes: dict[str, Any]) -> LogSettings:
    """Apply a client's update (checked first: nothing changes on an error) and return the settings."""
    checked = checked_update(changes)
    if not checked:
        return current()
    settings = replace(current(), **checked)
    path = _path() or _create(settings)
    _write(path, settings)
    return current()


# --- a process's handler -----------------------------------------------------------------------------


class _Gate(logging.Filter):
    """Reads the settings once per line: whether it is written, and (for _Formatter, which the handler
    runs next on the same record) its time format."""

    def filter(self, record: logging.LogRecord) -> bool:
        settings = current()
        record.azulite_iso = settings.log_format == "ISO8601"
        return settings.shows(record.levelno, record.name)


class _Formatter(logging.Formatter):
    """The process's line format, its time as the settings say: logging's default or ISO 8601 (UTC)."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if getattr(record, "azulite_iso", False):
            return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        return super().formatTime(record, datefmt)


def install(initial: LogSettings | None = None, *, prefix: str = "") -> None:
    """Configure this process's logging: one standard-error handler whose lines the settings choose. A
    server's first process passes ``initial`` and gets a file of its own (never one it inherited: a server
    started from another's process tree is its own server); its children pass nothing and read the file
    their environment names."""
    if initial is not None:
        _create(initial)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Gate())
    handler.setFormatter(_Formatter(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    # the gate decides, so a change needs no level set in each process; only azulite's debug lines are
    # made at all (a library's are never written)
    root.setLevel(logging.INFO)
    logging.getLogger("azulite").setLevel(logging.DEBUG)
