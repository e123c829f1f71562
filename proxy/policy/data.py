"""The OPA data document a security team ships: checked before it reaches OPA.

Owns: validating a data document (``data.toolproxy``: roles, subject
directory, resource ownership, approval thresholds, limits) against
``schemas/opa-data.schema.json`` and the cross references a schema cannot
state (a subject's role that no role defines, a resource whose kind is not
declared). ``toolproxy check-policy-data FILE`` runs it. Must never: talk to
OPA or the registry, or accept a document the policies would misread.
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator

from ..decode import schema_violations
from ..registry import load_schema


def problems(document: Any) -> list[str]:
    """Every problem of ``document`` as ``<json path>: <message>``; empty when it is usable."""
    validator = Draft202012Validator(load_schema("opa-data.schema.json"))
    found = [f"{v['path']}: {v['message']}" for v in schema_violations(document, validator)]
    if found:
        return found
    data = document["toolproxy"]
    roles = set(data["roles"])
    for tenant, subjects in data.get("subjects", {}).items():
        for subject, entry in subjects.items():
            for role in entry.get("roles", []):
                if role not in roles:
                    found.append(f"toolproxy.subjects.{tenant}.{subject}.roles: role {role!r} is not defined "
                                 "in toolproxy.roles (it would grant nothing)")
    kinds = set(data["resource_kinds"])
    for resource in data.get("resources", {}):
        kind = resource.split(":", 1)[0]
        if kind not in kinds:
            found.append(f"toolproxy.resources.{resource}: kind {kind!r} is not declared in "
                         "toolproxy.resource_kinds (every call touching it is denied)")
    return found


def summary(document: Any) -> str:
    data = document["toolproxy"]
    subjects = sum(len(s) for s in data.get("subjects", {}).values())
    return (f"revision {data['meta']['revision']}: {len(data['roles'])} role(s), {subjects} subject(s), "
            f"{len(data['resource_kinds'])} resource kind(s), {len(data.get('resources', {}))} resource(s)")
