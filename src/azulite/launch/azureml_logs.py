"""An Azure ML job's logs, read the way azure-ai-ml reads them for ``az ml job stream``: the run's details
from the workspace's run-history service (``RunOperations.get_run_details``, the SDK's generated client,
reached through the workspace's discovery URL) list each log file with a read SAS URL on the workspace's
Blob store, and each file is fetched through the SDK's HTTP pipeline.

Why not ``MLClient.jobs.stream`` itself: it writes to ``sys.stdout`` (no lines to hand to the CLI), sleeps on
a sigmoid up to 60 s between polls, streams only rank 0, and raises on a failed run. The pieces it is made
of are used instead: the run-history client, the SDK's log-name patterns and its retrying pipeline. As
``jobs.stream`` does, when the job has a ``default`` output on a datastore (the workspace artifact store) the
log files are listed from that datastore's Blob container (``list_logs_in_datastore``, with read-SAS URLs the
SDK signs from the datastore's key) rather than taken from the run details.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Iterator

from azulite.errors import RemoteError

#: run-history statuses after which no more log lines come (RunHistoryConstants.TERMINAL_STATUSES)
ENDED = frozenset({"Completed", "Failed", "Canceled", "NotResponding", "Paused"})
_RANK = re.compile(r"(\d+)(?:_ps)?\.txt$")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def log_names(log_files: dict[str, str], rank: int | None) -> list[str]:
    """The user log files of the run (common runtime ``user_logs/std_log*.txt``, else the legacy
    ``azureml-logs/NN_*.txt``), sorted; with ``rank`` only that process's file."""
    from azure.ai.ml.constants._job.job import JobLogPattern

    names = sorted(n for n in log_files if re.match(JobLogPattern.COMMON_RUNTIME_ALL_USER_LOG_PATTERN, n))
    if not names:
        names = sorted(n for n in log_files if re.match(JobLogPattern.COMMAND_JOB_LOG_PATTERN, n))
    if rank is None:
        return names
    # a single-process job writes std_log.txt (rank 0); a distributed one std_log_process_<rank>.txt
    return [n for n in names if (int(m.group(1)) if (m := _RANK.search(n)) else 0) == rank]


class RunLogs:
    """Reads the log files of one run; ``lines()`` yields ``[file] line`` for every line not yet yielded."""

    def __init__(self, client: Any, name: str, *, poll_s: float, sleep: Callable[[float], None] = time.sleep) -> None:
        from azure.ai.ml._utils.utils import create_requests_pipeline_with_retry

        self.client, self.name, self.poll_s, self.sleep = client, name, poll_s, sleep
        self.pipeline = create_requests_pipeline_with_retry(requests_pipeline=client.jobs._requests_pipeline)
        self.seen: dict[str, int] = {}
        self.status = ""
        self._store: tuple[dict, str] | None | bool = False  # (datastore info, prefix), None: none; False: not looked up

    def _log_store(self) -> tuple[dict, str] | None:
        """The datastore and path of the job's ``default`` output, as ``jobs.stream`` finds them, or None."""
        if self._store is False:
            from azure.ai.ml._artifacts._artifact_utilities import get_datastore_info

            try:
                job = self.client.jobs._get_job(self.name)
                outputs = getattr(job.properties, "outputs", None) or {}
                out = outputs.get("default")
                uri = getattr(out, "uri", None) or ""
                kind = getattr(out, "job_output_type", None)
                kind = str(getattr(kind, "value", kind))
                if out is None or kind != "uri_folder" or "datastores/" not in uri:
                    self._store = None
                else:
                    datastore, prefix = uri.split("datastores/", 1)[1].split("/", 1)
                    self._store = (get_datastore_info(self.client.jobs._datastore_operations, datastore), prefix)
            except Exception as e:  # noqa: BLE001
                raise RemoteError(f"cannot find where Azure ML job {self.name} keeps its logs: {_first_line(e)}",
                                  where="Azure ML workspace", fix="check the workspace settings and your access") from None
        return self._store  # type: ignore[return-value]

    def _files(self, details: Any) -> dict[str, str]:
        store = self._log_store()
        if store is None:
            return details.log_files or {}
        from azure.ai.ml._artifacts._artifact_utilities import list_logs_in_datastore

        try:
            return list_logs_in_datastore(store[0], prefix=store[1], legacy_log_folder_name="/azureml-logs/")
        except Exception as e:  # noqa: BLE001
            raise RemoteError(f"cannot list the log files of Azure ML job {self.name}: {_first_line(e)}",
                              where="workspace Blob store", fix="check your network access to the workspace's storage") from None

    def _details(self) -> Any:
        try:
            # the SDK's own run-history operations; built on first use from the workspace's discovery URL
            return self.client.jobs._runs_operations.get_run_details(self.name)
        except Exception as e:  # noqa: BLE001 - the SDK raises many types for one user-visible failure
            raise RemoteError(f"cannot read the run details of Azure ML job {self.name}: {_first_line(e)}",
                              where="Azure ML run history", fix="check the workspace settings and your access") from None

    def _text(self, log: str, url: str) -> str:
        try:
            response = self.pipeline.get(url)
        except Exception as e:  # noqa: BLE001
            raise RemoteError(f"cannot read {log} of Azure ML job {self.name}: {_first_line(e)}",
                              where="workspace Blob store", fix="check your network access to the workspace's storage") from None
        if response.status_code == 404:  # listed before its first line was flushed
            return ""
        if response.status_code != 200:
            raise RemoteError(f"reading {log} of Azure ML job {self.name}: HTTP {response.status_code}",
                              where="workspace Blob store", fix="run the command again (the SAS URL may have expired)")
        return response.text()

    def poll(self, rank: int | None) -> list[str]:
        details = self._details()
        self.status = str(details.status or "")
        files = self._files(details)
        out: list[str] = []
        ended = self.status in ENDED
        for log in log_names(files, rank):
            text = self._text(log, files[log])
            lines = text.splitlines()
            if lines and not ended and not text.endswith("\n"):
                lines.pop()  # a line still being written: yielded whole on a later poll
            start = self.seen.get(log, 0)
            if len(lines) > start:
                label = log.rsplit("/", 1)[-1].removesuffix(".txt")
                out += [f"[{label}] {line}" for line in lines[start:]]
                self.seen[log] = len(lines)
        return out

    def lines(self, *, rank: int | None, follow: bool) -> Iterator[str]:
        """Every line so far; with ``follow``, poll every ``poll_s`` until the run has ended (the details
        are read before the files, so the last poll after the end has every line)."""
        while True:
            yield from self.poll(rank)
            if not follow or self.status in ENDED:
                return
            self.sleep(self.poll_s)
