"""Checkpoints the export tests read: written in-process by the real Checkpointer (world size 1) for the
small cases; the DDP example's 2-rank checkpoints are made by its own test module through a real job."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch


def save_checkpoint(uri: Path, model: torch.nn.Module, model_config: dict, step: int = 1) -> Path:
    """A committed checkpoint of ``model`` (Checkpointer state ``"model"``) at ``uri``; returns its step dir."""
    from azulite import train

    ctx = train.init(seed=0)
    ckpt = train.Checkpointer(train.CheckpointConfig(uri=str(uri), interval=0, model_config=model_config), ctx,
                              state={"model": train.ModelState(model)})
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... save in a single process": intended
            warnings.simplefilter("ignore", UserWarning)
            ckpt.save(step, sync=True, raise_on_error=True)
    finally:
        ckpt.close()
    return uri / f"step-{step:08d}"


def repo_entries(repo: Path) -> list[str]:
    """Everything under the repository, hidden staging folders included (relative paths)."""
    return sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) if repo.exists() else []
