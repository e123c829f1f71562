"""The README is the front door, the reference lives in docs/: links resolve, and the reference tables
cover what the code defines (configuration, error catalogue, metrics)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.config import describe
from proxy.errors import CATALOGUE
from proxy.telemetry.metrics import Metrics
from tests.unit import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "helm" / "toolproxy" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page (code blocks skipped, duplicates numbered)."""
    found: set[str] = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"^#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            n, candidate = 0, slug
            while candidate in found:
                n += 1
                candidate = f"{slug}-{n}"
            found.add(candidate)
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [url for url in LINK.findall(text) if not re.match(r"^[a-z]+:", url)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for url in links(page):
        path, _, anchor = url.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(url)
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(url)
    assert not broken


def test_the_readme_opens_with_the_two_commands_and_maps_every_docs_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```sh\n(.*?)```", readme, flags=re.S)
    assert [b.strip() for b in blocks[:2]] == ["./scripts/dev.sh", "./scripts/test.sh"]
    unmapped = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"(docs/{p.name})" not in readme]
    assert not unmapped


def test_every_setting_is_in_the_configuration_reference():
    reference = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = [env for key, env, default, help_ in describe() if f"`{env}`" not in reference or not help_]
    assert not missing


def test_every_error_code_is_in_the_error_table():
    table = (REPO / "docs" / "errors.md").read_text(encoding="utf-8")
    assert [code for code in CATALOGUE if f"| `{code}` |" not in table] == []


def test_every_metric_is_in_the_metrics_reference():
    reference = (REPO / "docs" / "observability.md").read_text(encoding="utf-8")
    names = {metric.name for metric in Metrics().registry.collect()}
    assert len(names) > 20
    documented = set(re.findall(r"^\| `(toolproxy_[a-z_]+)`", reference, flags=re.M))
    undocumented = {n for n in names if n not in documented and n.removesuffix("_total") not in documented
                    and n + "_total" not in documented}
    assert not undocumented


def test_the_docs_put_an_mcp_error_envelope_where_the_front_does():
    """Every page that says where an MCP error result carries the envelope names the front's own key
    (``_meta`` under ``ENVELOPE_META_KEY``), never ``structuredContent``."""
    from proxy.fronts.mcp.tools import ENVELOPE_META_KEY

    claim = re.compile(r"envelope (?:as|in)[^.`]{0,40}?`(structuredContent|_meta\[\"([^\"]+)\"\])`")
    seen = []
    for page in PAGES:
        for match in claim.finditer(page.read_text(encoding="utf-8")):
            seen.append((page.name, match.group(1), match.group(2)))
    assert ("quotas.md", f'_meta["{ENVELOPE_META_KEY}"]', ENVELOPE_META_KEY) in seen
    wrong = [s for s in seen if s[2] != ENVELOPE_META_KEY]
    assert not wrong, wrong


def test_the_performance_page_table_is_the_newest_saved_run():
    from bench import results

    history = results.runs()
    assert history, "bench/results/ holds no run"
    text = results.PAGE.read_text(encoding="utf-8")
    assert results.render_page(text, history[-1]) == text, "python -m bench.results doc"
    assert all(r.met() is not None for r in history[-1].ratios if r.target)  # a ratio without a target is reported only


def test_a_ratio_knows_its_target():
    from bench.results import Ratio

    assert Ratio("a", 1.2, "<= 1.5").met() and not Ratio("a", 1.6, "<= 1.5").met()
    assert Ratio("b", 0.8, ">= 0.75").met() and Ratio("b", None, ">= 0.75").met() is None


# What a reader cannot look up: the project's internal history (its specification's numbered sections, its
# issue numbers). The pages, the chart, the schemas, the policies, the examples and the proxy's own text
# (messages, CLI output, console, docstrings and comments) state the rule itself; the CHANGELOG names
# versions. "seeded" (a random generator's seed) is not history.
# (The lookahead names the branches' first letters: without it the search tries every branch at every character,
# half a second over these files.)
HISTORY = re.compile(r"(?=[§ist])(?:§|\bissue\s*#?\d+\b|\bseeds?[\s-]+\d{3}\b|\bthe seeds\b|\bseed\s+(?:section|§))", re.I)
USER_FACING = [REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").rglob("*.md"),
               *(p for d in ("proxy", "deploy", "schemas", "policies", "examples")
                 for p in (REPO / d).rglob("*") if p.is_file() and p.suffix in
                 {".py", ".md", ".yaml", ".yml", ".tpl", ".json", ".rego", ".html", ".js", ".css", ".txt"})]


def test_user_facing_text_states_the_rule_not_the_projects_history():
    found = [f"{p.relative_to(REPO)}:{n}: {line.strip()[:100]}" for p in USER_FACING
             for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if HISTORY.search(line)]
    assert not found, "\n".join(found)


def test_the_history_check_sees_what_it_must():
    assert all(HISTORY.search(s) for s in ["(seed 004 §5)", "issue 28", "issue #32", "Seed 001 section 3",
                                           "the seed-004 fault matrix", "defaults that follow the seeds"])
    assert not any(HISTORY.search(s) for s in ["a deterministically seeded DemoState", "_seed_orders()",
                                               "issues show", "an issuer"])
