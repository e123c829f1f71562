"""Every Lua script's keys hash to one slot, whatever the key prefix (pure key layout, no Redis)."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, load_config
from proxy.process.runtime import check_key_layout
from proxy.store import check_one_slot


def test_every_script_key_set_of_the_default_layout_is_in_one_slot():
    for scope in ("tenant", "global"):
        check_key_layout(load_config(env={}, overrides={"locks.scope": scope}))


def test_key_sets_that_span_slots_are_refused_naming_the_script():
    with pytest.raises(ConfigError, match=r"script locks.acquire span Cluster slots"):
        check_one_slot({"locks.acquire": [["tp:fence:{acme}", "tp:lock:{globex}:r1"]]})
    # A brace in the prefix moves the hash tag into the prefix: the buckets of one script split.
    with pytest.raises(ConfigError, match=r"script operations span"):
        check_key_layout(load_config(env={}, overrides={"redis.key_prefix": "tp{"}))
