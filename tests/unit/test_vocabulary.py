"""One vocabulary: the README's diagram, the pipeline's stage names and the error phases agree
(proxy/errors.py: CALL_STAGES, PHASES)."""

from __future__ import annotations

import ast
import re

from proxy.errors import CALL_STAGES, PHASES
from tests.unit import REPO, parsed, walk

PACKAGE = REPO / "proxy"


def literal_keywords(name: str) -> list[tuple[str, str]]:
    """(file, value) of every ``name="<literal>"`` keyword argument in proxy/."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in walk(parsed(path)):
            if isinstance(node, ast.keyword) and node.arg == name and isinstance(node.value, ast.Constant):
                found.append((path.name, node.value.value))
    return found


def stage_names() -> list[str]:
    """The names the pipeline times and sets as the call's phase (``self._stage(state, "<name>")``,
    ``timing.stage("<name>", ...)``), in source order."""
    source = (PACKAGE / "pipeline.py").read_text(encoding="utf-8")
    return re.findall(r'(?:_stage\(state, |timing\.stage\()"([a-z_]+)"', source)


def test_every_error_phase_is_in_the_vocabulary():
    phases = literal_keywords("phase")
    assert phases, "no phase= literals found: the test would prove nothing"
    assert [p for p in phases if p[1] not in PHASES] == []


def test_the_pipeline_runs_stages_of_the_vocabulary_in_its_order():
    names = stage_names()
    assert {"resolve", "lock", "execute"} <= set(names)
    assert set(names) <= set(CALL_STAGES)
    first = [n for i, n in enumerate(names) if n not in names[:i]]  # idempotency runs twice, around authorize
    order = [CALL_STAGES.index(n) for n in first if n != "quota"]  # quota is timed inside authorize
    assert order == sorted(order), names


def test_the_readme_diagram_lists_the_stages_in_order():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    diagram = readme.split("agent ──► /v1/tool-calls", 1)[1].split("```", 1)[0]
    listed = [m.group(1) for m in re.finditer(r"^  ([a-z_]+) {2,}", diagram, re.M)]
    deduplicated = [name for i, name in enumerate(listed) if name not in listed[:i]]
    assert deduplicated == list(CALL_STAGES)
