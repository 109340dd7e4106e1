"""Kubernetes quantities (deploy/quantity.py) and AKS's allocatable share of a node (deploy/sku.py)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from azulite.deploy.quantity import parse_quantity, resource_quantity
from azulite.deploy.sku import SkuFacts, aks_allocatable, aks_reserved_cpu_millicores, sku_facts


@pytest.mark.parametrize("text, value", [
    ("8", 8), ("500m", Decimal("0.5")), ("1.5", Decimal("1.5")), ("16Gi", 16 * 2**30), ("512Mi", 512 * 2**20),
    ("1G", 10**9), ("1e3", 1000), ("2E-1", Decimal("0.2")), ("1E", 10**18), ("+4", 4), (".5", Decimal("0.5")),
])
def test_quantities_parse_as_the_api_server_reads_them(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["lots", "banana", "16GB", "2 cores", "", "1.2.3", "Gi", " 4", "4 ", "1e"])
def test_what_is_not_a_quantity_is_refused(text):
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)


def test_a_negative_request_is_refused():
    with pytest.raises(ValueError, match="negative"):
        resource_quantity("-1")


def test_aks_cpu_reservation_matches_its_published_table():
    # learn.microsoft.com/azure/aks/node-resource-reservations
    table = {1: 60, 2: 100, 4: 140, 8: 180, 16: 260, 32: 420, 64: 740}
    assert {c: aks_reserved_cpu_millicores(c) for c in table} == table


def test_allocatable_of_a_t4_node():
    cpu_m, mem = aks_allocatable(sku_facts("Standard_NC4as_T4_v3"))
    assert cpu_m == 3860
    # 28 GiB less min(20 MiB x 110 pods + 50 MiB, 7 GiB) less the 100Mi eviction threshold
    assert mem == 28 * 2**30 - 2250 * 2**20 - 100 * 2**20
    # a small VM reserves a quarter of its memory instead (the page's 4 GB example)
    small = SkuFacts(name="small", gpus=0, ram_gb=4, infiniband=False, vcpus=2)
    assert aks_allocatable(small) == (1900, 3 * 2**30 - 100 * 2**20)
