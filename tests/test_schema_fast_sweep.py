"""The differential sweeps of the unit tier, at full breadth: the compiled schema check against
``jsonschema`` and the canonical JSON against ``rfc8785``, on more random inputs (other seeds) than
``scripts/test.sh --fast`` has time for. Pure: no server."""

from __future__ import annotations

import pytest

from tests.unit.test_canonical_json import check_rfc8785_on_random_values
from tests.unit.test_schema_fast import check_schema_agrees


@pytest.mark.filterwarnings("ignore:Possible:FutureWarning")
def test_check_schema_agrees_with_jsonschema_on_3000_more_random_schemas():
    check_schema_agrees(seed=33, random_schemas=3000)


def test_canonical_json_is_rfc8785_on_20000_more_random_values():
    check_rfc8785_on_random_values(seed=8786, count=20000)
