"""The ``azureml`` backend: a job spec rendered as an Azure ML command job (``azulite.deploy.azureml``) and
submitted with azure-ai-ml's ``MLClient`` (pytorch / tensorflow / mpi distributions, resources, instance
count, environment, inputs/outputs, ``queue_settings`` spot tier). ``job show`` / ``wait`` read the job's
status from the workspace, ``job cancel`` cancels it, ``job logs [--follow]`` reads the run's log files
through the workspace's run-history service (``azulite.launch.azureml_logs``). ``job preempt`` is refused:
Azure ML evicts low-priority nodes itself and has no call to simulate it.

Settings (read once from the environment): ``AZULITE_AML_SUBSCRIPTION``, ``AZULITE_AML_RESOURCE_GROUP``,
``AZULITE_AML_WORKSPACE`` (all required), ``AZULITE_AML_COMPUTE`` (default: the spec's ``compute``),
``AZULITE_AML_DATASTORE`` and ``AZULITE_AML_STORAGE_ACCOUNT`` (for az:// outputs and inputs),
``AZULITE_AML_POLL_S`` (seconds between log polls of ``job logs --follow``, default 10).
Credentials: azure-identity's DefaultAzureCredential (``az login``, a service principal in AZURE_CLIENT_ID /
AZURE_TENANT_ID / AZURE_CLIENT_SECRET, or a managed identity), checked before anything is recorded or sent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from azulite.deploy.azureml import AzureMLOptions, command_job
from azulite.deploy.options import check_storage_account
from azulite.errors import AzuliteError, DeployError, LaunchError, RemoteError
from azulite.launch.azureml_logs import RunLogs
from azulite.launch.backend import Backend, Feature, register_backend, restated
from azulite.launch.local.store import JobStore
from azulite.launch.records import JobRecord, JobState
from azulite.spec.job import JobSpec

ARM_SCOPE = "https://management.azure.com/.default"
#: Azure ML job status -> azulite state (JobStatus of the REST API)
STATES = {
    "NotStarted": JobState.QUEUED, "Starting": JobState.QUEUED, "Provisioning": JobState.QUEUED,
    "Preparing": JobState.QUEUED, "Queued": JobState.QUEUED, "Paused": JobState.QUEUED, "Unknown": JobState.QUEUED,
    "Running": JobState.RUNNING, "Finalizing": JobState.RUNNING, "NotResponding": JobState.RUNNING,
    "CancelRequested": JobState.RUNNING,
    "Completed": JobState.SUCCEEDED, "Failed": JobState.FAILED, "Canceled": JobState.CANCELED,
}
_REQUIRED = (("AZULITE_AML_SUBSCRIPTION", "subscription id"), ("AZULITE_AML_RESOURCE_GROUP", "resource group"),
             ("AZULITE_AML_WORKSPACE", "workspace name"))


def _status_name(status: Any) -> str:
    """azure-ai-ml gives "Completed" or a JobStatus enum member; the REST name either way."""
    value = getattr(status, "value", status)
    return str(value)


@register_backend("azureml")
class AzureMLBackend(Backend):
    # max_restarts and elastic: refused where the document is rendered (deploy.azureml.check_azureml_fields),
    # in the same words as `deploy render --target azureml`
    unsupported = frozenset({Feature.PREEMPT})

    def __init__(self, settings, environ: Mapping[str, str] | None = None, *, credential: Any = None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(settings, environ)
        self.store = JobStore(settings.db_path)
        self.opts = AzureMLOptions(compute=self.environ.get("AZULITE_AML_COMPUTE") or None,
                                   datastore=self.environ.get("AZULITE_AML_DATASTORE") or None,
                                   storage_account=check_storage_account(account, "AZULITE_AML_STORAGE_ACCOUNT")
                                   if (account := self.environ.get("AZULITE_AML_STORAGE_ACCOUNT")) else None)
        self._credential = credential
        self._client: Any = None
        raw = self.environ.get("AZULITE_AML_POLL_S", "10")
        try:
            self.poll_s = float(raw)
        except ValueError:
            raise DeployError(f"AZULITE_AML_POLL_S={raw!r} is not a number", where="AZULITE_AML_POLL_S",
                              fix="set it to the seconds between log polls, such as 10, or unset it") from None

    # ---- workspace and credentials -------------------------------------------------------------------
    def _workspace(self) -> tuple[str, str, str]:
        missing = [f"{var} ({what})" for var, what in _REQUIRED if not self.environ.get(var)]
        if missing:
            raise DeployError(f"no Azure ML workspace: {', '.join(missing)} not set", where=missing[0].split()[0],
                              fix="export AZULITE_AML_SUBSCRIPTION=... AZULITE_AML_RESOURCE_GROUP=... AZULITE_AML_WORKSPACE=...")
        return tuple(self.environ[v] for v, _ in _REQUIRED)  # type: ignore[return-value]

    def _checked_credential(self) -> Any:
        if self._credential is None:
            from azure.identity import DefaultAzureCredential

            self._credential = DefaultAzureCredential(exclude_interactive_browser_credential=True)
        try:
            self._credential.get_token(ARM_SCOPE)
        except Exception as e:  # noqa: BLE001 - every credential failure is the same user problem
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise DeployError(f"Azure credentials absent or refused: {first}", where="Azure credentials",
                              fix="run `az login`, or set AZURE_CLIENT_ID, AZURE_TENANT_ID and AZURE_CLIENT_SECRET "
                                  "(a service principal), or run where a managed identity is assigned") from None
        return self._credential

    @property
    def client(self) -> Any:
        if self._client is None:
            sub, rg, ws = self._workspace()
            credential = self._checked_credential()
            from azure.ai.ml import MLClient

            self._client = MLClient(credential, sub, rg, ws)
        return self._client

    def _where(self, rec: JobRecord) -> dict:
        try:
            return json.loads((Path(rec.job_dir) / "remote.json").read_text())
        except (OSError, ValueError):
            raise LaunchError(f"{rec.id} has no record of its Azure ML job ({rec.job_dir}/remote.json)",
                              fix="it was not submitted to Azure ML by this azulite home") from None

    # ---- submit --------------------------------------------------------------------------------------
    def _submit_impl(self, spec: JobSpec, *, spec_path: str | None) -> JobRecord:
        try:
            doc = command_job(spec, self.opts)  # every spec check first
        except AzuliteError as e:
            raise restated(e, {"--compute": "AZULITE_AML_COMPUTE", "--datastore": "AZULITE_AML_DATASTORE",
                               "--storage-account": "AZULITE_AML_STORAGE_ACCOUNT"}) from None
        client = self.client  # then the workspace settings and the credentials
        rec = self.store.create(name=spec.name, backend=self.name, spec=spec.model_dump(mode="json"), spec_path=spec_path,
                                environment=spec.environment_label, jobs_dir=self.settings.jobs_dir)
        job_dir = Path(rec.job_dir)
        job_dir.mkdir(parents=True, exist_ok=True)
        doc_path = job_dir / "job.azureml.yml"
        doc_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        try:
            from azure.ai.ml import load_job

            created = client.jobs.create_or_update(load_job(doc_path))
        except Exception as e:  # noqa: BLE001 - the SDK raises many types for one user-visible failure
            message = str(e).strip().splitlines()[0][:500] if str(e).strip() else type(e).__name__
            self.store.transition(rec.id, JobState.FAILED, message=f"submit failed: {message}", exit_code=1)
            raise RemoteError(f"Azure ML refused the job: {message}", where="Azure ML workspace",
                              fix=f"check the rendered document {doc_path} (azulite deploy render --target azureml)") from None
        (job_dir / "remote.json").write_text(json.dumps({"name": created.name, "studio_url": created.studio_url}))
        self.store.event(rec.id, f"created Azure ML job {created.name}: {created.studio_url}")
        return self._sync(self.store.get(rec.id), _status_name(created.status))

    # ---- status --------------------------------------------------------------------------------------
    def _sync(self, rec: JobRecord, status: str) -> JobRecord:
        state = STATES.get(status, JobState.QUEUED)
        if state != rec.state and not rec.state.terminal:
            if state != JobState.QUEUED and rec.state == JobState.QUEUED and state != JobState.CANCELED:
                self.store.transition(rec.id, JobState.RUNNING, attempt=max(rec.attempt, 1))
            if state.terminal:
                self.store.transition(rec.id, state, message=f"Azure ML status {status}",
                                      exit_code=0 if state == JobState.SUCCEEDED else 1)
        return self.store.get(rec.id)

    def _status_impl(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id)
        if rec.state.terminal:
            return rec
        name = self._where(rec)["name"]
        try:
            job = self.client.jobs.get(name)
        except DeployError:
            raise
        except Exception as e:  # noqa: BLE001
            raise RemoteError(f"cannot read Azure ML job {name}: {str(e).strip().splitlines()[0][:300]}",
                              where="Azure ML workspace", fix="check the workspace settings and your access") from None
        return self._sync(rec, _status_name(job.status))

    def _list_impl(self, limit: int) -> list[JobRecord]:
        return [r for r in self.store.list(limit) if r.backend == self.name]

    def _logs_impl(self, job_id: str, *, rank: int | None, follow: bool) -> Iterator[str]:
        rec = self.store.get(job_id)
        name = self._where(rec)["name"]
        reader = RunLogs(self.client, name, poll_s=self.poll_s)
        yield from reader.lines(rank=rank, follow=follow)
        if reader.status:  # the run history's status is the job's: record an end seen while following
            self._sync(self.store.get(job_id), reader.status)

    def preempt(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id)
        raise LaunchError(f"the azureml backend cannot preempt {rec.id}: Azure ML evicts low-priority nodes itself "
                          "and offers no call to simulate an eviction", where="job preempt",
                          fix="rehearse preemption on the local or kubernetes backend (`azulite job submit SPEC "
                              "--backend local|kubernetes`, then `azulite job preempt ID`); on Azure ML submit with "
                              "`priority: spot` and a checkpoint location so a real eviction resumes")

    def _cancel_impl(self, job_id: str) -> JobRecord:
        rec = self.store.get(job_id)
        name = self._where(rec)["name"]
        if not rec.state.terminal:
            try:
                self.client.jobs.begin_cancel(name).result()
            except DeployError:
                raise
            except Exception as e:  # noqa: BLE001
                raise RemoteError(f"cannot cancel Azure ML job {name}: {str(e).strip().splitlines()[0][:300]}",
                                  where="Azure ML workspace", fix="check the workspace settings and your access") from None
            self.store.transition(rec.id, JobState.CANCELED, message="canceled in Azure ML")
        return self.store.get(job_id)
