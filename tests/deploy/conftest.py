from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SEEDS = Path(__file__).parent / "data" / "seeds"


def seed(name: str) -> dict:
    return yaml.safe_load((SEEDS / name).read_text())


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


@pytest.fixture
def job_file(tmp_path):
    """Writes a job spec (a dict) with a code folder beside it; returns its path."""

    def make(spec: dict, name: str = "job.yaml") -> Path:
        (tmp_path / "code").mkdir(exist_ok=True)
        (tmp_path / "code" / "train.py").write_text("print('hi')\n")
        p = tmp_path / name
        p.write_text(yaml.safe_dump({"code": "code", **spec}))
        return p

    return make


def quantities(resources: dict) -> dict:
    """Resource quantities as strings (the API takes 8 and "8" alike; the kubernetes client wants strings)."""
    return {k: {n: str(q) for n, q in v.items()} for k, v in resources.items()}
