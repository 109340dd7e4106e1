"""``azulite dashboard`` in a real browser (Debian's headless Chromium driven by Playwright): the jobs
page against the job store, a running job's ranks, curves, checkpoints and live log tail, served models
against a real ``azulite serve``, GPUs absent here; a key off loopback. Screenshots are saved under
build/test-artifacts/dashboard/."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from azulite.launch.backend import get_backend
from azulite.launch.local.store import JobStore
from azulite.launch.records import JobState
from azulite.launch.settings import Settings
from azulite.spec.loader import load_job
from tests.launch.jobkit import REPO, home, spec_2x1, wait_for, write_job

_ = home
AZULITE = str(Path(sys.executable).parent / "azulite")
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = REPO / "build" / "test-artifacts" / "dashboard"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (apt-get install chromium)")

# Logs 5 steps to the job's MLflow store (its log prints other losses: the curves must come from the
# store), commits a checkpoint in the documented layout, then logs step 6 once the test creates the file
# named in GO (the live tail must show it without a reload), then waits to be canceled.
TRAINING = """
import json, os, time
from datetime import datetime, timezone
from azulite import train
from azulite.train import metrics
for step in range(1, 6):
    train.log_metrics({"loss": 1.0 / step, "step_time_s": step / 100}, step=step, batch_size=32)
assert metrics.flush(300)  # in the store before the log says so (the test waits on the log)
for step in range(1, 6):
    print(f"step {step} loss 9.0 step_s 0.0{step}", flush=True)
d = os.path.join(os.environ["AZULITE_OUTPUT_CHECKPOINTS"], "step-00000005")
os.makedirs(d)
open(os.path.join(d, "shard.bin"), "wb").write(b"x" * 4096)
json.dump({"format": "azulite.checkpoint/1", "step": 5, "files": {"shard.bin": {"bytes": 4096}},
           "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")},
          open(os.path.join(d, "manifest.json"), "w"))
while not os.path.exists(os.environ["GO"]):
    time.sleep(0.1)
train.log_metrics({"loss": 0.15, "step_time_s": 0.06}, step=6)
print("step 6 loss 0.15000 step_s 0.06", flush=True)
time.sleep(300)
"""


class Dash:
    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen([AZULITE, "dashboard", "--port", "0", *args], stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})})
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in self.proc.stderr], daemon=True).start()
        while True:
            m = re.search(r"(http://[\d.]+:\d+/)(\?key=(\S+))?", lines.get(timeout=120))
            if m:
                self.url, self.key = m.group(1), m.group(3)
                break

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


#: In the page: stop the live timer and let a tail it started finish, hold the log API's answers until
#: released, refresh the job page the way the timer does, read the log while that refresh's tail is out,
#: start a second tail meanwhile; then the page routed again (its timer back).
GATED_TAIL = """async (id) => {
  clearInterval(timer);
  while (logState.busy) await new Promise((r) => setTimeout(r, 10));
  const real = api;
  let release, started, requests = 0;
  const gate = new Promise((r) => { release = r; });
  const first = new Promise((r) => { started = r; });
  api = async (path) => {
    if (path.includes("/log?")) { requests += 1; started(document.querySelector("#log").textContent); await gate; }
    return real(path);
  };
  try {
    const refresh = jobPageQuiet(id);
    const shown = await first;
    const second = tailLog();
    const during = requests;
    release();
    await Promise.all([refresh, second]);
    return {shown_while_tail_out: shown, log_requests_while_out: during};
  } finally {
    api = real;
    await route();
  }
}"""


def test_jobs_page_job_page_live_tail_and_gpus(home, tmp_path, browser):
    go = tmp_path / "go"
    spec = write_job(tmp_path / "job", TRAINING, spec_2x1(nodes=1, per_node=1, extra=f"""outputs: {{checkpoints: {{type: uri_folder}}}}
    environment_variables: {{GO: "{go}"}}"""))
    settings = Settings.from_environ()
    b = get_backend("local", settings)
    rec = b.submit(load_job(spec))
    store = JobStore(settings.db_path)
    # jobs that never ran: the list shows what the store holds, whatever their state (no supervisor: the
    # test ends them itself; the teardown's cancel would wait ~33 s for a supervisor each)
    never_ran = [store.create(name=f"queued{i}", backend="local", spec={"command": "true"}, spec_path=None,
                              environment=None, jobs_dir=settings.jobs_dir).id for i in range(3)]
    wait_for(lambda: "step 5" in "".join(b.logs(rec.id, rank=0)), 180, "the job's first steps")
    dash = Dash()
    try:
        page = browser.new_page()
        lists: list[str] = []
        page.on("request", lambda r: lists.append(r.url) if "/api/jobs" in r.url and "/api/jobs/" not in r.url else None)
        page.goto(dash.url)
        page.wait_for_selector("#jobs-table tbody tr")
        shown = page.eval_on_selector_all("#jobs-table tbody tr", "rows => rows.map(r => r.dataset.job)")
        assert sorted(shown) == sorted(r.id for r in b.list(100))
        assert page.inner_text(f'tr[data-job="{rec.id}"] td:nth-child(2)') == "running"
        page.screenshot(path=str(ARTIFACTS / "jobs.png"), full_page=True)
        # live updates fetch only what changed: a new job and a state change appear, nothing else is fetched
        late = store.create(name="late", backend="local", spec={"command": "true"}, spec_path=None, environment=None,
                            jobs_dir=settings.jobs_dir)
        never_ran.append(late.id)
        store.transition(never_ran[0], JobState.CANCELED, message="by the test")
        page.wait_for_selector(f'tr[data-job="{late.id}"]', timeout=60_000)
        page.wait_for_function(f"document.querySelector('tr[data-job=\"{never_ran[0]}\"] td:nth-child(2)').textContent === 'canceled'",
                               timeout=60_000)
        assert page.evaluate("window.__jobsState.changed") == 2
        assert len(lists) >= 2 and "since=" not in lists[0] and all("since=" in u for u in lists[1:]), lists
        assert page.inner_text("#job-count") == str(len(shown) + 1)

        page.click(f'a[href="#/job/{rec.id}"]')
        page.wait_for_selector("#loss-curve")
        assert page.inner_text("#job-state") == "running"
        assert "(mlflow)" in page.inner_text("body")
        assert page.get_attribute("#loss-curve", "data-points") == "5"
        assert float(page.get_attribute("#loss-curve", "data-last")) == pytest.approx(0.2)
        assert page.get_attribute("#step-time-curve", "data-points") == "5"
        assert float(page.get_attribute("#step-time-curve", "data-last")) == pytest.approx(0.05)
        assert page.get_attribute("#samples-curve", "data-points") == "4"  # measured between log calls
        assert page.inner_text('#checkpoints tr[data-step="5"] td:nth-child(2)') == "yes"
        assert "4.0 KiB" in page.inner_text('#checkpoints tr[data-step="5"]')
        page.wait_for_function("document.querySelector('#log').textContent.includes('step 5 loss')")
        go.touch()  # the job prints step 6 now: the page shows it without a reload
        page.wait_for_function("document.querySelector('#log').textContent.includes('step 6 loss 0.15')", timeout=120_000)
        page.wait_for_function("document.querySelector('#loss-curve').dataset.points === '6'", timeout=60_000)
        assert page.inner_text("#log").count("step 1 loss") == 1, "appended, not repeated"
        # a live refresh draws the page again: while its tail is out the log shows the text already read
        # (it was empty for that moment, which a read of it caught once in CI), and no second tail starts
        # while one is out (both would read from the same offset and append the same lines twice)
        seen = page.evaluate(GATED_TAIL, rec.id)
        assert seen["shown_while_tail_out"].count("step 1 loss") == 1, seen
        assert seen["log_requests_while_out"] == 1, seen
        assert page.inner_text("#log").count("step 1 loss") == 1
        page.screenshot(path=str(ARTIFACTS / "job.png"), full_page=True)

        b.cancel(rec.id)
        page.wait_for_function("document.querySelector('#job-state').textContent === 'canceled'", timeout=60_000)

        page.goto(dash.url + "#/gpus")
        page.wait_for_selector("#gpu-absent")
        assert "No GPU metrics" in page.inner_text("#gpu-absent")
        page.screenshot(path=str(ARTIFACTS / "gpus.png"))
    finally:
        dash.stop()
        for job_id in never_ran:
            store.transition(job_id, JobState.CANCELED, message="by the test")


def test_curves_fall_back_to_rank0_log_without_a_store(tmp_path):
    from azulite.launch.records import JobRecord, ProcessRecord
    from azulite.observe.dashboard import training_curves

    log = tmp_path / "rank0.log"
    log.write_text("step 1 loss 0.5 step_s 0.1\nstep 2 loss nan\nstep 3 loss 0.25 step_s 0.3\n")
    rank0 = ProcessRecord(attempt=1, kind="rank", name="r0", node=0, rank=0, local_rank=0, pid=None, exit_code=0, log=str(log))
    rec = JobRecord(id="j", name="j", backend="local", state=JobState.SUCCEEDED, attempt=1, created_at=0, started_at=None,
                    ended_at=None, exit_code=0, reason=None, spec={}, spec_path=None, environment=None,
                    job_dir=str(tmp_path), supervisor_pid=None, processes=[rank0])
    assert training_curves(rec) == {"source": "rank 0 log", "step": [1, 2, 3], "loss": [0.5, None, 0.25],
                                    "step_s": [0.1, None, 0.3], "samples_per_s": [None, None, None]}


def test_serving_page_against_a_real_server(home, browser):
    from tests.cli.test_serve import Served
    from tests.serve.conftest import build_model_repository
    import tritonclient.http as httpclient

    repo = build_model_repository(Path(os.environ["AZULITE_HOME"]).parent / "repo", ("add_sub_onnx",))
    s = Served(str(repo))
    dash = None
    try:
        metrics = f"http://127.0.0.1:{s.ports['Metrics']}/metrics"
        client = httpclient.InferenceServerClient(f"127.0.0.1:{s.ports['HTTPService']}")
        x = np.ones((1, 16), np.float32)
        inputs = []
        for n in ("INPUT0", "INPUT1"):
            i = httpclient.InferInput(n, [1, 16], "FP32")
            i.set_data_from_numpy(x)
            inputs.append(i)
        for _ in range(7):
            client.infer("add_sub_onnx", inputs)
        client.close()
        dash = Dash("--serve-metrics", metrics, "--serve-metrics", "http://127.0.0.1:9/metrics")
        page = browser.new_page()
        page.goto(dash.url + "#/serving")
        page.wait_for_selector('.serving-table tr[data-model="add_sub_onnx"]')
        row = page.inner_text('.serving-table tr[data-model="add_sub_onnx"]')
        assert page.inner_text('tr[data-model="add_sub_onnx"] td.success') == "7"
        assert "no histogram" not in row
        p99 = float(page.inner_text('tr[data-model="add_sub_onnx"] td:nth-child(5)'))
        assert 0 < p99 <= 10_000
        assert "cannot read http://127.0.0.1:9/metrics" in page.inner_text(".server-error")
        page.screenshot(path=str(ARTIFACTS / "serving.png"), full_page=True)
    finally:
        if dash:
            dash.stop()
        s.stop()


def test_off_loopback_a_key_is_required(home, browser):
    dash = Dash("--host", "0.0.0.0")
    try:
        assert dash.key
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(dash.url + "api/jobs", timeout=30)
        assert e.value.code == 401
        req = urllib.request.Request(dash.url + "api/jobs", headers={"Authorization": f"Bearer {dash.key}"})
        assert urllib.request.urlopen(req, timeout=30).status == 200
        page = browser.new_page()
        page.goto(f"{dash.url}?key={dash.key}")  # sets the cookie the page's own requests carry
        page.wait_for_selector("#job-count")
        assert page.inner_text("#job-count") == "0"
    finally:
        dash.stop()
