from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.azurite import running
from tests.train.procs import Runner

#: the toy run every resume test is compared with
STEPS = 16
INTERVAL = 4


@pytest.fixture
def runner(tmp_path: Path):
    r = Runner(tmp_path / "logs")
    try:
        yield r
    finally:
        r.cleanup()


@pytest.fixture(scope="session")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted 2-rank run: its final parameter hash and its checkpoint directory."""
    tmp = tmp_path_factory.mktemp("baseline")
    r = Runner(tmp / "logs")
    try:
        res = r.run(["--ckpt", str(tmp / "ckpt"), "--steps", str(STEPS), "--interval", str(INTERVAL),
                     "--out", str(tmp / "out.json")])
    finally:
        r.cleanup()
    assert res.returncode == 0, res.output[-4000:]
    out = json.loads((tmp / "out.json").read_text())
    assert out["step"] == STEPS and out["resumed_from"] is None
    return {"sha256": out["sha256"], "ckpt": tmp / "ckpt", "output": res.output}


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory):
    with running(tmp_path_factory) as az:
        yield az
