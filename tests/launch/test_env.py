"""The env contract against seed 001 §1.2 (pytorch), §1.4 (tensorflow) and Open MPI's rank variables."""

import json

import pytest

from azulite.launch.env import (
    mpi_env, overridden_variables, pytorch_env, pytorch_env_from_torchrun, rank_identity, tensorflow_env, tf_config,
)


def test_pytorch_env_has_every_variable_azure_ml_sets():
    # §1.2: MASTER_ADDR (rank-0 host), MASTER_PORT, WORLD_SIZE (all processes), RANK (global),
    # LOCAL_RANK (within node), NODE_RANK (the node) — 2 nodes x 4 processes, second node, third GPU
    env = pytorch_env(master_addr="10.0.0.4", master_port=29500, node_rank=1, nnodes=2, nproc_per_node=4, local_rank=2)
    assert env["MASTER_ADDR"] == "10.0.0.4"
    assert env["MASTER_PORT"] == "29500"
    assert env["WORLD_SIZE"] == "8"
    assert env["RANK"] == "6"
    assert env["LOCAL_RANK"] == "2"
    assert env["NODE_RANK"] == "1"
    assert env["AZUREML_NODE_COUNT"] == "2"
    assert all(isinstance(v, str) for v in env.values())


def test_pytorch_ranks_are_a_bijection():
    seen = set()
    for node in range(3):
        for local in range(2):
            e = pytorch_env(master_addr="h", master_port=1, node_rank=node, nnodes=3, nproc_per_node=2, local_rank=local)
            seen.add(int(e["RANK"]))
    assert seen == set(range(6))


@pytest.mark.parametrize("kw", [dict(node_rank=2, nnodes=2), dict(local_rank=4), dict(nproc_per_node=0), dict(node_rank=-1)])
def test_pytorch_env_rejects_out_of_range(kw):
    args = dict(master_addr="h", master_port=1, node_rank=0, nnodes=2, nproc_per_node=4, local_rank=0) | kw
    with pytest.raises(ValueError):
        pytorch_env(**args)


def test_node_rank_from_torchrun_group_rank():
    env = {"GROUP_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "3", "LOCAL_RANK": "1"}
    assert pytorch_env_from_torchrun(env) == {"NODE_RANK": "1", "NNODES": "2", "AZUREML_NODE_COUNT": "2"}
    assert rank_identity({**env, **pytorch_env_from_torchrun(env)}) == (3, 1, 1)


def test_tf_config_matches_the_seed_shape():
    # §1.4: {"cluster": {"worker": [...]}, "task": {"type": "worker", "index": 0}, "environment": "cloud"}
    env = tensorflow_env(workers=["host0:2222", "host1:2222"], task_type="worker", task_index=0)
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"worker": ["host0:2222", "host1:2222"]},
        "task": {"type": "worker", "index": 0},
        "environment": "cloud",
    }
    assert env["AZULITE_RANK"] == "0"


def test_tf_config_with_parameter_servers():
    cfg = tf_config(workers=["a:1", "b:2"], parameter_servers=["c:3"], task_type="ps", task_index=0)
    assert cfg["cluster"] == {"worker": ["a:1", "b:2"], "ps": ["c:3"]}
    assert cfg["task"] == {"type": "ps", "index": 0}
    env = tensorflow_env(workers=["a:1"], parameter_servers=["c:3"], task_type="ps", task_index=0)
    assert "AZULITE_RANK" not in env  # ranks are workers; a ps has no rank
    with pytest.raises(ValueError):
        tf_config(workers=["a:1"], task_type="worker", task_index=1)
    with pytest.raises(ValueError):
        tf_config(workers=[], task_type="worker", task_index=0)


def test_mpi_env_names_open_mpi_variables():
    env = mpi_env(world_size=4, rank=3, local_rank=1, local_size=2, node_rank=1)
    assert env["OMPI_COMM_WORLD_SIZE"] == "4"
    assert env["OMPI_COMM_WORLD_RANK"] == "3"
    assert env["OMPI_COMM_WORLD_LOCAL_RANK"] == "1"
    assert env["OMPI_COMM_WORLD_LOCAL_SIZE"] == "2"
    assert env["OMPI_COMM_WORLD_NODE_RANK"] == "1"
    assert env["PMIX_RANK"] == "3"
    assert rank_identity(env) == (3, 1, 1)
    with pytest.raises(ValueError):
        mpi_env(world_size=2, rank=2, local_rank=0, local_size=1, node_rank=0)


def test_rank_identity_prefers_explicit_azulite_rank():
    assert rank_identity({"AZULITE_RANK": "1", "RANK": "5"}) == (1, 0, 1)
    assert rank_identity({}) is None


@pytest.mark.parametrize("kind, names, replaced", [
    ("pytorch", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "FOO", "TF_CONFIG"],
     ["RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"]),  # MASTER_PORT pins the rendezvous instead
    ("tensorflow", ["TF_CONFIG", "RANK", "AZULITE_RANK"], ["TF_CONFIG", "AZULITE_RANK"]),
    ("mpi", ["OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_RANK", "MASTER_ADDR"], ["OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_RANK"]),
    ("none", ["RANK", "MASTER_PORT", "AZUREML_NODE_COUNT", "AZULITE_OUTPUT_CKPT", "AZURE_ML_INPUT_data"],
     ["AZUREML_NODE_COUNT", "AZULITE_OUTPUT_CKPT", "AZURE_ML_INPUT_data"]),
])
def test_the_variables_a_launcher_replaces(kind, names, replaced):
    assert overridden_variables(names, kind, inputs=["data"], outputs=["ckpt"]) == replaced
