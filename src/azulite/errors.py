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
    #: no retry can fix it (a spec, a URI, a setting or credentials wrong as given): a training process that
    #: fails on it exits ``contract.EXIT_CONFIG`` (``azulite.train.exit_code``), and its job is not restarted
    permanent: bool = False

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

    permanent = True

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


class StorageConfigError(StorageError):
    """Storage named or set up wrongly (a malformed URI, no credentials, a file where a folder must be):
    trying again cannot help, unlike storage that is down. The user's to fix: the CLI exits 2 (a training
    process exits 78 for it, ``permanent``)."""

    exit_code = 2
    permanent = True


class CheckpointError(AzuliteError):
    """A checkpoint that cannot be saved, found, verified or loaded."""

    exit_code = 1


class CheckpointCorruptError(CheckpointError):
    """Committed checkpoints of which none is intact (each un-committed, its bad file named in the log): a
    restart finds the same, since resume never starts over on its own, so a training process exits 78 for
    it (``permanent``) rather than being restarted into it."""

    permanent = True


class CheckpointUsageError(CheckpointError):
    """A checkpoint used wrongly as the script is written (a bad CheckpointConfig, a step that is no whole
    number, state that does not fit the checkpoint, a location another job writes): the same on every
    restart, so a training process exits 78 for it (``permanent``) and its job fails at once."""

    exit_code = 2
    permanent = True


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


class ModelNotReady(Unavailable):
    """A model the repository has, with no ready version (unloaded, failed to load, loading): unavailable to
    a fallback policy, answered as Triton does, 404 / NOT_FOUND (a gRPC client's retry policy retries
    UNAVAILABLE, and a 503 told it to come back in a second for a model that was unloaded)."""

    status = "NOT_FOUND"


class Unsupported(ServeError):
    """A protocol extension or feature azulite does not implement."""

    status = "UNIMPLEMENTED"


class ModelLoadError(ServeError):
    """A model whose files or config fail to load; the server keeps serving the others."""

    status = "INVALID_ARGUMENT"


class Internal(ServeError):
    """A failure inside the server or a model's own code: not the client's fault."""

    status = "INTERNAL"


class CatalogError(AzuliteError):
    """A SKU or price the catalog cannot give: an unknown SKU, a price file with a wrong field."""


class UnknownSku(CatalogError):
    """No SKU of that name; ``suggestions`` holds the nearest names in the catalog."""

    def __init__(self, name: str, suggestions: list[str], *, where: str | None = None) -> None:
        self.name = name
        self.suggestions = suggestions
        hint = f"did you mean {', '.join(suggestions)}? " if suggestions else ""
        super().__init__(
            f"unknown SKU {name!r}", where=where,
            fix=f"{hint}list the known SKUs with `azulite catalog`; catalog, cost, simulate and plan also read "
                "your own SKUs from a catalog file (--catalog FILE)",
        )


class PriceUnknown(CatalogError):
    """A price the catalog has no source for (never invented)."""


class CostError(AzuliteError):
    """Inputs the cost model or planner cannot price (a zero duration, evictions faster than progress)."""


class TraceError(AzuliteError):
    """A job trace (CSV, Philly, Alibaba PAI) that cannot be read: names the file, the row and the column."""


class SimulationError(AzuliteError):
    """A cluster and trace that cannot be simulated as given (e.g. a job no node pool can ever fit)."""


class DeployError(AzuliteError):
    """A spec or option that cannot be rendered or sent to a cluster target (AKS, Azure ML): a SKU with
    too few GPUs, a spot job without a checkpoint location, no image, no kubeconfig, no credentials."""


class RemoteError(AzuliteError):
    """A cluster or workspace API that refused or failed a call (Kubernetes, Azure ML)."""

    exit_code = 1


class DataError(AzuliteError):
    """Training data that cannot be read as asked: a missing path, a truncated gzip file, more malformed
    lines than the configured limit."""


class FlagError(AzuliteError):
    """A command-line flag given a value it cannot take (a batch size of 0, a negative number of epochs):
    names the flag, the values it takes and the value given. Permanent: a training process restarted with
    the same flags fails the same way (it exits 78, its job is not restarted)."""

    permanent = True


class ModelConfigError(AzuliteError):
    """Model flags that contradict each other or this machine (table sizes, layer sizes, memory).
    Permanent, as FlagError."""

    permanent = True


class ExportError(AzuliteError):
    """A checkpoint that cannot become a served model as asked: missing rebuild metadata, a model file
    config generate cannot read, a repository that cannot take the new version."""


class ExportVerificationError(ExportError):
    """The exported model does not reproduce the PyTorch model within the tolerance."""

    exit_code = 1


class Unauthenticated(ServeError):
    """No key, or a key that is unknown, revoked or expired (HTTP 401 / gRPC UNAUTHENTICATED)."""

    status = "UNAUTHENTICATED"


class PermissionDenied(ServeError):
    """A valid key outside what it may reach: another model, or a restricted API (403 / PERMISSION_DENIED)."""

    status = "PERMISSION_DENIED"


class ResourceExhausted(ServeError):
    """A rate limit or quota is spent (429 / RESOURCE_EXHAUSTED); ``retry_after_s`` says when to retry."""

    status = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, where: str | None = None,
                 fix: str | None = None) -> None:
        super().__init__(message, where=where, fix=fix)
        self.retry_after_s = retry_after_s


class PayloadTooLarge(ServeError):
    """A request larger than the server takes, counted after decompression (HTTP 413; gRPC
    RESOURCE_EXHAUSTED, as gRPC answers a message past its receive limit)."""

    status = "RESOURCE_EXHAUSTED"


class IntegrityError(AzuliteError):
    """A model repository whose files do not match its manifest, or a manifest or signature that does not
    verify. Names the file."""


class AuditError(AzuliteError):
    """An audit log's seal key that cannot be read or is too short, or an audit log that cannot be read to
    verify. Names the file."""


class KeyStoreError(AzuliteError):
    """An endpoint key store that cannot be read or written, or a key name that does not exist."""


class MetricsError(AzuliteError):
    """A training metric that cannot be logged or read (not a number; MLflow missing or its store unreadable)."""


class InputError(AzuliteError):
    """A job input that cannot be made available: a remote URI that does not exist or cannot be read, a
    registered data asset without a workspace to resolve it."""


class SweepError(AzuliteError):
    """A sweep job that cannot run as written: its search space, sampling algorithm, objective or limits."""


class BenchError(AzuliteError):
    """A benchmark or health check that could not run, or whose results are wrong (a collective that
    returned wrong values)."""

    exit_code = 1


class BenchInputError(AzuliteError):
    """A benchmark or health check asked for with arguments that cannot work (a size that is not one)."""


class StartupError(AzuliteError):
    """A server that cannot serve as asked once started (``--exit-on-error`` and a model that failed)."""

    exit_code = 1
