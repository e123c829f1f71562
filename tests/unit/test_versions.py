"""What a call is told about a deprecated contract (proxy/versions.py): the envelope's ``deprecation`` block,
RFC 9745 ``Deprecation`` and RFC 8594 ``Sunset``. The run pin itself keeps its version in Redis and is
tests/test_contract_versions.py's."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

import pytest

from proxy.registry import load_registry
from proxy.versions import deprecation, deprecation_headers
from tests.unit import DEMO_REGISTRY

ACTIVE = load_registry([DEMO_REGISTRY]).get("get_order", "1.0.0")


def deprecated(**facts: str | None) -> object:
    return dataclasses.replace(ACTIVE, status="deprecated", **facts)


def test_an_active_contract_or_none_says_nothing():
    assert ACTIVE is not None and ACTIVE.status == "active"
    assert deprecation(ACTIVE) is None and deprecation(None) is None
    assert deprecation_headers(ACTIVE) == {} and deprecation_headers(None) == {}


def test_a_deprecated_contract_names_its_dates_and_successor():
    tool = deprecated(deprecated_at="2026-01-15", sunset="2026-06-30", replaced_by="get_order@2.0.0")
    assert deprecation(tool) == {"deprecated_at": "2026-01-15", "sunset": "2026-06-30",
                                 "replaced_by": "get_order@2.0.0"}


def test_the_headers_are_midnight_utc_as_unix_seconds_and_an_http_date():
    headers = deprecation_headers(deprecated(deprecated_at="2026-01-15", sunset="2026-06-30"))
    assert headers["Deprecation"] == f"@{int(datetime(2026, 1, 15, tzinfo=timezone.utc).timestamp())}"
    assert headers["Sunset"] == "Tue, 30 Jun 2026 00:00:00 GMT"
    assert parsedate_to_datetime(headers["Sunset"]) == datetime(2026, 6, 30, tzinfo=timezone.utc)


@pytest.mark.parametrize("facts, names", [
    ({"deprecated_at": "2026-01-15", "sunset": None}, {"Deprecation"}),
    ({"deprecated_at": None, "sunset": "2026-06-30"}, {"Sunset"}),
    ({"deprecated_at": None, "sunset": None}, set()),
])
def test_a_date_the_contract_leaves_out_is_no_header(facts, names):
    assert set(deprecation_headers(deprecated(**facts))) == names
