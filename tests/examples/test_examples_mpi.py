"""examples/mpi: mpi4py allreduce SGD under mpirun, 2 ranks; every rank ends with the same weights."""

import importlib.util
import shutil

import pytest

from tests.examples.runner import final_hashes, run_example
from tests.launch.jobkit import home

_ = home  # fixture
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                       reason="Open MPI (mpirun) or mpi4py not installed"),
]


def test_mpi_example(home):
    rec = run_example("mpi", "inputs.steps=20")
    logs = rec["rank_logs"]
    assert sorted(logs) == [0, 1]
    hashes = final_hashes(rec)
    assert len(set(hashes.values())) == 1, hashes
    assert "rank 0/2" in logs[0] and "rank 1/2" in logs[1] and "Open MPI" in logs[0]
    assert "step 20 loss" in logs[0] and "step 30 " not in logs[0]
    assert not [r for r, text in logs.items() if "\0" in text]  # text, not "binary file matches" to grep
