"""The catalog: packaged SKUs and prices as the seeds and Microsoft's size pages give them, derived prices
naming their rule, unknown prices left unknown, nearest-name suggestions, and the user's override file."""

from __future__ import annotations

import pytest

from azulite.catalog import Catalog, get_sku, skus
from azulite.errors import CatalogError, UnknownSku

SEED_SKUS = ["NC6s_v3", "NC24rs_v3", "NC4as_T4_v3", "NC24ads_A100_v4", "NC96ads_A100_v4", "ND40rs_v2",
             "ND96asr_v4", "ND96amsr_A100_v4", "ND96isr_H100_v5", "D4s_v3"]


def test_every_seed_sku_is_there_with_prefix_and_case_optional():
    for short in SEED_SKUS:
        s = get_sku(short)
        assert s.name == f"Standard_{short}" and s.cloud == "azure"
        assert get_sku(s.name.upper()) is s
    assert {s.name for s in skus(cloud="aws")} == {"ml.p3.2xlarge", "ml.p4d.24xlarge"}
    assert {s.name for s in skus(cloud="gcp")} == {"n1-standard-8-v100", "a2-highgpu-1g"}


def test_specs_follow_microsoft_where_a_seed_disagrees():
    nc96 = get_sku("NC96ads_A100_v4")  # seed 001 §2.1: 8x A100 / 640 GB; Microsoft: 4x A100 80 GB
    assert (nc96.gpus, nc96.gpu_memory_gb, nc96.total_gpu_memory_gb) == (4, 80, 320)
    assert "seed" in nc96.notes
    nd40 = get_sku("ND40rs_v2")  # seed 001 §1.5: 200 Gb/s; Microsoft: 100 Gb EDR
    assert (nd40.gpus, nd40.gpu_memory_gb, nd40.infiniband_gbps) == (8, 32, 100)
    assert get_sku("ND96isr_H100_v5").infiniband_gbps == 3200
    assert get_sku("D4s_v3").gpus == 0
    assert [s.short for s in skus("a100", cloud="azure")] == ["NC24ads_A100_v4", "NC96ads_A100_v4", "ND96asr_v4", "ND96amsr_A100_v4"]


def test_prices_are_the_seeds_with_source_and_date():
    nc24 = get_sku("NC24rs_v3")
    assert nc24.price("on_demand").usd_per_hour == 3.06 and nc24.price("spot").usd_per_hour == 0.92
    assert nc24.price("on_demand").date == "2025-11-14" and "seed 001" in nc24.price("on_demand").source
    assert nc24.price("on_demand").derived is None
    nd96 = get_sku("ND96asr_v4")
    assert nd96.price("on_demand").usd_per_hour == 27.0 and nd96.price("spot").usd_per_hour == 9.5
    assert nd96.price("on_demand").date is None  # seed 002 is undated: shown as such, not given a date


def test_derived_prices_name_their_rule_and_unknown_stays_unknown():
    t4 = get_sku("NC4as_T4_v3")
    sp1 = t4.price("savings_1y")
    assert sp1.usd_per_hour == pytest.approx(0.526 * 0.7) and "30%" in sp1.derived and "Savings Plans" in sp1.source
    assert t4.price("reserved_1y") is None and t4.price("reserved_3y") is None  # "up to 72%" is no price
    assert get_sku("ND96isr_H100_v5").prices == {}  # no seed prices it
    assert get_sku("D4s_v3").price("on_demand") is None


def test_unknown_sku_suggests_the_nearest_names():
    with pytest.raises(UnknownSku) as e:
        get_sku("NC24r_v3")
    assert e.value.suggestions[0] == "Standard_NC24rs_v3"
    assert "did you mean Standard_NC24rs_v3" in str(e.value)
    with pytest.raises(UnknownSku) as e:
        get_sku("ND96isr_H100_v6")
    assert "Standard_ND96isr_H100_v5" in e.value.suggestions


def test_override_file_adds_a_sku_and_replaces_a_price(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text(
        '[[sku]]\nname = "Standard_NC8as_T4_v3"\ncloud = "azure"\ngpus = 1\ngpu_type = "T4"\ngpu_memory_gb = 16\nvcpus = 8\nram_gb = 56\n'
        '[[sku]]\nname = "ND96isr_H100_v5"\nnotes = "ours"\n'
        '[[price]]\nsku = "Standard_NC8as_T4_v3"\nkind = "on_demand"\nusd_per_hour = 0.752\nsource = "EA sheet"\ndate = "2026-01-05"\n'
        '[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hour = 0.5\nsource = "EA sheet"\n'
        '[[price]]\nsku = "ND96isr_H100_v5"\nkind = "reserved_1y"\nusd_per_hour = 60\nsource = "quote"\n'
    )
    cat = Catalog.load(f)
    new = cat.get("NC8as_T4_v3")
    assert new.gpus == 1 and new.price("on_demand").usd_per_hour == 0.752
    assert new.price("spot").derived  # the packaged 70% rule applies to the user's on-demand price too
    assert cat.get("NC24rs_v3").price("spot").usd_per_hour == 0.5
    h100 = cat.get("ND96isr_H100_v5")
    assert h100.notes == "ours" and h100.gpus == 8 and h100.price("reserved_1y").source == "quote"
    assert Catalog.load().get("NC24rs_v3").price("spot").usd_per_hour == 0.92  # the packaged data is untouched


@pytest.mark.parametrize(
    "text, where, words",
    [
        ('[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hr = 0.5\nsource = "x"\n', "price[0]", "unknown field 'usd_per_hr'"),
        ('[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hour = -1\nsource = "x"\n', "price[0]", "usd_per_hour"),
        ('[[price]]\nsku = "NC24rs_v3"\nkind = "cheap"\nusd_per_hour = 1\nsource = "x"\n', "price[0]", "kind"),
        ('[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hour = 1\n', "price[0]", "'source' is missing"),
        ('[[price]]\nsku = "NC24zz_v3"\nkind = "spot"\nusd_per_hour = 1\nsource = "x"\n', "price[0]", "did you mean"),
        ('[[sku]]\nname = "Brand_New"\ngpus = 2\n', "sku[0]", "lacks cloud"),
        ('[[sku]]\nname = "Brand_New"\ncloud = "azure"\ngpus = 2\ngpu_memory_gb = 16\nvcpus = 8\nram_gb = 64\n', "sku[0]",
         "has 2 GPU(s) but no gpu_type"),  # it listed as "2x None"
        ('[[skus]]\nname = "x"\n', "mine.toml", "unknown table 'skus'"),
        ('[[price]\n', "mine.toml", "not valid TOML"),
        ('[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hour = 1\nsource = "x"\ndate = "last week"\n', "price[0]",
         "field 'date': must be a date as YYYY-MM-DD"),
    ],
)
def test_bad_override_file_names_the_entry_and_field(tmp_path, text, where, words):
    f = tmp_path / "mine.toml"
    f.write_text(text)
    with pytest.raises(CatalogError) as e:
        Catalog.load(f)
    assert where in str(e.value) and words in str(e.value)


def test_override_price_date_may_be_a_toml_date(tmp_path):
    # TOML's unquoted date is a datetime.date: accepted and shown as YYYY-MM-DD, like the quoted form
    f = tmp_path / "mine.toml"
    f.write_text('[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hour = 0.5\nsource = "EA"\ndate = 2026-01-05\n')
    assert Catalog.load(f).get("NC24rs_v3").price("spot").date == "2026-01-05"


def test_override_path_that_is_a_directory_is_an_error(tmp_path):
    with pytest.raises(CatalogError) as e:
        Catalog.load(tmp_path)
    assert "is a directory" in str(e.value) and str(tmp_path) in str(e.value)


def test_cloud_filter_ignores_case():
    assert [s.name for s in skus(cloud="AWS")] == [s.name for s in skus(cloud="aws")] != []


def test_a_retired_size_says_so_from_its_date(tmp_path):
    import datetime as dt

    nc6 = get_sku("NC6s_v3")
    assert nc6.retired == "2025-09-30" and nc6.retired_by(dt.date(2025, 9, 30)) and not nc6.retired_by(dt.date(2025, 9, 29))
    assert "Standard_NC6s_v3 was retired on 2025-09-30" in nc6.retirement() and get_sku("NC24rs_v3").retirement() == ""
    f = tmp_path / "mine.toml"  # a user's file may retire a size
    f.write_text('[[sku]]\nname = "NC24rs_v3"\nretired = 2026-01-31\n')
    assert Catalog.load(f).get("NC24rs_v3").retired == "2026-01-31"
    f.write_text('[[sku]]\nname = "NC24rs_v3"\nretired = "soon"\n')
    with pytest.raises(CatalogError, match="field 'retired': must be a date as YYYY-MM-DD"):
        Catalog.load(f)


def test_every_bad_field_of_an_entry_is_named_at_once(tmp_path):
    # only the first was reported: a round of edits per field
    f = tmp_path / "mine.toml"
    f.write_text('[[price]]\nsku = "NC24rs_v3"\nkind = "cheap"\nusd_per_hour = "a lot"\nsource = "x"\ndate = "soon"\n')
    with pytest.raises(CatalogError) as e:
        Catalog.load(f)
    assert "also wrong in this entry: " in e.value.fix and all(k in e.value.fix or k in e.value.message
                                                               for k in ("kind", "usd_per_hour", "date"))
    f.write_text('[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hr = 0.5\nsource = "x"\n')
    with pytest.raises(CatalogError) as e:  # the misspelt key, said once (not also as usd_per_hour missing)
        Catalog.load(f)
    assert "unknown field 'usd_per_hr'" in str(e.value) and "also wrong" not in str(e.value)


@pytest.mark.parametrize(
    "text, words",
    [
        ("sku = 1\n", "'sku' must be an array of tables ([[sku]]), got int 1"),  # a TypeError traceback
        ("sku = [1]\n", "'sku' must be an array of tables ([[sku]]), got list [1]"),  # "field ''" and an empty fix
        ('price = "x"\n', "'price' must be an array of tables ([[price]]), got str 'x'"),
        ('[sku]\nname = "x"\n', "'sku' must be an array of tables ([[sku]]), not one table ([sku])"),
    ],
)
def test_a_top_level_key_that_is_no_array_of_tables_is_named(tmp_path, text, words):
    f = tmp_path / "c10.toml"
    f.write_text(text)
    with pytest.raises(CatalogError) as e:
        Catalog.load(f)
    assert str(e.value).startswith(f"{f}: {words}")
    assert "own [[" in e.value.fix


def test_entries_are_named_by_their_header_line(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('# mine\n\n[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hr = 0.5\nsource = "x"\n')
    with pytest.raises(CatalogError) as e:
        Catalog.load(f)
    assert str(e.value).startswith(f"{f}:3: price[0]: unknown field 'usd_per_hr'")


def test_two_prices_of_one_sku_and_kind_are_refused_naming_both(tmp_path):
    # the last one won without a word
    f = tmp_path / "mine.toml"
    one = '[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hour = {}\nsource = "EA"\n'
    f.write_text(one.format(0.5) + "\n" + one.format(0.6))
    with pytest.raises(CatalogError) as e:
        Catalog.load(f)
    assert str(e.value).startswith(f"{f}:7: price[1]: a second spot price for Standard_NC24rs_v3: price[0] (line 1) gives one too")
    assert "keep one [[price]] per SKU and kind" in e.value.fix


def test_two_entries_of_one_sku_are_refused(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[[sku]]\nname = "NC24rs_v3"\nnotes = "a"\n[[sku]]\nname = "Standard_NC24rs_v3"\nnotes = "b"\n')
    with pytest.raises(CatalogError, match=r"mine.toml:4: sku\[1\]: SKU 'Standard_NC24rs_v3' is given twice: also at sku\[0\] \(line 1\)"):
        Catalog.load(f)


def test_a_spot_price_above_on_demand_is_refused(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hour = 5\nsource = "EA"\n')
    with pytest.raises(CatalogError) as e:
        Catalog.load(f)
    assert "price[0]: Standard_NC24rs_v3: spot $5/h is above on-demand $3.06/h" in str(e.value)
    assert "spot is a discount on on-demand" in e.value.fix
    f.write_text('[[price]]\nsku = "NC24rs_v3"\nkind = "on_demand"\nusd_per_hour = 0.5\nsource = "EA"\n')  # below the packaged spot
    with pytest.raises(CatalogError, match=r"spot \$0.92/h is above on-demand \$0.5/h"):
        Catalog.load(f)
    f.write_text('[[price]]\nsku = "NC24rs_v3"\nkind = "spot"\nusd_per_hour = 3.06\nsource = "EA"\n')  # equal is a price
    assert Catalog.load(f).get("NC24rs_v3").price("spot").usd_per_hour == 3.06


def test_a_sku_without_gpus_has_no_gpu_type(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[[sku]]\nname = "X1"\ncloud = "azure"\ngpus = 0\ngpu_type = "V100"\ngpu_memory_gb = 0\nvcpus = 4\nram_gb = 8\n')
    with pytest.raises(CatalogError, match=r"sku\[0\]: SKU 'X1' has 0 GPUs but gpu_type 'V100'"):
        Catalog.load(f)
    # an existing GPU size set to 0 GPUs drops its GPU type: it is no longer listed under --gpu V100
    f.write_text('[[sku]]\nname = "NC24rs_v3"\ngpus = 0\n')
    cat = Catalog.load(f)
    assert cat.get("NC24rs_v3").gpu_type is None
    assert "Standard_NC24rs_v3" not in [s.name for s in cat.skus("V100")]
    assert "Standard_NC6s_v3" in [s.name for s in cat.skus("V100")]
