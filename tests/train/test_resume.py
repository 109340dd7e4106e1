"""Resume after every kind of interruption ends bitwise identical to the uninterrupted run (CPU, gloo).

Real torchrun processes on loopback, real files. Issue 3 items (a)-(d).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
from pathlib import Path

import pytest

from azulite.train import list_checkpoints
from tests.train.conftest import INTERVAL, STEPS

pytestmark = pytest.mark.slow


def _args(ckpt: Path, out: Path, *extra: str) -> list[str]:
    return ["--ckpt", str(ckpt), "--steps", str(STEPS), "--interval", str(INTERVAL), "--out", str(out), *extra]


def _out(path: Path) -> dict:
    return json.loads(path.read_text())


def test_kill9_random_rank_then_relaunch_is_identical(baseline, runner, tmp_path):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    rank, step = rng.randrange(2), rng.randint(2 * INTERVAL + 1, STEPS - 1)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    first = runner.run(_args(ckpt, out, "--kill-at", str(step), "--kill-rank", str(rank)))
    why = f"(seed {seed}: rank {rank} killed at step {step})"
    assert first.returncode != 0 and f"rank {rank} SIGKILL at step {step}" in first.output, why + first.output[-3000:]
    assert not out.exists()

    second = runner.run(_args(ckpt, out))
    assert second.returncode == 0, why + second.output[-3000:]
    result = _out(out)
    assert result["resumed_from"] in {s for s in range(INTERVAL, step + 1, INTERVAL)}, why
    assert result["sha256"] == baseline["sha256"], why


def test_elastic_restart_after_kill9_resumes_identical(baseline, runner, tmp_path):
    rng = random.Random()
    rank, step = rng.randrange(2), rng.randint(2 * INTERVAL + 1, STEPS - 1)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    res = runner.run(_args(ckpt, out, "--kill-at", str(step), "--kill-rank", str(rank),
                           "--kill-marker", str(tmp_path / "killed-once")), max_restarts=1)
    why = f"(rank {rank} killed at step {step})"
    assert res.returncode == 0, why + res.output[-4000:]
    assert f"rank {rank} SIGKILL at step {step}" in res.output, why
    assert "resumed from checkpoint step" in res.output, why
    assert _out(out)["sha256"] == baseline["sha256"], why


def test_sigterm_commits_exits_preempted_and_resumes_identical(baseline, runner, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    proc = runner.start(_args(ckpt, out, "--step-sleep", "0.15"))
    proc.wait_for(lambda text: "step 6 " in text)
    proc.signal(signal.SIGTERM)  # what Kubernetes / a launcher sends to torchrun; torchrun forwards it
    res = proc.wait(timeout=120)
    assert res.output.count("checkpoint committed, exiting 75") == 2, res.output[-4000:]
    assert not out.exists()
    committed = [c.step for c in list_checkpoints(str(ckpt)) if c.committed]
    stop_step = max(committed)
    assert 6 <= stop_step < STEPS, committed  # the step it was at when asked, not a periodic one

    again = runner.run(_args(ckpt, out))
    assert again.returncode == 0, again.output[-3000:]
    assert _out(out)["resumed_from"] == stop_step
    assert _out(out)["sha256"] == baseline["sha256"]


def test_sigterm_single_process_exit_code_is_75(runner, tmp_path):
    proc = runner.start(["--ckpt", str(tmp_path / "ckpt"), "--steps", "200", "--interval", "4",
                         "--step-sleep", "0.1"], torchrun=False)
    proc.wait_for(lambda text: "step 3 " in text)
    proc.signal(signal.SIGTERM)
    res = proc.wait(timeout=120)
    assert res.returncode == 75, res.output[-3000:]
    stopped = [c for c in list_checkpoints(str(tmp_path / "ckpt")) if c.committed]
    assert stopped and stopped[-1].step >= 3


def test_kill_between_shards_and_manifest_uses_previous(baseline, runner, tmp_path):
    ckpt, out, pause = tmp_path / "ckpt", tmp_path / "out.json", tmp_path / "pause"
    pause.mkdir()
    proc = runner.start(_args(ckpt, out, "--pause-at", f"before_manifest:{2 * INTERVAL}", "--pause-dir", str(pause)))
    marker = pause / f"paused-before_manifest-{2 * INTERVAL}-rank0"
    proc.wait_for(lambda _: marker.exists())
    proc.kill_group()  # kill -9 of torchrun and every worker while the shards are written, the manifest not
    proc.close()

    partial = ckpt / f"step-{2 * INTERVAL:08d}"
    assert (partial / ".metadata").exists() and list(partial.glob("*.distcp"))
    assert not (partial / "manifest.json").exists()
    listed = {c.step: c.committed for c in list_checkpoints(str(ckpt))}
    assert listed == {INTERVAL: True, 2 * INTERVAL: False}

    res = runner.run(_args(ckpt, out))
    assert res.returncode == 0, res.output[-3000:]
    assert "no valid manifest.json (an interrupted save)" in res.output
    assert _out(out)["resumed_from"] == INTERVAL
    assert _out(out)["sha256"] == baseline["sha256"]


def test_corrupt_shard_is_detected_logged_and_previous_used(baseline, runner, tmp_path):
    """A flipped byte in the newest checkpoint's shard (a missing shard: test_checkpoint.py, in one process)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.json"
    shutil.copytree(baseline["ckpt"], ckpt)
    newest = ckpt / f"step-{STEPS:08d}"
    shard = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle of a tensor
    shard.write_bytes(bytes(data))

    res = runner.run(_args(ckpt, out))
    assert res.returncode == 0, res.output[-3000:]
    want = "does not match the manifest"
    assert f"checkpoint step {STEPS} is corrupt: file {shard.name} {want}" in res.output, res.output[-3000:]
    assert f"resumed from checkpoint step {STEPS - INTERVAL}" in res.output
    assert _out(out)["sha256"] == baseline["sha256"]
    # the damaged one was un-committed and then replaced by the re-run's own save of that step
    assert "un-committed" in res.output
    assert (newest / "manifest.json").exists() and not (newest / "manifest.corrupt.json").exists()
    assert {c.step: c.committed for c in list_checkpoints(str(ckpt))}[STEPS] is True
