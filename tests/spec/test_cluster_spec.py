"""The cluster spec: durations, defaults, spot taint and eviction-rate default, and errors that name the
file, line and field (an unknown SKU with the nearest names)."""

from __future__ import annotations

import pytest

from azulite.cluster.pools import resolve_pools
from azulite.errors import SpecError
from azulite.spec.cluster import DEFAULT_EVICTION_RATE_PER_HOUR, SPOT_TAINT, load_cluster

GOOD = """name: c
autoscaler:
  scale_up_delay: 5m
  scale_down_unneeded_time: 10m
pools:
  - name: gpunp
    sku: Standard_NC24rs_v3
    max_nodes: 4
    labels: {team: a}
  - name: gpuspot
    sku: NC24rs_v3
    spot: true
    max_nodes: 8
"""


def _write(tmp_path, text):
    f = tmp_path / "cluster.yaml"
    f.write_text(text)
    return f


def test_good_spec_and_resolved_pools(tmp_path):
    f = _write(tmp_path, GOOD)
    spec = load_cluster(f)
    assert spec.autoscaler.scale_up_delay == 300 and spec.autoscaler.scale_down_unneeded_time == 600
    assert spec.pools[1].evictions_per_hour == DEFAULT_EVICTION_RATE_PER_HOUR
    pools = resolve_pools(spec, spec_file=f)
    assert pools[0].node_gpus == 4 and pools[0].usd_per_hour == 3.06 and pools[1].usd_per_hour == 0.92
    assert SPOT_TAINT in pools[1].taints and pools[0].labels["team"] == "a" and pools[0].labels["agentpool"] == "gpunp"


@pytest.mark.parametrize("text, where, words", [
    (GOOD.replace("max_nodes: 4", "max_nodez: 4"), "cluster.yaml:8 (pools[0].max_nodez)", "did you mean 'max_nodes'"),
    (GOOD.replace("max_nodes: 4", "max_nodes: 0"), "pools[0].max_nodes", ">= 1"),
    (GOOD.replace("max_nodes: 4", "max_nodes: 4\n    min_nodes: 6"), "pools[0]", "min_nodes (6) > max_nodes (4)"),
    (GOOD.replace("scale_up_delay: 5m", "scale_up_delay: soon"), "autoscaler.scale_up_delay", "not a duration"),
    (GOOD.replace("name: gpuspot", "name: gpunp"), "cluster.yaml", "pool name 'gpunp' appears twice"),
    ("pools: []\n", "pools", "at least 1"),
    # was "not a valid job name ... e.g. my-job"
    (GOOD.replace("name: gpuspot", "name: GPU_spot"), "pools[1].name", "'GPU_spot' is not a valid pool name"),
    # the spec's own fix allowed '-' and 40 characters, and cluster render then refused the name (AKS: 1-12
    # lowercase letters and digits)
    (GOOD.replace("name: gpuspot", "name: gpu-pool"), "pools[1].name", "1-12 lowercase letters and digits"),
    (GOOD.replace("name: gpuspot", "name: gpuspotpoolnumber1"), "pools[1].name", "not a valid pool name"),
])
def test_bad_specs_name_line_and_field(tmp_path, text, where, words):
    with pytest.raises(SpecError) as e:
        load_cluster(_write(tmp_path, text))
    assert where in str(e.value) and words in str(e.value)


def test_unknown_sku_names_the_line_and_nearest(tmp_path):
    f = _write(tmp_path, GOOD.replace("sku: NC24rs_v3", "sku: NC24r_v3"))
    with pytest.raises(SpecError) as e:
        resolve_pools(load_cluster(f), spec_file=f)
    assert "cluster.yaml:11 (pools[1].sku)" in str(e.value) and "did you mean Standard_NC24rs_v3" in str(e.value)


def test_directory_and_binary_file_are_errors_that_say_so(tmp_path):
    with pytest.raises(SpecError) as e:
        load_cluster(tmp_path)
    assert "is a directory" in str(e.value)  # was "cluster spec not found", for a path that exists
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"\xff\xfe\x00pools")
    with pytest.raises(SpecError) as e:  # was a UnicodeDecodeError traceback
        load_cluster(binary)
    assert "cannot read the cluster spec" in str(e.value)
