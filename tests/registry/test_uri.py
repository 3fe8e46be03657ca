"""Model URIs parse and print back; bad ones are usage errors that say the expected forms."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlscale.errors import UsageError
from mlscale.registry import STAGES, ModelURI, parse_uri

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,30}", fullmatch=True)
aliases = st.from_regex(r"[A-Za-z][A-Za-z0-9_\-]{0,20}", fullmatch=True)


@given(names, st.integers(min_value=1, max_value=10**6))
def test_version_uris_round_trip(name, version):
    assert parse_uri(str(ModelURI(name, version=version))) == ModelURI(name, version=version)


@given(names, aliases)
def test_alias_uris_round_trip(name, alias):
    assert parse_uri(f"models:/{name}@{alias}") == ModelURI(name, alias=alias)


@given(names, st.sampled_from(STAGES), st.sampled_from([str.lower, str.upper, str.title]))
def test_stage_uris_are_case_insensitive(name, stage, case):
    assert parse_uri(f"models:/{name}/{case(stage)}") == ModelURI(name, stage=stage)


@pytest.mark.parametrize("text", ["digits/1", "models:/", "models:/digits", "models:/digits/0", "models:/digits/-1",
                                  "models:/digits/Prod", "models:/digits@", "models:/digits/1/2", "models://x/1",
                                  "models:/di gits/1", "models:/digits@1abc"])
def test_bad_uris_are_usage_errors(text):
    with pytest.raises(UsageError):
        parse_uri(text)


@pytest.mark.parametrize("name", ["digits\n", "digits\n\n", "\ndigits", "digits\r", "digits "])
def test_a_name_with_a_trailing_newline_is_refused_as_a_whole_not_matched_up_to_it(name):
    from mlscale.registry.uri import check_name

    with pytest.raises(UsageError, match="bad value name="):
        check_name(name)


@pytest.mark.parametrize("text", ["models:/digits/1\n", "models:/digits@champion\n", "models:/digits/Production\n"])
def test_a_uri_or_alias_with_a_trailing_newline_is_refused(text):
    from mlscale.registry.uri import check_alias

    with pytest.raises(UsageError):
        parse_uri(text)
    with pytest.raises(UsageError, match="bad value alias="):
        check_alias("champion\n")
