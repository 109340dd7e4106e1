"""SIMULATION-ONLY pytest plugin: no cp312 torch here, so the tests' model repository leaves add_sub_pt out
(the TorchScript model, the only one that needs torch). The device has torch: not used there."""
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    import tests.serve.conftest as c

    models = tuple(m for m in c.ALL_MODELS if m != "add_sub_pt")
    c.build_model_repository.__defaults__ = (models,)
    c.ALL_MODELS = models
