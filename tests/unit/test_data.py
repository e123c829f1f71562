"""The OPA data document checked before it reaches OPA (proxy/policy/data.py): the schema, then the cross
references a schema cannot state."""

from __future__ import annotations

import copy
import json

from proxy.policy.data import problems, summary
from tests.unit import REPO

DEMO = json.loads((REPO / "examples" / "opa" / "data.json").read_text(encoding="utf-8"))


def changed(edit) -> dict:
    document = copy.deepcopy(DEMO)
    edit(document["toolproxy"])
    return document


def test_the_demo_data_is_usable_and_summarised():
    assert problems(DEMO) == []
    data = DEMO["toolproxy"]
    text = summary(DEMO)
    assert text.startswith(f"revision {data['meta']['revision']}: {len(data['roles'])} role(s), ")
    assert f"{len(data['resources'])} resource(s)" in text


def test_a_subjects_role_no_role_defines_is_named_with_its_path():
    document = changed(lambda t: t["subjects"]["acme"]["carol"]["roles"].append("wizard"))
    assert problems(document) == ["toolproxy.subjects.acme.carol.roles: role 'wizard' is not defined in "
                                  "toolproxy.roles (it would grant nothing)"]


def test_a_resource_of_an_undeclared_kind_is_named():
    document = changed(lambda t: t["resources"].update(
        {"spaceship:sp_1": copy.deepcopy(t["resources"]["order:ord_1001"])}))
    [problem] = problems(document)
    assert problem.startswith("toolproxy.resources.spaceship:sp_1: kind 'spaceship' is not declared")


def test_a_document_the_schema_refuses_stops_before_the_cross_references():
    document = changed(lambda t: (t.pop("roles"), t["subjects"]["acme"]["carol"]["roles"].append("wizard")))
    found = problems(document)
    assert found and all("wizard" not in p for p in found)  # the schema's findings alone
    assert any("roles" in p for p in found)
