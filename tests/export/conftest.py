"""Checkpoints the export tests read: written in-process by the real Checkpointer (world size 1) for the
small cases; the DDP example's 2-rank checkpoints are made by its own test module through a real job."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.train.azurite import running


def save_checkpoint(uri: Path | str, model: torch.nn.Module, model_config: dict, step: int = 1,
                    environ: dict | None = None) -> Path | str:
    """A committed checkpoint of ``model`` (Checkpointer state ``"model"``) at ``uri`` (a directory, or
    az:// with Blob credentials in ``environ``); returns its step dir."""
    from azulite import train

    ctx = train.init(seed=0)
    ckpt = train.Checkpointer(train.CheckpointConfig(uri=str(uri), interval=0, model_config=model_config), ctx,
                              state={"model": train.ModelState(model)}, environ=environ)
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... save in a single process": intended
            warnings.simplefilter("ignore", UserWarning)
            ckpt.save(step, sync=True, raise_on_error=True)
    finally:
        ckpt.close()
    return f"{uri}/step-{step:08d}" if isinstance(uri, str) else uri / f"step-{step:08d}"


def repo_entries(repo: Path) -> list[str]:
    """Everything under the repository, hidden staging folders included (relative paths)."""
    return sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) if repo.exists() else []


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory):
    """A real Azurite (Blob emulator) on a free port for the export tests that read checkpoints from Blob."""
    with running(tmp_path_factory, "azurite-export") as az:
        yield az
