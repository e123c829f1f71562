"""``Prefer: wait`` parsing without servers (proxy/fronts/ingress.py: prefer_wait, RFC 7240)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from proxy.fronts.ingress import prefer_wait


def headers(*values: str) -> CIMultiDict:
    return CIMultiDict([("Prefer", v) for v in values])


@pytest.mark.parametrize("values, expected", [
    ((), None),
    (("wait=5",), 5.0),
    (("wait=2.5",), 2.5),
    (('wait="3"',), 3.0),
    (("respond-async, wait=7",), 7.0),
    (("return=minimal", "WAIT=4"), 4.0),
    (("wait=4; foo=bar",), 4.0),
    (("wait = 9",), 9.0),
])
def test_the_wait_preference_is_read_wherever_it_stands(values, expected):
    assert prefer_wait(headers(*values)) == expected


@pytest.mark.parametrize("value", ["wait=-1", "wait=abc", "wait=1e3", "wait=1234567", "wait=1.2345", "wait=",
                                   "waiting=5", "handling=lenient"])
def test_a_preference_the_proxy_does_not_understand_is_ignored(value):
    assert prefer_wait(headers(value)) is None
