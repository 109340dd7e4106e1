"""The DLRM factory and its checks: every inconsistent flag is named before any process group starts,
the seed's 105 GB of tables do not fit this machine, and the unsharded model runs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from azulite.data.criteo_stream import Rows
from azulite.errors import DataError, ModelConfigError
from azulite.workloads.dlrm import loop, sharding
from azulite.workloads.dlrm.model import FACTORY, DLRMConfig, build_model
from tests.launch.jobkit import REPO

SEED_TABLES = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
               155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
SMALL = dict(num_embeddings_per_feature=[50] * 26, embedding_dim=8, dense_arch_layer_sizes=[16, 8],
             over_arch_layer_sizes=[16, 1])


@pytest.mark.parametrize("change, where, words", [
    ({"num_embeddings_per_feature": [50] * 25}, "--num_embeddings_per_feature", "has 25 values"),
    ({"num_embeddings_per_feature": [50] * 25 + [0]}, "--num_embeddings_per_feature", "C26 must be an integer >= 1"),
    ({"embedding_dim": 16}, "--dense_arch_layer_sizes", "last layer (8) does not match --embedding_dim=16"),
    ({"over_arch_layer_sizes": [16, 2]}, "--over_arch_layer_sizes", "click logit: 1"),
    ({"dense_arch_layer_sizes": []}, "--dense_arch_layer_sizes", "layer sizes must be integers >= 1"),
])
def test_inconsistent_flags_are_named(change, where, words):
    kw = {**SMALL, **change}
    with pytest.raises(ModelConfigError) as e:
        DLRMConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})
    assert e.value.where == where and words in str(e.value) and e.value.fix


def test_the_seeds_tables_do_not_fit_this_machine():
    cfg = DLRMConfig(num_embeddings_per_feature=SEED_TABLES, embedding_dim=128, dense_arch_layer_sizes=(512, 256, 128),
                     over_arch_layer_sizes=(1024, 1024, 512, 256, 1))
    assert cfg.table_bytes() > 100e9  # ~105 GB of fp32
    with pytest.raises(ModelConfigError) as e:
        sharding.check_fits(cfg, world_size=2, ranks_here=2)
    assert "the embedding tables need" in str(e.value) and "available on this machine" in str(e.value)
    # scaled down, they fit and each rank gets a share of the memory for the planner
    small = DLRMConfig(num_embeddings_per_feature=(1000,) * 26, embedding_dim=8, dense_arch_layer_sizes=(8,),
                       over_arch_layer_sizes=(1,))
    assert sharding.check_fits(small, world_size=2, ranks_here=2, available_bytes=10 * 1024**3) == 4 * 1024**3


def test_row_wise_needs_cuda():
    with pytest.raises(ModelConfigError) as e:
        sharding.sharding_types(torch.device("cpu"), ["table_wise", "row_wise"])
    assert "row_wise" in str(e.value) and "CUDA" in str(e.value)
    assert sharding.sharding_types(torch.device("cpu")) == ["table_wise", "column_wise", "data_parallel"]
    assert "row_wise" in sharding.sharding_types(torch.device("cuda"))


def test_the_unsharded_model_runs_and_its_config_is_json_for_the_manifest():
    cfg = DLRMConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in SMALL.items()})
    mc = cfg.model_config()
    assert mc["factory"] == FACTORY and mc["state_key"] == "model"
    assert mc["preprocess"]["num_embeddings_per_feature"] == [50] * 26
    model = build_model(**mc["kwargs"])
    rows = Rows(torch.rand(4, 13).numpy(), torch.randint(0, 50, (4, 26)).numpy(), torch.ones(4).numpy(),
                torch.ones(4).numpy())
    dense, kjt, labels, _ = loop.to_batch(rows)
    assert model(dense, kjt).shape == (4, 1)
    keys = set(model.state_dict())
    assert "sparse_arch.embedding_bag_collection.embedding_bags.t_cat_25.weight" in keys


def _train_module():
    spec = importlib.util.spec_from_file_location("dlrm_train", REPO / "examples" / "dlrm" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("args, error, words", [
    (["--embedding_dim", "7"], ModelConfigError, "does not match --embedding_dim=7"),
    (["--dataset_path", "/nonexistent/criteo"], DataError, "does not exist"),
    (["--num_embeddings_per_feature", ",".join(map(str, SEED_TABLES)), "--embedding_dim", "128",
      "--dense_arch_layer_sizes", "512,256,128"], ModelConfigError, "the embedding tables need"),
])
def test_the_script_fails_before_any_process_group_starts(tmp_path, args, error, words):
    (tmp_path / "day_0").write_text("")
    base = ["--dataset_path", str(tmp_path), "--num_embeddings_per_feature", "100", "--embedding_dim", "16"]
    with pytest.raises(error) as e:
        _train_module().main(base + args)
    assert words in str(e.value)
    assert not dist.is_initialized()


def test_torch_fx_tracing_notice_stays_out_of_the_logs():
    """torchrec's forward calls torch.fx's is_fx_tracing(), whose deprecation notice landed in every rank's log
    of a DLRM job and on `azulite export`'s console."""
    import logging

    import torch.fx._symbolic_trace as fx_trace

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("torch.fx._symbolic_trace")
    handler = Keep(logging.DEBUG)
    logger.addHandler(handler)
    fx_trace.is_fx_tracing_warning.cache_clear()  # torch logs it once per process
    try:
        cfg = DLRMConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in SMALL.items()})
        model = build_model(**cfg.model_config()["kwargs"])
        rows = Rows(torch.rand(4, 13).numpy(), torch.randint(0, 50, (4, 26)).numpy(), torch.ones(4).numpy(),
                    torch.ones(4).numpy())
        dense, kjt, _, _ = loop.to_batch(rows)
        model(dense, kjt)
        fx_trace.is_fx_tracing()  # the call torchrec makes, whether or not this forward made it
    finally:
        logger.removeHandler(handler)
    assert not [m for m in seen if "is_fx_tracing will return true" in m], seen


BASE = ["--num_embeddings_per_feature", "100", "--embedding_dim", "4", "--dense_arch_layer_sizes", "8,4",
        "--over_arch_layer_sizes", "8,1", "--batch_size", "16"]


@pytest.mark.parametrize("flag, value, says", [
    # a ValueError traceback in the reader / an AssertionError in TorchRec's planner, both exit 1
    ("--batch_size", "0", "must be an integer >= 1, got 0"),
    ("--batch_size", "-3", "must be an integer >= 1, got -3"),
    # 0 steps, exit 0: an untrained model committed, and exported
    ("--epochs", "0", "must be an integer >= 1, got 0"),
    ("--epochs", "-1", "must be an integer >= 1, got -1"),
    ("--log_every", "-1", "must be an integer >= 0, got -1"),
    # named CheckpointConfig.interval, an API the user never called
    ("--checkpoint_every", "-1", "must be an integer >= 0, got -1"),
    ("--limit_train_batches", "-1", "must be an integer >= 0, got -1"),
    ("--limit_val_batches", "-2", "must be an integer >= 0, got -2"),
    ("--stop_check_every", "0", "must be an integer >= 1, got 0"),
    ("--untimed_steps", "-1", "must be an integer >= 0, got -1"),
    ("--seed", "-1", "must be an integer >= 0, got -1"),
    ("--learning_rate", "0", "must be a number > 0, got 0.0"),
    ("--learning_rate", "nan", "must be a number > 0, got nan"),
    ("--validation_fraction", "1", "must be a number >= 0 and < 1, got 1.0"),
    ("--max_bad_lines_fraction", "-0.1", "must be a number >= 0 and <= 1, got -0.1"),
    ("--step_sleep", "-1", "must be a number >= 0, got -1.0"),
])
def test_every_number_flag_of_the_trainer_is_checked_by_name(tmp_path, flag, value, says):
    from azulite.errors import FlagError
    from azulite.train import exit_code

    with pytest.raises(FlagError) as e:
        _train_module().main(["--dataset_path", str(tmp_path), *BASE, flag, value])
    assert e.value.where == flag and e.value.message == says and e.value.fix.startswith(f"e.g. {flag} ")
    assert exit_code(e.value) == 78 and not dist.is_initialized()  # EXIT_CONFIG: its job is not restarted


@pytest.mark.parametrize("content, says", [
    ("", "0 training rows from '{path}': no well-formed Criteo row to train on"),
    ("\n\n\n", "0 training rows from '{path}': no well-formed Criteo row to train on"),
    ("5 rows", "0 training steps from '{path}': its 5 training row(s) are fewer than one step takes (16: "
               "--batch_size 16 x 1 rank)"),
])
def test_data_that_gives_no_step_fails_before_any_process_group_starts(tmp_path, content, says):
    from azulite.data.criteo_synth import generate

    if content == "5 rows":
        generate(tmp_path / "gen", rows=5, files=1, seed=0)
        content = (tmp_path / "gen" / "day_0").read_text()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "day_0").write_text(content)
    with pytest.raises(DataError) as e:
        _train_module().main(["--dataset_path", str(tmp_path / "d"), *BASE, "--validation_fraction", "0",
                              "--checkpoints", str(tmp_path / "ck")])
    assert e.value.message == says.format(path=tmp_path / "d") and e.value.where == "--dataset_path"
    assert not dist.is_initialized() and not (tmp_path / "ck").exists()


def test_the_trainer_exits_2_on_data_of_no_step_and_commits_nothing(tmp_path):
    """Through the script's own entry point: the exit code a launcher sees, and no checkpoint (it was
    'checkpoint step 0 committed', 'held-out AUC nan (0 rows)', exit 0)."""
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "day_0").write_text("")
    p = subprocess.run([sys.executable, str(REPO / "examples" / "dlrm" / "train.py"), "--dataset_path",
                        str(tmp_path / "empty"), *BASE, "--checkpoints", str(tmp_path / "ck")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith(f"error: --dataset_path: 0 training rows from '{tmp_path / 'empty'}'"), p.stderr
    assert "Traceback" not in p.stderr and "fix: check the files hold Criteo TSV rows" in p.stderr
    assert not (tmp_path / "ck").exists()


def test_the_trainer_exits_78_on_a_bad_flag_so_its_job_is_not_restarted(tmp_path):
    """A flag a restart cannot change (--batch_size 0) exits EXIT_CONFIG: the launcher fails the job at
    once instead of running it again into the same error (it was a traceback, exit 1, retried)."""
    import subprocess
    import sys

    from azulite.contract import EXIT_CONFIG

    p = subprocess.run([sys.executable, str(REPO / "examples" / "dlrm" / "train.py"), "--dataset_path",
                        str(tmp_path), *BASE, "--batch_size", "0", "--checkpoints", str(tmp_path / "ck")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == EXIT_CONFIG == 78, p.stdout + p.stderr
    assert p.stderr.startswith("error: --batch_size: must be an integer >= 1, got 0"), p.stderr
