"""examples/tensorflow: MultiWorkerMirroredStrategy with 2 workers, each with its own TF_CONFIG; both
workers are in sync (2 replicas) and end with identical weights."""

import importlib.util
import json
import re

import pytest

from tests.examples.runner import final_hashes, run_example
from tests.launch.jobkit import home

_ = home  # fixture
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="tensorflow-cpu not installed"),
]


def test_tensorflow_multiworker_example(home):
    rec = run_example("tensorflow", "inputs.steps=3")
    logs = rec["rank_logs"]
    assert sorted(logs) == [0, 1]
    hashes = final_hashes(rec)
    assert len(set(hashes.values())) == 1, hashes
    cfgs = {r: json.loads(re.search(r"^tf_config=(.*)$", t, re.M).group(1)) for r, t in logs.items()}
    assert cfgs[0]["cluster"] == cfgs[1]["cluster"] and len(cfgs[0]["cluster"]["worker"]) == 2
    assert [cfgs[r]["task"] for r in (0, 1)] == [{"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    for r, text in logs.items():
        assert f"worker {r} replicas_in_sync 2" in text
    assert "step 3 loss" in logs[0] and "step 4 " not in logs[0]
