"""Site grammar: parsing, wildcards, range checks and close-match errors."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vlmbind.core.errors import SiteError
from vlmbind.core.sites import LM_HOOKS, Site, all_sites, parse_site, resolve_sites


def test_parse_round_trip_every_site():
    for site in all_sites(4, 2):
        assert parse_site(site.name, 4, 2) == site
    for site in all_sites(4, 2, n_deepstack=3):
        assert parse_site(site.name, 4, 2, n_deepstack=3) == site


def test_deepstack_sites_exist_only_where_the_model_has_injections():
    assert [s.name for s in resolve_sites("deepstack.*.hook_out", 4, 2, n_deepstack=2)] == [
        "deepstack.0.hook_out", "deepstack.1.hook_out"]
    assert not [s for s in resolve_sites("*", 4, 2) if s.component == "deepstack"]
    for pattern in ("deepstack.0.hook_out", "deepstack.*.hook_out", "deepstack.*"):
        with pytest.raises(SiteError, match="no DeepStack injections"):
            resolve_sites(pattern, 4, 2)
    with pytest.raises(SiteError, match="DeepStack injection 2 is out of range"):
        parse_site("deepstack.2.hook_out", 4, 2, n_deepstack=2)


def test_wildcard_expands_in_model_order():
    sites = resolve_sites("blocks.*.attn.hook_z", 3, 2)
    assert [s.name for s in sites] == [f"blocks.{i}.attn.hook_z" for i in range(3)]
    assert len(resolve_sites(["blocks.1.*"], 3, 2)) == len(LM_HOOKS)
    assert [s.name for s in resolve_sites("vision.*", 3, 2)] == [
        "vision.blocks.0.hook_resid_post", "vision.blocks.1.hook_resid_post"]


def test_duplicates_removed():
    assert len(resolve_sites(["blocks.0.hook_resid_pre", "blocks.0.hook_resid_pre", "blocks.*.hook_resid_pre"], 2)) == 2


@pytest.mark.parametrize("bad,hint", [
    ("blocks.0.attn.hook_zz", "blocks.0.attn.hook_z"),
    ("block.1.hook_resid_post", "blocks.1.hook_resid_post"),
    ("blocks.1.hook_resid_pst", "blocks.1.hook_resid_post"),
])
def test_misspelt_site_suggests_close_match(bad, hint):
    with pytest.raises(SiteError) as e:
        parse_site(bad, 4, 2)
    assert hint in str(e.value)


def test_layer_out_of_range():
    with pytest.raises(SiteError, match="out of range"):
        parse_site("blocks.4.hook_resid_post", 4, 2)
    with pytest.raises(SiteError, match="vision layer 5"):
        parse_site("vision.blocks.5.hook_resid_post", 4, 2)


def test_pattern_matching_nothing_is_an_error():
    with pytest.raises(SiteError, match="matches no site"):
        resolve_sites("blocks.*.hook_zzz", 4)
    with pytest.raises(SiteError, match="no sites"):
        resolve_sites([], 4)


@given(st.text(max_size=40))
def test_parser_never_crashes_on_junk(text):
    try:
        site = parse_site(text, 4, 2)
    except SiteError:
        return
    assert isinstance(site, Site) and site.name == text


@given(st.integers(0, 30), st.sampled_from(LM_HOOKS))
def test_lm_sites_parse_iff_in_range(layer, hook):
    name = f"blocks.{layer}.{hook}"
    if layer < 8:
        assert parse_site(name, 8).layer == layer
    else:
        with pytest.raises(SiteError):
            parse_site(name, 8)
