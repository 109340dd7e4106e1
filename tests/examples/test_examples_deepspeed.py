"""examples/deepspeed: DeepSpeed ZeRO-3 on CPU as a pytorch distribution (``--deepspeed_config``), 2 ranks
through the torchrun path; every rank ends with the same gathered parameters, and ZeRO-3 really
partitioned them (each rank held about half)."""

import importlib.util
import re

import pytest

from tests.examples.runner import REPO, final_hashes, run_example
from tests.launch.jobkit import home

_ = home  # fixture
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed"),
]


def test_deepspeed_zero3_example(home, monkeypatch):
    # should any op get JIT-compiled, it lands in the project's cache, not in ~
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    rec = run_example("deepspeed", "inputs.steps=5")
    assert sorted(rec["rank_logs"]) == [0, 1]
    hashes = final_hashes(rec)
    assert len(set(hashes.values())) == 1, hashes
    for text in rec["rank_logs"].values():
        m = re.search(r"zero_stage (\d+) params (\d+) partition_on_rank (\d+)", text)
        assert m, text[-2000:]
        stage, full, mine = map(int, m.groups())
        assert stage == 3 and full == 1153 and mine < full  # partitioned, not replicated
    assert "step 5 loss" in rec["rank_logs"][0] and "step 6 " not in rec["rank_logs"][0]
