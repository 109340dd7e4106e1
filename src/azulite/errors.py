"""One error root for everything azulite reports to a user.

Every error a user can cause is an :class:`AzuliteError` carrying structured fields: *what* is wrong,
*where* (a file and line, a field path, a URI, a model name), and *how to fix it*. Each transport maps
these once: the CLI to an exit code and a message without a traceback, the serving front-ends to an
HTTP status or a gRPC code (see ``azulite.serve``).
"""

from __future__ import annotations


class AzuliteError(Exception):
    """Root of every error azulite raises on purpose.

    ``exit_code`` is what the CLI exits with: 2 for a user's mistake (bad spec, bad flag, bad input),
    1 for a failure of the thing that ran (a job that failed, storage that broke).
    """

    exit_code: int = 2

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.where = where
        self.fix = fix

    def __str__(self) -> str:
        parts = []
        if self.where:
            parts.append(f"{self.where}: ")
        parts.append(self.message)
        if self.fix:
            parts.append(f"\n  fix: {self.fix}")
        return "".join(parts)


class SpecError(AzuliteError):
    """A spec file (job, deployment, cluster) that does not validate."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        field: str | None = None,
        value: object = None,
        fix: str | None = None,
    ) -> None:
        self.file = file
        self.line = line
        self.field = field
        self.value = value
        where = None
        if file:
            where = f"{file}:{line}" if line else file
        if field:
            where = f"{where} ({field})" if where else field
        super().__init__(message, where=where, fix=fix)


class LaunchError(AzuliteError):
    """A job that cannot be started as asked (a port in use, mpirun missing, a missing input path)."""


class JobNotFound(AzuliteError):
    """No job with that id in the job store."""


class StorageError(AzuliteError):
    """Checkpoint or artifact storage that cannot be reached or written (a bad URI, Blob down)."""

    exit_code = 1


class CheckpointError(AzuliteError):
    """A checkpoint that cannot be saved, found, verified or loaded."""

    exit_code = 1


class ServeError(AzuliteError):
    """An error answered to an inference client. ``status`` names the KServe v2 / Triton class of error;
    the HTTP and gRPC front-ends map it once to their own codes."""

    status: str = "INTERNAL"

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None) -> None:
        super().__init__(message, where=where, fix=fix)


class InvalidArgument(ServeError):
    """The client sent something wrong: input name, dtype, shape, malformed body, bad parameter."""

    status = "INVALID_ARGUMENT"


class NotFound(ServeError):
    """Unknown model, version or resource."""

    status = "NOT_FOUND"


class Unavailable(ServeError):
    """The model exists but cannot answer now: not ready, queue full, shutting down."""

    status = "UNAVAILABLE"


class Unsupported(ServeError):
    """A protocol extension or feature azulite does not implement."""

    status = "UNIMPLEMENTED"


class ModelLoadError(ServeError):
    """A model whose files or config fail to load; the server keeps serving the others."""

    status = "INVALID_ARGUMENT"


class Internal(ServeError):
    """A failure inside the server or a model's own code: not the client's fault."""

    status = "INTERNAL"


class StartupError(AzuliteError):
    """A server that cannot serve as asked once started (``--exit-on-error`` and a model that failed)."""

    exit_code = 1
