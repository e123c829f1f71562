"""scripts/setup.sh is the one entry point; the tool families it sources (scripts/setup/*.sh) only define.

A family that ran a step while being sourced would run it before the background builds start, out of the
entry point's order; a family file the entry point does not name would never run at all."""

from __future__ import annotations

import re

from tests.unit import REPO

ENTRY = (REPO / "scripts" / "setup.sh").read_text(encoding="utf-8")
FAMILIES = {path.stem: path.read_text(encoding="utf-8") for path in (REPO / "scripts" / "setup").glob("*.sh")}
# What a family may hold at its top level: comments, assignments, function definitions and their bodies.
DEFINITION = re.compile(r"^(#.*|[A-Z_][A-Z0-9_]*=.*|[a-z_][a-z0-9_]*\(\) \{.*|\s.*|\}|)$")


def top_level_commands(text: str) -> list[str]:
    """The lines of ``text`` outside a function body that are not a comment, an assignment or a definition."""
    found, depth, heredoc = [], 0, None
    for line in text.splitlines():
        if heredoc is not None:
            heredoc = None if line == heredoc else heredoc
            continue
        if (match := re.search(r"<<'(\w+)'", line)) is not None:
            heredoc = match.group(1)
        if depth == 0 and not DEFINITION.match(line):
            found.append(line)
        if re.match(r"^[a-z_][a-z0-9_]*\(\) \{", line) and not line.rstrip().endswith("}"):
            depth += 1
        elif line == "}":
            depth -= 1
    return found


def test_the_check_sees_a_step_run_while_sourcing():
    assert top_level_commands('X="1"\nf() {\n    echo hi\n}\necho now\n') == ["echo now"]
    assert top_level_commands("f() {\n    python - <<'PY'\nprint(1)\nPY\n}\n") == []


def test_the_entry_point_sources_every_family_and_only_those():
    named = re.search(r"^for family in ([a-z_ ]+); do$", ENTRY, re.M).group(1).split()
    assert sorted(named) == sorted(FAMILIES)
    assert named[0] == "common"  # the helpers the others use


def test_a_family_only_defines():
    found = {name: lines for name, text in FAMILIES.items() if (lines := top_level_commands(text))}
    assert not found


def test_every_step_the_entry_point_calls_is_defined_by_a_family():
    defined = {m for text in FAMILIES.values() for m in re.findall(r"^([a-z_][a-z0-9_]*)\(\) \{", text, re.M)}
    called = set(re.findall(r"^(?:    )?((?:create|start|install|fetch|wait|stop|summary)_[a-z_]+)$", ENTRY, re.M))
    assert called and called <= defined, sorted(called - defined)
    assert {f"summary_{name}" for name in ("go_tools", "python", "node", "redis", "java", "debian")} <= called
