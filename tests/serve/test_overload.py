"""Three times the capacity for 30 s against ``azulite serve`` (a real process, so its RSS is its own):
the server stays up, its memory stays bounded (bounded queues), every refusal is a 503 (full queue) or a
429 (rate limit), and a model with a fallback answers every request (some marked as the fallback's).

The one long test of the serving suite. Load is generated open-loop (requests leave at the offered rate
whatever the answers); nothing is asserted about time: only about answers and memory.
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from tests.cli.test_serve import Served

from .conftest import MODELS_DIR

DURATION_S = 30.0
# one instance, 0.1 s per batch of at most 2: 20 requests/s each; offered 60/s each (3x)
CAPACITY_RPS = 20.0
MODEL = """
name: "{name}"
backend: "python"
max_batch_size: 2
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
parameters {{ key: "delay_s" value: {{ string_value: "{delay}" }} }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
dynamic_batching {{ default_queue_policy {{ max_queue_size: {queue} }} }}
{extra}
"""
BODY = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [3.0]}]}).encode()


def _repo(root):
    for name, delay, queue, extra in (
        ("bounded", 0.1, 8, ""),
        ("limited", 0.1, 0, ""),  # unbounded queue, but a rate limit in front (--model-rate-limit)
        ("guarded", 0.1, 8, 'parameters { key: "azulite_fallback_model" value: { string_value: "light" } }'),
        ("light", 0.0, 0, ""),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(MODEL.format(name=name, delay=delay, queue=queue, extra=extra))
        shutil.copy(MODELS_DIR / "slow_py" / "model.py", root / name / "1" / "model.py")
    return root


class _Client(threading.local):
    conn: http.client.HTTPConnection | None = None


def test_three_times_overload_for_30_s(tmp_path):
    repo = _repo(tmp_path / "repo")
    served = Served(str(repo), "--model-rate-limit", f"limited={CAPACITY_RPS:g}")
    proc = psutil.Process(served.proc.pid)
    port = served.ports["HTTPService"]
    local = _Client()
    answers: dict[str, list] = {"bounded": [], "limited": [], "guarded": []}
    errors: list = []
    rss: list[int] = []
    done = threading.Event()

    def post(model: str) -> None:
        try:
            if local.conn is None:
                local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            local.conn.request("POST", f"/v2/models/{model}/infer", body=BODY)
            resp = local.conn.getresponse()
            body = resp.read()
            answers[model].append((resp.status, resp.getheader("Retry-After"), body))
        except Exception as exc:  # noqa: BLE001 - asserted below: every request must be answered
            errors.append(repr(exc))
            if local.conn is not None:
                local.conn.close()
            local.conn = None

    def sample_rss() -> None:
        while not done.wait(0.5):
            rss.append(proc.memory_info().rss)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    try:
        sampler.start()
        rss.append(proc.memory_info().rss)
        offered = 0
        with ThreadPoolExecutor(64) as pool:
            start = time.monotonic()
            interval = 1.0 / (3 * CAPACITY_RPS)
            next_at = start
            while next_at - start < DURATION_S:  # open loop: each model gets 3x its capacity
                for model in answers:
                    pool.submit(post, model)
                    offered += 1
                next_at += interval
                pause = next_at - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
            elapsed = time.monotonic() - start
        done.set()
        sampler.join(10)
        assert not errors, errors[:5]
        assert served.proc.poll() is None, "the server died under overload"
        live = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        live.request("GET", "/v2/health/live")
        assert live.getresponse().status == 200
        live.close()
    finally:
        done.set()
        served.stop()
    statuses = {m: sorted({a[0] for a in v}) for m, v in answers.items()}
    print(f"offered {offered / elapsed:.0f} requests/s for {elapsed:.0f} s; statuses {statuses}; "
          f"RSS {min(rss) / 2**20:.0f}..{max(rss) / 2**20:.0f} MiB")
    assert sum(len(v) for v in answers.values()) == offered
    # the queue-bounded model: answers or 503 with Retry-After, nothing else
    assert set(statuses["bounded"]) <= {200, 503} and 503 in statuses["bounded"]
    assert all(a[1] == "1" for a in answers["bounded"] if a[0] == 503)
    # the rate-limited model: answers or 429 with Retry-After
    assert set(statuses["limited"]) <= {200, 429} and 429 in statuses["limited"]
    assert all(a[1] is not None for a in answers["limited"] if a[0] == 429)
    # the model with a fallback: every request answered, the overflow by the fallback
    assert statuses["guarded"] == [200]
    fallen = [a for a in answers["guarded"] if b'"fallback_from":"guarded"' in a[2]]
    assert fallen and len(fallen) < len(answers["guarded"])
    # bounded memory: queues are bounded, so the server does not grow with the backlog offered
    assert max(rss) - rss[0] < 200 * 2**20, f"RSS grew by {(max(rss) - rss[0]) / 2**20:.0f} MiB"
