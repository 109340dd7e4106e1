"""CheckpointConfig: every field a user gets wrong is named, with a fix, when the config is built."""

from __future__ import annotations

import subprocess
import sys

import pytest

from azulite.errors import AzuliteError, CheckpointError
from azulite.train.checkpoint_config import CheckpointConfig


def test_defaults_are_valid():
    cfg = CheckpointConfig(uri="/tmp/ck")
    assert (cfg.interval, cfg.keep_last, cfg.keep_every, cfg.thread_count) == (0, 3, 0, 2)
    assert cfg.on_save_error == "continue" and cfg.async_save and cfg.overlap_staging


@pytest.mark.parametrize("field, value", [
    ("interval", -1), ("keep_last", 0), ("keep_every", -5), ("thread_count", 0), ("max_failed_saves", 0),
    ("interval", 2.5), ("keep_last", "3"),
])
def test_bad_counts_are_named(field, value):
    with pytest.raises(CheckpointError) as e:
        CheckpointConfig(uri="/tmp/ck", **{field: value})
    assert field in str(e.value) and repr(value) in str(e.value)
    assert e.value.where == f"CheckpointConfig.{field}" and e.value.fix
    assert isinstance(e.value, AzuliteError)
    assert e.value.permanent  # a script exits 78 for it (train.exit_code): no restart fixes it (it exited 1)


def test_unknown_on_save_error():
    with pytest.raises(CheckpointError, match="on_save_error='retry' is not one of"):
        CheckpointConfig(uri="/tmp/ck", on_save_error="retry")


def test_model_config_must_be_json():
    CheckpointConfig(uri="/tmp/ck", model_config={"tables": [8, 16], "name": "dlrm", "lr": 0.1})
    with pytest.raises(CheckpointError, match="model_config is not JSON-serialisable") as e:
        CheckpointConfig(uri="/tmp/ck", model_config={"dtype": object()})
    assert e.value.where == "CheckpointConfig.model_config"


def test_frozen():
    cfg = CheckpointConfig(uri="/tmp/ck")
    with pytest.raises(AttributeError):
        cfg.interval = 5  # type: ignore[misc]


def test_built_without_torch():
    code = ("import sys; from azulite.train import CheckpointConfig; CheckpointConfig(uri='x', interval=5); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
